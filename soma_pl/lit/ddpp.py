"""`DDPPModule`: one monolithic model whose perturbations and micro-batches are shared out across ranks.

The paper's DDPP baseline (Fig. 12), with an exchange of a few floats per step instead of a
gradient: every rank reads the same global batch `[1, B, T]`; the step's `(B / micro_batch) ·
n_pert` directions (direction `m · n_pert + k` reads micro-batch m) are dealt out in contiguous
shares; each rank evaluates its share, the ranks all-gather each direction's loss difference δ and
mean loss (8 bytes per direction in float32), and every rank regenerates every direction from
`(seed, step, direction)`, assembles the whole estimate in the same order and applies the same
update. All ranks therefore hold identical weights without exchanging any, and a run on W ranks
reaches the weights of `SPSAModule` on one process with the same global batch.

Run with `--trainer.strategy=ddp` and any `devices` / `num_nodes`; on one process it is
`SPSAModule` exactly.
"""

from __future__ import annotations

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.data.stream import RankSplit, rank_share
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, SPSAResult, assemble_estimate, spsa_differences
from soma_pl.lit.base import UpdateRecord
from soma_pl.lit.parallel import gather_bytes, gather_shares, keep_buffers_local
from soma_pl.lit.spsa import EpsSchedule, SPSAModule


class DDPPModule(SPSAModule):
    """Monolithic SPSA with each step's directions and micro-batches split across DDP ranks.

    `data.batch_size` is the global batch B of a step (every rank reads it); `n_pert` and
    `micro_batch` are as in `SPSAModule`, so the estimator does not depend on the number of ranks.
    Arguments: see `SPSAModule`.
    """

    rank_split = RankSplit.replicated

    def __init__(self, width: int = 509, num_layers: int = 4, embed_dim: int = 32, eps: float = 0.0025,
                 n_pert: int = 64, micro_batch: int = 64, direction: DirectionKind = DirectionKind.RADEMACHER,
                 max_rows: int | None = None, eps_schedule: EpsSchedule = EpsSchedule.proportional,
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau_factor: float = 0.5,
                 plateau_patience: int = 2, min_lr: float = 0.0, seed: int = 0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, time_chunk: int = 64, init_checkpoint: str | None = None):
        super().__init__(width, num_layers, embed_dim, eps, n_pert, micro_batch, direction, max_rows, eps_schedule,
                         optimizer, plateau_factor, plateau_patience, min_lr, seed, train_context, score_from,
                         time_chunk, init_checkpoint=init_checkpoint)
        self.directions_here = 0
        """Directions this rank evaluated in the last step."""
        self.exchange_bytes = 0
        """Bytes the last step's all-gather delivered to each rank."""

    def check_world_size(self, world_size: int) -> None:
        """Any number of ranks: each step's directions are dealt out, a rank may get none."""

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.trainer.world_size > 1:
            keep_buffers_local(self)

    def estimate(self, tokens: Tensor, eps: float) -> SPSAResult:
        """This rank's share of the step's directions, then the whole estimate from everyone's δ.

        Args:
            tokens: `[1, B, T]` the global batch (the same on every rank).
        """
        params = self.trainable_parameters()
        config = SPSAConfig(eps=eps, n_pert=self.spsa.n_pert, micro_batch=self.spsa.micro_batch,
                            direction=self.spsa.direction, max_rows=self.spsa.max_rows)
        total = tokens.shape[1] // config.micro_batch * config.n_pert
        share = rank_share(total, self.trainer.global_rank, self.trainer.world_size)
        delta, loss = spsa_differences(self.model.loss_per_group, params, tokens, config, self.global_step,
                                       self.seed, share)
        local = torch.stack([delta, loss]).permute(2, 0, 1)  # [directions, 2, E]: one row per direction
        everyone = gather_shares(self, local, total).permute(1, 2, 0).contiguous()  # [2, E, total]
        self.directions_here = len(share)
        self.exchange_bytes = gather_bytes(total, tuple(local.shape[1:]), local.dtype, self.trainer.world_size)
        gradient = assemble_estimate(params, everyone[0], config, self.global_step, self.seed)
        return SPSAResult(gradient, everyone[1].mean(1), everyone[0], everyone[0])

    def log_update(self, losses: Tensor, tokens: Tensor, seconds: float, eps: float) -> None:
        """Log the step; compute accounting counts only the forwards this rank evaluated."""
        experts, _, length = tokens.shape
        forwards = 2 * self.directions_here * experts * self.spsa.micro_batch * (length - 1)
        self.last_update = UpdateRecord(seconds, forwards, experts)
        self.log("train/loss", losses.mean(), prog_bar=True)
        self.log_dict({"train/lr": self.current_lr(), "train/eps": eps, "train/update_seconds": seconds,
                       "train/token_forwards_per_s": forwards / max(seconds, 1e-12),
                       "train/exchange_bytes": float(self.exchange_bytes)})
