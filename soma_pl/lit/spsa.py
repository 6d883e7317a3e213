"""`SPSAModule`: monolithic zero-order training with the central-difference SPSA estimator.

Manual optimization: the estimate goes into `.grad` and a real torch optimizer (from the config)
steps. The learning rate decays (`ReduceLROnPlateau`) on the model's own expert-validation split,
the held-out 1% of the training documents, never on the ensemble-validation set. ε follows the
learning rate (`eps_schedule: proportional`): when the learning rate decays, ε decays by the same
factor.

One process trains one model: fitting on several processes is refused (each would train its own,
diverging replica); `DDPPModule` shares one model's directions across processes instead.
"""

from __future__ import annotations

import math
from enum import Enum

import torch
from lightning.pytorch.cli import OptimizerCallable
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.errors import ConfigError
from soma_pl.lit.base import ByteLMModule, UpdateClock, UpdateRecord, check_plateau, require
from soma_pl.models.checkpoints import monolithic_state
from soma_pl.models.experts import HeadMode


FULL_PRECISION = ("32-true", "64-true")
"""The precisions zero-order modules run in: a bf16 forward puts a 1.3% error into each δ."""

SMALL_EPS = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-3}
"""Below these ε, central differences lose their precision in the dtype (float32 at ε = 5e-6, width
32: an error of 0.046 in δ)."""


def small_eps_warning(eps: float | Tensor, dtype: torch.dtype) -> str | None:
    """A warning when the smallest ε is below what `dtype` resolves; None when it is not."""
    floor, smallest = SMALL_EPS.get(dtype), float(torch.as_tensor(eps).min())
    if floor is None or smallest >= floor:
        return None
    return (f"eps has decayed to {smallest:.3g}, below {floor:g}: central differences in {dtype} lose their "
            f"precision there; set min_lr (or eps_schedule: constant)")


class EpsSchedule(str, Enum):
    """How ε moves during training (member names are what configs write)."""

    proportional = "proportional"
    """ε = ε₀ · lr / lr₀: ε decays with the learning rate."""
    constant = "constant"


class SPSAModule(ByteLMModule):
    """Zero-order training of a monolithic byte LM (E = 1) or, by subclassing, of stacked experts.

    Args:
        eps: initial ε (the paper sweeps 0.00125–0.005, Table 6).
        n_pert: directions per micro-batch (the paper: 64).
        micro_batch: windows per micro-batch; each has its own n_pert directions.
        direction: Rademacher (default) or Gaussian entries.
        max_rows: most windows one batched forward may hold; directions are chunked to fit.
        eps_schedule: `proportional` (ε follows the learning rate) or `constant`.
        optimizer: the torch optimizer the estimate steps (SGD by default; set its lr in YAML).
        plateau_factor: learning-rate decay factor when validation loss plateaus.
        plateau_patience: validations without improvement before a decay.
        min_lr: floor of the decayed learning rate.
        seed: seed of the perturbation directions (regenerated from seed, step, expert, direction).
        init_checkpoint: a monolithic checkpoint of the same shapes to start from (a seed model);
            every expert starts as a copy of it. Ignored when resuming (`--ckpt_path`).
        Other arguments: see `ByteLMModule`.
    """

    def __init__(self, width: int = 509, num_layers: int = 4, embed_dim: int = 32, eps: float = 0.0025,
                 n_pert: int = 64, micro_batch: int = 64, direction: DirectionKind = DirectionKind.RADEMACHER,
                 max_rows: int | None = None, eps_schedule: EpsSchedule = EpsSchedule.proportional,
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau_factor: float = 0.5,
                 plateau_patience: int = 2, min_lr: float = 0.0, seed: int = 0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, time_chunk: int = 64, num_experts: int = 1,
                 head: HeadMode = HeadMode.PER_EXPERT, init_checkpoint: str | None = None):
        super().__init__(num_experts, width, num_layers, embed_dim, head, train_context, score_from, time_chunk)
        require(math.isfinite(eps) and eps > 0, "model.init_args.eps", eps, "a positive finite number")
        require(n_pert >= 1, "model.init_args.n_pert", n_pert, ">= 1")
        require(micro_batch >= 1, "model.init_args.micro_batch", micro_batch, ">= 1")
        require(max_rows is None or max_rows >= 1, "model.init_args.max_rows", max_rows, ">= 1 (or null)")
        check_plateau(plateau_factor, plateau_patience, min_lr)
        self.save_hyperparameters(ignore=["optimizer"])
        self.init_checkpoint = init_checkpoint
        self.keep_head = False
        self.automatic_optimization = False
        self.spsa = SPSAConfig(eps=eps, n_pert=n_pert, micro_batch=micro_batch, direction=DirectionKind(direction),
                               max_rows=max_rows)
        self.eps_schedule = EpsSchedule(eps_schedule)
        self.keep_optimizer(optimizer)
        self.seed = seed
        self.eps_warned = False

    def setup(self, stage: str) -> None:
        precision = str(self.trainer.precision)
        if precision not in FULL_PRECISION:
            raise ConfigError(f"trainer.precision={precision}: {type(self).__name__} estimates gradients from loss "
                              f"differences, which mixed precision ruins; use one of {', '.join(FULL_PRECISION)}")
        if stage == "fit" and self.trainer.world_size > 1:
            self.check_world_size(self.trainer.world_size)
        batch_size = getattr(self.trainer.datamodule, "batch_size", None)
        if stage == "fit" and isinstance(batch_size, int):  # before the first step, not at it
            self.check_batch_size(batch_size)
        # A fresh fit starts from the seed; a resumed one gets its weights from the checkpoint.
        if stage == "fit" and self.init_checkpoint and self.trainer.ckpt_path is None:
            self._warm_start(self.init_checkpoint)

    def check_batch_size(self, batch_size: int) -> None:
        """The training batch B splits into micro-batches of `micro_batch` windows."""
        if batch_size % self.spsa.micro_batch:
            raise ConfigError(f"data.init_args.batch_size={batch_size} is not a multiple of "
                              f"model.init_args.micro_batch={self.spsa.micro_batch}")

    def training_tokens(self, batch: Tensor) -> Tensor:
        """As `ByteLMModule`'s, and the batch must fit `check_batch_size`."""
        tokens = super().training_tokens(batch)
        self.check_batch_size(tokens.shape[1])
        return tokens

    def check_world_size(self, world_size: int) -> None:
        """Refuse to fit on several processes: each would train its own replica and they would diverge.

        DDPPModule shares one model's directions across processes; SOMAModule shares its experts.
        """
        raise ConfigError(f"{type(self).__name__} trains one model per process, so {world_size} processes would "
                          f"train {world_size} diverging replicas: use --model=soma_pl.lit.DDPPModule for "
                          f"multi-process SPSA (or trainer.devices=1, num_nodes=1)")

    @torch.no_grad()
    def _warm_start(self, path: str) -> None:
        """Copy the seed model into every expert (and into the shared head, unless it is random)."""
        state, _ = monolithic_state(path)
        for name, param in self.model.named_parameters():
            if name == "head" and self.keep_head:
                continue
            if name not in state:
                raise ConfigError(f"seed checkpoint {path}: no '{name}'")
            source = state[name]
            one = source if name == "head" and source.dim() == 2 else source[0]  # one expert's tensor
            wanted = param.shape if self.model.is_shared(name) else param.shape[1:]
            if one.shape != wanted:
                raise ConfigError(f"seed checkpoint {path}: '{name}' has shape {list(one.shape)} per expert, "
                                  f"the configured experts have {list(wanted)}")
            param.copy_(one if self.model.is_shared(name) else one.expand_as(param))

    def configure_optimizers(self):
        optimizer = self.build_optimizer(self.trainable_parameters().values())
        scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(
            optimizer, mode="min", factor=self.hparams.plateau_factor, patience=self.hparams.plateau_patience,
            min_lr=self.hparams.min_lr)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "expert/0/val_loss"}}

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the estimator perturbs: `[E, ...]` each."""
        return {n: p for n, p in self.model.expert_parameters().items() if p.requires_grad}

    def current_lr(self) -> float:
        return self.optimizers().param_groups[0]["lr"]

    def current_eps(self) -> float:
        if self.eps_schedule is EpsSchedule.constant:
            return self.spsa.eps
        initial = self.optimizers().param_groups[0].get("initial_lr") or self._initial_lr()
        return self.spsa.eps * self.current_lr() / initial

    def _initial_lr(self) -> float:
        group = self.optimizers().param_groups[0]
        group.setdefault("initial_lr", group["lr"])
        return group["initial_lr"]

    def warn_small_eps(self, eps: float | Tensor) -> None:
        """Warn once per run when ε falls below the precision of the model's dtype (checked where it
        decays, after a validation: no per-step cost)."""
        message = None if self.eps_warned else small_eps_warning(eps, self.model.w_hh.dtype)
        if message:
            rank_zero_warn(message)
            self.eps_warned = True

    def estimate(self, tokens: Tensor, eps: float):
        """The SPSA estimate of every expert's gradient on `tokens: [E, B, T]`."""
        params = self.trainable_parameters()
        config = SPSAConfig(eps=eps, n_pert=self.spsa.n_pert, micro_batch=self.spsa.micro_batch,
                            direction=self.spsa.direction, max_rows=self.spsa.max_rows)
        return spsa_estimate(self.model.loss_per_group, params, tokens, config, step=self.global_step, seed=self.seed)

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        optimizer = self.optimizers()
        self._initial_lr()
        step = self.global_step
        clock = UpdateClock(tokens.device)
        clock.start()
        eps = self.current_eps()
        result = self.estimate(tokens, eps)
        for name, param in self.trainable_parameters().items():
            param.grad = result.gradient[name]
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        seconds = clock.stop()
        self.check_finite(step, result.loss, self.model, range(self.model.num_experts))
        self.log_result(result, tokens, seconds, eps)

    def log_result(self, result, tokens: Tensor, seconds: float, eps: float) -> None:
        """Log an update from the estimator's result (EGGROLL logs more of its population)."""
        self.log_update(result.loss, tokens, seconds, eps)

    def log_update(self, losses: Tensor, tokens: Tensor, seconds: float, eps: float) -> None:
        experts, windows, length = tokens.shape
        forwards = 2 * self.spsa.n_pert * experts * windows * (length - 1)
        self.last_update = UpdateRecord(seconds, forwards, experts)
        self.log("train/loss", losses.mean(), prog_bar=True)
        self.log_dict({"train/lr": self.current_lr(), "train/eps": eps, "train/update_seconds": seconds,
                       "train/token_forwards_per_s": forwards / max(seconds, 1e-12)})

    def after_validation(self, held_out: Tensor) -> None:
        """Decay on the model's own held-out 1% training split (N = 1 is one expert)."""
        self.lr_schedulers().step(float(held_out.mean()))
        self.warn_small_eps(self.current_eps())
