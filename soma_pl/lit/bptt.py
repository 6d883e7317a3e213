"""`BPTTModule`: the backpropagation baseline, autograd through the whole training context."""

from __future__ import annotations

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.lit.base import ByteLMModule, UpdateClock, UpdateRecord
from soma_pl.models.experts import HeadMode


class BPTTModule(ByteLMModule):
    """Backprop through time over `train_context` bytes (the paper: 1,024), Adam by default.

    Args:
        optimizer: the torch optimizer (Adam by default; set its lr in YAML).
        plateau_factor, plateau_patience, min_lr: learning-rate decay on validation plateaus.
        Other arguments: see `ByteLMModule`.
    """

    def __init__(self, width: int = 509, num_layers: int = 4, embed_dim: int = 32,
                 optimizer: OptimizerCallable = torch.optim.Adam, plateau_factor: float = 0.5,
                 plateau_patience: int = 2, min_lr: float = 0.0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, time_chunk: int = 64, num_experts: int = 1,
                 head: HeadMode = HeadMode.PER_EXPERT):
        super().__init__(num_experts, width, num_layers, embed_dim, head, train_context, score_from, time_chunk)
        self.save_hyperparameters(ignore=["optimizer"])
        self.automatic_optimization = False  # manual, like the ZO modules: one update per batch
        self.optimizer_factory = optimizer

    def configure_optimizers(self):
        optimizer = self.optimizer_factory([p for p in self.parameters() if p.requires_grad])
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=self.hparams.plateau_factor, patience=self.hparams.plateau_patience,
            min_lr=self.hparams.min_lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "val/loss"}}

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        optimizer = self.optimizers()
        clock = UpdateClock(tokens.device)
        clock.start()
        loss = self.model.loss_per_group({}, tokens).mean()
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(loss)
        optimizer.step()
        seconds = clock.stop()
        experts, windows, length = tokens.shape
        self.last_update = UpdateRecord(seconds, experts * windows * (length - 1), experts)
        self.log("train/loss", loss.detach(), prog_bar=True)
        self.log_dict({"train/lr": optimizer.param_groups[0]["lr"], "train/update_seconds": seconds})

    def after_validation(self, value: Tensor) -> None:
        self.lr_schedulers().step(float(value))
