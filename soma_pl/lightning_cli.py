"""LightningCLI for `fit`, `validate`, `test` and `predict`.

Defaults a researcher expects: a W&B logger that runs offline (no account, no network; `wandb sync`
later) next to a local CSV logger, a last-and-periodic checkpoint, and `summary.json` in the run
directory. The `--model` and `--data` classes are picked by `class_path` in the YAML.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import CSVLogger, WandbLogger

from soma_pl.callbacks.summary import RunSummary
from soma_pl.data.datamodule import ByteDataModule
from soma_pl.lit.base import ByteLMModule

RUNS_DIR = "runs"


def trainer_defaults() -> dict:
    return {"default_root_dir": RUNS_DIR}


def default_loggers(root: str) -> list:
    """A CSV logger (the run directory is its `root/version_N`) and W&B, offline unless
    `WANDB_MODE=online` is set, writing under the same root."""
    return [
        CSVLogger(save_dir=root, name=""),
        WandbLogger(project="soma_pl", save_dir=root, offline=os.environ.get("WANDB_MODE", "offline") != "online"),
    ]


class SomaCLI(LightningCLI):
    """LightningCLI with the suite's forced callbacks (checkpointing, run summary)."""

    def add_arguments_to_parser(self, parser) -> None:
        parser.add_lightning_class_args(ModelCheckpoint, "checkpoint")
        # Checkpoints are written when a validation ends, after the learning-rate decay it drives:
        # the state a resumed run needs to continue exactly as an uninterrupted one.
        parser.set_defaults({"checkpoint.save_last": True, "checkpoint.save_top_k": 1,
                             "checkpoint.save_on_train_epoch_end": False})
        parser.add_lightning_class_args(RunSummary, "summary")

    def instantiate_trainer(self, **kwargs):
        """Replace Lightning's default logger (`logger: true`) by the CSV + offline W&B pair."""
        config = self._get(self.config_init, "trainer", default={})
        if config.get("logger") in (True, None) and "logger" not in kwargs:
            kwargs["logger"] = default_loggers(config.get("default_root_dir") or RUNS_DIR)
        return super().instantiate_trainer(**kwargs)

    def _parse_ckpt_path(self) -> None:
        """Keep the model the config describes when `--ckpt_path` is given.

        LightningCLI would otherwise replace the configured model arguments with the checkpoint's
        hyperparameters, silently overriding what the user asked for; instead the checkpoint is
        checked against the configured shapes and a mismatch is an error naming both.
        """


def make_cli(argv: Sequence[str], run: bool = True) -> SomaCLI:
    """Parse `argv` (a subcommand first when `run`), instantiate, and run the subcommand."""
    os.environ.setdefault("WANDB_MODE", "offline")
    os.environ.setdefault("WANDB_SILENT", "true")
    return SomaCLI(
        model_class=ByteLMModule,
        datamodule_class=ByteDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults=trainer_defaults(),
        save_config_kwargs={"overwrite": True},
        args=list(argv),
        run=run,
    )


def run_lightning(argv: Sequence[str]) -> None:
    make_cli(argv)
