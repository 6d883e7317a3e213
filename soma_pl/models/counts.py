"""Parameter counts of the Table 2 ensembles, read from the real modules on the meta device."""

from __future__ import annotations

from dataclasses import dataclass

from soma_pl.models.stacked import HeadMode, StackedExperts


@dataclass(frozen=True)
class EnsembleShape:
    """One row's configuration: N experts of body width d_t."""

    num_experts: int
    width: int
    head: HeadMode


TABLE2_SHAPES = (
    EnsembleShape(1, 509, HeadMode.per_expert),
    EnsembleShape(2, 361, HeadMode.per_expert),
    EnsembleShape(8, 181, HeadMode.per_expert),
    EnsembleShape(256, 32, HeadMode.shared),
)
"""The SPSA sharding comparison of Table 2 (about 8.4M parameters each)."""


def count_parameters(shape: EnsembleShape) -> dict:
    """Table 2 row for one ensemble, counted from a meta-device :class:`StackedExperts`.

    Returns:
        ``N``, ``d_t``, ``head_params_per_expert``, ``head_shared``, ``expert_body_params``,
        ``ensemble_params`` (bodies plus heads, a shared head counted once).
    """
    model = StackedExperts(shape.num_experts, shape.width, head=shape.head, device="meta")
    heads = set(model.head_parameter_names())
    params = dict(model.named_parameters())
    head_total = sum(params[name].numel() for name in heads)
    body_total = sum(p.numel() for name, p in params.items() if name not in heads)
    shared = shape.head == HeadMode.shared
    return {
        "N": shape.num_experts,
        "d_t": shape.width,
        "head_params_per_expert": head_total if shared else head_total // shape.num_experts,
        "head_shared": shared,
        "expert_body_params": body_total // shape.num_experts,
        "ensemble_params": head_total + body_total,
    }


def table2_rows() -> list[dict]:
    """The four rows of Table 2, in the paper's order."""
    return [count_parameters(shape) for shape in TABLE2_SHAPES]
