"""Learning-rate decay on the experts' own held-out splits (Table 1).

`PlateauConfig` is the decay's settings (`model.init_args.plateau`). A monolithic zero-order module
decays its one learning rate with torch's `ReduceLROnPlateau` (`PlateauConfig.scheduler`);
`ExpertPlateau` is the same rule with one learning-rate multiplier per expert, stepped on the
experts' expert-validation losses, and `scale_updates` applies the multipliers to an optimizer step.
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
    """Decay factor when the expert-validation loss plateaus."""
    patience: int = 2
    """Validations without improvement before a decay."""
    min_lr: float = 0.0
    """Floor of the decayed learning rate."""
    every: int | None = None
    """Updates between decay checks: a validation decides a decay only when the update count is a
    multiple of `every`. None: every validation does. With it set, the decay is part of the
    selected schedule and no longer depends on how often a run validates for its curves (a run
    validating every 50 updates decays exactly as its selection trial validating every 200 did)."""

    def __post_init__(self) -> None:
        require(0 < self.factor < 1, f"{KEY}.plateau.factor", self.factor, "in (0, 1)")
        require(self.patience >= 0, f"{KEY}.plateau.patience", self.patience, ">= 0")
        require(math.isfinite(self.min_lr) and self.min_lr >= 0, f"{KEY}.plateau.min_lr", self.min_lr,
                "a finite number >= 0")
        require(self.every is None or self.every >= 1, f"{KEY}.plateau.every", self.every, "None or >= 1")

    def checks_at(self, updates: int) -> bool:
        """Whether the validation after `updates` updates decides a decay."""
        return self.every is None or updates % self.every == 0

    def scheduler(self, optimizer: torch.optim.Optimizer) -> dict:
        """Lightning's scheduler entry: one `ReduceLROnPlateau`, stepped by hand in `after_validation` on
        the model's expert-validation loss (manual optimization: no `monitor` key, which Lightning
        would only warn about)."""
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=self.factor, patience=self.patience, min_lr=self.min_lr)
        return {"scheduler": scheduler}


class ExpertPlateau(nn.Module):
    """Per-expert `ReduceLROnPlateau`: a learning-rate scale per expert, decayed on its own loss.

    Buffers (saved in checkpoints): `best [E]`, `bad [E]` validations without improvement,
    `scale [E]` the current learning-rate multiplier, never below `min_scale` (`min_lr` over the
    optimizer's learning rate, set by `floor_at`).
    """

    def __init__(self, experts: int, config: PlateauConfig, threshold: float = 1e-4):
        super().__init__()
        self.config, self.threshold, self.min_scale = config, threshold, 0.0
        self.register_buffer("best", torch.full((experts,), float("inf")))
        self.register_buffer("bad", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("scale", torch.ones(experts))

    def floor_at(self, base_lr: float) -> None:
        """Never decay an expert's learning rate below `min_lr`, the optimizer's being `base_lr`."""
        self.min_scale = self.config.min_lr / base_lr if base_lr > 0 else 0.0

    def learning_rates(self, base_lr: float) -> dict[str, float]:
        """`expert/<e>/lr` of every expert, for logging."""
        return {f"expert/{e}/lr": base_lr * scale for e, scale in enumerate(self.scale.tolist())}

    @torch.no_grad()
    def step(self, losses: Tensor) -> None:
        """One validation's losses `[E]`: experts without improvement for `patience` validations decay."""
        losses = losses.to(self.best.device)
        improved = losses < self.best * (1 - self.threshold)
        self.best = torch.where(improved, losses, self.best)
        self.bad = torch.where(improved, torch.zeros_like(self.bad), self.bad + 1)
        decay = self.bad > self.config.patience
        self.scale = torch.where(decay, (self.scale * self.config.factor).clamp_min(self.min_scale), self.scale)
        self.bad = torch.where(decay, torch.zeros_like(self.bad), self.bad)


def per_expert(scale: Tensor, param: Tensor) -> Tensor:
    """`scale [E]` shaped to multiply `param [E, ...]` expert by expert."""
    return scale.to(param.dtype).view(-1, *[1] * (param.dim() - 1))


def steps_with_gradient(optimizer: torch.optim.Optimizer) -> bool:
    """Whether the optimizer's step is `-lr · grad` (SGD without momentum or weight decay), so that
    scaling an expert's gradient scales its update exactly."""
    return type(optimizer) is torch.optim.SGD and all(
        group["momentum"] == 0 and group["weight_decay"] == 0 for group in optimizer.param_groups)


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
