"""Checkpoints are written atomically: a failed or killed write leaves no partial file under a
checkpoint's name, a full, read-only or size-limited disk ends `fit` with one line, and a run killed
while writing resumes from its last checkpoint.

`kill_during_checkpoint_writes` is the kill experiment of issue 12 (SIGKILL while `last.ckpt` is
written, the run folder on tmpfs and on disk); the slow test runs two rounds per filesystem, and
    python -c "from tests.robustness.test_atomic_checkpoints import main; main()"
runs ten.
"""

from __future__ import annotations

import builtins
import errno
import json
import os
import random
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from soma_pl.callbacks.checkpoint_io import AtomicCheckpointIO
from soma_pl.cli import main as cli_main
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.errors import DataError
from soma_pl.io import TEMPORARY, machine, write_atomic
from soma_pl.models.checkpoints import load_checkpoint
from tests.data.corpora import write_jsonl_corpus
from tests.lit.conftest import fit_args
from tests.robustness.cli import dead_pid, tiny_dataset

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path]:
    """`(corpus, prepared data)`, prepared as tests/lit/tiny_spsa.yaml prepares it (so `fit` reuses it)."""
    return tiny_dataset(tmp_path_factory.mktemp("atomic"))


def _temporaries(folder: Path) -> list[str]:
    return sorted(entry.name for entry in folder.iterdir() if TEMPORARY.match(entry.name)) if folder.is_dir() else []


def _stderr_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.strip()]


# --- the writer ----------------------------------------------------------------------------------


def test_a_write_failing_midway_leaves_the_old_checkpoint_and_no_temporary(tmp_path, monkeypatch):
    target = tmp_path / "last.ckpt"
    target.write_bytes(b"old checkpoint")

    def full_disk(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full_disk)
    with pytest.raises(OSError):
        write_atomic(b"new checkpoint", target)
    assert target.read_bytes() == b"old checkpoint" and _temporaries(tmp_path) == []


def test_save_on_a_full_disk_is_one_line_naming_the_folder(tmp_path, monkeypatch):
    monkeypatch.setattr(os, "fsync", lambda fd: (_ for _ in ()).throw(OSError(errno.ENOSPC, "No space left on device")))
    target = tmp_path / "checkpoints" / "epoch=0-step=8.ckpt"
    with pytest.raises(DataError) as error:
        AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.zeros(3)}}, target)
    message = str(error.value)
    assert "\n" not in message and "Errno 28" in message and str(target.parent) in message
    assert "--checkpoint.dirpath" in message and list(target.parent.iterdir()) == []


def test_temporaries_of_dead_processes_are_removed_by_the_next_save(tmp_path):
    host = machine()
    stale = tmp_path / f".last.ckpt.tmp-{host}-{dead_pid()}"
    live = tmp_path / f".last.ckpt.tmp-{host}-{os.getppid()}"
    elsewhere = tmp_path / ".last.ckpt.tmp-another-machine-1"
    # a container of the same host name whose processes this one cannot see: its PID says nothing here
    container = tmp_path / f".last.ckpt.tmp-{socket.gethostname()}.pidns1-{dead_pid()}"
    for path in (stale, live, elsewhere, container):
        path.write_bytes(b"partial")
    AtomicCheckpointIO().save_checkpoint({"state_dict": {"w": torch.ones(2)}}, tmp_path / "last.ckpt")
    assert not stale.exists() and live.exists() and elsewhere.exists() and container.exists()
    assert host.startswith(socket.gethostname() + ".pidns")  # Linux names the PID namespace
    assert torch.equal(load_checkpoint(tmp_path / "last.ckpt")["state_dict"]["w"], torch.ones(2))


# --- fit, through the CLI ----------------------------------------------------------------------


def _limited_fit(args: list[str], max_file_bytes: int, tmpdir: Path) -> subprocess.CompletedProcess:
    """`fit` in a process that may write no file larger than `max_file_bytes` (a write past it fails
    with EFBIG, as on a full disk; SIGXFSZ is ignored so the write returns the error)."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_file_bytes, max_file_bytes))
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)

    env = {**os.environ, "TMPDIR": str(tmpdir), "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env, preexec_fn=limit, timeout=600)


def test_a_checkpoint_write_cut_short_is_one_line_and_leaves_no_partial_file(dataset, tmp_path):
    corpus, data = dataset
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    # width 96: a ~0.7 MB checkpoint, cut at 256 kB; the prepared data are written already. The tiny
    # config's learning rate diverges at this width (validation loss 15.9 at step 4): a tenth of it.
    args = fit_args(corpus, data, run, "--model.init_args.shape.width=96", "--model.init_args.shape.embed_dim=32",
                    "--trainer.max_steps=4", "--model.init_args.optimizer.init_args.lr=0.01")
    result = _limited_fit(args, 256 * 1024, scratch)
    err = _stderr_lines(result.stderr)
    assert result.returncode == 2 and err[-1].startswith("soma_pl: error: cannot write checkpoint"), err[-5:]
    assert "Errno 27" in err[-1] and "Traceback" not in result.stderr
    folder = run / "checkpoints"
    assert list(folder.glob("*.ckpt")) == [] and _temporaries(folder) == [] and list(scratch.iterdir()) == []


def test_a_config_write_cut_short_leaves_no_partial_config(dataset, tmp_path):
    corpus, data = dataset
    run, scratch = tmp_path / "run", tmp_path / "scratch"
    scratch.mkdir()
    result = _limited_fit(fit_args(corpus, data, run, "--trainer.max_steps=4"), 1024, scratch)  # config.yaml: ~3 kB
    err = _stderr_lines(result.stderr)
    assert result.returncode == 2 and "Traceback" not in result.stderr, err[-5:]
    assert err[-1].startswith(f"soma_pl: error: cannot write {run / 'config.yaml'}: File too large (Errno 27)")
    assert not (run / "config.yaml").exists()


def _failing_disk(monkeypatch, under: Path, code: int) -> None:
    """Creating a folder or file, writing or renaming into `under` fails with `code`, as on a full
    or read-only disk mounted there (reads and writes elsewhere, `$TMPDIR` included, work)."""
    real_open, real_mkdir, real_rename, real_replace = builtins.open, os.mkdir, os.rename, os.replace

    def refuse(path) -> None:
        if str(path).startswith(str(under)):
            raise OSError(code, os.strerror(code), str(path))

    def fake_open(file, mode="r", *args, **kwargs):
        if any(flag in mode for flag in "wax+"):
            refuse(file)
        return real_open(file, mode, *args, **kwargs)

    def fake_mkdir(path, *args, **kwargs):
        refuse(path)
        return real_mkdir(path, *args, **kwargs)

    def fake_rename(source, target, *args, **kwargs):
        refuse(target)
        return real_rename(source, target, *args, **kwargs)

    def fake_replace(source, target, *args, **kwargs):
        refuse(target)
        return real_replace(source, target, *args, **kwargs)

    for module, name, fake in ((builtins, "open", fake_open), (os, "mkdir", fake_mkdir), (os, "rename", fake_rename),
                               (os, "replace", fake_replace)):
        monkeypatch.setattr(module, name, fake)


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_checkpoints_on_a_full_or_read_only_disk_end_fit_with_one_line(code, dataset, tmp_path, monkeypatch,
                                                                       capsys):
    corpus, data = dataset
    folder = tmp_path / "elsewhere" / "checkpoints"
    args = [*fit_args(corpus, data, tmp_path / "run", "--trainer.max_steps=4"), f"--checkpoint.dirpath={folder}"]
    _failing_disk(monkeypatch, folder, code)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(args)
    err = _stderr_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"soma_pl: error: cannot write checkpoint {folder}") and f"Errno {code}" in err[0]
    assert "--checkpoint.dirpath" in err[0] and not list(folder.glob("*.ckpt"))


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS])
def test_a_run_folder_on_a_full_or_read_only_disk_ends_fit_with_one_line(code, dataset, tmp_path, monkeypatch,
                                                                         capsys):
    corpus, data = dataset
    run = tmp_path / "run"
    _failing_disk(monkeypatch, run, code)
    with pytest.raises(SystemExit) as exit_info:
        cli_main(fit_args(corpus, data, run, "--trainer.max_steps=4"))
    err = _stderr_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and len(err) == 1, err
    assert err[0].startswith(f"soma_pl: error: cannot write {run}") and f"Errno {code}" in err[0]
    assert "--trainer.default_root_dir" in err[0]


def test_resuming_from_a_truncated_last_checkpoint_is_one_line(dataset, tmp_path, capsys):
    corpus, data = dataset
    cli_main(fit_args(corpus, data, tmp_path / "run", "--trainer.max_steps=4"))
    last = tmp_path / "run" / "checkpoints" / "last.ckpt"
    last.write_bytes(last.read_bytes()[:65536 // 4])  # what a copy killed midway left
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_info:
        cli_main(fit_args(corpus, data, tmp_path / "run", "--trainer.max_steps=8", "--ckpt_path=last"))
    err = _stderr_lines(capsys.readouterr().err)
    assert exit_info.value.code == 2 and err[-1].startswith(f"soma_pl: error: unreadable checkpoint {last}"), err


# --- the kill experiment -----------------------------------------------------------------------


def _wait_for_write(folder: Path, writes: int, deadline: float) -> bool:
    """Poll `folder` until the `writes`-th checkpoint write has begun (its temporary file appeared;
    `last.ckpt`'s has the same name every time); False at the deadline."""
    begun, present = 0, set()
    while time.monotonic() < deadline:
        now = set(_temporaries(folder))
        begun += len(now - present)
        present = now
        if begun >= writes:
            return True
        time.sleep(0.0005)
    return False


def kill_round(corpus: Path, data: Path, run: Path, rng: random.Random, width: int) -> dict:
    """Start a fit, SIGKILL it a random 0-10 ms after its 2nd-6th checkpoint write began (even:
    `last.ckpt`), then load every `*.ckpt` left and resume once with `--ckpt_path last`."""
    # The tiny config's learning rate diverges at this width: without the divergence check's stop
    # the run goes on writing checkpoints, which is all this experiment needs of it.
    args = fit_args(corpus, data, run, f"--model.init_args.shape.width={width}", "--model.init_args.shape.embed_dim=32",
                    "--trainer.max_steps=1000", "--trainer.val_check_interval=2", "--divergence.enabled=false")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen([sys.executable, "-m", "soma_pl.cli", *args], cwd=ROOT, env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    folder = run / "checkpoints"
    writes = rng.randint(2, 6)
    try:
        caught = _wait_for_write(folder, writes, time.monotonic() + 300)
        time.sleep(rng.uniform(0, 0.01))
        mid_write = bool(_temporaries(folder))
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    left, loadable, unloadable = sorted(folder.glob("*.ckpt")), 0, []
    steps = []
    for path in left:
        try:
            steps.append(load_checkpoint(path)["global_step"])
            loadable += 1
        except DataError as error:
            unloadable.append(str(error))
    temporaries = _temporaries(folder)
    last_step = load_checkpoint(folder / "last.ckpt")["global_step"] if (folder / "last.ckpt").is_file() else 0
    resume_args = fit_args(corpus, data, run, f"--model.init_args.shape.width={width}",
                                               "--model.init_args.shape.embed_dim=32",
                           f"--trainer.max_steps={last_step + 2}", "--trainer.val_check_interval=2",
                           "--divergence.enabled=false", "--ckpt_path=last")
    resumed = subprocess.run([sys.executable, "-m", "soma_pl.cli", *resume_args], cwd=ROOT, env=env,
                             capture_output=True, text=True, timeout=600)
    resumed_step = load_checkpoint(folder / "last.ckpt")["global_step"] if resumed.returncode == 0 else None
    return {"caught_write": caught, "killed_mid_write": mid_write, "ckpt_files": len(left), "loadable": loadable,
            "unloadable": unloadable, "steps": steps, "temporaries_left": len(temporaries),
            "resume_returncode": resumed.returncode, "resume_error": _stderr_lines(resumed.stderr)[-1:]
            if resumed.returncode else [], "resumed_from": last_step, "resumed_to": resumed_step,
            "temporaries_after_resume": len(_temporaries(folder))}


def kill_during_checkpoint_writes(corpus: Path, data: Path, bases: dict[str, Path], rounds: int, width: int = 512,
                                  seed: int = 0) -> dict:
    """`rounds` kill rounds in a fresh run folder under each of `bases` (name -> folder); the counts."""
    rng, results = random.Random(seed), {}
    for name, base in bases.items():
        with tempfile.TemporaryDirectory(dir=base) as scratch:
            runs = [kill_round(corpus, data, Path(scratch) / f"round{i}", rng, width) for i in range(rounds)]
        results[name] = {
            "folder": str(base), "rounds": rounds,
            "killed_mid_write": sum(r["killed_mid_write"] for r in runs),
            "ckpt_files_left": sum(r["ckpt_files"] for r in runs),
            "loadable": sum(r["loadable"] for r in runs),
            "unloadable": sum(len(r["unloadable"]) for r in runs),
            "temporaries_left_by_kill": sum(r["temporaries_left"] for r in runs),
            "resumed_ok": sum(r["resume_returncode"] == 0 and r["resumed_to"] == r["resumed_from"] + 2 for r in runs),
            "temporaries_after_resume": sum(r["temporaries_after_resume"] for r in runs),
            "rounds_detail": runs,
        }
    return results


def _filesystems(tmp_path: Path) -> dict[str, Path]:
    bases = {"disk (tmp_path)": tmp_path}
    if Path("/dev/shm").is_dir() and os.access("/dev/shm", os.W_OK):
        bases["tmpfs (/dev/shm)"] = Path("/dev/shm")
    return bases


def _check(results: dict) -> None:
    for name, counts in results.items():
        assert counts["unloadable"] == 0, (name, counts)
        assert counts["loadable"] == counts["ckpt_files_left"] > 0, (name, counts)
        assert counts["resumed_ok"] == counts["rounds"], (name, counts)
        assert counts["temporaries_after_resume"] == 0, (name, counts)


@pytest.mark.slow
def test_a_run_killed_while_writing_checkpoints_leaves_only_loadable_ones_and_resumes(dataset, tmp_path):
    corpus, data = dataset
    _check(kill_during_checkpoint_writes(corpus, data, _filesystems(tmp_path), rounds=2, width=256))


def main(rounds: int = 10) -> None:
    """The issue's experiment: `rounds` kills with the run folder on /dev/shm and on the disk under
    /tmp; prints the counts as JSON."""
    with tempfile.TemporaryDirectory(dir="/tmp") as folder:
        corpus, data = Path(folder) / "corpus", Path(folder) / "data"
        write_jsonl_corpus(corpus, {"alpha": 40, "beta": 40}, min_words=150, max_words=600)
        prepare(PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(corpus)]), output_dir=str(data),
                              val_documents=2, val_windows=4, test_windows=4, shard_max_bytes=40000), progress=False)
        results = kill_during_checkpoint_writes(corpus, data, {"tmpfs (/dev/shm)": Path("/dev/shm"),
                                                               "disk (/tmp)": Path(folder)}, rounds)
    summary = {name: {k: v for k, v in counts.items() if k != "rounds_detail"} for name, counts in results.items()}
    print(json.dumps({"summary": summary, "detail": results}, indent=1, default=str))
    _check(results)
