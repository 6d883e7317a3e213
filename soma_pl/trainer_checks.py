"""Settings of `fit`, `validate`, `test` and `predict` that Lightning takes with a traceback, deep
into a run or not at all, checked before any data is prepared: each bad one is a one-line error.

A checkpoint folder holds one run. `--ckpt_path last` resumes it from its latest state: the
checkpoint recording the highest global step, whatever the files' modification times say (a
`cp -r` of a run folder scrambles them); `last.ckpt` or an `epoch=…` checkpoint written after it (a
run stopped between writing the two; Lightning would look for `last*.ckpt` only and, finding none,
train from scratch). A new `fit` does
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

from soma_pl.errors import ConfigError, DataError
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
    """The checkpoints in `folder`, by name. Temporary files of unfinished writes are hidden and
    never counted."""
    if not folder.is_dir():
        return []
    return sorted(path for path in folder.iterdir()
                  if path.suffix == ".ckpt" and not path.name.startswith(".") and path.is_file())


def recorded_step(path: Path) -> int:
    """The global step a checkpoint records (read weights-only and memory-mapped: no tensor is read)."""
    try:
        step = torch.load(path, map_location="cpu", weights_only=True, mmap=True).get("global_step")
    except Exception:  # torch.load raises many types for a damaged file
        step = None
    if not _is_int(step):
        raise DataError(f"--ckpt_path last: unreadable checkpoint {path} (truncated, corrupt or not a Lightning "
                        "checkpoint): move it out of the run's checkpoint folder")
    return step


def resume_point(folder: Path) -> Path | None:
    """What `--ckpt_path last` resumes: the checkpoint recording the highest global step, as
    `last.ckpt` (at a tie `last.ckpt` itself); None when `folder` holds none (a first run, which
    Lightning starts from scratch with a warning).

    An `epoch=…` checkpoint ahead of `last.ckpt` (or without one) becomes `last.ckpt` by a hard
    link (a copy where links fail) and a rename: resuming from `last.ckpt` lets the top-k rotation
    delete the `epoch=…` file at the next save, which Lightning never does to the file it resumed
    from. No later state is lost: the file taken is the latest. Checkpoints are written by a
    rename, so each is complete; one damaged afterwards is refused with one line."""
    found = checkpoints(folder)
    if not found:
        return None
    last = folder / LAST
    latest = max(found, key=lambda path: (recorded_step(path), path == last))
    if latest != last:
        staged = folder / f".{LAST}.tmp-{socket.gethostname()}-{os.getpid()}"
        try:
            os.link(latest, staged)
        except OSError:
            shutil.copyfile(latest, staged)
        os.replace(staged, last)
        warnings.warn(f"--ckpt_path last: resuming from {latest.name}, the latest state in {folder} (global step "
                      f"{recorded_step(last)}; {LAST} now holds the same state)",
                      stacklevel=1)  # a caller's frame would be a file Lightning formats as its own
    return last


def refuse_earlier_run(folder: Path) -> None:
    """A new `fit` (no `--ckpt_path`) may not write into a folder with another run's checkpoints."""
    found = [path.name for path in checkpoints(folder)]
    if found:
        shown = ", ".join(found[:3]) + (f" and {len(found) - 3} more" if len(found) > 3 else "")
        raise ConfigError(f"checkpoint folder {folder} holds an earlier run's checkpoints ({shown}): resume it with "
                          "--ckpt_path last, or give this run its own --trainer.default_root_dir (or "
                          "--checkpoint.dirpath)")
