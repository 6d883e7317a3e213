"""The demo's steps: `python -m soma_pl.cli` commands in child processes that die with the demo."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from tqdm import tqdm

from soma_pl.errors import SomaError
from soma_pl.io import die_with_parent, write_json_atomic


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
            resume: Sequence[str] = ()) -> dict:
        """Run `args` unless `reuse` and `<folder>/<name>.json` records the same arguments; `resume`
        is added to a run without being part of its record (`--ckpt_path=last` after an interruption)."""
        record = folder / f"{name}.json"
        previous = json.loads(record.read_text()) if reuse and record.is_file() else None
        if previous is not None and previous.get("args") == args:
            self.reused += 1
            self.bar.update()
            return previous
        folder.mkdir(parents=True, exist_ok=True)
        log = folder / f"{name}.log"
        started = time.monotonic()
        code = self._call([*args, *resume], log)
        if code != 0:
            tail = log.read_text().strip().splitlines()[-3:]
            raise SomaError(f"`{' '.join(args[:1])}` failed ({log}): " + " | ".join(tail))
        result = {"args": args, "resumed": bool(resume), "seconds": round(time.monotonic() - started, 1)}
        write_json_atomic(record, result)
        self.bar.update()
        return result

    def _call(self, args: list[str], log: Path) -> int:
        with log.open("w") as out:
            with self.lock:  # `stop` either sees this child or keeps it from starting
                if self.stopped:
                    raise SomaError(f"the demo was stopped before `{args[0]}` ({log})")
                process = subprocess.Popen([*self.command, *args], stdout=out, stderr=subprocess.STDOUT,
                                           env=self.env, preexec_fn=die_with_parent(os.getpid()))
                self.running.add(process)
            try:
                return process.wait()
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
