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
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from soma_pl.estimators.directions import DirectionKind


def _sign(kind: DirectionKind) -> int:
    """−1 for Rademacher (no spread in ‖z‖²), +1 for Gaussian (its fourth moment adds 2‖g‖²)."""
    if kind == DirectionKind.RADEMACHER:
        return -1
    if kind == DirectionKind.GAUSSIAN:
        return 1
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
