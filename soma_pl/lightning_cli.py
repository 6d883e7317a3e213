"""LightningCLI for `fit`, `validate`, `test` and `predict`.

Defaults a researcher expects: a W&B logger that runs offline (no account, no network; `wandb sync`
later) next to a local CSV logger, a last-and-periodic checkpoint, compute accounting
(`compute.json`), an optional compute budget, and `summary.json` in the run directory. The
`--model` and `--data` classes are picked by `class_path` in the YAML. Checkpoints are written
atomically and read with `weights_only=True` (`soma_pl.callbacks.checkpoint_io`); a full or read-only
disk ends the command with one line. Each W&B run gets the whole resolved config, and is grouped and
named by the `wandb:` section (sweeps set `--wandb.group=<study> --wandb.name=trial-<n>`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import sys
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.plugins.io import CheckpointIO

from soma_pl.callbacks.checkpoint_io import AtomicCheckpointIO
from soma_pl.callbacks.compute import ComputeAccounting, ComputeBudget
from soma_pl.callbacks.final import EndStateCheckpoint
from soma_pl.callbacks.summary import RunSummary
from soma_pl.data.datamodule import ByteDataModule
from soma_pl.errors import DataError, SomaError
from soma_pl.lit.base import ByteLMModule

RUNS_DIR = "runs"


def trainer_defaults() -> dict:
    return {"default_root_dir": RUNS_DIR}


@dataclass
class WandbSettings:
    """Where a run's W&B record goes. W&B runs offline unless the environment sets
    `WANDB_MODE=online`; offline runs are uploaded later with `wandb sync`."""

    project: str = "soma_pl"
    group: str | None = None
    """Runs that belong together (a sweep's study name)."""
    name: str | None = None
    """The run's display name (a sweep trial: `trial-<number>`)."""
    job_type: str | None = None
    """None: the subcommand (`fit`, `validate`, `test`, `predict`)."""
    tags: list[str] = field(default_factory=list)
    notes: str | None = None
    entity: str | None = None


def default_loggers(root: str, settings: WandbSettings | None = None, config: dict | None = None,
                    job_type: str | None = None) -> list:
    """A CSV logger (the run directory is its `root/version_N`) and W&B, offline unless
    `WANDB_MODE=online` is set, writing under the same root, with `config` as the run's config."""
    settings = settings or WandbSettings()
    return [
        CSVLogger(save_dir=root, name=""),
        WandbLogger(project=settings.project, name=settings.name, save_dir=root, group=settings.group,
                    job_type=settings.job_type or job_type, tags=list(settings.tags) or None, notes=settings.notes,
                    entity=settings.entity, config=config,
                    offline=os.environ.get("WANDB_MODE", "offline") != "online"),
    ]


def finish_wandb(exit_code: int = 0) -> None:
    """End the process's W&B run, if any, so the next `fit` in this process (a sweep trial) starts
    its own run instead of appending to this one. `finish` returns before W&B's service has
    written the last records; `teardown` waits for it, so the offline run is complete on disk (ready
    for `wandb sync`) when the command returns."""
    wandb = sys.modules.get("wandb")
    if wandb is not None and wandb.run is not None:
        wandb.finish(exit_code=exit_code)
        wandb.teardown(exit_code=exit_code)


class CompleteConfigCallback(SaveConfigCallback):
    """Saves `config.yaml` into the run folder, or nothing: a write that fails (a full disk) removes
    its partial file and names it in the error."""

    def setup(self, trainer, pl_module, stage: str) -> None:
        try:
            super().setup(trainer, pl_module, stage)
        except OSError as error:
            path = Path(trainer.log_dir or trainer.default_root_dir) / self.config_filename
            with contextlib.suppress(OSError):
                path.unlink()
            raise OSError(error.errno, error.strerror, error.filename or str(path)) from error


class SomaCLI(LightningCLI):
    """LightningCLI with the suite's forced callbacks (checkpointing, compute accounting and budget,
    run summary) and the `wandb:` section."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(EndStateCheckpoint, "checkpoint")
        # Checkpoints are written when a validation ends, after the learning-rate decay it drives:
        # the state a resumed run needs to continue exactly as an uninterrupted one; `last.ckpt`
        # also when training ends, so it holds the last updates.
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1,
                             "checkpoint.save_on_train_epoch_end": False})
        parser.add_lightning_class_args(ComputeAccounting, "compute")
        parser.add_lightning_class_args(ComputeBudget, "budget")
        parser.add_lightning_class_args(RunSummary, "summary")
        parser.add_class_arguments(WandbSettings, "wandb")

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs):
        """`--weights_only` (of `fit`, `validate`, ...) defaults to true: `--ckpt_path` loads no code."""
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if "weights_only" in self._subcommand_method_arguments[subcommand]:
            parser.set_defaults(weights_only=True)
        return parser

    def instantiate_trainer(self, **kwargs):
        """Replace Lightning's default logger (`logger: true`) by the CSV + offline W&B pair, and
        write checkpoints atomically (unless the config names its own CheckpointIO)."""
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (True, None) and "logger" not in kwargs:
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or RUNS_DIR,
                                               self._get(self.config_init, "wandb"), self.resolved_config(),
                                               self.subcommand)
        if "plugins" not in kwargs:
            plugins = config.get("plugins") or []
            plugins = list(plugins) if isinstance(plugins, list) else [plugins]
            if not any(isinstance(plugin, CheckpointIO) for plugin in plugins):
                kwargs["plugins"] = [*plugins, AtomicCheckpointIO()]
        return super().instantiate_trainer(**kwargs)

    def resolved_config(self) -> dict:
        """The subcommand's whole config (defaults included) as plain data, for the W&B run."""
        parser = self._parser(self.subcommand)
        config = self.config.get(str(self.subcommand), self.config)
        return yaml.safe_load(parser.dump(config, format="yaml", skip_unset=False))

    def _parse_ckpt_path(self) -> None:
        """Keep the model the config describes when `--ckpt_path` is given.

        LightningCLI would otherwise replace the configured model arguments with the checkpoint's
        hyperparameters, silently overriding what the user asked for; instead the checkpoint is
        checked against the configured shapes and a mismatch is an error naming both. A path that
        names no checkpoint file fails here, before any data is prepared.
        """
        subcommand = self.config.get("subcommand")
        ckpt_path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if ckpt_path is not None:
            check_ckpt_path(str(ckpt_path))

    def instantiate_classes(self) -> None:
        """A SomaError from a module's or data module's constructor ends the command with its own
        line (jsonargparse wraps it in an error that lists the whole config)."""
        try:
            super().instantiate_classes()
        except Exception as error:
            cause, seen = error, set()
            while cause is not None and not isinstance(cause, SomaError) and id(cause) not in seen:
                seen.add(id(cause))
                cause = cause.__cause__ or cause.__context__
            if not isinstance(cause, SomaError):
                raise
            raise cause from None


def check_ckpt_path(ckpt_path: str) -> None:
    """Refuse a local `--ckpt_path` that is missing or not a torch checkpoint (a zip archive); names
    Lightning resolves itself (`last`, `best`, ...) and remote URLs pass."""
    if ckpt_path in ("last", "best", "hpc") or ckpt_path.startswith("registry") or "://" in ckpt_path:
        return
    path = Path(ckpt_path).expanduser()
    if not path.is_file():
        raise DataError(f"--ckpt_path {path}: no such checkpoint file")
    if not zipfile.is_zipfile(path):
        raise DataError(f"--ckpt_path {path} is not a checkpoint (torch.save writes a zip archive)")


ROOM = "free space there or set --trainer.default_root_dir (and --checkpoint.dirpath) to a folder on a disk with room"
WRITABLE = "set --trainer.default_root_dir (and --checkpoint.dirpath) to a writable folder"
DISK_ERRORS = {errno.ENOSPC: ROOM, errno.EDQUOT: ROOM, errno.EFBIG: "raise the file size limit (ulimit -f)",
               errno.EROFS: WRITABLE, errno.EACCES: WRITABLE}
"""Errors of the disk a run writes to, which the user fixes, and how."""


def disk_error(error: OSError, argv: Sequence[str]) -> DataError:
    """One line naming the file (or, when the error does not say, the run folder) that could not be
    written, and the setting that moves the run elsewhere."""
    target = error.filename or next((arg.split("=", 1)[1] for arg in argv
                                     if arg.startswith("--trainer.default_root_dir=")), "the run folder")
    return DataError(f"cannot write {target}: {error.strerror or error} (Errno {error.errno}): {DISK_ERRORS[error.errno]}")


def make_cli(argv: Sequence[str], run: bool = True) -> SomaCLI:
    """Parse `argv` (a subcommand first when `run`), instantiate, and run the subcommand."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    try:
        cli = SomaCLI(
            model_class=ByteLMModule,
            datamodule_class=ByteDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_defaults=trainer_defaults(),
            save_config_callback=CompleteConfigCallback,
            save_config_kwargs={"overwrite": True},
            # The optimizer is a model argument (`--model.init_args.optimizer`), with the module's
            # own learning-rate decay; LightningCLI's `--optimizer` would replace both.
            auto_configure_optimizers=False,
            args=list(argv),
            run=run,
        )
    except OSError as error:
        finish_wandb(exit_code=1)
        if error.errno in DISK_ERRORS:
            raise disk_error(error, argv) from error
        raise
    except BaseException:
        finish_wandb(exit_code=1)
        raise
    if run:
        finish_wandb()
    return cli


def run_lightning(argv: Sequence[str]) -> None:
    make_cli(argv)
