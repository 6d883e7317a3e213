"""`EGGROLLModule`: monolithic training by evolution strategies with low-rank perturbations.

Each update evaluates a population of members, antithetic pairs of rank-r perturbations applied
inside every matmul (`soma_pl.models.lowrank`), chunks of members per batched forward; the
shaped fitness weights the regenerated perturbations into an update direction that goes into
`.grad`, and a torch optimizer from the config steps (manual optimization). The training batch
holds `population / group_size` windows; each is shared by `group_size` members.

The step follows the reference (HyperscaleES, the EGGROLL paper) by default: `.grad` is
`σ₀/√N · Σ φ_m ε_m` (φ the shaped loss), so SGD steps `θ += lr·σ₀/√N · Σ f_m ε_m` with fitness
`f = −φ` and the reference's learning rates transfer. σ₀ is the configured `sigma`, fixed: a σ
schedule moves only the perturbation scale, so where the shaped fitness does not depend on σ the
learning rate alone sets the step size and halving it halves the step. The reference's `group`
shaping divides by a spread that is mostly how much the windows differ, so its fitness grows with
σ: under `sigma_schedule: proportional` a halving of lr would quarter the step, so `proportional` is
refused with every shaping but `group_own_std`; `constant` is the default (the reference's own).

Everything else is `ZOModule`'s: warm start from a seed checkpoint, the optimizer and its plateau
decay, and, under `proportional`, the perturbation scale following the learning rate as SPSA's ε
does.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError
from soma_pl.estimators.eggroll import EGGROLLConfig, EGGROLLResult, FitnessShaping, MemberNoise, eggroll_estimate
from soma_pl.lit.args import KEY, ModelShape, require
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.zo import EpsSchedule, Init, ZOModule
from soma_pl.models.lowrank import LOW_RANK_MATRICES, population_losses


@dataclass(frozen=True)
class EGGROLLArgs(EGGROLLConfig):
    """The EGGROLL estimator's settings (`model.init_args.eggroll`), and how σ moves during training."""

    sigma: float = 0.0025
    """σ₀: the initial perturbation scale, and the σ of the step's scale (unless `step_sigma`)."""
    sigma_schedule: EpsSchedule = EpsSchedule.constant
    """`constant` (the reference's: σ stays `sigma`) or `proportional` (the perturbation scale
    follows the learning rate; only with `fitness: group_own_std`, whose fitness does not grow with σ,
    so that a halving of lr halves the step); either way the step's σ₀ stays fixed."""

    def __post_init__(self) -> None:
        key = f"{KEY}.eggroll"
        require(self.sigma > 0, f"{key}.sigma", self.sigma, "> 0")
        require(self.step_sigma is None or self.step_sigma > 0, f"{key}.step_sigma", self.step_sigma, "> 0 (or null)")
        require(self.rank >= 1, f"{key}.rank", self.rank, ">= 1")
        require(self.group_size >= 2 and self.group_size % 2 == 0, f"{key}.group_size", self.group_size,
                "even and >= 2 (antithetic pairs)")
        require(self.population % self.group_size == 0, f"{key}.population", self.population,
                f"a multiple of {key}.group_size={self.group_size}")
        require(self.max_members is None or self.max_members >= 2, f"{key}.max_members", self.max_members,
                ">= 2 (one antithetic pair; or null)")
        super().__post_init__()
        object.__setattr__(self, "sigma_schedule", EpsSchedule(self.sigma_schedule))
        if self.sigma_schedule is EpsSchedule.proportional and self.fitness is not FitnessShaping.group_own_std:
            # Its fitness grows with σ: a decay would shrink the step as lr², not as lr.
            raise ConfigError(f"{key}.sigma_schedule=proportional with {key}.fitness={self.fitness.value} would "
                              f"make each learning-rate decay quarter the step; use sigma_schedule: constant (the "
                              f"reference's) or fitness: group_own_std")


class EGGROLLModule(ZOModule):
    """EGGROLL baseline on one byte LM (Table 4: population 2²⁰, B = 256).

    The training batch holds `eggroll.population / eggroll.group_size` windows (`data.batch_size`).

    Args:
        eggroll: σ₀, perturbation rank, population, group size, fitness shaping, chunking, step
            convention, σ schedule.
        optimizer: the torch optimizer the update steps (SGD by default; set its lr in YAML).
        Other arguments: see `ZOModule` and `ByteLMModule`.
    """

    scale_name = "sigma"

    def __init__(self, shape: ModelShape = ModelShape(), eggroll: EGGROLLArgs = EGGROLLArgs(),
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau: PlateauConfig = PlateauConfig(),
                 seed: int = 0, train_context: int = 1024, score_from: int = ROUTE_BYTES,
                 init: Init | None = None, init_checkpoint: str | None = None):
        super().__init__(shape=shape, optimizer=optimizer, plateau=plateau, seed=seed, train_context=train_context,
                         score_from=score_from, init=init, init_checkpoint=init_checkpoint)
        self.eggroll = self.arg_group(EGGROLLArgs, eggroll, "eggroll")

    @property
    def initial_scale(self) -> float:
        return self.eggroll.sigma

    @property
    def scale_schedule(self) -> EpsSchedule:
        return self.eggroll.sigma_schedule

    def member_losses(self, noise: MemberNoise, tokens: Tensor) -> Tensor:
        """Training loss of every member: `tokens [1, M, b, T]` → `[1, M]`."""
        return population_losses(self.model, tokens, noise.factors, noise.offsets)

    def estimate(self, tokens: Tensor, sigma: float) -> EGGROLLResult:
        """The EGGROLL update direction on `tokens [1, B, T]`: perturbations of scale `sigma`, the step's
        σ₀ fixed."""
        params = self.trainable_parameters()
        matrices = [name for name in params if name in LOW_RANK_MATRICES]
        config = replace(self.eggroll, sigma=sigma, step_sigma=self.eggroll.step_sigma or self.eggroll.sigma)
        return eggroll_estimate(self.member_losses, params, matrices, tokens, config, step=self.global_step,
                                seed=self.seed)

    def check_batch_size(self, batch_size: int) -> None:
        """The batch holds one window per group of members (checked at setup and on every batch)."""
        if batch_size != self.eggroll.windows:
            raise ConfigError(f"training batch of {batch_size} windows: {KEY}.eggroll.population="
                              f"{self.eggroll.population} in groups of {self.eggroll.group_size} needs "
                              f"data.init_args.batch_size={self.eggroll.windows}")

    def token_forwards(self, tokens: Tensor) -> int:
        """Every member predicts the T bytes of its one window."""
        experts, _, length = tokens.shape
        return self.eggroll.population * experts * (length - 1)

    def update_logs(self, result: EGGROLLResult) -> dict[str, float | Tensor]:
        """How far the members' losses spread (the fitness signal)."""
        return {"loss_spread": result.losses.double().std(1).mean()}
