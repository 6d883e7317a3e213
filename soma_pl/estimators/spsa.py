"""Central-difference SPSA gradient estimates for E experts, all ± evaluations batched.

Paper symbols and their names here:
    ε       ``SPSAConfig.eps``        perturbation step;
    n_pert  ``SPSAConfig.n_pert``     directions per micro-batch (Fig. 7: 64);
    B       ``batch.shape[1]``        effective batch, accumulated as ``B / micro_batch``
                                      micro-batches of ``SPSAConfig.micro_batch`` (64) windows, each
                                      with its own n_pert directions (Fig. 7 caption);
    N       ``E = batch.shape[0]``    experts, each estimated from its own loss (FSO) unless
                                      ``SPSAConfig.loss_grouping`` > 1 joins them (Fig. 11).

For expert e the estimate is ``ĝ_e = 1/(M·n_pert) Σ_{m,k} δ_ek · z_ek`` with
``δ_ek = (L(θ + ε z_k) − L(θ − ε z_k)) / 2ε`` on micro-batch m, where L is the expert's own loss or,
with grouping, the SUM of its group's losses. The sum (not the mean) keeps ``E[ĝ_e] = ∇L_e``: the
other experts' losses do not depend on θ_e, so grouping adds variance but no bias or rescaling.
Direction ``k`` of micro-batch ``m`` has direction index ``m·n_pert + k``.

The loss function sees weights with a leading group dimension ``G = E·2K`` laid out expert-major,
``[E, 2 (±), K]``, so that one call evaluates K directions of every expert.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from soma_pl.errors import require
from soma_pl.estimators.directions import DirectionKind, direction_keys, parameter_directions

LossFn = Callable[[Mapping[str, Tensor], Tensor], Tensor]
"""``loss_fn(params, tokens) -> [G]``: params name → ``[G, ...]``, tokens ``[G, b, T]``."""


@dataclass(frozen=True)
class SPSAConfig:
    """Settings of one SPSA estimate."""

    eps: float = 1e-3
    """ε: perturbation step."""
    n_pert: int = 64
    """n_pert: directions per micro-batch."""
    micro_batch: int = 64
    """Windows per micro-batch; the batch size B must be a multiple of it."""
    direction: DirectionKind = DirectionKind.sparse
    """Distribution of the direction entries: `sparse` is the paper's training probe (App. E;
    ``E[ĝ] = q ⊙ ∇L``, q = 1 on norm gains, ½ elsewhere), `rademacher` the theory's unbiased one."""
    loss_grouping: int = 1
    """Experts per joint loss: 1 = one loss per expert (SOMA's FSO); K > 1 = consecutive groups of
    K experts share the summed loss difference: one perturbation over the group's coordinates, one
    difference (the summed-loss arm of Fig. 4, App. J; the estimator study of Fig. 11)."""
    max_rows: int | None = None
    """Most windows one loss call may evaluate (``E · 2K · micro_batch`` for K directions). The
    directions are split into chunks to respect it, at least one direction per chunk; None: all
    n_pert at once. Besides bounding memory, on CPU chunks whose perturbed weights fit in the
    last-level cache run faster (d_t = 181: 8 directions per call ≈ 2× faster than 64)."""

    key: ClassVar[str] = "spsa"
    """Where these settings sit, for messages (`model.init_args.spsa` in a fit config)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "direction", DirectionKind(self.direction))  # a YAML gives the value
        require(math.isfinite(self.eps) and self.eps > 0, f"{self.key}.eps", self.eps, "a positive finite number")
        for name in ("n_pert", "micro_batch", "loss_grouping"):
            require(getattr(self, name) >= 1, f"{self.key}.{name}", getattr(self, name), ">= 1")
        require(self.max_rows is None or self.max_rows >= 1, f"{self.key}.max_rows", self.max_rows, ">= 1 (or null)")


@dataclass
class SPSAResult:
    """One SPSA estimate."""

    gradient: dict[str, Tensor]
    """Estimate ĝ, name → tensor shaped like the parameter ``[E, ...]``."""
    loss: Tensor
    """``[E]`` mean of L+ and L− over all directions and micro-batches."""
    projected: Tensor
    """``[E, M·n_pert]`` the δ that multiplied each direction (group sums when grouped)."""
    expert_projected: Tensor
    """``[E, M·n_pert]`` each expert's own δ; regroup it with :func:`group_sums`."""


def group_sums(values: Tensor, group_size: int) -> Tensor:
    """Give every expert the sum over its group of consecutive experts.

    Args:
        values: ``[E, K]`` per-expert loss differences; E must be a multiple of group_size.
        group_size: experts per joint loss.

    Returns:
        ``[E, K]``.
    """
    experts = values.shape[0]
    if experts % group_size:
        raise ValueError(f"{experts} experts cannot form groups of {group_size}")
    grouped = values.reshape(experts // group_size, group_size, -1).sum(1, keepdim=True)
    return grouped.expand(-1, group_size, -1).reshape(values.shape)


def chunk_size(config: SPSAConfig, experts: int) -> int:
    """Directions per loss call: all n_pert, or as many as ``max_rows`` windows allow (at least one)."""
    if config.max_rows is None:
        return config.n_pert
    per_direction = experts * 2 * config.micro_batch
    return max(1, min(config.n_pert, config.max_rows // per_direction))


def _index_chunks(indices: range, n_pert: int, chunk: int) -> Iterator[tuple[int, Tensor]]:
    """``(micro-batch m, direction indices)`` covering ``indices`` in order.

    Direction ``k`` of micro-batch ``m`` has index ``m·n_pert + k``; each micro-batch's directions
    are cut into chunks of ``chunk`` from its first index, so every subset of the indices is
    chunked (and its estimate accumulated) exactly as the whole range is.
    """
    for m in range(indices.start // n_pert, -(-indices.stop // n_pert)):
        for first in range(m * n_pert, (m + 1) * n_pert, chunk):
            low, high = max(first, indices.start), min(first + chunk, (m + 1) * n_pert, indices.stop)
            if low < high:
                yield m, torch.arange(low, high)


def _generate(
    params: Mapping[str, Tensor],
    kind: DirectionKind,
    seed: int,
    step: int,
    ids: Tensor,
    dirs: Tensor,
) -> dict[str, Tensor]:
    """Directions of experts ids ``[E]``, indices dirs ``[K]``: name → ``[E, K, *shape]``."""
    keys = direction_keys(seed, step, ids, dirs.to(ids.device))
    shapes = {name: param.shape[1:] for name, param in params.items()}
    return parameter_directions(kind, keys, shapes, next(iter(params.values())).dtype)


def _accumulate(gradient: dict[str, Tensor], coefficients: Tensor, z: Mapping[str, Tensor]) -> None:
    """``gradient[e] += Σ_k coefficients[e, k] · z[e, k]``. coefficients: ``[E, K]``."""
    for name, grad in gradient.items():
        flat = z[name].reshape(*coefficients.shape, -1)
        update = torch.bmm(coefficients.to(flat.dtype)[:, None, :], flat)
        grad += update.view(grad.shape)


def _evaluate_pairs(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    z: Mapping[str, Tensor],
    tokens: Tensor,
    eps: float | Tensor,
) -> tuple[Tensor, Tensor]:
    """Losses at θ ± ε·z for K directions of every expert in one call.

    Args:
        params: name → ``[E, ...]``; z: name → ``[E, K, ...]``; tokens: ``[E, b, T]``.
        eps: ε, one for all experts or ``[E]`` one per expert.

    Returns:
        ``(L+ − L−) / 2ε`` and ``(L+ + L−) / 2``, each ``[E, K]``.
    """
    experts, count = next(iter(z.values())).shape[:2]
    per_expert = torch.as_tensor(eps, dtype=torch.float64).expand(experts).to(tokens.device)
    perturbed = {}
    for name, param in params.items():
        both = param.new_empty(experts, 2, count, *param.shape[1:])
        if isinstance(eps, Tensor):
            step = per_expert.to(param.dtype).view(experts, *[1] * (param.dim()))
            torch.addcmul(param[:, None], z[name], step, out=both[:, 0])
            torch.addcmul(param[:, None], z[name], -step, out=both[:, 1])
        else:
            torch.add(param[:, None], z[name], alpha=eps, out=both[:, 0])
            torch.sub(param[:, None], z[name], alpha=eps, out=both[:, 1])
        perturbed[name] = both.view(experts * 2 * count, *param.shape[1:])
    window_shape = tokens.shape[1:]
    rows = tokens[:, None].expand(experts, 2 * count, *window_shape).reshape(-1, *window_shape)
    losses = loss_fn(perturbed, rows).view(experts, 2, count)
    scale = (2 * per_expert).to(losses.dtype)[:, None]
    return (losses[:, 0] - losses[:, 1]) / scale, losses.mean(1)


@torch.no_grad()
def spsa_estimate(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Tensor,
    config: SPSAConfig,
    step: int,
    seed: int,
    expert_ids: Tensor | None = None,
    expert_eps: Tensor | None = None,
) -> SPSAResult:
    """SPSA estimate of every expert's gradient from its (or its group's) loss differences.

    Args:
        loss_fn: ``(params [G, ...], tokens [G, b, T]) -> [G]`` losses.
        params: name → ``[E, ...]`` the perturbed (trainable) weights; frozen ones stay in loss_fn.
        batch: ``[E, B, T]`` each expert's windows.
        config: ε, n_pert, micro-batch, direction kind, grouping, chunking.
        step: update counter; seed: run seed (directions are regenerated from both).
        expert_ids: ``[E]`` global expert indices for the direction keys (default ``0..E-1``).
        expert_eps: ``[E]`` per-expert ε replacing ``config.eps`` (SOMA decays each expert's ε
            with its own learning rate).

    Returns:
        The estimate, per-expert losses and projected gradients.
    """
    experts = batch.shape[0]
    total = _micro_batches(batch, config) * config.n_pert
    ids = torch.arange(experts, device=batch.device) if expert_ids is None else expert_ids.to(batch.device)
    gradient = {name: torch.zeros_like(param) for name, param in params.items()}
    projected, own, losses = [], [], []
    for m, dirs in _index_chunks(range(total), config.n_pert, chunk_size(config, experts)):
        tokens = batch[:, m * config.micro_batch : (m + 1) * config.micro_batch]
        z = _generate(params, config.direction, seed, step, ids, dirs)
        eps = config.eps if expert_eps is None else expert_eps
        delta, mean_loss = _evaluate_pairs(loss_fn, params, z, tokens, eps)
        coefficients = group_sums(delta, config.loss_grouping)
        _accumulate(gradient, coefficients, z)
        projected.append(coefficients)
        own.append(delta)
        losses.append(mean_loss)
    for grad in gradient.values():
        grad /= total
    mean_loss = torch.cat(losses, 1).mean(1)
    return SPSAResult(gradient, mean_loss, torch.cat(projected, 1), torch.cat(own, 1))


def _micro_batches(batch: Tensor, config: SPSAConfig) -> int:
    micro_batches, leftover = divmod(batch.shape[1], config.micro_batch)
    if leftover or not micro_batches:
        raise ValueError(f"batch {batch.shape[1]} is not a multiple of micro_batch {config.micro_batch}")
    return micro_batches


@torch.no_grad()
def spsa_differences(
    loss_fn: LossFn,
    params: Mapping[str, Tensor],
    batch: Tensor,
    config: SPSAConfig,
    step: int,
    seed: int,
    indices: range,
) -> tuple[Tensor, Tensor]:
    """The loss differences δ of a subset of one step's directions, without assembling ĝ.

    Lets processes share one estimate: each evaluates its own direction indices, they exchange
    the δ's, and every process rebuilds the whole ĝ with :func:`assemble_estimate` (DDPP).

    Args:
        loss_fn, params, batch, config, step, seed: as in :func:`spsa_estimate` (the whole step's
            batch ``[E, B, T]``: direction ``m·n_pert + k`` reads micro-batch ``m``).
        indices: direction indices to evaluate, within ``0 .. (B / micro_batch)·n_pert − 1``.

    Returns:
        ``(δ, mean of L+ and L−)``, each ``[E, len(indices)]``, column j for index ``indices[j]``.
    """
    experts = batch.shape[0]
    total = _micro_batches(batch, config) * config.n_pert
    if indices.step != 1 or not 0 <= indices.start <= indices.stop <= total:
        raise ValueError(f"direction indices {indices} outside 0..{total - 1}")
    ids = torch.arange(experts, device=batch.device)
    empty = next(iter(params.values())).new_zeros(experts, 0)  # a rank may hold no directions
    deltas, losses = [empty], [empty]
    for m, dirs in _index_chunks(indices, config.n_pert, chunk_size(config, experts)):
        tokens = batch[:, m * config.micro_batch : (m + 1) * config.micro_batch]
        z = _generate(params, config.direction, seed, step, ids, dirs)
        delta, mean_loss = _evaluate_pairs(loss_fn, params, z, tokens, config.eps)
        deltas.append(delta)
        losses.append(mean_loss)
    return torch.cat(deltas, 1), torch.cat(losses, 1)


@torch.no_grad()
def assemble_estimate(
    params: Mapping[str, Tensor],
    projected: Tensor,
    config: SPSAConfig,
    step: int,
    seed: int,
    expert_ids: Tensor | None = None,
) -> dict[str, Tensor]:
    """Rebuild ``ĝ_e = mean_k projected[e, k] · z_ek`` by regenerating the directions.

    Lets an analysis regroup the same forward evaluations (Fig. 11): pass
    ``group_sums(result.expert_projected, K)`` to get the joint-loss estimate for groups of K.

    Args:
        params: name → ``[E, ...]`` (only shapes, dtypes and devices are read).
        projected: ``[E, M·n_pert]`` coefficients, direction index = column.
        config: the direction kind, n_pert and chunking of the original estimate; the estimate is
            accumulated chunk by chunk as :func:`spsa_estimate` does, so rebuilding from its own
            ``projected`` gives its gradient bit for bit.
        step, seed, expert_ids: as in :func:`spsa_estimate`.

    Returns:
        name → ``[E, ...]``.
    """
    total = projected.shape[1]
    gradient = estimate_sum(params, projected, config, step, seed, range(total), expert_ids)
    for grad in gradient.values():
        grad /= total
    return gradient


def estimate_sum(params: Mapping[str, Tensor], projected: Tensor, config: SPSAConfig, step: int, seed: int,
                 indices: range, expert_ids: Tensor | None = None) -> dict[str, Tensor]:
    """``Σ_{k ∈ indices} projected[e, k - indices.start] · z_ek``, accumulated chunk by chunk in index
    order as :func:`spsa_estimate` does (`_index_chunks`): name → ``[E, ...]``. A DDPP rank sums its
    own share of the directions this way (`soma_pl.lit.ddpp`)."""
    experts, device = projected.shape[0], projected.device
    ids = torch.arange(experts, device=device) if expert_ids is None else expert_ids.to(device)
    gradient = {name: torch.zeros_like(param) for name, param in params.items()}
    for _, dirs in _index_chunks(indices, config.n_pert, chunk_size(config, experts)):
        z = _generate(params, config.direction, seed, step, ids, dirs)
        _accumulate(gradient, projected[:, (dirs - indices.start).to(device)], z)
    return gradient
