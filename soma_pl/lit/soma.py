"""`SOMAModule`: N experts trained by zero-order SPSA, each on its own shard with its own loss.

Every step each expert draws its own micro-batch from its own shard (`[E, B, T]` batches from
`ByteDataModule(experts_dir=...)`) and its own directions, and its estimate uses only its own loss
(FSO): nothing is exchanged between experts. All experts × directions run as one batched forward.
Each expert's learning rate and ε decay on its own expert-validation split. Evaluation routes each
window on its first 256 bytes and averages the top-k experts' probabilities (Table 1, Fig. 16).

Expert-parallel: fitting on W > 1 processes (`devices`, `num_nodes`, strategy `ddp`), rank r owns
a contiguous share of the experts, reads only their shards and trains them in a model of its own,
with no per-step communication; each expert sees the data, directions and updates it would see on
one process (`ExpertParallel`, which also gathers the experts for evaluation and checkpoints).
"""

from __future__ import annotations

from enum import Enum

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.distributed import RankSplit
from soma_pl.errors import ConfigError
from soma_pl.estimators.spsa import SPSAResult, spsa_estimate
from soma_pl.lit.args import ModelShape
from soma_pl.lit.parallel import ExpertParallel
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.routing import RoutedEnsemble
from soma_pl.lit.spsa import SPSAArgs, SPSAModule
from soma_pl.lit.zo import Init
from soma_pl.models.stacked import EMBED_HEAD, HeadMode, StackedExperts


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


class SOMAModule(RoutedEnsemble, SPSAModule):
    """SOMA: N experts in one stacked module, trained independently by SPSA.

    Args:
        num_experts: N (Table 2: 2, 8, 256).
        shape: each expert's shape (Table 2's widths: 361, 181, 32).
        init: `seed` (copies of `seed_checkpoint`) or `random`.
        seed_checkpoint: a monolithic checkpoint of the same width (e.g. from `configs/seed.yaml`).
        head_training: `trainable`, `decoder_only`, `frozen_shared` or `frozen_random`.
        router_path: the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
        top_k: experts averaged in evaluation (the paper: 4; capped at N).
        plateau: each expert's learning-rate (and, proportionally, ε) decay on its own expert-validation loss.
        Other arguments: see `SPSAModule`.
    """

    per_expert_decay = True
    checkpoint_key = "seed_checkpoint"

    def __init__(self, num_experts: int = 8, shape: ModelShape = ModelShape(width=181), init: Init = Init.seed,
                 seed_checkpoint: str | None = None, head_training: HeadTraining = HeadTraining.trainable,
                 router_path: str | None = None, top_k: int = 4, spsa: SPSAArgs = SPSAArgs(),
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau: PlateauConfig = PlateauConfig(),
                 seed: int = 0, train_context: int = 1024, score_from: int = ROUTE_BYTES):
        head_training = HeadTraining(head_training)
        shared = head_training in (HeadTraining.frozen_shared, HeadTraining.frozen_random)
        super().__init__(num_experts=num_experts, shape=shape, head=HeadMode.shared if shared else HeadMode.per_expert,
                         spsa=spsa, optimizer=optimizer, plateau=plateau, seed=seed, train_context=train_context,
                         score_from=score_from, init=Init(init), init_checkpoint=seed_checkpoint)
        self.head_training = head_training
        self.init_routing(top_k, router_path)
        self.keep_head = head_training is HeadTraining.frozen_random
        if shared:
            self.model.head.requires_grad_(False)
        self.parallel = ExpertParallel(self)
        """This rank's share of the experts when fitting on several processes."""

    @property
    def rank_split(self) -> RankSplit:
        return self.parallel.rank_split

    @property
    def experts(self) -> range:
        return self.parallel.experts

    @property
    def trained_model(self) -> StackedExperts:
        return self.parallel.trained_model

    def check_world_size(self, world_size: int) -> None:
        self.parallel.check_world_size(world_size)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        self.parallel.setup()

    def configure_optimizers(self):
        self.parallel.take_share()  # after setup and any checkpoint restore: `model` holds the start weights
        return super().configure_optimizers()

    def training_tokens(self, batch: Tensor) -> Tensor:
        """`batch: [E, B, 1025] uint8` (E: this process's experts) → `[E, B, train_context + 1]`."""
        experts = self.experts
        if batch.dim() != 3 or batch.shape[0] != len(experts):
            raise ConfigError(f"training batch of shape {tuple(batch.shape)}: this process trains experts "
                              f"{experts.start}..{experts.stop - 1}, expected [{len(experts)}, B, T]")
        self.check_batch_size(batch.shape[1])
        return batch[..., : self.train_context + 1]

    def loss_fn(self, params: dict[str, Tensor], tokens: Tensor) -> Tensor:
        """Per-group losses; with `decoder_only` the input embedding keeps the unperturbed head."""
        model = self.trained_model
        if self.head_training is HeadTraining.decoder_only:
            copies = tokens.shape[0] // model.num_experts
            params = {**params, EMBED_HEAD: model.head.detach().repeat_interleave(copies, dim=0)}
        return model.loss_per_group(params, tokens)

    def estimate(self, tokens: Tensor, eps: Tensor) -> SPSAResult:
        """Each expert's SPSA estimate at its own ε (`eps: [E]`), directions keyed by its global index."""
        ids = torch.arange(self.experts.start, self.experts.stop, device=tokens.device)
        return spsa_estimate(self.loss_fn, self.trainable_parameters(), tokens, self.spsa, step=self.global_step,
                             seed=self.seed, expert_ids=ids, expert_eps=eps)

    def on_validation_epoch_start(self) -> None:
        self.parallel.gather_weights()

    def gather_expert_losses(self, losses: Tensor) -> Tensor:
        return self.parallel.gather_losses(losses)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        self.parallel.save(checkpoint, list(self.trainable_parameters().values()))
        super().on_save_checkpoint(checkpoint)

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        self.parallel.load(checkpoint)
