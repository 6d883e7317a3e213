"""`SOMAModule`: N experts trained by zero-order SPSA, each on its own shard with its own loss.

Every step each expert draws its own micro-batch from its own shard (`[E, B, T]` batches from
`ByteDataModule(experts_dir=...)`) and its own directions, and its estimate uses only its own loss
(FSO): nothing is exchanged between experts. All experts × directions run as one batched forward.
Each expert's learning rate and ε decay on its own expert-validation split. Evaluation routes each
window on its first 256 bytes and averages the top-k experts' probabilities (Table 1, Fig. 16).

Expert-parallel: fitting on W > 1 processes (`devices`, `num_nodes`, strategy `ddp`), rank r owns
a contiguous share of the experts, reads only their shards and trains them in a model of its own,
with no per-step communication; each expert sees the data, directions and updates it would see on
one process. Evaluation gathers every rank's experts into the full `model` first (at the start of
each validation) and all-gathers the per-expert validation losses, so every rank decays each
expert's learning rate alike; `on_save_checkpoint` gathers the experts and their optimizer state,
so rank 0's checkpoint holds every expert, as a one-process checkpoint does.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.data.stream import RankSplit, rank_share
from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import spsa_estimate
from soma_pl.eval.metrics import PerExpertNats
from soma_pl.lit.base import UpdateClock
from soma_pl.lit.parallel import gather_optimizer_state, gather_shares, keep_buffers_local, slice_optimizer_state
from soma_pl.lit.plateau import ExpertPlateau, scale_updates
from soma_pl.lit.routing import RoutedEnsemble
from soma_pl.lit.spsa import EpsSchedule, SPSAModule
from soma_pl.models.experts import EMBED_HEAD, HeadMode, StackedExperts


class Init(str, Enum):
    """Where the experts start (Fig. 9)."""

    seed = "seed"
    """Every expert a copy of the seed model (the paper's warm start)."""
    random = "random"


class HeadTraining(str, Enum):
    """How the tied byte embedding / output head is trained (Fig. 9 ablations)."""

    trainable = "trainable"
    """Each expert's own head, perturbed and updated by its estimator."""
    decoder_only = "decoder_only"
    """Each expert's own head, perturbed only where it decodes (embedding sees it unperturbed)."""
    frozen_shared = "frozen_shared"
    """One head shared by all experts, frozen at the seed's values (the N = 256 default)."""
    frozen_random = "frozen_random"
    """One shared head frozen at random values."""


@dataclass
class ExpertShare:
    """The experts one rank trains in expert-parallel mode.

    A plain attribute, not a submodule: DDP, `state_dict` and checkpoints see only the full
    `model`, into which the shares are gathered.
    """

    experts: range
    """Global indices of the rank's experts (a contiguous `rank_share`)."""
    model: StackedExperts
    """Their weights, `[len(experts), ...]`, which the rank's optimizer steps."""


class SOMAModule(RoutedEnsemble, SPSAModule):
    """SOMA: N experts in one stacked module, trained independently by SPSA.

    Args:
        num_experts: N (Table 2: 2, 8, 256).
        width: expert body width d_t (Table 2: 361, 181, 32).
        init: `seed` (copies of `seed_checkpoint`) or `random`.
        seed_checkpoint: a monolithic checkpoint of the same width (e.g. from `configs/seed.yaml`).
        head_training: `trainable`, `decoder_only`, `frozen_shared` or `frozen_random`.
        router_path: the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: experts averaged in evaluation (the paper: 4; capped at N).
        Other arguments: see `SPSAModule` (plateau settings apply per expert).
    """

    def __init__(self, num_experts: int = 8, width: int = 181, num_layers: int = 4, embed_dim: int = 32,
                 init: Init = Init.seed, seed_checkpoint: str | None = None,
                 head_training: HeadTraining = HeadTraining.trainable, router_path: str | None = None,
                 top_k: int = 4, eps: float = 0.0025, n_pert: int = 64, micro_batch: int = 64,
                 direction: DirectionKind = DirectionKind.RADEMACHER, max_rows: int | None = None,
                 eps_schedule: EpsSchedule = EpsSchedule.proportional, optimizer: OptimizerCallable = torch.optim.SGD,
                 plateau_factor: float = 0.5, plateau_patience: int = 2, min_lr: float = 0.0, seed: int = 0,
                 train_context: int = 1024, score_from: int = ROUTE_BYTES, time_chunk: int = 64):
        head_training = HeadTraining(head_training)
        shared = head_training in (HeadTraining.frozen_shared, HeadTraining.frozen_random)
        super().__init__(width, num_layers, embed_dim, eps, n_pert, micro_batch, direction, max_rows, eps_schedule,
                         optimizer, plateau_factor, plateau_patience, min_lr, seed, train_context, score_from,
                         time_chunk, num_experts, HeadMode.SHARED if shared else HeadMode.PER_EXPERT)
        self.head_training = head_training
        self.init_routing(top_k, router_path)
        if Init(init) is Init.seed and seed_checkpoint is None:
            raise ConfigError("init: seed needs model.init_args.seed_checkpoint (or set init: random)")
        self.init_checkpoint = seed_checkpoint if Init(init) is Init.seed else None
        self.keep_head = head_training is HeadTraining.frozen_random
        if shared:
            self.model.head.requires_grad_(False)
        self.plateau = ExpertPlateau(num_experts, plateau_factor, plateau_patience)
        """Each expert's learning-rate (and, proportionally, ε) multiplier, floored at `min_lr`."""
        self.share: ExpertShare | None = None
        """This rank's experts when fitting expert-parallel; None on one process."""

    @property
    def expert_parallel(self) -> bool:
        """Fitting on several processes: each owns a share of the experts."""
        return self._trainer is not None and self.trainer.world_size > 1 and self.trainer.state.fn == "fit"

    @property
    def rank_split(self) -> RankSplit:
        """How ranks share the training data (read by `ByteDataModule`)."""
        return RankSplit.experts if self.expert_parallel else RankSplit.documents

    @property
    def experts(self) -> range:
        """The experts this process trains: all of them, or its share."""
        return self.share.experts if self.share is not None else range(self.model.num_experts)

    @property
    def trained_model(self) -> StackedExperts:
        """The weights the optimizer steps: `model`, or this rank's share of it."""
        return self.share.model if self.share is not None else self.model

    def check_world_size(self, world_size: int) -> None:
        if world_size > self.model.num_experts:
            raise ConfigError(f"expert-parallel SOMA of {self.model.num_experts} experts on {world_size} processes: "
                              f"each process needs at least one expert")

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.expert_parallel:
            # Each rank scores only its own experts' expert-validation windows; the losses are gathered.
            share = rank_share(self.model.num_experts, self.trainer.global_rank, self.trainer.world_size)
            self.expert_val_loss = PerExpertNats(len(share), sync_on_compute=False)
            keep_buffers_local(self)

    def configure_optimizers(self):
        if self.expert_parallel:  # after setup and any checkpoint restore: `model` holds the start weights
            self.share = self._take_share()
        optimizer = self.build_optimizer(self.trainable_parameters().values())
        self.plateau.floor_at(self.hparams.min_lr, optimizer.param_groups[0]["lr"])
        return optimizer

    @torch.no_grad()
    def _take_share(self) -> ExpertShare:
        """A model of this rank's experts, copied from the full `model` (shared head included)."""
        experts = rank_share(self.model.num_experts, self.trainer.global_rank, self.trainer.world_size)
        full = self.model
        own = StackedExperts(len(experts), full.width, full.embed_dim, full.num_layers, full.head_mode,
                             full.time_chunk, device=self.device, dtype=full.w_hh.dtype)
        for (name, mine), theirs in zip(own.named_parameters(), full.parameters(), strict=True):
            mine.copy_(theirs if full.is_shared(name) else theirs[experts.start : experts.stop])
            mine.requires_grad_(theirs.requires_grad)
        return ExpertShare(experts, own)

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the estimator perturbs (this rank's experts when expert-parallel)."""
        return {n: p for n, p in self.trained_model.expert_parameters().items() if p.requires_grad}

    def training_tokens(self, batch: Tensor) -> Tensor:
        """`batch: [E, B, 1025] uint8` (E: this process's experts) → `[E, B, train_context + 1]`."""
        if batch.dim() != 3 or batch.shape[0] != len(self.experts):
            raise ConfigError(f"training batch of shape {tuple(batch.shape)}: this process trains experts "
                              f"{self.experts.start}..{self.experts.stop - 1}, expected [{len(self.experts)}, B, T]")
        self.check_batch_size(batch.shape[1])
        return batch[..., : self.train_context + 1]

    def loss_fn(self, params: dict[str, Tensor], tokens: Tensor) -> Tensor:
        """Per-group losses; with `decoder_only` the input embedding keeps the unperturbed head."""
        model = self.trained_model
        if self.head_training is HeadTraining.decoder_only:
            copies = tokens.shape[0] // model.num_experts
            params = {**params, EMBED_HEAD: model.head.detach().repeat_interleave(copies, dim=0)}
        return model.loss_per_group(params, tokens)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        optimizer = self.optimizers()
        step = self.global_step
        clock = UpdateClock(tokens.device)
        clock.start()
        experts = self.experts
        scale = self.plateau.scale[experts.start : experts.stop]
        eps = self.spsa.eps * (scale if self.eps_schedule is EpsSchedule.proportional else torch.ones_like(scale))
        params = self.trainable_parameters()
        ids = torch.arange(experts.start, experts.stop, device=tokens.device)  # directions keyed by global index
        result = spsa_estimate(self.loss_fn, params, tokens, self.spsa, step=self.global_step, seed=self.seed,
                               expert_ids=ids, expert_eps=eps)
        before = {name: param.detach().clone() for name, param in params.items()}
        for name, param in params.items():
            param.grad = result.gradient[name]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scale_updates(params, before, scale)
        seconds = clock.stop()
        self.check_finite(step, result.loss, self.trained_model, experts)
        self.log_update(result.loss, tokens, seconds, float(eps.mean()))
        self.log_dict({f"expert/{e}/train_loss": loss for e, loss in zip(experts, result.loss)})

    def current_lr(self) -> float:
        return self.optimizers().param_groups[0]["lr"] * float(self.plateau.scale.mean())

    def on_validation_epoch_start(self) -> None:
        if self.share is not None:
            self._gather_weights()

    @torch.no_grad()
    def _gather_weights(self) -> None:
        """Every rank's experts into the full `model` (a collective: every rank calls it)."""
        full = dict(self.model.named_parameters())
        for name, param in self.share.model.expert_parameters().items():
            full[name].copy_(gather_shares(self, param.detach(), self.model.num_experts))

    def gather_expert_losses(self, losses: Tensor) -> Tensor:
        if self.share is None:
            return super().gather_expert_losses(losses)
        # torchmetrics squeezes a one-expert share to a scalar
        return gather_shares(self, losses.reshape(len(self.experts)), self.model.num_experts)

    def after_validation(self, held_out: Tensor) -> None:
        """Each expert's learning rate (and ε) decays on its own expert-validation loss."""
        self.plateau.step(held_out)
        if self.eps_schedule is EpsSchedule.proportional:
            self.warn_small_eps(self.spsa.eps * self.plateau.scale)
        self.log_dict(self.plateau.learning_rates(self.optimizers().param_groups[0]["lr"]))

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.share is not None:  # every rank saves (rank 0 writes): gather the experts and their optimizer state
            self._gather_weights()
            for name, param in self.model.expert_parameters().items():
                checkpoint["state_dict"][f"model.{name}"] = param.detach().clone()
            if "optimizer_states" in checkpoint:
                params = list(self.trainable_parameters().values())
                checkpoint["optimizer_states"] = [gather_optimizer_state(self, state, params, self.model.num_experts)
                                                  for state in checkpoint["optimizer_states"]]
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if self.expert_parallel:  # the checkpoint holds every expert's optimizer state: keep this rank's
            shapes = [p.shape for p in self.model.expert_parameters().values() if p.requires_grad]
            share = rank_share(self.model.num_experts, self.trainer.global_rank, self.trainer.world_size)
            for state in checkpoint.get("optimizer_states", []):
                slice_optimizer_state(state, shapes, share)
