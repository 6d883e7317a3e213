"""`EndStateCheckpoint`: `last.ckpt` holds the state a `fit` ended in, not the last validation's.

Checkpoints are written when a validation ends (after the learning-rate decay it drives), so with
`max_steps` not a multiple of `val_check_interval` the updates after the last validation were in no
checkpoint, while `summary.json` reported the final step. This `ModelCheckpoint` also writes
`last.ckpt` when training ends, unless the end state is already saved. No extra validation runs:
the checkpoint holds the weights, optimizer and decay state after the last update and the loop
counters, so `--ckpt_path last` with a larger `max_steps` continues exactly as an uninterrupted run
(the data stream skips the `global_step` batches already used; the next validation falls on the
same step). A run stopped by an error writes nothing at its end; a `fast_dev_run` writes no
checkpoint at all (Lightning's own end-of-training save would leave a `last.ckpt` that makes the
next real `fit` in the folder refuse to start).

A signal ends training the same way (`StopOnSignal`): SIGINT (Ctrl-C) or SIGTERM (a scheduler, a
`kill`) during a single-process `fit` lets the update in progress, and a validation due after it,
finish, then training ends as if `max_steps` were that update: `last.ckpt` holds its state and the
command ends with `Interrupted` (`soma_pl: interrupted`, exit status 130 or 143). `summary.json` is
not written: it marks a finished fit, which sweeps, `runs` and `reproduce` read as the run's result.
A second signal stops at once, keeping the last checkpoint written. A multi-process fit is left to
Lightning's own handling of the signals (`soma_pl.lightning_cli` turns its ends into `Interrupted`),
keeping its last validation's checkpoint: its ranks would not agree on an update to end with.

Metric names hold `/` (`val/loss`); a filename template such as `{val/loss:.4f}` would make
Lightning write `val/loss=2.3456.ckpt`, a file inside a new folder `val/`. Checkpoint names here
never nest folders: every `/` of a formatted name becomes `_` (`val_loss=2.3456.ckpt`).
"""

from __future__ import annotations

import signal

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint

from soma_pl.errors import Interrupted

PATH_SEPARATOR, REPLACEMENT = "/", "_"
SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""What stops a `fit` after its current update."""


class StopOnSignal:
    """While it is held, the first SIGINT or SIGTERM ends training after the update in progress (by
    lowering the loop's `max_steps` to it); a second raises `Interrupted` at once."""

    def __init__(self, trainer: L.Trainer):
        self.trainer = trainer
        self.received: signal.Signals | None = None
        self.previous = {signum: signal.signal(signum, self.handle) for signum in SIGNALS}
        if trainer.received_sigterm:  # during set-up, to Lightning's handler, which this one replaces
            self.handle(signal.SIGTERM, None)

    def handle(self, signum: int, frame) -> None:
        if self.received is not None:
            raise Interrupted(signum)
        self.received = signal.Signals(signum)
        # An update in progress has not yet counted itself: it ends the run.
        self.trainer.fit_loop.epoch_loop.max_steps = self.trainer.global_step

    def release(self) -> signal.Signals | None:
        """Put the earlier handlers back; the signal received, or None."""
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)
        self.previous = {}
        return self.received


class EndStateCheckpoint(ModelCheckpoint):
    """`ModelCheckpoint` whose `last.ckpt` (with `save_last`) is the end state of every `fit`, also one
    ended by a signal, and whose file names stay in `dirpath` whatever metric names the `filename`
    template uses."""

    stop: StopOnSignal | None = None

    def _format_checkpoint_name(self, filename, metrics, prefix=None, auto_insert_metric_name=True) -> str:
        # The only hook between the template and the path: `format_checkpoint_name` joins the
        # result to `dirpath`, so a `/` left here would become a folder.
        name = super()._format_checkpoint_name(filename, metrics, prefix, auto_insert_metric_name)
        return name.replace(PATH_SEPARATOR, REPLACEMENT)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_train_start(trainer, pl_module)
        if trainer.world_size == 1:
            self.stop = StopOnSignal(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        received = self._release()
        # Skips fast_dev_run, and a step already saved (the run ended on a validation). Lightning's
        # own `on_train_end`, which saves `last.ckpt` whenever this session saved none, is not run.
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if received is not None:
            saved = self.last_model_path or "the run's last checkpoint"
            raise Interrupted(received, f"stopped after update {trainer.global_step}, whose state is in {saved} "
                                        f"(--ckpt_path last resumes the run); no summary.json: the fit did not finish")

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._release()
        super().on_exception(trainer, pl_module, exception)

    def _release(self) -> signal.Signals | None:
        stop, self.stop = self.stop, None
        return stop.release() if stop is not None else None
