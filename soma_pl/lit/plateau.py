"""Learning-rate (and ε) decay on the experts' own held-out splits (Table 1, §4).

The paper's rule (Table 1: "halve after 1,000 updates without improvement of 1e-8 / 1e-5"): each
expert's learning rate and ε start at their configured values and halve together when its own
expert-validation loss has not improved by at least 1e-8 nats/byte for 1,000 updates, never below a
learning rate of 1e-5. `PlateauConfig` is the rule's settings (`model.init_args.plateau`);
`ExpertPlateau` holds one learning-rate multiplier per expert (N = 1 is one expert) and applies it
through `scale_gradients` or `scale_updates` to each optimizer step.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from soma_pl.lit.args import KEY, require


@dataclass(frozen=True)
class PlateauConfig:
    """When and how far the learning rate decays (and, under a proportional schedule, ε or σ with it)."""

    factor: float = 0.5
    """Decay factor of an expert whose expert-validation loss plateaus (the paper: halve)."""
    patience_updates: int = 1000
    """Updates without an improvement of `threshold` before a decay; a decay restarts the count."""
    threshold: float = 1e-8
    """Least decrease of the best expert-validation loss, in nats/byte, that counts as an improvement."""
    min_lr: float = 1e-5
    """Floor of the decayed learning rate (ε, following it, stops decaying there too)."""
    every: int | None = None
    """Updates between the validations the rule reads: a validation updates the best loss and can
    decay only when its update count is a multiple of `every`. None: every validation. Patience is
    counted in updates either way, but which losses the rule sees (and so when an expert last
    improved) depends on which validations it reads: with `every` set, a run validating every 50
    updates for its curves decays exactly as its selection trial validating every 200 did."""

    def __post_init__(self) -> None:
        require(0 < self.factor < 1, f"{KEY}.plateau.factor", self.factor, "in (0, 1)")
        require(self.patience_updates >= 0, f"{KEY}.plateau.patience_updates", self.patience_updates, ">= 0")
        for name in ("threshold", "min_lr"):
            value = getattr(self, name)
            require(math.isfinite(value) and value >= 0, f"{KEY}.plateau.{name}", value, "a finite number >= 0")
        require(self.every is None or self.every >= 1, f"{KEY}.plateau.every", self.every, "None or >= 1")

    def checks_at(self, updates: int) -> bool:
        """Whether the validation after `updates` updates is read by the rule."""
        return self.every is None or updates % self.every == 0


class ExpertPlateau(nn.Module):
    """Each expert's learning-rate multiplier, decayed on its own expert-validation loss (Table 1).

    At a validation after `updates` updates, expert e improves when its loss is at least
    `threshold` below its best; otherwise, once `updates - since[e] >= patience_updates`, its
    multiplier is multiplied by `factor` (never below `min_scale`, never raised) and the count
    restarts. The rule depends on the update counts, not on how many validations fell between them.

    Buffers (saved in checkpoints, so a resumed run decays as an uninterrupted one): `best [E]`
    float64 (a 1e-8 step is below float32's resolution at 2 nats/byte), `since [E]` the update count
    of the last improvement or decay, `scale [E]` the multipliers. `multipliers` is `scale` on the
    host, refreshed where the rule changes it (`step`, a checkpoint load; `refresh` after writing
    `scale` by hand): one model's estimators (SPSA, DDPP, EGGROLL) take ε or σ as a number, read at
    every step without waiting for the device.
    """

    def __init__(self, experts: int, config: PlateauConfig):
        super().__init__()
        self.config, self.min_scale = config, 0.0
        self.register_buffer("best", torch.full((experts,), math.inf, dtype=torch.float64))
        self.register_buffer("since", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("scale", torch.ones(experts))
        self.multipliers = [1.0] * experts
        self.register_load_state_dict_post_hook(ExpertPlateau.loaded)

    def refresh(self) -> None:
        """Copy `scale` to the host (`multipliers`)."""
        self.multipliers = self.scale.tolist()

    @staticmethod
    def loaded(module: ExpertPlateau, incompatible_keys) -> None:
        """After a checkpoint's buffers are loaded: refresh `multipliers` from them."""
        module.refresh()

    def floor_at(self, base_lr: float) -> None:
        """Never decay an expert's learning rate below `min_lr`, the optimizer's being `base_lr`."""
        self.min_scale = self.config.min_lr / base_lr if base_lr > 0 else 0.0

    def learning_rates(self, base_lr: float) -> dict[str, float]:
        """`expert/<e>/lr` of every expert, for logging."""
        return {f"expert/{e}/lr": base_lr * scale for e, scale in enumerate(self.multipliers)}

    @torch.no_grad()
    def step(self, losses: Tensor, updates: int) -> None:
        """One validation's expert-validation losses `[E]` (nats/byte), after `updates` updates."""
        losses = losses.to(self.best)
        improved = losses <= self.best - self.config.threshold
        decay = ~improved & (updates - self.since >= self.config.patience_updates)
        lowered = (self.scale * self.config.factor).clamp_min(self.min_scale).minimum(self.scale)
        self.best = torch.where(improved, losses, self.best)
        self.scale = torch.where(decay, lowered, self.scale)
        self.since = torch.where(improved | decay, updates, self.since)
        self.refresh()


def per_expert(scale: Tensor, param: Tensor) -> Tensor:
    """`scale [E]` shaped to multiply `param [E, ...]` expert by expert."""
    return scale.to(param.dtype).view(-1, *[1] * (param.dim() - 1))


def steps_with_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step is `-lr · grad` (SGD without momentum, weight decay or `maximize`),
    so that scaling an expert's gradient scales its update exactly."""
    return type(optimizer) is torch.optim.SGD and all(
        group["momentum"] == 0 and group["weight_decay"] == 0 and not group["maximize"]
        for group in optimizer.param_groups)


@torch.no_grad()
def scale_gradients(params: dict[str, Tensor], scale: Tensor) -> None:
    """Each expert's gradient times its own learning-rate multiplier, in place. params: name →
    `[E, ...]` weights with their `.grad`; scale: `[E]`."""
    for param in params.values():
        param.grad.mul_(per_expert(scale, param))


@torch.no_grad()
def scale_updates(params: dict[str, Tensor], before: dict[str, Tensor], scale: Tensor) -> None:
    """Each expert's update times its own learning-rate multiplier.

    Exact for any optimizer whose step is proportional to its learning rate (SGD with momentum,
    Adam, AdamW): its state does not depend on the learning rate.

    Args:
        params: name → `[E, ...]` weights after the optimizer's step.
        before: the same weights before it.
        scale: `[E]` multipliers.
    """
    for name, param in params.items():
        view = per_expert(scale, param)
        param.copy_(torch.lerp(before[name], param, view))
