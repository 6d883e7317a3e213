"""`BPTTModule`: the backpropagation baseline, autograd through the whole training context.

With N > 1 experts (Table 5's BPTT N = 2, 8) it trains an ensemble exactly as SOMA does, with
backprop instead of SPSA: each expert on its own shard (`data.init_args.experts_dir`) with its own
loss, its learning rate decaying on its own expert-validation split, evaluated by the router on
the first 256 bytes and top-k probability averaging (the same scoring code as SOMA).
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.lit.base import ByteLMModule, UpdateClock, UpdateRecord, check_plateau
from soma_pl.lit.plateau import ExpertPlateau, scale_updates
from soma_pl.lit.routing import RoutedEnsemble
from soma_pl.models.experts import HeadMode


class BPTTModule(RoutedEnsemble, ByteLMModule):
    """Backprop through time over `train_context` bytes (the paper: 1,024), Adam by default.

    Args:
        optimizer: the torch optimizer (Adam by default; set its lr in YAML).
        plateau_factor, plateau_patience, min_lr: each expert's learning-rate decay when its own
            expert-validation loss plateaus (N = 1: the prepared dataset's held-out 1%).
        num_experts: N; each expert is trained on its own shard with its own loss.
        router_path: with N > 1, the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: with N > 1, experts averaged in evaluation (the paper: 4; capped at N).
        Other arguments: see `ByteLMModule`.
    """

    def __init__(self, width: int = 509, num_layers: int = 4, embed_dim: int = 32,
                 optimizer: OptimizerCallable = torch.optim.Adam, plateau_factor: float = 0.5,
                 plateau_patience: int = 2, min_lr: float = 0.0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, time_chunk: int = 64, num_experts: int = 1,
                 head: HeadMode = HeadMode.PER_EXPERT, router_path: str | None = None, top_k: int = 4):
        super().__init__(num_experts, width, num_layers, embed_dim, head, train_context, score_from, time_chunk)
        check_plateau(plateau_factor, plateau_patience, min_lr)
        self.save_hyperparameters(ignore=["optimizer"])
        self.automatic_optimization = False  # manual, like the ZO modules: one update per batch
        self.keep_optimizer(optimizer)
        self.init_routing(top_k, router_path)
        self.plateau = ExpertPlateau(num_experts, plateau_factor, plateau_patience)
        """Each expert's learning-rate multiplier, floored at `min_lr`."""

    def configure_optimizers(self):
        optimizer = self.build_optimizer([p for p in self.parameters() if p.requires_grad])
        self.plateau.floor_at(self.hparams.min_lr, optimizer.param_groups[0]["lr"])
        return optimizer

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        optimizer = self.optimizers()
        step = self.global_step
        clock = UpdateClock(tokens.device)
        clock.start()
        losses = self.model.loss_per_group({}, tokens)  # [E]: each expert's own loss
        optimizer.zero_grad(set_to_none=True)
        self.manual_backward(losses.sum())  # experts share no weight: each gets its own loss's gradient
        experts = self.model.expert_parameters()
        before = {name: param.detach().clone() for name, param in experts.items()}
        optimizer.step()
        scale_updates(experts, before, self.plateau.scale)
        seconds = clock.stop()
        self.check_finite(step, losses, self.model, range(self.model.num_experts))
        count, windows, length = tokens.shape
        self.last_update = UpdateRecord(seconds, count * windows * (length - 1), count)
        self.log("train/loss", losses.detach().mean(), prog_bar=True)
        self.log_dict({"train/lr": self.current_lr(), "train/update_seconds": seconds})
        if count > 1:
            self.log_dict({f"expert/{e}/train_loss": loss for e, loss in enumerate(losses.detach())})

    def current_lr(self) -> float:
        return self.optimizers().param_groups[0]["lr"] * float(self.plateau.scale.mean())

    def after_validation(self, held_out: Tensor) -> None:
        """Each expert's learning rate decays on its own expert-validation loss."""
        self.plateau.step(held_out)
        if self.model.num_experts > 1:
            self.log_dict(self.plateau.learning_rates(self.optimizers().param_groups[0]["lr"]))
