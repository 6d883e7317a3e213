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

A resumed run keeps its settings. Every checkpoint records the resolved config its run was started
with (`RUN_SETTINGS_KEY`); a `fit` resuming a checkpoint of its own run with another model or
training-data setting is refused, naming the keys: it would rewrite `config.yaml` with the new values
while the checkpoint's optimizer and decay state carry the old ones on. How long, where and on how
many devices it trains, what it logs and how it checkpoints (`trainer`, `checkpoint`, `wandb`, ...), and
what only bounds memory or locates the data (`FREE_ON_RESUME`) may change.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

import torch

from soma_pl.errors import ConfigError, DataError
from soma_pl.io import existing_parent, remove_stale_temporaries, temporary_path

LAST = "last.ckpt"
RUN_SETTINGS_KEY = "run_settings"
"""The checkpoint entry holding the resolved config (as `config.yaml` has it) its run was started with."""
KEPT_ON_RESUME = ("model", "data")
"""The config sections a resumed run keeps: what it trains, how, and on which data."""
FREE_ON_RESUME = (
    # memory and speed: the same updates in other pieces
    "model.init_args.shape.time_chunk", "model.init_args.spsa.max_rows", "model.init_args.eggroll.max_members",
    "model.init_args.recipe.max_members", "data.init_args.eval_batch_size", "data.init_args.num_workers",
    # where a fresh fit starts: not read when resuming
    "model.init_args.init", "model.init_args.seed_checkpoint",
    # where the data are and how they are built or checked (what they are: the checkpoint's fingerprints)
    "model.init_args.router_path", "data.init_args.dataset", "data.init_args.experts_dir", "data.init_args.prepared",
    "data.init_args.recipe", "data.init_args.verify", "data.init_args.auto_prepare", "data.init_args.test_split",
)
"""Keys (and the keys under them) of `KEPT_ON_RESUME` that a resumed run may change."""


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
        raise DataError(f"unreadable checkpoint {path} (truncated, corrupt or not a Lightning checkpoint): "
                        "--ckpt_path last reads every checkpoint of the run; move it out of its checkpoint folder")
    return step


def resume_point(folder: Path) -> Path | None:
    """What `--ckpt_path last` resumes: the checkpoint recording the highest global step, as
    `last.ckpt` (at a tie `last.ckpt` itself); None when `folder` holds none (a first run, which
    Lightning starts from scratch with a warning).

    An `epoch=…` checkpoint ahead of `last.ckpt` (or without one) becomes `last.ckpt` by a hard
    link (a copy where links fail) and a rename: resuming from `last.ckpt` lets the top-k rotation
    delete the `epoch=…` file at the next save, which Lightning never does to the file it resumed
    from. No later state is lost: the file taken is the latest. Checkpoints are written by a
    rename, so each is complete; one damaged afterwards is refused with one line. Temporary files
    that killed writers left in `folder` are removed first."""
    remove_stale_temporaries(folder)  # here too: a resume that trains no further saves nothing
    found = checkpoints(folder)
    if not found:
        return None
    last = folder / LAST
    latest = max(found, key=lambda path: (recorded_step(path), path == last))
    if latest != last:
        staged = temporary_path(last)
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


def _flat(settings: dict, prefix: str = "") -> dict[str, object]:
    """Nested mappings as `{"a.b.c": value}`."""
    flat = {}
    for key, value in settings.items():
        if isinstance(value, dict) and value:
            flat.update(_flat(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def changed_settings(recorded: dict, given: dict) -> list[tuple[str, object, object]]:
    """`(key, recorded value, given value)` of every key of `KEPT_ON_RESUME` whose value differs
    between two resolved configs, but those `FREE_ON_RESUME`; `None` stands for a key one lacks."""
    def kept(settings: dict) -> dict[str, object]:
        flat = _flat({section: settings.get(section) for section in KEPT_ON_RESUME})
        return {key: value for key, value in flat.items()
                if not any(key == free or key.startswith(f"{free}.") for free in FREE_ON_RESUME)}

    before, now = kept(recorded), kept(given)
    return [(key, before.get(key), now.get(key)) for key in sorted(before.keys() | now.keys())
            if before.get(key) != now.get(key)]


def check_same_settings(checkpoint: Path, given: dict) -> None:
    """Refuse to resume `checkpoint`, one of this run's, with settings its run did not start with
    (`given`: the resolved config). A checkpoint recording none is not compared."""
    recorded = torch.load(checkpoint, map_location="cpu", weights_only=True, mmap=True).get(RUN_SETTINGS_KEY)
    changes = changed_settings(recorded, given) if isinstance(recorded, dict) else []
    if changes:
        shown = "; ".join(f"{key}: {before!r} -> {now!r}" for key, before, now in changes[:4])
        more = f" and {len(changes) - 4} more" if len(changes) > 4 else ""
        raise ConfigError(f"--ckpt_path {checkpoint} resumes a run with other settings ({shown}{more}): a resumed "
                          "run keeps its settings (its checkpoint carries the optimizer and decay state on); resume "
                          "with the run's values, or start a new run in its own --trainer.default_root_dir")
