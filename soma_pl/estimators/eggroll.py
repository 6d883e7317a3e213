"""EGGROLL: evolution strategies with low-rank Gaussian perturbations applied inside the matmul.

Paper symbols and their names here:
    σ   ``EGGROLLConfig.sigma``        perturbation scale of this update;
    σ₀  ``EGGROLLConfig.step_sigma``   the σ in the step's normalisation (default: σ);
    r   ``EGGROLLConfig.rank``         rank of each matrix perturbation;
    N   ``EGGROLLConfig.population``   members per update (the paper: 2²⁰);
    B   ``EGGROLLConfig.windows``      windows per update, ``N / group_size`` (the paper: 256).

Member ``m`` is sign ``s_m = +1`` (m even) or ``−1`` (m odd) of antithetic pair ``k = m // 2`` and
evaluates window ``m // group_size`` (a pair never straddles two windows). For a matrix ``W``
(``[out, in]``) pair k draws ``A_k [out, r]``, ``B_k [in, r]`` and the member runs with
``W + s_m σ/√r · A_k B_kᵀ``; for a vector it draws full Gaussian noise ``ε_k``. Write
``ε_m = s_m A_k B_kᵀ / √r`` (or ``s_m ε_k``): ``E[vec ε vec εᵀ] = I`` for every r.

Three steps, each a function:
    perturb   :func:`evaluate_population`  member losses ``L [E, N]``, chunk by chunk, the factors
              regenerated from ``(seed, step, expert, pair)``; the loss function applies them
              inside the matmul, so no member's full perturbation is ever formed;
    shape     :func:`shape_fitness`        ``φ [E, N]`` from L, as HyperscaleES's ``convert_fitnesses``;
    assemble  :func:`assemble_update`      ``ĝ = c Σ_m φ_m ε_m``, regenerating the factors.

φ is shaped *loss* and ĝ a descent direction for ``θ ← θ − lr·ĝ`` (EGGROLL maximises the fitness
``f = −φ``). The step convention sets c (:func:`step_scale`): ``reference`` (HyperscaleES and the
EGGROLL paper) ``c = σ₀/√N``, so SGD steps ``Δθ = +lr·σ₀/√N·Σ_m f_m ε_m`` exactly as the reference;
``mean_over_sigma`` ``c = 1/(Nσ₀)``, the Monte-Carlo estimate of the gradient, which with raw losses
(``FitnessShaping.none``) is unbiased for the gradient of a linear loss and on a quadratic has the
closed-form error :func:`lowrank_relative_error`. The two give the same step when
``lr_mean_over_sigma = lr_reference · σ₀²·√N``.

The EGGROLL authors' GRU language-model recipe (App. I.1, :mod:`soma_pl.models.gru`) replaces shape
and assemble by a vote: :func:`sign_test_step` moves a coordinate by a fixed step where the pairs'
signed votes pass a level-α z-test.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from enum import Enum
from statistics import NormalDist
from typing import ClassVar

import torch
from torch import Tensor

from soma_pl.errors import require
from soma_pl.estimators.directions import DirectionKind, direction_keys, directions_from_keys

_FITNESS_EPS = 1e-12
"""Floor of a fitness standard deviation (all-equal losses give zero fitness, not NaN)."""
REFERENCE_VARIANCE_EPS = 1e-5
"""Added to the population variance by HyperscaleES's group shaping (``jnp.var(raw_scores) + 1e-5``)."""


class FitnessShaping(str, Enum):
    """How member losses become fitness values (member names are what configs write)."""

    population = "population"
    """z-score over all N members of an expert, the std floored instead of the reference's +1e-5."""
    group = "group"
    """The reference's (the default): subtract each group's mean (removes its window's difficulty),
    divide by ``√(var + 1e-5)`` of the whole population's losses; with one group (``group_size =
    N``) it is the reference's ungrouped shaping. That spread is mostly how much the windows
    differ, so the fitness grows with σ (as does ``population``'s over several windows)."""
    group_own_std = "group_own_std"
    """z-score within each group by its own mean and std: to first order independent of σ."""
    none = "none"
    """Raw losses: under ``mean_over_sigma`` ĝ is an unbiased estimate of the (smoothed) gradient."""


class StepConvention(str, Enum):
    """What ĝ is scaled by (member names are what configs write); see :func:`step_scale`."""

    reference = "reference"
    """HyperscaleES / the EGGROLL paper: ``ĝ = σ₀/√N · Σ φ_m ε_m``, so SGD's step is
    ``Δθ = lr·σ₀/√N · Σ f_m ε_m`` with fitness ``f = −φ``; their learning rates transfer unchanged."""
    mean_over_sigma = "mean_over_sigma"
    """``ĝ = 1/(Nσ₀) · Σ φ_m ε_m``: the same step as ``reference`` at ``lr · σ₀²·√N``."""


@dataclass(frozen=True)
class EGGROLLConfig:
    """Settings of one EGGROLL update."""

    sigma: float = 1e-3
    """σ: perturbation scale."""
    rank: int = 1
    """r: rank of every matrix perturbation."""
    population: int = 2**20
    """N: members (both signs of N/2 antithetic pairs)."""
    group_size: int = 4096
    """Members that share one window; N / group_size windows per update."""
    fitness: FitnessShaping = FitnessShaping.group
    """Fitness shaping; `group` is the reference's (HyperscaleES `convert_fitnesses`)."""
    max_members: int | None = None
    """Most members one loss call evaluates (bounds memory); None: all N at once."""
    step_convention: StepConvention = StepConvention.reference
    """How ĝ is scaled: the reference's σ₀/√N or the Monte-Carlo 1/(Nσ₀)."""
    step_sigma: float | None = None
    """σ₀ of the step's scale; None: ``sigma``. A σ schedule moves ``sigma`` (the perturbations)
    only, so with a σ-free fitness the learning rate alone sets the step size."""

    key: ClassVar[str] = "eggroll"
    """Where these settings sit, for messages (`model.init_args.eggroll` in a fit config)."""

    def __post_init__(self) -> None:
        # A checkpoint's hyperparameters or a YAML give the enums as their values.
        object.__setattr__(self, "fitness", FitnessShaping(self.fitness))
        object.__setattr__(self, "step_convention", StepConvention(self.step_convention))
        key = self.key
        require(self.sigma > 0, f"{key}.sigma", self.sigma, "> 0")
        require(self.step_sigma is None or self.step_sigma > 0, f"{key}.step_sigma", self.step_sigma, "> 0 (or null)")
        require(self.rank >= 1, f"{key}.rank", self.rank, ">= 1")
        require(self.group_size >= 2 and self.group_size % 2 == 0, f"{key}.group_size", self.group_size,
                "even and >= 2 (antithetic pairs)")
        require(self.population % self.group_size == 0, f"{key}.population", self.population,
                f"a multiple of {key}.group_size={self.group_size}")
        require(self.max_members is None or self.max_members >= 2, f"{key}.max_members", self.max_members,
                ">= 2 (one antithetic pair; or null)")

    @property
    def windows(self) -> int:
        """B: windows per update."""
        return self.population // self.group_size

    @property
    def chunk(self) -> int:
        """Members per loss call: whole pairs, at most ``max_members``."""
        limit = self.population if self.max_members is None else min(self.max_members, self.population)
        return max(2, limit - limit % 2)


@dataclass
class MemberNoise:
    """The perturbations of M members of each of E experts, signed and scaled."""

    factors: dict[str, tuple[Tensor, Tensor]]
    """Matrices: name → ``(s σ/√r · A [E, M, *stack, out, r], B [E, M, *stack, in, r])``."""
    offsets: dict[str, Tensor]
    """Vectors: name → ``s σ ε [E, M, *shape]``."""


MemberLossFn = Callable[[MemberNoise, Tensor], Tensor]
"""``loss_fn(noise, tokens [E, M, b, T]) -> [E, M]``: each member's loss on its own windows."""


@dataclass
class EGGROLLResult:
    """One EGGROLL update direction."""

    gradient: dict[str, Tensor]
    """ĝ, name → tensor shaped like the parameter ``[E, ...]`` (scaled per ``step_convention``)."""
    loss: Tensor
    """``[E]`` mean member loss."""
    losses: Tensor
    """``[E, N]`` every member's loss."""
    fitness: Tensor
    """``[E, N]`` the shaped losses φ that weighted each member."""


def _coordinates(shape: torch.Size, low_rank: bool, rank: int) -> int:
    """Stream coordinates one pair needs for a parameter of per-expert ``shape``."""
    if not low_rank:
        return shape.numel()
    return shape[:-2].numel() * (shape[-2] + shape[-1]) * rank


def pair_noise(params: Mapping[str, Tensor], matrices: Collection[str], rank: int, seed: int, step: int,
               ids: Tensor, pairs: Tensor) -> dict[str, Tensor | tuple[Tensor, Tensor]]:
    """Unscaled noise of antithetic pairs, regenerated from ``(seed, step, expert, pair)``.

    Each pair owns one Gaussian stream; the parameters take consecutive coordinates of it (a
    matrix ``(out + in)·r`` per stacked matrix: A then B).

    Args:
        params: name → ``[E, ...]`` (shapes, dtypes and devices are read).
        matrices: names whose last two dims are ``(out, in)`` matrices (leading dims stack them).
        rank: r.
        ids: ``[E]`` expert indices; pairs: ``[K]`` pair indices.

    Returns:
        Matrices: name → ``(A [E, K, *stack, out, r], B [E, K, *stack, in, r])``; vectors: name →
        ``ε [E, K, *shape]``.
    """
    keys = direction_keys(seed, step, ids, pairs.to(ids.device))
    noise: dict[str, Tensor | tuple[Tensor, Tensor]] = {}
    offset = 0
    for name, param in params.items():
        shape, low_rank = param.shape[1:], name in matrices
        count = _coordinates(shape, low_rank, rank)
        flat = directions_from_keys(DirectionKind.gaussian, keys, offset, count, param.dtype)
        offset += count
        if low_rank:
            stacked = flat.view(*keys.shape, *shape[:-2], shape[-2] + shape[-1], rank)
            noise[name] = tuple(stacked.split([shape[-2], shape[-1]], dim=-2))
        else:
            noise[name] = flat.view(*keys.shape, *shape)
    return noise


def member_noise(noise: Mapping[str, Tensor | tuple[Tensor, Tensor]], sigma: float, rank: int) -> MemberNoise:
    """Both members of every pair: ``[E, K, ...]`` pair noise → ``[E, 2K, ...]``, (+, −) per pair."""

    def signed(x: Tensor, scale: float) -> Tensor:
        return torch.stack((x * scale, x * -scale), dim=2).flatten(1, 2)

    def repeated(x: Tensor) -> Tensor:
        return x.unsqueeze(2).expand(x.shape[0], x.shape[1], 2, *x.shape[2:]).flatten(1, 2)

    factors, offsets = {}, {}
    for name, value in noise.items():
        if isinstance(value, tuple):
            factors[name] = (signed(value[0], sigma / math.sqrt(rank)), repeated(value[1]))
        else:
            offsets[name] = signed(value, sigma)
    return MemberNoise(factors, offsets)


def _chunks(total: int, size: int, first: int = 0) -> Iterator[Tensor]:
    for start in range(first, total, size):
        yield torch.arange(start, min(start + size, total))


def member_chunks(config: EGGROLLConfig, members: range | None = None) -> Iterator[Tensor]:
    """Indices of the members one loss call evaluates, ``config.chunk`` at a time (whole pairs), over
    ``members`` (whole pairs; default all N)."""
    members = range(config.population) if members is None else members
    return _chunks(members.stop, config.chunk, members.start)


def chunk_noise(params: Mapping[str, Tensor], matrices: Collection[str], config: EGGROLLConfig, step: int,
                seed: int, ids: Tensor, members: Tensor) -> MemberNoise:
    """The perturbations of ``members`` (consecutive whole pairs), regenerated from their pairs' keys."""
    noise = pair_noise(params, matrices, config.rank, seed, step, ids, members[::2] // 2)
    return member_noise(noise, config.sigma, config.rank)


def evaluate_population(loss_fn: MemberLossFn, params: Mapping[str, Tensor], matrices: Collection[str],
                        batch: Tensor, config: EGGROLLConfig, step: int, seed: int, ids: Tensor) -> Tensor:
    """Step 1: every member's loss, ``config.chunk`` members per loss call.

    Args:
        batch: ``[E, B, T]`` windows; member m evaluates window ``m // group_size``.

    Returns:
        losses: ``[E, N]``.
    """
    losses = []
    for members in member_chunks(config):
        tokens = batch[:, (members // config.group_size).to(batch.device)].unsqueeze(2)
        losses.append(loss_fn(chunk_noise(params, matrices, config, step, seed, ids, members), tokens))
    return torch.cat(losses, dim=1)


def shape_fitness(losses: Tensor, config: EGGROLLConfig) -> Tensor:
    """Step 2: ``[E, N]`` losses → ``[E, N]`` shaped losses φ (float64), as ``config.fitness`` says.

    ``group`` is HyperscaleES's ``convert_fitnesses``: ``(L − mean of L's group) / √(var(L) + 1e-5)``
    with the (biased) variance over all N members; shaping ``−L`` instead gives exactly ``−φ``.
    """
    values = losses.double()
    if config.fitness == FitnessShaping.none:
        return values
    if config.fitness == FitnessShaping.population:
        spread = values.std(-1, unbiased=False, keepdim=True).clamp_min(_FITNESS_EPS)
        return (values - values.mean(-1, keepdim=True)) / spread
    groups = values.view(values.shape[0], config.windows, config.group_size)
    centred = groups - groups.mean(-1, keepdim=True)
    if config.fitness == FitnessShaping.group_own_std:
        spread = groups.std(-1, unbiased=False, keepdim=True).clamp_min(_FITNESS_EPS)
    else:
        spread = (values.var(-1, unbiased=False, keepdim=True) + REFERENCE_VARIANCE_EPS).sqrt().unsqueeze(-1)
    return (centred / spread).view(losses.shape)


def step_scale(config: EGGROLLConfig) -> float:
    """c in ``ĝ = c Σ_m φ_m ε_m``: ``σ₀/√N`` (``reference``) or ``1/(Nσ₀)`` (``mean_over_sigma``).

    σ₀ is ``config.step_sigma`` (default ``config.sigma``). Their ratio is ``1/(σ₀²√N)``, so
    ``lr_mean_over_sigma = lr_reference · σ₀²·√N`` gives the same step.
    """
    sigma = config.sigma if config.step_sigma is None else config.step_sigma
    if config.step_convention == StepConvention.reference:
        return sigma / math.sqrt(config.population)
    return 1.0 / (config.population * sigma)


@torch.no_grad()
def assemble_update(params: Mapping[str, Tensor], matrices: Collection[str], fitness: Tensor,
                    config: EGGROLLConfig, step: int, seed: int, ids: Tensor) -> dict[str, Tensor]:
    """Step 3: ``ĝ = c Σ_m φ_m ε_m`` with c from :func:`step_scale`, regenerating each pair's noise.

    A pair contributes ``c_k = c (φ_{2k} − φ_{2k+1})`` times its noise (:func:`pair_sum`).

    Args:
        fitness: ``[E, N]`` shaped losses φ.

    Returns:
        name → ``[E, ...]`` shaped like each parameter.
    """
    coefficients = (fitness[:, 0::2] - fitness[:, 1::2]) * step_scale(config)
    return pair_sum(params, matrices, coefficients, config, step, seed, ids)


@torch.no_grad()
def pair_sum(params: Mapping[str, Tensor], matrices: Collection[str], coefficients: Tensor,
             config: EGGROLLConfig, step: int, seed: int, ids: Tensor) -> dict[str, Tensor]:
    """``Σ_k c_k ε_k`` over the antithetic pairs, ε_k pair k's unscaled noise (``A_k B_kᵀ/√r`` for a
    matrix, the Gaussian ε_k for a vector), regenerated ``config.chunk // 2`` pairs at a time; for a
    matrix a chunk's sum is one GEMM over its ``K·r`` columns.

    Args:
        coefficients: ``[E, N/2]`` c_k.

    Returns:
        name → ``[E, ...]`` shaped like each parameter.
    """
    gradient = {name: torch.zeros_like(param) for name, param in params.items()}
    for pairs in _chunks(config.population // 2, config.chunk // 2):
        noise = pair_noise(params, matrices, config.rank, seed, step, ids, pairs)
        weights = coefficients[:, pairs.to(coefficients.device)]
        for name, grad in gradient.items():
            value = noise[name]
            if isinstance(value, tuple):
                grad += _weighted_outer_sum(weights.to(grad.dtype), *value) / math.sqrt(config.rank)
            else:
                flat = value.flatten(2)
                grad += torch.bmm(weights.to(grad.dtype)[:, None, :], flat).view(grad.shape)
    return gradient


def vote_threshold(alpha: float, pairs: int) -> float:
    """``Φ⁻¹(1 − α/2)·√K``: the two-sided level-α bound of a sum of K independent ±1-weighted
    unit-variance noise coordinates (:func:`sign_test_step`)."""
    return NormalDist().inv_cdf(1 - alpha / 2) * math.sqrt(pairs)


@torch.no_grad()
def sign_test_step(params: Mapping[str, Tensor], matrices: Collection[str], losses: Tensor, alpha: float,
                   config: EGGROLLConfig, step: int, seed: int, ids: Tensor) -> dict[str, Tensor]:
    """The EGGROLL reference's GRU update (nano-egg's ``fast_fitness`` with ``use_clt``), in FP32.

    Each antithetic pair votes ``f_k = sign(L_{2k+1} − L_{2k})``: +1 when its + member's loss is the
    lower. ``Z = Σ_k f_k ε_k`` (:func:`pair_sum`); with no signal each coordinate of Z has mean 0
    and variance K, so a coordinate moves only where ``|Z| ≥ Φ⁻¹(1 − α/2)·√K`` (a level-α z-test of
    the votes, :func:`vote_threshold`), by one fixed step in Z's sign.

    Args:
        losses: ``[E, N]`` member losses.
        alpha: the test's level α (the paper's reproduction: 0.01).

    Returns:
        name → ``−sign(Z)·[|Z| ≥ threshold]`` shaped like each parameter: a descent direction, so
        ``θ ← θ − lr·g`` (SGD at lr = the step size, the reference's ``float_at_step``) moves each
        passing coordinate by the step towards the winning members.
    """
    votes = torch.sign(losses[:, 1::2] - losses[:, 0::2]).to(torch.float64)
    threshold = vote_threshold(alpha, config.population // 2)
    return {name: -torch.sign(z) * (z.abs() >= threshold)
            for name, z in pair_sum(params, matrices, votes, config, step, seed, ids).items()}


def _weighted_outer_sum(weights: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """``Σ_k w_k A_k B_kᵀ``. weights ``[E, K]``; a ``[E, K, *stack, out, r]``; b ``[E, K, *stack, in, r]``."""
    scaled = a * weights.view(*weights.shape, *[1] * (a.dim() - 2))
    # K and r together form the inner dimension of one matmul per expert (and stacked matrix).
    left = scaled.movedim(1, -2).flatten(-2)
    right = b.movedim(1, -2).flatten(-2)
    return left @ right.transpose(-1, -2)


@torch.no_grad()
def eggroll_estimate(loss_fn: MemberLossFn, params: Mapping[str, Tensor], matrices: Collection[str],
                     batch: Tensor, config: EGGROLLConfig, step: int, seed: int,
                     expert_ids: Tensor | None = None) -> EGGROLLResult:
    """One EGGROLL update direction for every expert: perturb and evaluate, shape, assemble.

    Args:
        loss_fn: ``(MemberNoise, tokens [E, M, b, T]) -> [E, M]`` member losses.
        params: name → ``[E, ...]`` the perturbed weights.
        matrices: names perturbed by rank-r factors; every other parameter gets full noise.
        batch: ``[E, B, T]`` with ``B = population / group_size``.
        config: σ, r, N, group size, shaping, chunking, step convention and σ₀.
        step, seed: regenerate the noise; expert_ids: ``[E]`` global expert indices (default 0..E-1).

    Returns:
        The update direction, the member losses and their fitness.
    """
    experts, windows = batch.shape[:2]
    if windows != config.windows:
        raise ValueError(f"batch of {windows} windows; population {config.population} in groups of "
                         f"{config.group_size} needs {config.windows}")
    device = batch.device
    ids = torch.arange(experts, device=device) if expert_ids is None else expert_ids.to(device)
    losses = evaluate_population(loss_fn, params, matrices, batch, config, step, seed, ids)
    fitness = shape_fitness(losses, config)
    gradient = assemble_update(params, matrices, fitness, config, step, seed, ids)
    return EGGROLLResult(gradient, losses.mean(1), losses, fitness)


def lowrank_relative_error(rows: int, cols: int, rank: int, pairs: int) -> float:
    """Closed-form ``E‖ĝ − g‖² / ‖g‖²`` of ĝ from raw losses on a quadratic in one ``rows × cols`` matrix.

    ĝ is the ``mean_over_sigma`` estimate here (the ``reference`` one is it times ``σ₀²·√N``).

    The antithetic difference of a quadratic is exactly ``2σ⟨g, ε⟩``, so over K pairs
    ``E‖ĝ − g‖² = (E[⟨g, ε⟩² ‖ε‖²] − ‖g‖²) / K``. With ``ε = Σ_p a_p b_pᵀ / √r`` only index pairings
    survive the expectation: r terms ``E[⟨g, abᵀ⟩² ‖a‖²‖b‖²] = (m + 2)(n + 2)‖g‖²`` and
    ``r(r − 1)`` terms ``(mn + 2)‖g‖²``, divided by r². Hence ``(mn + 1 + 2(m + n + 1)/r) / K``:
    full-rank Gaussian ES's ``(d + 1)/K`` plus an excess that falls as 1/r.
    """
    return (rows * cols + 1 + 2 * (rows + cols + 1) / rank) / pairs
