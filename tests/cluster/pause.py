"""A callback that holds a run at a given step, so that a test can cancel its job there."""

from __future__ import annotations

import time
from pathlib import Path

import lightning as L


class PauseAtStep(L.Callback):
    """Before update `step`, write `marker` and wait `seconds`: the job is caught in the middle of
    its run, after the checkpoints of the earlier validations. Waiting changes no arithmetic.

    Args:
        step: the update to wait before.
        marker: a file written when the wait starts.
        seconds: how long to wait.
    """

    def __init__(self, step: int, marker: str, seconds: float = 600):
        self.step, self.marker, self.seconds = step, Path(marker), seconds

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            self.marker.touch()
            time.sleep(self.seconds)
