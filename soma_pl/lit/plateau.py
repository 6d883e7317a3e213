"""Per-expert learning-rate decay on each expert's own held-out split (Table 1).

`ExpertPlateau` is `ReduceLROnPlateau` with one learning-rate multiplier per expert, stepped on the
experts' expert-validation losses; `scale_updates` applies the multipliers to an optimizer step.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn


class ExpertPlateau(nn.Module):
    """Per-expert `ReduceLROnPlateau`: a learning-rate scale per expert, decayed on its own loss.

    Buffers (saved in checkpoints): `best [E]`, `bad [E]` validations without improvement,
    `scale [E]` the current learning-rate multiplier, never below `min_scale`.
    """

    def __init__(self, experts: int, factor: float, patience: int, threshold: float = 1e-4, min_scale: float = 0.0):
        super().__init__()
        self.factor, self.patience, self.threshold, self.min_scale = factor, patience, threshold, min_scale
        self.register_buffer("best", torch.full((experts,), float("inf")))
        self.register_buffer("bad", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("scale", torch.ones(experts))

    def floor_at(self, min_lr: float, base_lr: float) -> None:
        """Never decay an expert's learning rate below `min_lr`, the optimizer's being `base_lr`."""
        self.min_scale = min_lr / base_lr if base_lr > 0 else 0.0

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
        decay = self.bad > self.patience
        self.scale = torch.where(decay, (self.scale * self.factor).clamp_min(self.min_scale), self.scale)
        self.bad = torch.where(decay, torch.zeros_like(self.bad), self.bad)


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
        view = scale.to(param.dtype).view(-1, *[1] * (param.dim() - 1))
        param.copy_(torch.lerp(before[name], param, view))
