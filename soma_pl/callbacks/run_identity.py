"""What a resumed `fit` continues: its CSV version folder and its W&B run.

Every checkpoint records the run's logger identities (`RunIdentity`: the CSV logger's version, the
W&B run id) under `RUN_IDENTITY_KEY`. A `fit` that resumes a checkpoint of its own checkpoint folder
reads them back before its loggers exist, so it logs into the same `version_N` folder (through
`ContinuedCSVLogger`, which keeps the rows already in `metrics.csv`) and the same W&B run id
(`WandbLogger(id=...)`, which resumes with `resume="allow"`) instead of starting another of each.
"""

from __future__ import annotations

import csv
import os
import warnings
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import CSVLogger, WandbLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter
from lightning.pytorch.loggers.logger import rank_zero_experiment

from soma_pl.models.checkpoints import load_checkpoint

RUN_IDENTITY_KEY = "run_identity"
"""The checkpoint entry holding the run's `RunIdentity` (a dict)."""


def wandb_disabled() -> bool:
    """`WANDB_MODE=disabled`: nothing of W&B is created or written."""
    return os.environ.get("WANDB_MODE") == "disabled"


@dataclass
class RunIdentity:
    """The names a run's loggers gave it: what a resumed session logs under again."""

    csv_version: int | str | None = None
    """The CSV logger's version: the run's files are in `<default_root_dir>/version_<N>`."""
    wandb_id: str | None = None
    """The W&B run id (also the last part of its `wandb/offline-run-<time>-<id>` folder)."""

    @classmethod
    def of(cls, loggers: list) -> RunIdentity:
        """The identities of `loggers` (a trainer's): its first CSV logger and first W&B logger."""
        csv_logger = next((logger for logger in loggers if isinstance(logger, CSVLogger)), None)
        wandb_logger = next((logger for logger in loggers if isinstance(logger, WandbLogger)), None)
        return cls(csv_version=csv_logger.version if csv_logger is not None else None,
                   wandb_id=wandb_logger.version if wandb_logger is not None and not wandb_disabled() else None)

    @classmethod
    def read(cls, checkpoint: str | Path) -> RunIdentity | None:
        """The identity recorded in `checkpoint` (read weights-only), or None when it holds none."""
        recorded = load_checkpoint(checkpoint).get(RUN_IDENTITY_KEY)
        if not isinstance(recorded, dict):
            return None
        return cls(**{key: recorded.get(key) for key in ("csv_version", "wandb_id")})


class RecordRunIdentity(L.Callback):
    """Writes the trainer's `RunIdentity` into every checkpoint it saves."""

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict) -> None:
        checkpoint[RUN_IDENTITY_KEY] = asdict(RunIdentity.of(trainer.loggers))


class ContinuedCSVLogger(CSVLogger):
    """A `CSVLogger` writing into an existing run's `<save_dir>/version_<version>`: `metrics.csv`
    keeps the earlier sessions' rows, and this session's rows follow them under the same header.

    Lightning's writer deletes a `metrics.csv` it finds in its folder, so the file is moved aside
    while the writer starts and moved back before anything is logged (both renames: a session killed
    in between leaves it as `.metrics.csv.resumed`, which the next session moves back).
    """

    def __init__(self, save_dir: str | Path, version: int | str):
        super().__init__(save_dir=save_dir, name="", version=version)
        self._continued = False

    @property
    @rank_zero_experiment
    def experiment(self) -> ExperimentWriter:
        if self._continued:
            return super().experiment
        metrics = Path(self.log_dir) / ExperimentWriter.NAME_METRICS_FILE
        kept = metrics.with_name(f".{metrics.name}.resumed")
        if metrics.is_file():
            os.replace(metrics, kept)
        with warnings.catch_warnings():  # "... will be deleted": the rows are kept, aside
            warnings.filterwarnings("ignore", message="Experiment logs directory")
            writer = super().experiment
        if kept.is_file():
            with kept.open(newline="") as rows:
                # New rows are appended under this header; a new metric rewrites the file with all rows.
                writer.metrics_keys = next(csv.reader(rows), [])
            os.replace(kept, metrics)
        self._continued = True
        return writer
