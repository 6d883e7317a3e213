"""The modules' typed argument groups, and how their settings are checked and saved.

A module takes small frozen dataclasses (`shape: ModelShape`, `spsa: SPSAArgs`, `plateau:
PlateauConfig`, ...): they are the YAML schema (`model.init_args.shape.width`), and each field's
docstring is its `--help` line. A checkpoint keeps them as plain dicts (enums as their values), which
a weights-only load reads, and a module rebuilt from one (`load_from_checkpoint`, `evaluate`)
accepts the dict in place of the dataclass (`arg_group`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields, is_dataclass
from enum import Enum
from typing import Any, TypeVar

from soma_pl.errors import ConfigError, require

KEY = "model.init_args"
"""Where a module's arguments sit in a fit config."""

Group = TypeVar("Group")

__all__ = ["KEY", "Group", "ModelShape", "arg_group", "plain", "require"]


def arg_group(cls: type[Group], value: Any, name: str) -> Group:
    """`value` as the dataclass `cls`: itself, or built from a mapping or another dataclass's fields.

    Args:
        name: the group's argument name (`shape`), for the message naming an unknown key.
    """
    if isinstance(value, cls):
        return value
    if is_dataclass(value) and not isinstance(value, type):
        value = {f.name: getattr(value, f.name) for f in fields(value)}
    if not isinstance(value, Mapping):
        raise ConfigError(f"{KEY}.{name} must be a mapping of {cls.__name__} settings, not {value!r}")
    known = [f.name for f in fields(cls)]
    unknown = sorted(set(value) - set(known))
    if unknown:
        raise ConfigError(f"{KEY}.{name}.{unknown[0]} is not a setting: {KEY}.{name} has {', '.join(known)}")
    return cls(**value)


def plain(value: Any) -> Any:
    """A dataclass as a dict, an enum as its value (recursively): what a weights-only load reads."""
    if is_dataclass(value) and not isinstance(value, type):
        return {f.name: plain(getattr(value, f.name)) for f in fields(value)}
    if isinstance(value, Enum):
        return value.value
    return value


@dataclass(frozen=True)
class ModelShape:
    """The stacked-expert model's shape (Table 2)."""

    width: int = 509
    """Body width d_t (509: the 8.33M-parameter monolithic model; SOMA N = 2, 8, 256: 361, 181, 32)."""
    num_layers: int = 2
    """D: residual blocks, each an LSTM sublayer then a GELU MLP (App. C: 2)."""
    embed_dim: int = 32
    """Tied byte embedding / output head width d_E."""
    time_chunk: int = 64
    """Time steps held at once in the forward (bounds activation memory; not a model setting)."""

    def __post_init__(self) -> None:
        for f in fields(self):
            require(getattr(self, f.name) >= 1, f"{KEY}.shape.{f.name}", getattr(self, f.name), ">= 1")
