"""Loss metrics that are correct under DDP: sums and counts reduced across ranks, then divided."""

from __future__ import annotations

import torch
from torch import Tensor
from torchmetrics import Metric


class NatsPerByte(Metric):
    """Mean next-byte cross entropy in nats/byte over every scored target of every window.

    `update(loss_sum, targets)` takes the summed nats and how many targets they cover, so windows
    of any batch size weigh by their targets, on every rank alike.
    """

    full_state_update = False
    higher_is_better = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nats", default=torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("targets", default=torch.tensor(0, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, loss_sum: Tensor, targets: int | Tensor) -> None:
        self.nats += loss_sum.detach().to(torch.float64).sum()
        self.targets += torch.as_tensor(targets, device=self.targets.device).long().sum()

    def compute(self) -> Tensor:
        return (self.nats / self.targets.clamp_min(1)).float()


class PerExpertNats(Metric):
    """Each expert's mean nats/byte on its own windows: `update(loss_sums [E], windows [E] or int)`."""

    full_state_update = False
    higher_is_better = False

    def __init__(self, experts: int, **kwargs):
        super().__init__(**kwargs)
        self.add_state("nats", default=torch.zeros(experts, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("windows", default=torch.zeros(experts, dtype=torch.long), dist_reduce_fx="sum")

    def update(self, loss_sums: Tensor, windows: int | Tensor) -> None:
        self.nats += loss_sums.detach().to(torch.float64)
        self.windows += torch.as_tensor(windows, device=self.windows.device).long()

    def compute(self) -> Tensor:
        return (self.nats / self.windows.clamp_min(1)).float()
