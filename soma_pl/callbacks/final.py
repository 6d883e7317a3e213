"""`EndStateCheckpoint`: `last.ckpt` holds the state a `fit` ended in, not the last validation's.

Checkpoints are written when a validation ends (after the learning-rate decay it drives), so with
`max_steps` not a multiple of `val_check_interval` the updates after the last validation were in no
checkpoint, while `summary.json` reported the final step. This `ModelCheckpoint` also writes
`last.ckpt` when training ends, unless the end state is already saved. No extra validation runs:
the checkpoint holds the weights, optimizer and decay state after the last update and the loop
counters, so `--ckpt_path last` with a larger `max_steps` continues exactly as an uninterrupted run
(the data stream skips the `global_step` batches already used; the next validation falls on the
same step). A run stopped by an error writes nothing at its end.

Metric names hold `/` (`val/loss`); a filename template such as `{val/loss:.4f}` would make
Lightning write `val/loss=2.3456.ckpt`, a file inside a new folder `val/`. Checkpoint names here
never nest folders: every `/` of a formatted name becomes `_` (`val_loss=2.3456.ckpt`).
"""

from __future__ import annotations

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

PATH_SEPARATOR, REPLACEMENT = "/", "_"


class EndStateCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last.ckpt` (with `save_last`) is the end state of every `fit`, and
    whose file names stay in `dirpath` whatever metric names the `filename` template uses."""

    def _format_checkpoint_name(self, filename, metrics, prefix=None, auto_insert_metric_name=True) -> str:
        # The only hook between the template and the path: `format_checkpoint_name` joins the
        # result to `dirpath`, so a `/` left here would become a folder.
        name = super()._format_checkpoint_name(filename, metrics, prefix, auto_insert_metric_name)
        return name.replace(PATH_SEPARATOR, REPLACEMENT)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Skips fast_dev_run, and a step already saved (the run ended on a validation).
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        super().on_train_end(trainer, pl_module)
