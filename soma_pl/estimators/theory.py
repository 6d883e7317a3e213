"""Closed-form relative error ``E‖ĝ − g‖² / ‖g‖²`` of the SPSA estimator (Figs. 10 and 11).

Take ``ĝ = (1/n) Σ_k (z_kᵀ g) z_k`` with n independent directions in d dimensions: the central
difference of a quadratic is exactly ``z_kᵀ g``, and for a smooth loss it is to O(ε²). Each term is
unbiased (``E[z zᵀ] = I``), so ``E‖ĝ − g‖² = (E‖(zᵀg) z‖² − ‖g‖²) / n`` with

    Rademacher: E[(zᵀg)² ‖z‖²] = d ‖g‖²            (‖z‖² = d exactly)      → (d − 1) ‖g‖² / n;
    Gaussian:   E[(zᵀg)² z_i²] = ‖g‖² + 2 g_i²      (E z⁴ = 3)             → (d + 1) ‖g‖² / n.

Grouped losses. K experts with gradients g_e in d_e dimensions share one loss, the SUM of their
losses, and one concatenated direction z = (z_1, …, z_K). Expert e then receives
``(zᵀ g_G) z_e`` with ``g_G = (g_1, …, g_K)``, so per direction

    Rademacher: E‖(zᵀg_G) z_e‖² = d_e ‖g_G‖²           → error_e = (d_e ‖g_G‖² − ‖g_e‖²) / n,
    Gaussian:   E‖(zᵀg_G) z_e‖² = d_e ‖g_G‖² + 2‖g_e‖² → error_e = (d_e ‖g_G‖² + ‖g_e‖²) / n,

and summed over the group: ``(D_G ∓ 1) ‖g_G‖² / n`` with ``D_G = Σ_e d_e`` (− Rademacher,
+ Gaussian). Separate losses give ``Σ_e (d_e ∓ 1) ‖g_e‖² / n``. For equal widths d the joint /
separate ratio is ``(K·d ∓ 1) / (d ∓ 1) ≈ K`` whatever the gradient norms (Fig. 11: 4.00
predicted for four experts); with unequal widths it weights each expert's width by the group's
gradient norm, which :func:`grouped_relative_error` computes exactly.

Batch noise (Fig. 11, right). When the batch b is drawn at random and the reference is the mean
gradient g of the pool it is drawn from, ``ĝ`` is unbiased for the batch gradient ``g_b``, so
``E‖ĝ − g‖² = E‖ĝ − g_b‖² + E‖g_b − g‖²``. The first term is the formula above with every
``‖g_e‖²`` replaced by ``E‖g_{e,b}‖² = ‖g_e‖² + v_e`` (concatenated experts add no cross terms),
where ``v_e = E‖g_{e,b} − g_e‖²`` is the batch variance; for B of P pool windows drawn without
replacement ``v_e = σ_e² (P − B) / (B (P − 1))`` with ``σ_e²`` the mean squared deviation of one
window's gradient from g_e (``ν = Σσ_e² / Σ‖g_e‖²``).

Sparse probes (App. G.1). Entries are independent with ``E z_j² = E z_j⁴ = q_j`` (z_j ∈ {0, ±1}; q_j = 1
on normalisation gains, ½ elsewhere) and no rescaling, so a term's mean is ``q ⊙ g``, not g. Its
centered variance, per coordinate ``q_i (S − q_i g_i²) + q_i g_i² − q_i² g_i²`` with
``S = Σ_j q_j g_j²``, sums to App. G.1's

    E‖(zᵀg) z − q ⊙ g‖² = Σ_j q_j (1 + s − 2 q_j) g_j²,      s = Σ_j q_j (the expected ‖z‖²),

and ``R_g = Σ_e Σ_j q_ej (1 + s_e − 2 q_ej) g_ej² / (n Σ_e ‖g_e‖²)``: centered variance relative to the
exact gradient, what Fig. 10 plots. With q = 1 it is Rademacher's ``(d − 1) ‖g‖²``. A joint loss over a
group G gives expert e ``(z_Gᵀ g_G) z_e`` and the same sum over the group's coordinates with ``s_G``.
With random batches each ``g_j²`` becomes ``g_j² + v_j`` (v_j the batch variance of coordinate j) and
the mean's own spread ``Σ_j q_j² v_j`` is added (q = 1: the dense batch-noise formula above).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from soma_pl.estimators.directions import DirectionKind


def _sign(kind: DirectionKind) -> int:
    """−1 for Rademacher (no spread in ‖z‖²), +1 for Gaussian (its fourth moment adds 2‖g‖²)."""
    if kind == DirectionKind.rademacher:
        return -1
    if kind == DirectionKind.gaussian:
        return 1
    if kind == DirectionKind.sparse:
        raise ValueError("sparse probes are predicted per coordinate: use sparse_relative_variance")
    raise ValueError(f"unknown direction kind {kind!r}")


def relative_error(kind: DirectionKind, dim: int, n_pert: int) -> float:
    """Predicted ``E‖ĝ − g‖² / ‖g‖²`` for one loss in ``dim`` dimensions and ``n_pert`` directions.

    Rademacher ``(d − 1) / n_pert``; Gaussian ``(d + 1) / n_pert``.
    """
    return (dim + _sign(kind)) / n_pert


def grouped_relative_error(
    kind: DirectionKind,
    grad_sq_norms: Sequence[float] | Tensor,
    dims: Sequence[int] | Tensor | int,
    group_size: int,
    n_pert: int,
) -> float:
    """Predicted relative error of all experts' estimates when groups of experts share a loss.

    Args:
        kind: direction distribution.
        grad_sq_norms: ``[E]`` squared exact gradient norms ``‖g_e‖²``.
        dims: ``[E]`` parameters per expert (or one int for all).
        group_size: experts per joint loss (consecutive experts; 1 = separate losses).
        n_pert: directions per expert.

    Returns:
        ``Σ_G (D_G ± 1) ‖g_G‖² / (n_pert · Σ_e ‖g_e‖²)``.
    """
    norms = torch.as_tensor(grad_sq_norms, dtype=torch.float64)
    widths = torch.as_tensor(dims, dtype=torch.float64).expand_as(norms)
    experts = norms.numel()
    if experts % group_size:
        raise ValueError(f"{experts} experts cannot form groups of {group_size}")
    group_norms = norms.reshape(-1, group_size).sum(1)
    group_dims = widths.reshape(-1, group_size).sum(1)
    error = ((group_dims + _sign(kind)) * group_norms).sum() / n_pert
    return float(error / norms.sum())


def joint_to_separate_ratio(
    kind: DirectionKind,
    grad_sq_norms: Sequence[float] | Tensor,
    dims: Sequence[int] | Tensor | int,
    group_size: int,
) -> float:
    """How many times larger the error is with joint losses over groups than with separate ones.

    Independent of n_pert; ``(K·d ∓ 1)/(d ∓ 1)`` for equal widths d (Fig. 11: ≈ 4 for K = 4).
    """
    joint = grouped_relative_error(kind, grad_sq_norms, dims, group_size, 1)
    return joint / grouped_relative_error(kind, grad_sq_norms, dims, 1, 1)


def sampled_batch_variance(window_variance: float | Tensor, batch: int, pool: int) -> float | Tensor:
    """``E‖g_b − g‖²`` for the mean over ``batch`` of ``pool`` windows drawn without replacement.

    Args:
        window_variance: ``σ²``, the mean over the pool of ``‖g_i − g‖²`` (a float or ``[E]``).
        batch: B windows per batch; pool: P windows in the pool (B ≤ P).
    """
    if not 1 <= batch <= pool:
        raise ValueError(f"batch {batch} must be in [1, pool={pool}]")
    finite_pool = (pool - batch) / (pool - 1) if pool > 1 else 0.0
    return window_variance * finite_pool / batch


def batch_noise_relative_error(
    kind: DirectionKind,
    grad_sq_norms: Sequence[float] | Tensor,
    batch_variances: Sequence[float] | Tensor,
    dims: Sequence[int] | Tensor | int,
    group_size: int,
    n_pert: int,
) -> float:
    """Predicted ``E‖ĝ − g‖² / ‖g‖²`` against the pool-mean gradient with random batches.

    Args:
        kind: direction distribution.
        grad_sq_norms: ``[E]`` ``‖g_e‖²`` of the pool-mean gradients.
        batch_variances: ``[E]`` ``v_e = E‖g_{e,b} − g_e‖²`` (see :func:`sampled_batch_variance`).
        dims: ``[E]`` perturbed parameters per expert (or one int).
        group_size: experts per joint loss; n_pert: directions per expert.

    Returns:
        ``(Σ_G (D_G ± 1) Σ_{e∈G} (‖g_e‖² + v_e) / n_pert + Σ_e v_e) / Σ_e ‖g_e‖²``.
    """
    norms = torch.as_tensor(grad_sq_norms, dtype=torch.float64)
    variances = torch.as_tensor(batch_variances, dtype=torch.float64)
    noisy = norms + variances
    estimator = grouped_relative_error(kind, noisy, dims, group_size, n_pert) * float(noisy.sum())
    return float((estimator + variances.sum()) / norms.sum())


def _sparse_spread(grad_sq: Tensor, activity: Tensor, group_size: int) -> Tensor:
    """``Σ_G Σ_{j∈G} q_j (1 + s_G − 2 q_j) g_j²``: one sparse direction's centered squared error.

    Args:
        grad_sq: ``[E, D]`` squared gradient coordinates ``g_ej²``.
        activity: ``[D]`` or ``[E, D]`` the probabilities ``q_ej`` that a coordinate's entry is non-zero.
        group_size: experts per joint loss (consecutive experts; 1 = separate losses).
    """
    squares = torch.as_tensor(grad_sq, dtype=torch.float64)
    q = torch.as_tensor(activity, dtype=torch.float64).expand_as(squares)
    experts = squares.shape[0]
    if experts % group_size:
        raise ValueError(f"{experts} experts cannot form groups of {group_size}")
    s = q.reshape(experts // group_size, -1).sum(1).repeat_interleave(group_size)  # s_G of each expert's group
    return (q * (1 + s[:, None] - 2 * q) * squares).sum()


def sparse_relative_variance(grad_sq: Tensor, activity: Tensor, group_size: int, n_pert: int) -> float:
    """App. G.1's prediction ``R_g`` for sparse probes: ``E‖ĝ − q ⊙ g‖² / ‖g‖²`` over all experts.

    Args:
        grad_sq: ``[E, D]`` squared exact gradient coordinates ``g_ej²``.
        activity: ``[D]`` or ``[E, D]`` q_ej (1 on gains, ½ elsewhere: ``coordinate_activity``).
        group_size: experts per joint loss; n_pert: directions per expert.

    Returns:
        ``Σ_G Σ_{j∈G} q_j (1 + s_G − 2 q_j) g_j² / (n_pert Σ_e ‖g_e‖²)`` with ``s_G = Σ_{j∈G} q_j``
        (``s_e`` of the paper when group_size is 1); with q = 1 the Rademacher value.
    """
    spread = _sparse_spread(grad_sq, activity, group_size)
    return float(spread / (n_pert * torch.as_tensor(grad_sq, dtype=torch.float64).sum()))


def sparse_batch_noise_relative_error(
    grad_sq: Tensor, batch_variances: Tensor, activity: Tensor, group_size: int, n_pert: int
) -> float:
    """Sparse probes on random batches: ``E‖ĝ − q ⊙ g‖² / ‖g‖²`` against the pool-mean gradient g.

    Args:
        grad_sq: ``[E, D]`` squared coordinates of the pool-mean gradients.
        batch_variances: ``[E, D]`` ``v_ej = E(g_{ej,b} − g_ej)²`` per coordinate (see
            :func:`sampled_batch_variance`).
        activity: ``[D]`` or ``[E, D]`` q_ej; group_size: experts per joint loss; n_pert: directions.

    Returns:
        ``(Σ_G Σ_{j∈G} q_j (1 + s_G − 2 q_j)(g_j² + v_j) / n_pert + Σ_j q_j² v_j) / Σ_j g_j²``.
    """
    squares = torch.as_tensor(grad_sq, dtype=torch.float64)
    variances = torch.as_tensor(batch_variances, dtype=torch.float64)
    q = torch.as_tensor(activity, dtype=torch.float64).expand_as(squares)
    estimator = _sparse_spread(squares + variances, q, group_size) / n_pert
    return float((estimator + (q.pow(2) * variances).sum()) / squares.sum())
