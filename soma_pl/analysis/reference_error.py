"""Fig. 5 and Table 8: the total error of zero-order estimates against a BPTT reference gradient,
beside the cost of a global step (§7, App. K).

For expert e, ``g_ref`` is the autograd gradient of its own loss on a large reference batch and ĝ
its zero-order estimate on a batch of B windows drawn from a separate pool; the relative error
``R = Σₑ E‖ĝₑ − g_ref,e‖² / Σₑ ‖g_ref,e‖²`` (Eq. 5) averages over drawn batches and directions, so it
holds batch variation, direction variation and the sparse probes' bias (their mean is ``q ⊙ g``).
Three curves: N experts at about equal total size at the base (n_pert, B), and the N = 1 model at
larger n_pert or larger B. Each point's cost is the multiply-adds of one global step (2·n_pert·B·T
byte forwards per expert) and its measured seconds (one thread, the median over draws; DDPP's
spreading of one estimate over ranks is the N = 1 model at larger n_pert, communication aside).
Table 8: each reference batch's cosine distance to the gradient on an independent batch of the
same size.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import replace

import torch
from torch import Tensor

from soma_pl.analysis.gradient_error import exact_gradient, flatten, mean_with_error
from soma_pl.analysis.variance_panels import Measurement, perturbed_weights, pool_batches, width_for_total
from soma_pl.estimators.spsa import spsa_estimate
from soma_pl.models.stacked import HeadMode, StackedExperts


def short_windows(windows: Tensor, context: int, seed: int) -> Tensor:
    """`[n, 1025]` windows cut into `[m, context + 1]` pieces (every whole piece of each), in a seeded
    random order: consecutive pieces of one document do not all go to one batch or pool."""
    pieces = windows.shape[1] // (context + 1)
    cut = windows[:, : pieces * (context + 1)].reshape(-1, context + 1)
    return cut[torch.randperm(len(cut), generator=torch.Generator().manual_seed(seed))]


def _forward_multiply_adds(model: StackedExperts) -> int:
    """Multiply-adds of one byte's forward through one expert (every weight matrix once)."""
    return sum(p[0].numel() if not model.is_shared(name) else p.numel()
               for name, p in model.named_parameters() if name != "norm_gains")


def step_settings(experts: int, n_pert: int, batch: int, scales: Sequence[int]) -> list[tuple[int, int]]:
    """The (n_pert, B) points of N = `experts`: the base for N > 1; for N = 1 the base with n_pert or
    B at each of `scales`."""
    if experts != 1:
        return [(n_pert, batch)]
    return sorted({(n_pert * s, batch) for s in scales} | {(n_pert, batch * s) for s in scales})


def _curve_point(model: StackedExperts, params: dict[str, Tensor], reference: Tensor, independent: Tensor,
                 pool: Tensor, n_pert: int, batch: int, measurement: Measurement) -> dict:
    """R over `measurement.repeats` draws of a batch (from each expert's `pool [E, P, T + 1]`) and of
    directions, with one global step's multiply-adds and median measured seconds; R against the
    `independent` reference too (Table 8: how much the reference's own batch moves it)."""
    config = replace(measurement.config, n_pert=n_pert, micro_batch=batch)
    generator = torch.Generator().manual_seed(measurement.seed + 7919 * n_pert + batch)
    draws = pool_batches(pool.shape[1], batch, measurement.repeats, generator)
    total, errors, seconds = reference.pow(2).sum(), [], []
    other_total, other_errors = independent.pow(2).sum(), []
    for step, picks in enumerate(draws):
        started = time.perf_counter()
        estimate = spsa_estimate(model.loss_per_group, params, pool[:, picks], config, step=step,
                                 seed=measurement.seed)
        seconds.append(time.perf_counter() - started)
        flat = flatten(estimate.gradient)
        errors.append((flat - reference).pow(2).sum() / total)
        other_errors.append((flat - independent).pow(2).sum() / other_total)
        measurement.drawn()
    stats = mean_with_error(torch.stack(errors))
    context = pool.shape[2] - 1
    return {"experts": model.num_experts, "n_pert": n_pert, "batch": batch, "relative_error": stats.mean,
            "stderr": stats.stderr, "relative_error_independent_reference": float(torch.stack(other_errors).mean()),
            "multiply_adds": 2 * n_pert * batch * context * model.num_experts
            * _forward_multiply_adds(model), "seconds": statistics.median(seconds)}


def reference_panel(windows: Tensor, expert_counts: Sequence[int], total_params: int, n_pert: int, batch: int,
                    scales: Sequence[int], reference_windows: int, pool: int, context: int,
                    measurement: Measurement) -> dict:
    """Fig. 5's three curves and Table 8's reference distances (random-init bodies at about
    `total_params` in all, one shared frozen head; every expert its own windows).

    Args:
        windows: ``[n, 1025]`` source windows, cut into pieces of ``context + 1`` bytes; each expert
            takes two reference batches and a sampling pool of its own, all disjoint.
        n_pert, batch: the base (n_pert, B) of every N; scales: the N = 1 model's n_pert and B
            multiples (the paper: 64 → 1,024).
    """
    pieces = short_windows(windows, context, measurement.seed)
    per_expert = 2 * reference_windows + pool
    needed = max(expert_counts) * per_expert
    if len(pieces) < needed:
        raise ValueError(f"{len(pieces)} windows of {context + 1} bytes, {needed} needed "
                         f"({max(expert_counts)} experts x (2 x {reference_windows} reference + {pool} pool))")
    points, table8, threads = [], [], torch.get_num_threads()
    torch.set_num_threads(1)  # each step's seconds on one thread, as the sweeps' calibrations time them
    try:
        for count in sorted(set(expert_counts)):
            row, curve = _expert_count(count, pieces[: count * per_expert].reshape(count, per_expert, context + 1),
                                       total_params, n_pert, batch, scales, reference_windows, measurement)
            table8.append(row)
            points += curve
    finally:
        torch.set_num_threads(threads)
    return {"base": {"n_pert": n_pert, "batch": batch}, "scales": list(scales), "context": context,
            "reference_windows": reference_windows, "pool": pool, "points": points, "table8": table8}


def _expert_count(count: int, own: Tensor, total_params: int, n_pert: int, batch: int, scales: Sequence[int],
                  reference_windows: int, measurement: Measurement) -> tuple[dict, list[dict]]:
    """N = `count` experts (each with its windows `own [N, 2·reference + pool, T + 1]`): Table 8's row
    and the curve points."""
    width = width_for_total(total_params, count)
    with torch.random.fork_rng():
        torch.manual_seed(measurement.seed + count)
        model = StackedExperts(count, width, head=HeadMode.shared, dtype=torch.float64).requires_grad_(False)
    params = perturbed_weights(model)
    reference = exact_gradient(model.loss_per_group, params, own[:, :reference_windows])
    other = exact_gradient(model.loss_per_group, params, own[:, reference_windows : 2 * reference_windows])
    cosine = torch.nn.functional.cosine_similarity(reference.flatten(), other.flatten(), dim=0)
    points = [{**_curve_point(model, params, reference, other, own[:, 2 * reference_windows :], n, b, measurement),
               "width": width, "params_per_expert": reference.shape[1]}
              for n, b in step_settings(count, n_pert, batch, scales)]
    return {"experts": count, "reference_windows": reference_windows, "cosine_distance": float(1 - cosine)}, points
