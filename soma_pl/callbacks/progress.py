"""`ProgressFile`: a fit's update count and latest validation loss as JSON lines, for another
process to follow while the fit runs (the main job's per-side bars, `soma_pl.main_job_steps`)."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L


class ProgressFile(L.Callback):
    """Appends one JSON line to `path` when training starts and after every update
    (`{"step": <updates made>}`) and after every validation (`{"step": ..., "val_loss": ...}`),
    flushed at once. A reader takes whole lines only, so a line being written is never half read.
    Only the main process (rank 0) writes.

    Args:
        path: the file the lines are appended to (it and its folder are made when missing).
        monitor: the logged metric reported as `val_loss`.
    """

    def __init__(self, path: str, monitor: str = "val/loss"):
        self.path = path
        self.monitor = monitor
        self._file = None

    def _write(self, trainer: L.Trainer, **fields: float) -> None:
        if not trainer.is_global_zero:
            return
        if self._file is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "a")  # noqa: SIM115 (open from the first line to teardown)
        self._file.write(json.dumps({"step": trainer.global_step, **fields}) + "\n")
        self._file.flush()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._write(trainer)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self._write(trainer)

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        if trainer.sanity_checking or value is None:
            return
        self._write(trainer, val_loss=float(value))

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
