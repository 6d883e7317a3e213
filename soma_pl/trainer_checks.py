"""Settings of `fit`, `validate`, `test` and `predict` that Lightning takes with a traceback, deep
into a run or not at all, checked before any data is prepared: each bad one is a one-line error.

A checkpoint folder holds one run. `--ckpt_path last` resumes it from its newest checkpoint:
`last.ckpt`, or an `epoch=…` checkpoint written after it (a run stopped between writing the two;
Lightning would look for `last*.ckpt` only and, finding none, train from scratch). A new `fit` does
not start in a folder holding an earlier run's checkpoints: Lightning would write numbered copies
(`epoch=0-step=200-v1.ckpt`, `last-v1.ckpt`) beside files that its `save_top_k` no longer tracks,
and `--ckpt_path last` could not tell the runs apart.
"""

from __future__ import annotations

import os
import shutil
import socket
import warnings
from pathlib import Path

import torch

from soma_pl.errors import ConfigError
from soma_pl.io import existing_parent

LAST = "last.ckpt"


def check_trainer(trainer) -> None:
    """Refuse trainer settings that cannot work here (`trainer` is the parsed `trainer:` section)."""
    max_steps = trainer.get("max_steps")
    if _is_int(max_steps) and max_steps < -1:
        raise ConfigError(f"--trainer.max_steps={max_steps}: give a number of updates (0 or more), or -1 for no limit")
    interval = trainer.get("val_check_interval")
    if isinstance(interval, float):
        raise ConfigError(f"--trainer.val_check_interval={interval}: a fraction of an epoch means nothing for an "
                          "endless training stream: give the number of updates between validations (an integer ≥ 1)")
    if _is_int(interval) and interval < 1:
        raise ConfigError(f"--trainer.val_check_interval={interval}: give the number of updates between validations "
                          "(an integer ≥ 1)")
    accelerator = trainer.get("accelerator")
    if isinstance(accelerator, str) and accelerator.lower() in ("gpu", "cuda") and not torch.cuda.is_available():
        raise ConfigError(f"--trainer.accelerator={accelerator}: no CUDA GPU is visible to this process: use "
                          "--trainer.accelerator=cpu (or the trainer base configs/trainer/cpu.yaml)")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def check_folder(path: str | Path, setting: str) -> None:
    """Refuse a run folder that is a file, or lies under one (it could never be created)."""
    path = Path(path).expanduser()
    folder = path if path.exists() else existing_parent(path)
    if not folder.is_dir():
        where = "is a file" if folder == path else f"lies under the file {folder}"
        raise ConfigError(f"--{setting}={path} {where}, not a folder: choose a folder for the run's outputs")


def checkpoints(folder: Path) -> list[Path]:
    """The checkpoints in `folder`, oldest first (by modification time; at a tie `last.ckpt` last).
    Temporary files of unfinished writes are hidden and never counted."""
    if not folder.is_dir():
        return []
    found = [path for path in folder.iterdir()
             if path.suffix == ".ckpt" and not path.name.startswith(".") and path.is_file()]
    return sorted(found, key=lambda path: (path.stat().st_mtime_ns, path.name == LAST))


def resume_point(folder: Path) -> Path | None:
    """What `--ckpt_path last` resumes: the run's newest checkpoint as `last.ckpt`; None when
    `folder` holds none (a first run, which Lightning starts from scratch with a warning).

    An `epoch=…` checkpoint newer than `last.ckpt` (or without one) becomes `last.ckpt` by a hard
    link (a copy where links fail) and a rename: resuming from `last.ckpt` lets the top-k rotation
    delete the `epoch=…` file at the next save, which Lightning never does to the file it resumed
    from. Checkpoints are written by a rename, so the newest is complete; one damaged afterwards
    fails to load with one line."""
    found = checkpoints(folder)
    if not found:
        return None
    newest, last = found[-1], folder / LAST
    if newest != last:
        staged = folder / f".{LAST}.tmp-{socket.gethostname()}-{os.getpid()}"
        try:
            os.link(newest, staged)
        except OSError:
            shutil.copyfile(newest, staged)
        os.replace(staged, last)
        warnings.warn(f"--ckpt_path last: resuming from {newest.name}, the newest checkpoint in {folder} (the run "
                      f"stopped after writing it and before its {LAST}, which now holds the same state)",
                      stacklevel=1)  # a caller's frame would be a file Lightning formats as its own
    return last


def refuse_earlier_run(folder: Path) -> None:
    """A new `fit` (no `--ckpt_path`) may not write into a folder with another run's checkpoints."""
    found = [path.name for path in reversed(checkpoints(folder))]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"checkpoint folder {folder} holds an earlier run's checkpoints ({shown}): resume it with "
                          "--ckpt_path last, or give this run its own --trainer.default_root_dir (or "
                          "--checkpoint.dirpath)")
