"""`ZOModule`: what every zero-order module shares; the estimate itself is each subclass's `estimate`.

Manual optimization: each step the estimate goes into `.grad` and a real torch optimizer (from the
config) steps. The perturbation scale (SPSA's ε, EGGROLL's σ) either stays fixed or follows the
learning rate (`EpsSchedule.proportional`): when the learning rate decays, the scale decays by the
same factor (per expert under per-expert decay). A fresh fit may start every expert from a seed
checkpoint (`init_checkpoint`). Zero-order modules run in full precision only: a bf16 forward puts
a 1.3% error into each loss difference.

One process trains one model: fitting on several processes is refused (each would train its own,
diverging replica); `DDPPModule` shares one model's directions across processes, `SOMAModule` its
experts.
"""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum

import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.contracts import BatchesWindows, RecordsData, UpdateClock
from soma_pl.errors import ConfigError
from soma_pl.lit.args import ModelShape
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.models.checkpoints import monolithic_state
from soma_pl.models.stacked import HeadMode

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
            f"precision there; set plateau.min_lr (or eps_schedule: constant)")


class Init(str, Enum):
    """Where a fresh fit starts (Fig. 9); every side of a comparison starts the same way."""

    seed = "seed"
    """From a seed model of the same width: every expert a copy of it (the paper's warm start)."""
    random = "random"
    """From the module's random initialisation (`seed_everything`)."""


def start_checkpoint(init: Init | str | None, checkpoint: str | None, key: str) -> str | None:
    """The checkpoint a fresh fit starts from: `checkpoint` under `init: seed`, None under `random`.

    `init` None (unset) is `seed` when a checkpoint is given, else `random`.

    Raises:
        ConfigError: `init: seed` without a checkpoint (`key` names its setting).
    """
    init = (Init.seed if checkpoint else Init.random) if init is None else Init(init)
    if init is Init.seed and checkpoint is None:
        raise ConfigError(f"init: seed needs model.init_args.{key} (or set init: random)")
    if init is Init.random and checkpoint is not None:
        # A config's seed checkpoint overridden by `--model.init_args.init=random` (Fig. 9's ablation).
        rank_zero_warn(f"init: random: model.init_args.{key}={checkpoint} is not used; the fit starts from "
                       "random weights")
    return checkpoint if init is Init.seed else None


class EpsSchedule(str, Enum):
    """How ε (or σ) moves during training (member names are what configs write)."""

    proportional = "proportional"
    """ε = ε₀ · lr / lr₀: ε decays with the learning rate."""
    constant = "constant"


class ZOModule(ByteLMModule):
    """Zero-order training: the estimate steps a torch optimizer; subclasses say how to estimate.

    A subclass defines `estimate`, `initial_scale`, `scale_schedule`, `check_batch_size` and
    `token_forwards`, and may add values to the step's log (`update_logs`).

    Args:
        seed: seed of the perturbations (regenerated from seed, step, expert, direction).
        init: `seed` (start from `init_checkpoint`) or `random`; None: `seed` when `init_checkpoint`
            is given, else `random`. Configs say it explicitly, so a sweep's sides can be compared.
        init_checkpoint: a monolithic checkpoint of the same shapes to start from (a seed model);
            every expert starts as a copy of it. Ignored when resuming (`--ckpt_path`).
        Other arguments: see `ByteLMModule`.
    """

    scale_name = "eps"
    """What the perturbation scale is called in logs (`train/<scale_name>`)."""
    checkpoint_key = "init_checkpoint"
    """The setting that names the seed checkpoint (in messages)."""

    def __init__(self, num_experts: int = 1, shape: ModelShape = ModelShape(),
                 head: HeadMode = HeadMode.per_expert, optimizer: Callable | dict = torch.optim.SGD,
                 plateau: PlateauConfig = PlateauConfig(), seed: int = 0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, init: Init | None = None, init_checkpoint: str | None = None):
        super().__init__(num_experts=num_experts, shape=shape, head=head, train_context=train_context,
                         score_from=score_from, optimizer=optimizer, plateau=plateau)
        self.seed = seed
        self.init_checkpoint = start_checkpoint(init, init_checkpoint, self.checkpoint_key)
        """The seed checkpoint a fresh fit starts from; None: random weights."""
        self.keep_head = False
        """Whether a warm start leaves the (shared, random) head as it is."""
        self.eps_warned = False

    def estimate(self, tokens: Tensor, scale: float | Tensor):
        """The update direction on `tokens: [E, B, T]` with perturbation scale `scale` (one number, or
        `[E]` per expert); a result with `gradient` (name → `[E, ...]`) and `loss` (`[E]`)."""
        raise NotImplementedError

    @property
    def initial_scale(self) -> float:
        """ε₀ (σ₀): the configured perturbation scale."""
        raise NotImplementedError

    @property
    def scale_schedule(self) -> EpsSchedule:
        """Whether the perturbation scale follows the learning rate."""
        raise NotImplementedError

    def check_batch_size(self, batch_size: int) -> None:
        """Refuse a training batch of `batch_size` windows the estimator cannot split (ConfigError)."""
        raise NotImplementedError

    def token_forwards(self, tokens: Tensor) -> int:
        """Token forwards one update on `tokens: [E, B, T]` evaluates on this process."""
        raise NotImplementedError

    def update_logs(self, result) -> dict[str, float | Tensor]:
        """More values of the estimator's `result` to log as `train/<name>` (none by default)."""
        return {}

    def setup(self, stage: str) -> None:
        precision = str(self.trainer.precision)
        if precision not in FULL_PRECISION:
            raise ConfigError(f"trainer.precision={precision}: {type(self).__name__} estimates gradients from loss "
                              f"differences, which mixed precision ruins; use one of {', '.join(FULL_PRECISION)}")
        if stage == "fit" and self.trainer.world_size > 1:
            self.check_world_size(self.trainer.world_size)
        data = self.trainer.datamodule
        if stage == "fit" and isinstance(data, BatchesWindows) and isinstance(data.batch_size, int):
            self.check_batch_size(data.batch_size)  # before the first step, not at it
        # A fresh fit starts from the seed; a resumed one gets its weights from the checkpoint.
        if stage == "fit" and self.init_checkpoint and self.trainer.ckpt_path is None:
            self._warm_start(self.init_checkpoint, data.data_in_use() if isinstance(data, RecordsData) else None)

    def check_world_size(self, world_size: int) -> None:
        """Refuse to fit on several processes: each would train its own replica and they would diverge."""
        raise ConfigError(f"{type(self).__name__} trains one model per process, so {world_size} processes would "
                          f"train {world_size} diverging replicas: use --model=soma_pl.lit.DDPPModule for "
                          f"multi-process SPSA (or trainer.devices=1, num_nodes=1)")

    @torch.no_grad()
    def _warm_start(self, path: str, data: dict[str, tuple[str | None, str]] | None = None) -> None:
        """Copy the seed model into every expert (and into the shared head, unless it is random).
        A seed trained on other data than `data` (the data module's `data_in_use`) is refused, as
        `--ckpt_path` refuses such a checkpoint."""
        state, _ = monolithic_state(path, data)
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

    def training_tokens(self, batch: Tensor) -> Tensor:
        """As `ByteLMModule`'s, and the batch must fit `check_batch_size`."""
        tokens = super().training_tokens(batch)
        self.check_batch_size(tokens.shape[1])
        return tokens

    def trainable_parameters(self) -> dict[str, torch.nn.Parameter]:
        """The parameters the estimator perturbs: `[E, ...]` each (a shared head is never perturbed)."""
        return {n: p for n, p in self.trained_model.expert_parameters().items() if p.requires_grad}

    def training_step(self, batch: Tensor, batch_idx: int) -> None:
        tokens = self.training_tokens(batch)
        step = self.global_step
        clock = UpdateClock(tokens.device)
        clock.start()
        scale = self.current_scale()
        result = self.estimate(tokens, scale)
        for name, param in self.trainable_parameters().items():
            param.grad = result.gradient[name]
        self.step_optimizer()
        seconds = clock.stop()
        self.check_finite(step, result.loss)
        self.log_update(result.loss, seconds, self.token_forwards(tokens),
                        **{self.scale_name: float(torch.as_tensor(scale).mean())}, **self.update_logs(result))

    def current_scale(self) -> float | Tensor:
        """The perturbation scale now: `[E]` (this process's experts) under per-expert decay, else one number."""
        if self.plateau is not None:
            multiplier = self.plateau.scale[self.experts.start : self.experts.stop]
            if self.scale_schedule is EpsSchedule.constant:
                multiplier = torch.ones_like(multiplier)
            return self.initial_scale * multiplier
        if self.scale_schedule is EpsSchedule.constant:
            return self.initial_scale
        group = self.optimizers().param_groups[0]
        group.setdefault("initial_lr", group["lr"])  # set by `configure_optimizers`; not on a bare optimizer
        return self.initial_scale * group["lr"] / group["initial_lr"]

    def after_validation(self, held_out: Tensor) -> None:
        super().after_validation(held_out)
        self.warn_small_eps(self.current_scale())

    def warn_small_eps(self, eps: float | Tensor) -> None:
        """Warn once per run when ε falls below the precision of the model's dtype (checked where it
        decays, after a validation: no per-step cost)."""
        message = None if self.eps_warned else small_eps_warning(eps, self.model.w_hh.dtype)
        if message:
            rank_zero_warn(message)
            self.eps_warned = True
