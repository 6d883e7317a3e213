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

Everything else is `SPSAModule`'s: warm start from a seed checkpoint, the optimizer and its
plateau decay, and, under `proportional`, the perturbation scale following the learning rate as
SPSA's ε does.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from lightning.pytorch.cli import OptimizerCallable
from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError
from soma_pl.estimators.eggroll import (
    EGGROLLConfig,
    EGGROLLResult,
    FitnessShaping,
    MemberNoise,
    StepConvention,
    eggroll_estimate,
)
from soma_pl.lit.base import UpdateRecord
from soma_pl.lit.spsa import EpsSchedule, SPSAModule
from soma_pl.models.lowrank import LOW_RANK_MATRICES, population_losses


class EGGROLLModule(SPSAModule):
    """EGGROLL baseline on one byte LM (Table 4: population 2²⁰, B = 256).

    Args:
        sigma: σ₀, the initial perturbation scale and the σ of the step's scale (fixed).
        rank: r, the rank of each matrix perturbation (vectors get full Gaussian noise).
        population: members per update, both signs of population / 2 antithetic pairs.
        group_size: members that share one training window; the data batch size must be
            population / group_size.
        fitness: `group` (the reference's: minus each group's mean, over the whole population's
            std), `group_own_std` (z-score within each group), `population` (z-score over all
            members) or `none` (raw losses).
        max_members: most members in one batched forward (bounds memory); None: all at once.
        step_convention: `reference` (`.grad` = σ₀/√N·Σ φ ε, the reference's learning rates) or
            `mean_over_sigma` (`.grad` = 1/(Nσ₀)·Σ φ ε); the same step at
            lr_mean_over_sigma = lr_reference·σ₀²·√N.
        sigma_schedule: `constant` (the reference's: σ stays `sigma`) or `proportional` (the
            perturbation scale follows the learning rate; only with `fitness: group_own_std`, the one
            shaping whose fitness does not grow with σ, so that a halving of lr halves the step);
            either way the step's σ₀ stays `sigma`.
        optimizer: the torch optimizer the update steps (SGD by default; set its lr in YAML).
        seed: seed of the perturbations (regenerated from seed, step, pair).
        Other arguments: see `SPSAModule` and `ByteLMModule`.
    """

    def __init__(self, width: int = 509, num_layers: int = 4, embed_dim: int = 32, sigma: float = 0.0025,
                 rank: int = 1, population: int = 2**20, group_size: int = 4096,
                 fitness: FitnessShaping = FitnessShaping.population, max_members: int | None = None,
                 step_convention: StepConvention = StepConvention.reference,
                 sigma_schedule: EpsSchedule = EpsSchedule.constant,
                 optimizer: OptimizerCallable = torch.optim.SGD, plateau_factor: float = 0.5,
                 plateau_patience: int = 2, min_lr: float = 0.0, seed: int = 0, train_context: int = 1024,
                 score_from: int = ROUTE_BYTES, time_chunk: int = 64, init_checkpoint: str | None = None):
        try:
            config = EGGROLLConfig(sigma=sigma, rank=rank, population=population, group_size=group_size,
                                   fitness=FitnessShaping(fitness), max_members=max_members,
                                   step_convention=StepConvention(step_convention))
        except ValueError as error:
            raise ConfigError(str(error)) from error
        if EpsSchedule(sigma_schedule) is EpsSchedule.proportional and config.fitness is not FitnessShaping.group_own_std:
            # Its fitness grows with σ: a decay would shrink the step as lr², not as lr.
            raise ConfigError(f"sigma_schedule: proportional with fitness: {config.fitness.value} would make each "
                              f"learning-rate decay quarter the step; use sigma_schedule: constant (the reference's) "
                              f"or fitness: group_own_std")
        super().__init__(width, num_layers, embed_dim, eps=sigma, eps_schedule=sigma_schedule, optimizer=optimizer,
                         plateau_factor=plateau_factor, plateau_patience=plateau_patience, min_lr=min_lr, seed=seed,
                         train_context=train_context, score_from=score_from, time_chunk=time_chunk,
                         init_checkpoint=init_checkpoint)
        # Replace SPSAModule's hyperparameters (its n_pert, micro_batch, ...) with this signature's.
        self.save_hyperparameters(ignore=["optimizer"])
        self.keep_optimizer(optimizer)
        self.eggroll = config

    def member_losses(self, noise: MemberNoise, tokens: Tensor) -> Tensor:
        """Training loss of every member: `tokens [1, M, b, T]` → `[1, M]`."""
        return population_losses(self.model, tokens, noise.factors, noise.offsets)

    def estimate(self, tokens: Tensor, eps: float) -> EGGROLLResult:
        """The EGGROLL update direction on `tokens [1, B, T]`: perturbations of scale `eps`, the step's σ₀ fixed."""
        params = self.trainable_parameters()
        matrices = [name for name in params if name in LOW_RANK_MATRICES]
        config = replace(self.eggroll, sigma=eps, step_sigma=self.eggroll.sigma)
        return eggroll_estimate(self.member_losses, params, matrices, tokens, config, step=self.global_step,
                                seed=self.seed)

    def check_batch_size(self, batch_size: int) -> None:
        """The batch holds one window per group of members (checked at setup and on every batch)."""
        if batch_size != self.eggroll.windows:
            raise ConfigError(f"training batch of {batch_size} windows: population {self.eggroll.population} "
                              f"in groups of {self.eggroll.group_size} needs data.init_args.batch_size="
                              f"{self.eggroll.windows}")

    def log_result(self, result: EGGROLLResult, tokens: Tensor, seconds: float, sigma: float) -> None:
        experts, _, length = tokens.shape
        # Every member predicts the T bytes of its one window.
        forwards = self.eggroll.population * experts * (length - 1)
        self.last_update = UpdateRecord(seconds, forwards, experts)
        self.log("train/loss", result.loss.mean(), prog_bar=True)
        self.log_dict({"train/lr": self.current_lr(), "train/sigma": sigma, "train/update_seconds": seconds,
                       "train/token_forwards_per_s": forwards / max(seconds, 1e-12),
                       "train/loss_spread": result.losses.double().std(1).mean()})
