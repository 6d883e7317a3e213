"""The Trainer LightningCLI builds: Lightning's own, with batch limits that keep their type.

Lightning reads `limit_val_batches: 1` as one batch and `1.0` as every batch. Its signature types
these settings `float | int`, and jsonargparse tries the union's members in order, so an integer
from a config file or the command line arrived as the float 1.0: every batch, where the file said
one. Here they are `BatchCount`, which keeps what was written: `1` stays the integer 1, `1.0` and
`0.25` stay fractions.

Its default progress bar is `ResumingProgressBar`, which shows its total after a resume too.
"""

from __future__ import annotations

import lightning as L
import yaml
from jsonargparse.typing import register_type
from lightning.pytorch.callbacks import Callback, ProgressBar, TQDMProgressBar


class BatchCount(float):
    """A number of batches (an integer) or a fraction of them (a float), as written."""


def _batch_count(value: object) -> int | float:
    if isinstance(value, str):  # the command line's text; a config file's value is already typed
        value = yaml.safe_load(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{value!r} is neither a number of batches (an integer) nor a fraction (a float)")
    return value


register_type(BatchCount, serializer=lambda value: value, deserializer=_batch_count)


class ResumingProgressBar(TQDMProgressBar):
    """Lightning's `TQDMProgressBar`, which also shows its total (`60/100`) in a fit resumed in the
    middle of an epoch, as every run of an endless training stream is: Lightning sets the total when
    an epoch starts, so a resumed fit showed `60/?`."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.fit_loop.restarted_mid_epoch:
            done = trainer.fit_loop.epoch_loop.batch_progress.current.ready  # batches of this epoch already run
            # `total_train_batches` is what is left: the epoch's rest, or the updates left by max_steps.
            total = min(trainer.num_training_batches, done + self.total_train_batches)
            self.train_progress_bar.total = None if total == float("inf") else total
            self.train_progress_bar.n = done
            self.train_progress_bar.set_description(f"Epoch {trainer.current_epoch}")


class Trainer(L.Trainer):
    """`lightning.Trainer`; `limit_*_batches` and `overfit_batches` are `BatchCount`s; the progress bar, unless
    `callbacks` holds one, is `ResumingProgressBar`."""

    def __init__(self, *, limit_train_batches: BatchCount | None = None, limit_val_batches: BatchCount | None = None,
                 limit_test_batches: BatchCount | None = None, limit_predict_batches: BatchCount | None = None,
                 overfit_batches: BatchCount = 0.0, callbacks: list[Callback] | Callback | None = None,
                 enable_progress_bar: bool | None = None, **kwargs) -> None:
        callbacks = list(callbacks) if isinstance(callbacks, list) else [] if callbacks is None else [callbacks]
        if enable_progress_bar is not False and not any(isinstance(c, ProgressBar) for c in callbacks):
            callbacks.append(ResumingProgressBar())
        super().__init__(callbacks=callbacks, enable_progress_bar=enable_progress_bar,
                         limit_train_batches=limit_train_batches, limit_val_batches=limit_val_batches,
                         limit_test_batches=limit_test_batches, limit_predict_batches=limit_predict_batches,
                         overfit_batches=overfit_batches, **kwargs)
