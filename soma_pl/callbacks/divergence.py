"""`DivergenceCheck`: a run whose weights or loss leave sane bounds stops with one line.

A learning rate far too large does not always give NaN: at `lr=1e30` the weights reach 5e29, every
gate saturates, and the loss sits at ln 256 (a uniform guess) for the rest of the run, which then
ends green with a checkpoint and a summary that read as a result. This check stops such a run
(exit status 2) naming the step, the expert and the bound, before the next checkpoint is written.
The non-finite case is the module's own check, every step (`ByteLMModule.check_finite`).

Bounds, both far outside what training reaches: no weight of a byte LSTM trained here exceeds a few
tens (its gates saturate long before 1e4), and twice ln 256 nats/byte is twice the loss of a model
that guesses uniformly (where training starts). `--divergence.enabled false` turns the check off;
either bound set to null turns that half off.
"""

from __future__ import annotations

import math

import lightning as L
import torch

from soma_pl.errors import ConfigError, SomaError
from soma_pl.eval.checks import largest_weights

UNIFORM_LOSS = math.log(256)
"""The loss of a uniform guess over bytes, nats/byte."""


class DivergedError(SomaError):
    """Weights or a loss beyond the `DivergenceCheck` bounds."""


class DivergenceCheck(L.Callback):
    """Every `every_n_steps` updates, when training ends, and after each validation: stop the run
    when an expert's largest weight magnitude exceeds `max_abs_weight` or the training or
    validation loss exceeds `max_loss` (one flag all-reduced so that every process stops together).

    Args:
        enabled: False: no check.
        max_abs_weight: largest allowed weight magnitude of any expert (null: no weight bound).
        max_loss: largest allowed training or validation loss, nats/byte (null: no loss bound).
        every_n_steps: updates between checks during training (each check reads `[E]` values to the host).
    """

    def __init__(self, enabled: bool = True, max_abs_weight: float | None = 1.0e4,
                 max_loss: float | None = 2 * UNIFORM_LOSS, every_n_steps: int = 10):
        for key, value in (("max_abs_weight", max_abs_weight), ("max_loss", max_loss)):
            if value is not None and not (math.isfinite(value) and value > 0):
                raise ConfigError(f"divergence.{key}={value}: give a positive finite bound, or null for none")
        if every_n_steps < 1:
            raise ConfigError(f"divergence.every_n_steps={every_n_steps} must be >= 1")
        self.enabled, self.max_abs_weight, self.max_loss = enabled, max_abs_weight, max_loss
        self.every_n_steps = every_n_steps

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args) -> None:
        if trainer.global_step % self.every_n_steps == 0:
            self.check(trainer, pl_module, "train/loss", "training loss")

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.check(trainer, pl_module, "train/loss", "training loss")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn == "fit" and not trainer.sanity_checking:
            self.check(trainer, pl_module, "val/loss", "validation loss")

    def check(self, trainer: L.Trainer, pl_module: L.LightningModule, metric: str, what: str) -> None:
        if not self.enabled:
            return
        problem = self.problem(pl_module, trainer.callback_metrics.get(metric), what)
        if trainer.strategy.reduce_boolean_decision(problem is not None, all=False):
            raise DivergedError(
                f"diverged at step {trainer.global_step}: {problem or 'another process diverged'}: lower the "
                "learning rate or eps/sigma (or resume from an earlier checkpoint with smaller ones); "
                "--divergence.enabled false turns this check off")

    def problem(self, pl_module: L.LightningModule, loss: torch.Tensor | None, what: str) -> str | None:
        """What is beyond its bound on this process, or None."""
        model = getattr(pl_module, "trained_model", None)
        if self.max_abs_weight is not None and model is not None:
            largest = largest_weights(model).tolist()
            experts = list(getattr(pl_module, "experts", range(len(largest))))
            over = [(expert, value) for expert, value in zip(experts, largest, strict=True)
                    if not value <= self.max_abs_weight]
            if over:
                expert, value = over[0]
                return (f"expert {expert}'s largest weight is {value:.3g} (bound {self.max_abs_weight:g}, "
                        "--divergence.max_abs_weight)")
        if self.max_loss is not None and loss is not None:
            value = float(loss)
            if not value <= self.max_loss:
                return f"the {what} is {value:.4g} nats/byte (bound {self.max_loss:.4g}, --divergence.max_loss)"
        return None
