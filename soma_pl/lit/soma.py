"""`SOMAModule`: N experts trained by zero-order SPSA, each on its own shard with its own loss.

Every step each expert draws its own micro-batch from its own shard (`[E, B, T]` batches from
`ByteDataModule(experts_dir=...)`) and its own directions, and its estimate uses only its own loss
(FSO): nothing is exchanged between experts. All experts × directions run as one batched forward.
Each expert's learning rate and ε decay on its own expert-validation split. Evaluation routes each
window on its first 256 bytes and averages the top-k experts' probabilities (Table 1, Fig. 16).
"""

from __future__ import annotations

import io
from enum import Enum
from pathlib import Path

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor, nn

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import spsa_estimate
from soma_pl.eval.metrics import PerExpertNats
from soma_pl.lit.base import UpdateClock
from soma_pl.lit.spsa import EpsSchedule, SPSAModule
from soma_pl.models.experts import EMBED_HEAD, HeadMode
from soma_pl.models.router import Router


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


class ExpertPlateau(nn.Module):
    """Per-expert `ReduceLROnPlateau`: a learning-rate scale per expert, decayed on its own loss.

    Buffers (saved in checkpoints): `best [E]`, `bad [E]` validations without improvement,
    `scale [E]` the current learning-rate multiplier.
    """

    def __init__(self, experts: int, factor: float, patience: int, threshold: float = 1e-4, min_scale: float = 0.0):
        super().__init__()
        self.factor, self.patience, self.threshold, self.min_scale = factor, patience, threshold, min_scale
        self.register_buffer("best", torch.full((experts,), float("inf")))
        self.register_buffer("bad", torch.zeros(experts, dtype=torch.long))
        self.register_buffer("scale", torch.ones(experts))

    @torch.no_grad()
    def step(self, losses: Tensor) -> None:
        improved = losses < self.best * (1 - self.threshold)
        self.best = torch.where(improved, losses, self.best)
        self.bad = torch.where(improved, torch.zeros_like(self.bad), self.bad + 1)
        decay = self.bad > self.patience
        self.scale = torch.where(decay, (self.scale * self.factor).clamp_min(self.min_scale), self.scale)
        self.bad = torch.where(decay, torch.zeros_like(self.bad), self.bad)


class SOMAModule(SPSAModule):
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
        self.top_k = top_k
        self.router_path = router_path
        self.router: Router | None = None
        if Init(init) is Init.seed and seed_checkpoint is None:
            raise ConfigError("init: seed needs model.init_args.seed_checkpoint (or set init: random)")
        self.init_checkpoint = seed_checkpoint if Init(init) is Init.seed else None
        self.keep_head = head_training is HeadTraining.frozen_random
        if shared:
            self.model.head.requires_grad_(False)
        self.plateau = ExpertPlateau(num_experts, plateau_factor, plateau_patience)
        self.expert_val_loss = PerExpertNats(num_experts)

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.router is None and self.trainer.ckpt_path is None:  # a checkpoint brings its own router
            self.router = Router.load(self.router_path or self._default_router_path())
        if self.router is not None and self.router.num_experts != self.model.num_experts:
            raise ConfigError(f"router has {self.router.num_experts} centroids, the model {self.model.num_experts} experts")

    def _default_router_path(self) -> str:
        experts_dir = getattr(self.trainer.datamodule, "experts_dir", None) if self._trainer else None
        if experts_dir is None:
            raise ConfigError("SOMA needs a router: set model.init_args.router_path or data.init_args.experts_dir")
        return str(Path(experts_dir) / "router.pt")

    def configure_optimizers(self):
        return self.optimizer_factory(self.trainable_parameters().values())

    @property
    def eval_k(self) -> int:
        return min(self.top_k, self.model.num_experts)

    def ranking(self, windows: Tensor) -> Tensor:
        self.router.to(windows.device)
        return self.router.ranking(windows[:, :ROUTE_BYTES])

    def loss_fn(self, params: dict[str, Tensor], tokens: Tensor) -> Tensor:
        """Per-group losses; with `decoder_only` the input embedding keeps the unperturbed head."""
        if self.head_training is HeadTraining.decoder_only:
            copies = tokens.shape[0] // self.model.num_experts
            params = {**params, EMBED_HEAD: self.model.head.detach().repeat_interleave(copies, dim=0)}
        return self.model.loss_per_group(params, tokens)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        optimizer = self.optimizers()
        clock = UpdateClock(tokens.device)
        clock.start()
        scale = self.plateau.scale
        eps = self.spsa.eps * (scale if self.eps_schedule is EpsSchedule.proportional else torch.ones_like(scale))
        params = self.trainable_parameters()
        result = spsa_estimate(self.loss_fn, params, tokens, self.spsa, step=self.global_step, seed=self.seed,
                               expert_eps=eps)
        before = {name: param.detach().clone() for name, param in params.items()}
        for name, param in params.items():
            param.grad = result.gradient[name]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        self._scale_updates(params, before, scale)
        seconds = clock.stop()
        self.log_update(result.loss, tokens, seconds, float(eps.mean()))
        self.log_dict({f"expert/{e}/train_loss": loss for e, loss in enumerate(result.loss)})

    @torch.no_grad()
    def _scale_updates(self, params: dict[str, Tensor], before: dict[str, Tensor], scale: Tensor) -> None:
        """Each expert's update times its own learning-rate multiplier (exact for any optimizer whose
        step is proportional to its learning rate)."""
        for name, param in params.items():
            view = scale.to(param.dtype).view(-1, *[1] * (param.dim() - 1))
            param.copy_(torch.lerp(before[name], param, view))

    def current_lr(self) -> float:
        return self.optimizers().param_groups[0]["lr"] * float(self.plateau.scale.mean())

    def validation_step(self, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if dataloader_idx == 0:
            self._evaluate(batch, "val")
            return
        tokens = batch  # [E, b, 1025] each expert's own validation windows
        self.expert_val_loss.update(self.model.window_losses(tokens, score_from=self.score_from).sum(1), tokens.shape[1])

    def on_validation_epoch_end(self) -> None:
        super().on_validation_epoch_end()
        if self.expert_val_loss.update_count:
            losses = self.expert_val_loss.compute()
            self.expert_val_loss.reset()
            if self.trainer.state.fn == "fit" and not self.trainer.sanity_checking:
                self.plateau.step(losses)
            base_lr = self.optimizers().param_groups[0]["lr"] if self._trainer and self.trainer.optimizers else 0.0
            for e, loss in enumerate(losses.tolist()):
                self.log_dict({f"expert/{e}/val_loss": loss, f"expert/{e}/lr": base_lr * float(self.plateau.scale[e])})

    def after_validation(self, value: Tensor) -> None:
        """Learning rates decay per expert on the expert-validation split, not on the ensemble."""

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        if self.router is not None:
            buffer = io.BytesIO()
            self.router.save_to(buffer)
            checkpoint["router"] = buffer.getvalue()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if "router" in checkpoint:
            self.router = Router.load_from(io.BytesIO(checkpoint["router"]), "in checkpoint")
