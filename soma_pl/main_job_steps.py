"""The demo's steps: `python -m soma_pl.cli` commands in child processes that die with the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from soma_pl.errors import SomaError
from soma_pl.io import die_with_parent, write_json_atomic

PROGRESS_CALLBACK = "soma_pl.callbacks.progress.ProgressFile"
"""The callback a followed fit runs (named, not imported: the demo's own process needs no Lightning)."""
POLL_SECONDS = 0.5
"""How often a followed fit's progress file is read while it runs."""


@dataclass
class Follow:
    """A bar that follows a fit step while it runs: the updates it has made and, as its postfix,
    its latest validation loss (`soma_pl.callbacks.progress.ProgressFile` in the fit reports them)."""

    label: str
    """The bar's description."""
    total: int | None
    """The updates the fit makes; None: not known in advance (a budget stops it)."""
    position: int
    """The bar's line below the main job's bar (1, 2, ...)."""


class FitProgress:
    """Reads a fit's progress file (JSON lines from `ProgressFile`) into `bar`: whole lines only,
    each once, so a line the fit is still writing waits for the next read."""

    def __init__(self, path: Path, bar: tqdm):
        self.path = path
        self.bar = bar
        self.offset = 0

    def poll(self) -> None:
        try:
            with self.path.open("rb") as file:
                file.seek(self.offset)
                data = file.read()
        except FileNotFoundError:  # the fit has not started training yet
            return
        whole = data[:data.rfind(b"\n") + 1]
        self.offset += len(whole)
        for line in whole.splitlines():
            record = json.loads(line)
            self.bar.update(record["step"] - self.bar.n)  # a resumed fit starts at its checkpoint's update
            if "val_loss" in record:
                self.bar.set_postfix_str(f"val loss {record['val_loss']:.4f}", refresh=False)
        if whole:
            self.bar.refresh()


def progress_arguments(path: Path) -> list[str]:
    """The fit arguments that add the callback writing `path` to the fit's own callbacks."""
    callback = {"class_path": PROGRESS_CALLBACK, "init_args": {"path": str(path)}}
    return [f"--trainer.callbacks+={json.dumps(callback)}"]


class Steps:
    """Runs `python -m soma_pl.cli` commands as child processes, each recorded in `<folder>/<name>.json`
    together with its arguments; a recorded command with the same arguments is not run again.

    Children die with the demo: the kernel kills each when its parent goes (Linux
    `PR_SET_PDEATHSIG`, as `prepare`'s workers), so a killed demo leaves no fit running on the
    folders a rerun uses; `stop` ends the running ones and starts no more (Ctrl-C)."""

    command: tuple[str, ...] = (sys.executable, "-m", "soma_pl.cli")
    """What a step runs, its arguments appended."""

    def __init__(self, threads: int, bar: tqdm):
        self.env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
        self.bar = bar
        self.reused = 0
        self.running: set[subprocess.Popen] = set()
        self.stopped = False
        self.lock = threading.Lock()

    def run(self, folder: Path, name: str, args: list[str], reuse: bool = True,
            resume: Sequence[str] = (), follow: Follow | None = None) -> dict:
        """Run `args` unless `reuse` and `<folder>/<name>.json` records the same arguments; `resume`
        is added to a run without being part of its record (`--ckpt_path=last` after an interruption),
        and so is `follow`'s callback, whose progress file `<folder>/<name>.progress.jsonl` feeds
        a bar while the fit runs."""
        record = folder / f"{name}.json"
        previous = json.loads(record.read_text()) if reuse and record.is_file() else None
        if previous is not None and previous.get("args") == args:
            self.reused += 1
            self.bar.update()
            return previous
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        started = time.monotonic()
        if follow is None:
            code = self._call([*args, *resume], log)
        else:
            progress = folder / f"{name}.progress.jsonl"
            progress.unlink(missing_ok=True)  # the lines of an earlier, interrupted run
            with tqdm(total=follow.total, desc=follow.label, unit="update", position=follow.position,
                      disable=self.bar.disable) as bar:
                code = self._call([*args, *resume, *progress_arguments(progress)], log, FitProgress(progress, bar))
        if code != 0:
            tail = log.read_text().strip().splitlines()[-3:]
            raise SomaError(f"`{' '.join(args[:1])}` failed ({log}): " + " | ".join(tail))
        result = {"args": args, "resumed": bool(resume), "seconds": round(time.monotonic() - started, 1)}
        write_json_atomic(record, result)
        self.bar.update()
        return result

    def _call(self, args: list[str], log: Path, progress: FitProgress | None = None) -> int:
        with log.open("w") as out:
            with self.lock:  # `stop` either sees this child or keeps it from starting
                if self.stopped:
                    raise SomaError(f"the demo was stopped before `{args[0]}` ({log})")
                process = subprocess.Popen([*self.command, *args], stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, preexec_fn=die_with_parent(os.getpid()))
                self.running.add(process)
            try:
                return _wait(process, progress)
            finally:
                if process.poll() is None:  # this thread was interrupted while the child ran
                    process.terminate()
                    process.wait()
                with self.lock:
                    self.running.discard(process)

    def stop(self) -> None:
        """End every running child (each thread waiting on one then fails) and start no more."""
        with self.lock:
            self.stopped = True
            for process in self.running:
                process.terminate()


def _wait(process: subprocess.Popen, progress: FitProgress | None) -> int:
    """The child's exit status; meanwhile, and once more at its end, `progress` reads its file."""
    if progress is None:
        return process.wait()
    while True:
        try:
            code = process.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            progress.poll()
            continue
        progress.poll()
        return code
