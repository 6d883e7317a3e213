"""`SPSAModule`: monolithic zero-order training with the central-difference SPSA estimator.

The learning rate decays (`ReduceLROnPlateau`) on the model's own expert-validation split, the
held-out 1% of the training documents, never on the ensemble-validation set. ε follows the learning
rate (`spsa.eps_schedule: proportional`): when the learning rate decays, ε decays by the same factor.
Everything else (manual optimization, warm start, logging) is `ZOModule`'s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError
from soma_pl.estimators.spsa import SPSAConfig, SPSAResult, spsa_estimate
from soma_pl.lit.args import KEY, ModelShape, require
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.zo import EpsSchedule, Init, ZOModule
from soma_pl.models.stacked import HeadMode

__all__ = ["EpsSchedule", "SPSAArgs", "SPSAModule"]


@dataclass(frozen=True)
class SPSAArgs(SPSAConfig):
    """The SPSA estimator's settings (`model.init_args.spsa`), and how ε moves during training."""

    eps: float = 0.0025
    """Initial ε, the perturbation step (the paper sweeps 0.00125–0.005, Table 6)."""
    eps_schedule: EpsSchedule = EpsSchedule.proportional
    """`proportional` (ε follows the learning rate) or `constant`."""

    def __post_init__(self) -> None:
        require(math.isfinite(self.eps) and self.eps > 0, f"{KEY}.spsa.eps", self.eps, "a positive finite number")
        for name in ("n_pert", "micro_batch"):
            require(getattr(self, name) >= 1, f"{KEY}.spsa.{name}", getattr(self, name), ">= 1")
        require(self.max_rows is None or self.max_rows >= 1, f"{KEY}.spsa.max_rows", self.max_rows, ">= 1 (or null)")
        require(self.loss_grouping == 1, f"{KEY}.spsa.loss_grouping", self.loss_grouping,
                "1 (each expert trains on its own loss; grouping is an estimator study, Fig. 11)")
        object.__setattr__(self, "eps_schedule", EpsSchedule(self.eps_schedule))
        super().__post_init__()


class SPSAModule(ZOModule):
    """Zero-order training of a monolithic byte LM (E = 1) or, by subclassing, of stacked experts.

    Args:
        spsa: ε, directions per micro-batch, micro-batch size, direction kind, chunking, ε schedule.
        optimizer: the torch optimizer the estimate steps (SGD by default; set its lr in YAML).
        Other arguments: see `ZOModule` and `ByteLMModule`.
    """

    def __init__(self, num_experts: int = 1, shape: ModelShape = ModelShape(),
                 head: HeadMode = HeadMode.per_expert, spsa: SPSAArgs = SPSAArgs(),
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau: PlateauConfig = PlateauConfig(),
                 seed: int = 0, train_context: int = 1024, score_from: int = ROUTE_BYTES,
                 init: Init | None = None, init_checkpoint: str | None = None):
        super().__init__(num_experts=num_experts, shape=shape, head=head, optimizer=optimizer, plateau=plateau,
                         seed=seed, train_context=train_context, score_from=score_from, init=init,
                         init_checkpoint=init_checkpoint)
        self.spsa = self.arg_group(SPSAArgs, spsa, "spsa")

    @property
    def initial_scale(self) -> float:
        return self.spsa.eps

    @property
    def scale_schedule(self) -> EpsSchedule:
        return self.spsa.eps_schedule

    def check_batch_size(self, batch_size: int) -> None:
        """The training batch B splits into micro-batches of `spsa.micro_batch` windows."""
        if batch_size % self.spsa.micro_batch:
            raise ConfigError(f"data.init_args.batch_size={batch_size} is not a multiple of "
                              f"{KEY}.spsa.micro_batch={self.spsa.micro_batch}")

    def token_forwards(self, tokens: Tensor) -> int:
        """2 · n_pert forwards of every window's T predicted bytes, per expert."""
        experts, windows, length = tokens.shape
        return 2 * self.spsa.n_pert * experts * windows * (length - 1)

    def estimate(self, tokens: Tensor, eps: float) -> SPSAResult:
        """The SPSA estimate of every expert's gradient on `tokens: [E, B, T]` at step ε = `eps`."""
        return spsa_estimate(self.model.loss_per_group, self.trainable_parameters(), tokens,
                             replace(self.spsa, eps=eps), step=self.global_step, seed=self.seed)
