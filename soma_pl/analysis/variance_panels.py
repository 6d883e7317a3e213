"""The three measurements of `analyze variance`, each with its closed-form prediction (Figs. 10, 11).

- :func:`experts_panel` (Fig. 10 left): N experts at about equal total size, one loss each.
- :func:`n_pert_panel` (Fig. 10 right, Fig. 11 left): fixed windows, n_pert and loss grouping varied
  on the same forward evaluations, against the exact gradient on those windows.
- :func:`batch_panel` (Fig. 11 right): a few probed coordinates per expert, batches drawn from a
  fixed pool at a fixed ``n_pert · B``, against the pool-mean gradient.

Predictions use the recorded direction distribution and the measured gradient norms (and, for the
batch panel, the measured per-window gradient spread); nothing is fitted. Sparse probes (the paper's
training probe) have mean ``q ⊙ g``, so their estimates are measured around it and predicted by App.
G.1's centered-variance formula; dense directions are measured around g itself (q = 1).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from soma_pl.analysis.gradient_error import (
    ProbedLoss,
    central_difference_deviation,
    draw_errors,
    exact_gradient,
    mean_with_error,
    per_window_gradients,
    ratio_with_error,
)
from soma_pl.estimators.directions import DirectionKind, coordinate_activity
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.estimators.theory import (
    batch_noise_relative_error,
    grouped_relative_error,
    sampled_batch_variance,
    sparse_batch_noise_relative_error,
    sparse_relative_variance,
)
from soma_pl.models.stacked import HeadMode, StackedExperts

CENTRAL_DIFFERENCE_DIRECTIONS = 4
"""Directions on which the central differences are compared with autograd's ``zᵀg``."""


@dataclass(frozen=True)
class Measurement:
    """What every panel shares: the estimator settings and the number of independent draws."""

    config: SPSAConfig
    repeats: int
    seed: int
    drawn: Callable[[], None] = field(default=lambda: None, compare=False)
    """Called after each draw of directions (a progress bar's update)."""

    @property
    def kind(self) -> DirectionKind:
        return self.config.direction

    def activity(self, params: dict[str, Tensor]) -> Tensor:
        """``[D]`` each perturbed coordinate's ``q = E z²``: the estimator's mean is ``q ⊙ g``."""
        return coordinate_activity(self.kind, {name: p.shape[1:] for name, p in params.items()})

    def predicted(self, reference: Tensor, activity: Tensor, group_size: int, n_pert: int) -> float:
        """Closed-form relative error for the gradient ``reference [E, D]`` (App. G.1 for sparse probes)."""
        if self.kind is DirectionKind.sparse:
            return sparse_relative_variance(reference.pow(2), activity, group_size, n_pert)
        return grouped_relative_error(self.kind, reference.pow(2).sum(1), reference.shape[1], group_size, n_pert)

    def predicted_with_batches(self, reference: Tensor, variances: Tensor, activity: Tensor, group_size: int,
                               n_pert: int) -> float:
        """The same on random batches: reference ``[E, D]`` the pool mean, variances ``[E, D]`` per coordinate."""
        if self.kind is DirectionKind.sparse:
            return sparse_batch_noise_relative_error(reference.pow(2), variances, activity, group_size, n_pert)
        return batch_noise_relative_error(self.kind, reference.pow(2).sum(1), variances.sum(1), reference.shape[1],
                                          group_size, n_pert)


def expert_tokens(windows: Tensor, experts: int, per_expert: int, context: int) -> Tensor:
    """Give each expert its own windows: `windows [n, 1025]` → `[E, per_expert, context + 1]`."""
    needed = experts * per_expert
    return windows[:needed, : context + 1].reshape(experts, per_expert, context + 1)


def perturbed_weights(model: StackedExperts) -> dict[str, Tensor]:
    """The experts' perturbed weights (name → `[E, ...]`), detached: what an estimate perturbs."""
    return {name: param.detach() for name, param in model.expert_parameters().items()}


def _draws(loss_fn, params, tokens, reference, n_perts, groupings, measurement: Measurement) -> Tensor:
    """``[R, len(n_perts), len(groupings)]`` relative errors of R independent draws around ``q ⊙ g``."""
    total = reference.pow(2).sum()
    mean = reference * measurement.activity(params)
    rows = []
    for r in range(measurement.repeats):
        rows.append(draw_errors(loss_fn, params, tokens, mean, n_perts, groupings, measurement.config,
                                step=r, seed=measurement.seed))
        measurement.drawn()
    return torch.stack(rows).sum(-1) / total


def _point(values: Tensor, predicted: float, **keys) -> dict:
    stats = mean_with_error(values)
    return {**keys, "relative_error": stats.mean, "stderr": stats.stderr, "predicted": predicted}


def body_params(width: int, embed_dim: int = 32, num_layers: int = 2) -> int:
    """Parameters of one expert body (App. C, Table 2): ``16D·d_t² + (2D+1)·d_t``, plus ``2·d_E·d_t``
    projections when ``d_t ≠ d_E`` (``32·d_t² + 5·d_t`` for the paper's D = 2 blocks)."""
    projections = 2 * embed_dim * width if width != embed_dim else 0
    return 16 * num_layers * width**2 + (2 * num_layers + 1) * width + projections


def width_for_total(total_params: int, experts: int, embed_dim: int = 32, num_layers: int = 2) -> int:
    """Body width whose N bodies come nearest to `total_params` (a shared head is not counted)."""
    def distance(width: int) -> int:
        return abs(experts * body_params(width, embed_dim, num_layers) - total_params)

    return min(range(1, 4097), key=distance)


def experts_panel(windows: Tensor, expert_counts: Sequence[int], total_params: int, per_expert: int,
                  context: int, n_pert: int, measurement: Measurement) -> dict:
    """Fig. 10 left: relative error against N at about equal total size (random-init bodies).

    Each N has a shared frozen head (as the paper's N = 256) and bodies of the width that brings
    the N bodies nearest to `total_params`; every expert scores its own windows.
    """
    points = []
    for count in expert_counts:
        width = width_for_total(total_params, count)
        with torch.random.fork_rng():
            torch.manual_seed(measurement.seed + count)
            model = StackedExperts(count, width, head=HeadMode.shared, dtype=torch.float64).requires_grad_(False)
        tokens = expert_tokens(windows, count, per_expert, context)
        params = perturbed_weights(model)
        reference = exact_gradient(model.loss_per_group, params, tokens)
        relative = _draws(model.loss_per_group, params, tokens, reference, [n_pert], [1], measurement)[:, 0, 0]
        dim = reference.shape[1]
        predicted = measurement.predicted(reference, measurement.activity(params), 1, n_pert)
        points.append(_point(relative, predicted, num_experts=count, width=width, params_per_expert=dim,
                             ensemble_params=dim * count))
    return {"n_pert": n_pert, "windows_per_expert": per_expert, "total_params_target": total_params,
            "head": "shared, frozen (not perturbed)", "points": points}


def _doubling(relative: Tensor, n_perts: Sequence[int], grouping_index: int) -> list[dict]:
    """Error at n_pert over error at 2·n_pert, for every such pair in the sweep (paired draws)."""
    out = []
    for i, n in enumerate(n_perts):
        if 2 * n in n_perts:
            stats = ratio_with_error(relative[:, i, grouping_index], relative[:, n_perts.index(2 * n), grouping_index])
            out.append({"n_pert": n, "ratio": stats.mean, "stderr": stats.stderr, "predicted": 2 * n / n})
    return out


def n_pert_panel(model: StackedExperts, tokens: Tensor, n_perts: Sequence[int], groupings: Sequence[int],
                 measurement: Measurement) -> dict:
    """Fig. 10 right and Fig. 11 left: error against n_pert for each loss grouping, same evaluations.

    Args:
        model: E experts at fixed weights; tokens: ``[E, B, T]`` each expert's windows.
    """
    n_perts, groupings = sorted(n_perts), list(groupings)
    params = perturbed_weights(model)
    reference = exact_gradient(model.loss_per_group, params, tokens)
    norms, dim, activity = reference.pow(2).sum(1), reference.shape[1], measurement.activity(params)
    relative = _draws(model.loss_per_group, params, tokens, reference, n_perts, groupings, measurement)
    curves = [{"loss_grouping": k, "points": [
        _point(relative[:, i, j], measurement.predicted(reference, activity, k, n), n_pert=n)
        for i, n in enumerate(n_perts)]} for j, k in enumerate(groupings)]
    check = replace(measurement.config, n_pert=CENTRAL_DIFFERENCE_DIRECTIONS, micro_batch=tokens.shape[1])
    probe = spsa_estimate(model.loss_per_group, params, tokens, check, step=0, seed=measurement.seed)
    panel = {"num_experts": model.num_experts, "width": model.width, "params_per_expert": dim,
             "windows_per_expert": tokens.shape[1], "grad_sq_norms": norms.tolist(), "curves": curves,
             "doubling": _doubling(relative, n_perts, groupings.index(1)) if 1 in groupings else [],
             "central_difference_deviation": central_difference_deviation(
                 probe.expert_projected, reference, {name: p.shape[1:] for name, p in params.items()}, check, 0,
                 measurement.seed)}
    joint = max(groupings)
    if 1 in groupings and joint > 1:
        stats = ratio_with_error(relative[:, -1, groupings.index(joint)], relative[:, -1, groupings.index(1)])
        predicted = (measurement.predicted(reference, activity, joint, 1)
                     / measurement.predicted(reference, activity, 1, 1))
        panel["joint_vs_separate"] = {"loss_grouping": joint, "n_pert": n_perts[-1], "ratio": stats.mean,
                                      "stderr": stats.stderr, "predicted": predicted}
    return panel


def probe_coordinates(model: StackedExperts, count: int, seed: int) -> Tensor:
    """``[E, count]`` distinct random flat coordinates of each expert's parameter vector."""
    dim = sum(shape.numel() for shape in model.expert_param_shapes().values())
    if count > dim:
        raise ValueError(f"{count} probed coordinates > {dim} parameters per expert")
    generator = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(dim, generator=generator)[:count] for _ in range(model.num_experts)])


def pool_batches(pool: int, batch: int, draws: int, generator: torch.Generator) -> list[Tensor]:
    """`draws` batches of `batch` distinct pool indices, each a uniform draw without replacement.

    Consecutive draws split random permutations of the pool (stratified passes), so a few draws
    already cover the pool evenly; the mean over draws stays unbiased and the standard error
    computed as for independent draws is, if anything, conservative.
    """
    out: list[Tensor] = []
    while len(out) < draws:
        order = torch.randperm(pool, generator=generator)
        out.extend(order[i * batch : (i + 1) * batch] for i in range(pool // batch))
    return out[:draws]


def _pool_statistics(per_window: Tensor) -> tuple[Tensor, Tensor]:
    """`per_window [E, P, m]` → pool-mean gradient ``[E, m]`` and window variance σ² ``[E, m]`` of each
    coordinate (summed over coordinates, the σ_e² of the theory)."""
    mean = per_window.mean(1)
    return mean, (per_window - mean[:, None]).pow(2).mean(1)


def batch_panel(model: StackedExperts, pool: Tensor, coordinates: int, budget: int, batch_sizes: Sequence[int],
                groupings: Sequence[int], measurement: Measurement) -> dict:
    """Fig. 11 right: error against B at fixed ``n_pert · B`` against the pool-mean gradient.

    Args:
        model: E experts at fixed weights.
        pool: ``[P, T]`` windows shared by all experts; each draw picks B of them without
            replacement (the same B for every expert) and fresh directions.
        coordinates: probed coordinates per expert (the paper: 128).
        budget: ``n_pert · B`` (each B must divide it).
    """
    experts, windows = model.num_experts, pool.shape[0]
    loss_fn = ProbedLoss(model, probe_coordinates(model, coordinates, measurement.seed))
    params = loss_fn.probe()
    reference, window_variance = _pool_statistics(
        per_window_gradients(loss_fn, params, pool.expand(experts, *pool.shape)))
    norms, activity = reference.pow(2).sum(1), measurement.activity(params)
    generator = torch.Generator().manual_seed(measurement.seed)
    curves = {k: [] for k in groupings}
    for index, batch in enumerate(batch_sizes):
        n_pert = budget // batch
        rows = []
        for r, picks in enumerate(pool_batches(windows, batch, measurement.repeats, generator)):
            tokens = pool[picks].expand(experts, batch, pool.shape[1])
            rows.append(draw_errors(loss_fn, params, tokens, reference * activity, [n_pert], groupings,
                                    measurement.config, step=index * measurement.repeats + r,
                                    seed=measurement.seed + 1)[0])
            measurement.drawn()
        relative = torch.stack(rows).sum(-1) / norms.sum()  # [R, groupings]
        variance = sampled_batch_variance(window_variance, batch, windows)
        for j, k in enumerate(groupings):
            predicted = measurement.predicted_with_batches(reference, variance, activity, k, n_pert)
            curves[k].append(_point(relative[:, j], predicted, batch=batch, n_pert=n_pert))
    return {"num_experts": experts, "pool_windows": windows, "probe_coordinates": coordinates,
            "budget": budget, "nu": float(window_variance.sum() / norms.sum()),
            "curves": [{"loss_grouping": k, "points": points} for k, points in curves.items()]}
