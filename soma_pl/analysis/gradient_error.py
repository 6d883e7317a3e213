"""Measuring ``E‖ĝ − g‖²`` of SPSA estimates at fixed weights against an exact autograd gradient.

One draw is one :func:`spsa_estimate` with the largest ``n_pert`` of a sweep; the smaller ``n_pert``
use its first directions, and every loss grouping regroups the same per-expert loss differences
(``group_sums``, then the estimate rebuilt from regenerated directions as ``assemble_estimate``
does), so all points of a draw share one set of forward
evaluations. Errors are kept per expert; a relative error is ``Σ_e ‖ĝ_e − g_e‖² / Σ_e ‖g_e‖²``, or for
sparse probes, whose mean is ``q ⊙ g``, ``Σ_e ‖ĝ_e − q ⊙ g_e‖² / Σ_e ‖g_e‖²`` (App. G.1's centered variance).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace

import torch
from torch import Tensor

from soma_pl.estimators.directions import DirectionKind, flat_directions
from soma_pl.estimators.spsa import LossFn, SPSAConfig, group_sums, spsa_estimate
from soma_pl.models.stacked import StackedExperts


@dataclass(frozen=True)
class MeanWithError:
    """A mean over independent draws and its standard error."""

    mean: float
    stderr: float


def mean_with_error(values: Tensor) -> MeanWithError:
    """Mean and standard error of `values: [R]` (R ≥ 2 independent draws)."""
    values = values.double()
    return MeanWithError(float(values.mean()), float(values.std() / values.numel() ** 0.5))


def ratio_with_error(numerator: Tensor, denominator: Tensor) -> MeanWithError:
    """``mean(a) / mean(b)`` of paired draws `[R]`, its standard error by the delta method."""
    a, b = numerator.double(), denominator.double()
    ratio = float(a.mean() / b.mean())
    stacked = torch.stack((a / a.mean(), b / b.mean()))
    covariance = torch.cov(stacked) / a.numel()
    relative_variance = covariance[0, 0] + covariance[1, 1] - 2 * covariance[0, 1]
    return MeanWithError(ratio, ratio * float(relative_variance.clamp_min(0).sqrt()))


def flatten(tensors: Mapping[str, Tensor]) -> Tensor:
    """name → ``[E, ...]`` into each expert's flat vector ``[E, D]`` (dict order, as the directions)."""
    return torch.cat([t.reshape(t.shape[0], -1) for t in tensors.values()], dim=1)


def exact_gradient(loss_fn: LossFn, params: Mapping[str, Tensor], tokens: Tensor) -> Tensor:
    """Autograd gradient of every expert's own loss at `params`.

    Args:
        loss_fn: ``(params [E, ...], tokens [E, b, T]) -> [E]`` as for :func:`spsa_estimate`.
        params: name → ``[E, ...]``; tokens: ``[E, b, T]``.

    Returns:
        ``[E, D]``: expert e's loss depends only on its own weights, so the gradient of the sum
        is each expert's own gradient.
    """
    leaves = {name: param.detach().clone().requires_grad_(True) for name, param in params.items()}
    with torch.enable_grad():
        grads = torch.autograd.grad(loss_fn(leaves, tokens).sum(), list(leaves.values()))
    return flatten(dict(zip(leaves, grads, strict=False)))


DIRECTION_CHUNK_ELEMENTS = 1 << 24
"""Most direction entries generated at once when estimates are rebuilt (128 MiB in float64)."""


def regrouped_estimates(projected: Tensor, n_perts: Sequence[int], groupings: Sequence[int], kind: DirectionKind,
                        step: int, seed: int, shapes: Mapping[str, torch.Size]) -> Tensor:
    """Every (n_pert, grouping) estimate of one draw from its per-expert loss differences.

    Equals ``assemble_estimate(params, group_sums(projected[:, :n], k), ...)`` for each pair, but
    regenerates each direction once for all pairs (one batched matmul per chunk of directions).

    Args:
        projected: ``[E, K]`` each expert's own δ for directions ``0..K-1`` (``K ≥ max(n_perts)``).
        n_perts, groupings: the estimates to build.
        shapes: name → per-expert shape of the perturbed parameters (D in all), in flat order.

    Returns:
        ``[E, len(n_perts)·len(groupings), D]`` estimates, n_pert-major.
    """
    experts, largest = projected.shape[0], max(n_perts)
    columns = []
    for n_pert in n_perts:
        for grouping in groupings:
            column = projected.new_zeros(experts, largest)
            column[:, :n_pert] = group_sums(projected[:, :n_pert], grouping) / n_pert
            columns.append(column)
    coefficients = torch.stack(columns, dim=1)  # [E, S, K]
    dim = sum(torch.Size(shape).numel() for shape in shapes.values())
    estimates = projected.new_zeros(experts, len(columns), dim)
    chunk = max(1, DIRECTION_CHUNK_ELEMENTS // (experts * dim))
    ids = torch.arange(experts, device=projected.device)
    for first in range(0, largest, chunk):
        dirs = torch.arange(first, min(first + chunk, largest), device=projected.device)
        z = flat_directions(kind, seed, step, ids, dirs, shapes, projected.dtype)  # [E, c, D]
        estimates.baddbmm_(coefficients[:, :, first : first + len(dirs)], z)
    return estimates


def draw_errors(loss_fn: LossFn, params: Mapping[str, Tensor], tokens: Tensor, reference: Tensor,
                n_perts: Sequence[int], groupings: Sequence[int], config: SPSAConfig, step: int,
                seed: int) -> Tensor:
    """Squared errors of one draw of directions for every n_pert and grouping.

    Args:
        tokens: ``[E, B, T]``, one micro-batch per expert; reference: ``[E, D]`` what ĝ is compared
            with (the estimator's mean ``q ⊙ g``: g itself for dense directions).
        n_perts: directions used (prefixes of one draw of ``max(n_perts)``).
        groupings: experts per joint loss (each must divide E).
        config: ε, direction kind and chunking; its n_pert and micro_batch are set here.
        step, seed: the draw's direction keys.

    Returns:
        ``[len(n_perts), len(groupings), E]`` values of ``‖ĝ_e − g_e‖²``.
    """
    config = replace(config, n_pert=max(n_perts), micro_batch=tokens.shape[1], loss_grouping=1)
    result = spsa_estimate(loss_fn, params, tokens, config, step=step, seed=seed)
    shapes = {name: param.shape[1:] for name, param in params.items()}
    estimates = regrouped_estimates(result.expert_projected, n_perts, groupings, config.direction, step, seed, shapes)
    errors = (estimates - reference[:, None]).pow(2).sum(2)  # [E, S]
    return errors.T.reshape(len(n_perts), len(groupings), -1)


def central_difference_deviation(result_projected: Tensor, reference: Tensor, shapes: Mapping[str, torch.Size],
                                 config: SPSAConfig, step: int, seed: int) -> float:
    """How far the central differences are from the directional derivatives ``zᵀg``.

    Args:
        result_projected: ``[E, K]`` each expert's own ``δ`` for directions ``0..K-1`` of `step`.
        reference: ``[E, D]`` the exact gradient.
        shapes: name → per-expert shape of the perturbed parameters, in flat order.

    Returns:
        ``max |δ − zᵀg| / rms(zᵀg)``: O(ε²) for a smooth loss, the premise of the predictions.
    """
    experts, count = result_projected.shape
    z = flat_directions(config.direction, seed, step, torch.arange(experts), torch.arange(count), shapes,
                        reference.dtype)
    derivative = torch.einsum("ekd,ed->ek", z, reference)
    return float((result_projected - derivative).abs().max() / derivative.pow(2).mean().sqrt())


class ProbedLoss:
    """The experts' loss as a function of offsets to a few chosen coordinates of each expert.

    Perturbing only ``m`` coordinates per expert (Fig. 11 right: 128) makes the estimator's own
    variance small enough for batch noise to show. The loss API is the one of
    :func:`spsa_estimate` with a single parameter ``probe: [G, m]``.

    Args:
        model: the experts (all their weights stay fixed except the probed coordinates).
        coordinates: ``[E, m]`` flat indices into each expert's parameter vector.
    """

    def __init__(self, model: StackedExperts, coordinates: Tensor):
        self.model = model
        self.coordinates = coordinates
        self.base = model.flatten_experts()  # [E, D]
        self.shapes = model.expert_param_shapes()

    def probe(self) -> dict[str, Tensor]:
        """Zero offsets ``{"probe": [E, m]}`` (the fixed weights themselves)."""
        return {"probe": self.base.new_zeros(self.coordinates.shape)}

    def __call__(self, params: Mapping[str, Tensor], tokens: Tensor) -> Tensor:
        """params ``{"probe": [G, m]}``, tokens ``[G, b, T]`` → ``[G]`` (groups expert-major)."""
        offsets = params["probe"]
        copies = offsets.shape[0] // self.base.shape[0]
        flat = self.base.repeat_interleave(copies, 0)
        index = self.coordinates.repeat_interleave(copies, 0)
        flat = flat.scatter_add(1, index, offsets)
        named, start = {}, 0
        for name, shape in self.shapes.items():
            size = shape.numel()
            named[name] = flat[:, start : start + size].view(-1, *shape)
            start += size
        return self.model.loss_per_group(named, tokens)


def per_window_gradients(loss_fn: LossFn, params: Mapping[str, Tensor], pool: Tensor) -> Tensor:
    """Each expert's gradient on each pool window, in one backward pass.

    Args:
        params: name → ``[E, ...]``; pool: ``[E, P, T]`` each expert's pool windows.

    Returns:
        ``[E, P, D]``: window p's gradient is taken through its own copy of the weights.
    """
    experts, windows = pool.shape[:2]
    copies = {name: param.repeat_interleave(windows, 0) for name, param in params.items()}
    per_window = exact_gradient(loss_fn, copies, pool.reshape(experts * windows, 1, -1))
    return per_window.view(experts, windows, -1)
