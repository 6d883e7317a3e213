"""estimators: perturbation directions, SPSA, the decoder-path delta rule, variance theory — pure torch, no
Lightning."""

from soma_pl.estimators.delta_rule import decoder_gradient
from soma_pl.estimators.directions import (
    DirectionKind,
    direction_keys,
    directions,
    directions_from_keys,
)
from soma_pl.estimators.spsa import (
    LossFn,
    SPSAConfig,
    SPSAResult,
    assemble_estimate,
    group_sums,
    spsa_estimate,
)
from soma_pl.estimators.theory import (
    grouped_relative_error,
    joint_to_separate_ratio,
    relative_error,
)

__all__ = [
    "DirectionKind",
    "LossFn",
    "SPSAConfig",
    "SPSAResult",
    "assemble_estimate",
    "decoder_gradient",
    "direction_keys",
    "directions",
    "directions_from_keys",
    "group_sums",
    "grouped_relative_error",
    "joint_to_separate_ratio",
    "relative_error",
    "spsa_estimate",
]
