"""The zero-order estimators as components of `ZOModule`: their settings are the component.

`ZOModule` trains with one of two typed argument groups, `spsa: SPSAArgs` (the default) or, when
it is given, `eggroll: EGGROLLArgs` (`model.init_args.spsa.eps`, `model.init_args.eggroll.sigma`).
Through the small `Estimator` protocol it asks the group for everything that depends on the
method: the perturbation scale and how it moves, the batch it can split, and one update's estimate
with its cost. Adding a method is adding one such group. Each group's numbers are checked once,
where they are defined (`SPSAConfig`, `EGGROLLConfig`, whose messages name the key); what the
groups add is checked here.

DDPP is SPSA with `spsa.exchange` set: each step's directions are dealt out across the DDP ranks
and the estimate is put back together (`soma_pl.lit.ddpp`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import Enum
from typing import TYPE_CHECKING, ClassVar, Protocol

import torch
from torch import Tensor

from soma_pl.contracts import UpdateMemory
from soma_pl.errors import ConfigError
from soma_pl.estimators.eggroll import EGGROLLConfig, FitnessShaping, MemberNoise, eggroll_estimate
from soma_pl.estimators.spsa import SPSAConfig, chunk_size, spsa_estimate
from soma_pl.lit.args import KEY
from soma_pl.lit.ddpp import Exchange, exchanged_estimate
from soma_pl.models.stacked import LOW_RANK_MATRICES, population_losses

if TYPE_CHECKING:
    from soma_pl.lit.zo import ZOModule


class EpsSchedule(str, Enum):
    """How ε (or σ) moves during training (member names are what configs write)."""

    proportional = "proportional"
    """ε = ε₀ · lr / lr₀: ε decays with the learning rate."""
    constant = "constant"


@dataclass
class Update:
    """One estimate, as `ZOModule.training_step` uses it."""

    gradient: dict[str, Tensor]
    """Name → `[E, ...]`: what goes into each trainable parameter's `.grad`."""
    loss: Tensor
    """`[E]` each expert's training loss at this step."""
    forwards: int
    """Token forwards this process evaluated."""
    logs: dict[str, float | Tensor]
    """More values to log as `train/<name>`."""


class Estimator(Protocol):
    """What `ZOModule` asks of an estimator's settings."""

    scale_name: ClassVar[str]
    """What the perturbation scale is called in logs (`train/<scale_name>`)."""

    @property
    def initial_scale(self) -> float:
        """ε₀ (σ₀): the configured perturbation scale."""

    @property
    def scale_schedule(self) -> EpsSchedule:
        """Whether the perturbation scale follows the learning rate."""

    def check_module(self, module: ZOModule) -> None:
        """Refuse a model this estimator cannot train (ConfigError)."""

    def check_batch_size(self, batch_size: int) -> None:
        """Refuse a training batch of `batch_size` windows the estimator cannot split (ConfigError)."""

    def estimate(self, module: ZOModule, tokens: Tensor, scale: float | Tensor) -> Update:
        """The update of `module`'s trained experts on `tokens [E, B, T]` at perturbation scale
        `scale` (one number, or `[E]` per expert)."""

    def update_memory(self, module: ZOModule) -> UpdateMemory:
        """What one of its loss calls holds at once on `module`'s device, at least."""


def activation_bytes(module: ZOModule, windows: int) -> int:
    """The activations a loss call over `windows` windows holds at least: a layer's gates, 4·d_t
    numbers per window and time step, over one time chunk (the bound `StackedExperts` documents)."""
    model = module.model
    return windows * min(model.time_chunk, module.train_context) * 4 * model.width * model.w_hh.element_size()


@dataclass(frozen=True)
class SPSAArgs(SPSAConfig):
    """The SPSA estimator (`model.init_args.spsa`): central differences along n_pert random directions."""

    key: ClassVar[str] = f"{KEY}.spsa"
    scale_name: ClassVar[str] = "eps"

    eps: float = 0.0025
    """Initial ε, the perturbation step (the paper sweeps 0.00125–0.005, Table 6)."""
    eps_schedule: EpsSchedule = EpsSchedule.proportional
    """`proportional` (ε follows the learning rate) or `constant`."""
    exchange: Exchange | None = None
    """DDPP (Fig. 12): deal each step's directions out across the DDP ranks and exchange `scalars`
    (each direction's δ, a few floats per step) or `estimates` (each rank's partial estimate, d
    floats up and back). The same update either way, equal to one process's. None: one process
    trains one model (or, with several experts, its share of them)."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "eps_schedule", EpsSchedule(self.eps_schedule))
        if self.exchange is not None:
            object.__setattr__(self, "exchange", Exchange(self.exchange))

    @property
    def initial_scale(self) -> float:
        return self.eps

    @property
    def scale_schedule(self) -> EpsSchedule:
        return self.eps_schedule

    def check_module(self, module: ZOModule) -> None:
        """DDPP shares one model's directions: it trains one expert. Summed-loss training
        (`loss_grouping` K > 1, §6 and App. J's control) joins consecutive groups of K experts."""
        experts = module.model.num_experts
        if self.exchange is not None and experts != 1:
            raise ConfigError(f"{self.key}.exchange={self.exchange.value} deals one model's directions out across "
                              f"processes: it needs {KEY}.num_experts=1 (several experts are shared out by "
                              f"expert-parallel SOMA, exchange: null)")
        if experts % self.loss_grouping:
            raise ConfigError(f"{self.key}.loss_grouping={self.loss_grouping} sums the losses of groups of that many "
                              f"experts: it must divide {KEY}.num_experts={experts}")

    def check_batch_size(self, batch_size: int) -> None:
        """The training batch B splits into micro-batches of `micro_batch` windows."""
        if batch_size % self.micro_batch:
            raise ConfigError(f"data.init_args.batch_size={batch_size} is not a multiple of "
                              f"{self.key}.micro_batch={self.micro_batch}")

    def estimate(self, module: ZOModule, tokens: Tensor, scale: float | Tensor) -> Update:
        """Every trained expert's SPSA estimate, its directions keyed by its global index; 2 · n_pert
        forwards of every window's T predicted bytes per expert (DDPP: this rank's directions only)."""
        count, windows, length = tokens.shape
        if self.exchange is not None:
            result, here, sent = exchanged_estimate(module, tokens, replace(self, eps=scale), self.exchange)
            return Update(result.gradient, result.loss, 2 * here * count * self.micro_batch * (length - 1),
                          {"exchange_bytes": float(sent)})
        experts = module.experts
        ids = torch.arange(experts.start, experts.stop, device=tokens.device)
        per_expert = isinstance(scale, Tensor)
        config = self if per_expert else replace(self, eps=scale)
        result = spsa_estimate(module.loss_fn, module.perturbed_parameters(), tokens, config,
                               step=module.global_step, seed=module.seed, expert_ids=ids,
                               expert_eps=scale if per_expert else None)
        return Update(result.gradient, result.loss, 2 * self.n_pert * count * windows * (length - 1), {})

    def update_memory(self, module: ZOModule) -> UpdateMemory:
        """Each loss call evaluates K directions of every trained expert (K = n_pert, or fewer under
        `max_rows`): it holds them, the 2K ± copies of the perturbed weights, and the activations of
        E·2K·micro_batch windows."""
        experts = len(module.experts)
        chunk = chunk_size(self, experts)
        weights = sum(param[0].numel() * param.element_size() for param in module.perturbed_parameters().values())
        copies = 3 * chunk * experts * weights
        rows = experts * 2 * chunk * self.micro_batch
        return UpdateMemory(copies + activation_bytes(module, rows),
                            f"{chunk} directions per loss call: {3 * chunk * experts} copies of an expert's perturbed "
                            f"weights and the activations of {rows} windows",
                            f"{self.key}.n_pert={self.n_pert}, or {self.key}.max_rows={self.max_rows} "
                            "(windows per loss call)")


@dataclass(frozen=True)
class EGGROLLArgs(EGGROLLConfig):
    """The EGGROLL estimator (`model.init_args.eggroll`): evolution strategies with low-rank perturbations.

    The step follows the reference (HyperscaleES, the EGGROLL paper) by default: `.grad` is
    `σ₀/√N · Σ φ_m ε_m` (φ the shaped loss), so SGD steps `θ += lr·σ₀/√N · Σ f_m ε_m` with fitness
    `f = −φ` and the reference's learning rates transfer. σ₀ is the configured `sigma`, fixed: a σ
    schedule moves only the perturbation scale. The reference's `group` shaping divides by a spread
    that is mostly how much the windows differ, so its fitness grows with σ: under a proportional σ a
    halving of lr would quarter the step, so `proportional` is refused with every shaping but
    `group_own_std`. The training batch holds `population / group_size` windows, each shared by
    `group_size` members.
    """

    key: ClassVar[str] = f"{KEY}.eggroll"
    scale_name: ClassVar[str] = "sigma"

    sigma: float = 0.0025
    """σ₀: the initial perturbation scale, and the σ of the step's scale (unless `step_sigma`)."""
    sigma_schedule: EpsSchedule = EpsSchedule.constant
    """`constant` (the reference's: σ stays `sigma`) or `proportional` (the perturbation scale
    follows the learning rate; only with `fitness: group_own_std`, whose fitness does not grow with σ,
    so that a halving of lr halves the step); either way the step's σ₀ stays fixed."""

    def __post_init__(self) -> None:
        super().__post_init__()
        object.__setattr__(self, "sigma_schedule", EpsSchedule(self.sigma_schedule))
        if self.sigma_schedule is EpsSchedule.proportional and self.fitness is not FitnessShaping.group_own_std:
            # Its fitness grows with σ: a decay would shrink the step as lr², not as lr.
            raise ConfigError(f"{self.key}.sigma_schedule=proportional with {self.key}.fitness={self.fitness.value} "
                              f"would make each learning-rate decay quarter the step; use sigma_schedule: constant "
                              f"(the reference's) or fitness: group_own_std")

    @property
    def initial_scale(self) -> float:
        return self.sigma

    @property
    def scale_schedule(self) -> EpsSchedule:
        return self.sigma_schedule

    def check_module(self, module: ZOModule) -> None:
        """The population's perturbations are of one model."""
        if module.model.num_experts != 1:
            raise ConfigError(f"{self.key} trains one model: set {KEY}.num_experts=1 "
                              f"(got {module.model.num_experts})")

    def check_batch_size(self, batch_size: int) -> None:
        """The batch holds one window per group of members."""
        if batch_size != self.windows:
            raise ConfigError(f"training batch of {batch_size} windows: {self.key}.population={self.population} "
                              f"in groups of {self.group_size} needs data.init_args.batch_size={self.windows}")

    def estimate(self, module: ZOModule, tokens: Tensor, scale: float | Tensor) -> Update:
        """The update direction on `tokens [1, B, T]`: perturbations of scale `scale`, the step's σ₀
        fixed; every member predicts the T bytes of its one window. Logs how far the members' losses
        spread (the fitness signal)."""
        model = module.trained_model

        def member_losses(noise: MemberNoise, members: Tensor) -> Tensor:  # [1, M, b, T] → [1, M]
            return population_losses(model, members, noise.factors, noise.offsets)

        params = module.perturbed_parameters()
        matrices = [name for name in params if name in LOW_RANK_MATRICES]
        config = replace(self, sigma=float(scale), step_sigma=self.step_sigma or self.sigma)
        result = eggroll_estimate(member_losses, params, matrices, tokens, config, step=module.global_step,
                                  seed=module.seed)
        count, _, length = tokens.shape
        return Update(result.gradient, result.loss, self.population * count * (length - 1),
                      {"loss_spread": result.losses.double().std(1).mean()})

    def update_memory(self, module: ZOModule) -> UpdateMemory:
        """Each loss call evaluates `chunk` members of every trained expert, a window each, with the
        low-rank perturbations inside the matmuls: their activations are what it holds."""
        rows = len(module.experts) * self.chunk
        return UpdateMemory(activation_bytes(module, rows), f"the activations of {rows} members per loss call",
                            f"{self.key}.max_members={self.max_members}")
