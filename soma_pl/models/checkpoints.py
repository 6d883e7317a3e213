"""Reading Lightning checkpoints safely, and model weights out of them (seed models for warm starts
and routers).

Every checkpoint is read with `torch.load(weights_only=True)`: tensors, plain values and the `str`
enums of soma_pl modules (which a module built in Python keeps in its hyperparameters) load; any
other class or function a file names is refused before anything in it runs.

Weights remember the data they came from: a checkpoint records the fingerprints of its prepared
dataset and sharding (its data module's state), a router the sharding that fitted it.
:func:`check_same_data` is the one check every command makes before it uses weights with data.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import BinaryIO

import torch
from torch import Tensor

from soma_pl.errors import ConfigError, DataError


def _reason(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def _soma_enum(name: str) -> type[Enum] | None:
    """The enum class `name` (`module.Class`) when it is one defined in a soma_pl module, else None.
    Only soma_pl's own modules are imported to find out."""
    module_name, _, attribute = name.rpartition(".")
    if not module_name.startswith("soma_pl."):
        return None
    try:
        found = getattr(importlib.import_module(module_name), attribute, None)
    except ImportError:
        return None
    if isinstance(found, type) and issubclass(found, Enum) and found.__module__ == module_name:
        return found
    return None


def _allowed_globals(path: Path, what: str) -> list[type[Enum]]:
    """The soma_pl enums a checkpoint names; any other global it names is refused (DataError)."""
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(path)
    except (ValueError, RuntimeError, OSError, EOFError):  # not a zip checkpoint, or damaged: torch.load says
        return []
    allowed = {name: _soma_enum(name) for name in names}
    refused = sorted(name for name, enum in allowed.items() if enum is None)
    if refused:
        more = f" (and {len(refused) - 1} more)" if len(refused) > 1 else ""
        raise DataError(f"{what} {path} refers to {refused[0]}{more}, which a weights-only load refuses "
                        "(only tensors, plain values and soma_pl enums load): pass a checkpoint soma_pl wrote")
    return list(allowed.values())


def read_weights_only(source: str | Path | BinaryIO, map_location="cpu", allowed: Sequence[type] = ()):
    """`torch.load(source, weights_only=True)`, the only way soma_pl reads a torch file (checkpoints,
    routers): tensors, plain values and the `allowed` classes load; anything else is refused."""
    with torch.serialization.safe_globals(list(allowed)):
        return torch.load(source, map_location=map_location, weights_only=True)


def load_checkpoint(path: str | Path, what: str = "checkpoint", map_location="cpu") -> dict:
    """A Lightning checkpoint read with `weights_only=True` (see the module doc).

    Args:
        path: the `.ckpt` file.
        what: how error messages name the file ("seed checkpoint", ...).
        map_location: as for `torch.load`.

    Raises:
        DataError: the file is missing, truncated or corrupt, names a class or function outside the
            allow-list, or holds no `state_dict`.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"{what} not found: {path}")
    allowed = _allowed_globals(path, what)
    try:
        checkpoint = read_weights_only(path, map_location, allowed)
    except Exception as error:  # torch.load raises many types for a damaged file
        raise DataError(f"unreadable {what} {path} (truncated, corrupt or not a torch checkpoint): "
                        f"{_reason(error)}") from error
    if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("state_dict"), dict):
        raise DataError(f"{what} {path} is not a Lightning checkpoint: it holds no state_dict")
    return checkpoint


def monolithic_state(path: str | Path, data: Mapping[str, tuple[str | None, str]] | None = None,
                     ) -> tuple[dict[str, Tensor], dict]:
    """The `StackedExperts` weights (`model.` prefix removed) of a monolithic (E = 1) checkpoint.

    Args:
        path: the checkpoint.
        data: the data the weights will be trained on, as for :func:`check_same_data`; None: not checked.

    Returns:
        `(state, config)`: the weights, and `width`, `num_layers`, `embed_dim`, `head`
        ("per_expert" or "shared") read off their shapes.

    Raises:
        DataError: the file is missing or unreadable, its weights hold NaN or infinite values, or
            it was trained on another prepared dataset than `data`.
        ConfigError: it holds no monolithic stacked-expert model, or its hyperparameters disagree
            with its weights.
    """
    path = Path(path).expanduser()
    checkpoint = load_checkpoint(path, "seed checkpoint")
    check_same_data(f"seed checkpoint {path} was trained on", trained_on(checkpoint), data or {})
    state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
    hparams = dict(checkpoint.get("hyper_parameters") or {})
    hparams = {**hparams, **(hparams.get("shape") or {})}  # a module's shape group, or older flat keys
    if "w_ih" not in state or state["w_ih"].shape[0] != 1:
        raise ConfigError(f"seed checkpoint {path}: no monolithic model (need model.w_ih of shape [1, ...])")
    config = {"width": int(state["w_ih"].shape[-1]), "num_layers": int(state["w_ih"].shape[1]),
              "embed_dim": int(state["head"].shape[-1]), "head": "shared" if state["head"].dim() == 2 else "per_expert"}
    for key in ("width", "num_layers", "embed_dim"):
        if key in hparams and int(hparams[key]) != config[key]:
            raise ConfigError(f"seed checkpoint {path}: hyper_parameters {key}={hparams[key]}, "
                              f"weights say {config[key]}")
    name = first_nonfinite(state)
    if name is not None:
        raise DataError(f"seed checkpoint {path}: 'model.{name}' holds NaN or infinite values (a diverged run): "
                        f"start from a finite checkpoint")
    return state, config


def first_nonfinite(state: dict[str, Tensor]) -> str | None:
    """The name of the first floating-point tensor of `state` holding a NaN or an infinity; None when
    every one is finite."""
    for name, value in state.items():
        if isinstance(value, Tensor) and value.is_floating_point() and not bool(torch.isfinite(value).all()):
            return name
    return None


DATA_KINDS = {
    "dataset": ("prepared dataset", "another corpus or preparation holds out other documents: use the "
                "prepared dataset the weights were trained on"),
    "experts": ("sharding", "its windows would go to the wrong experts: use the router.pt, experts and "
                "checkpoint of one sharding"),
}
"""The fingerprints weights record (`manifest.json`'s and `experts.json`'s `fingerprint`): what each
identifies, and what to do when they differ."""


def trained_on(checkpoint: Mapping) -> dict[str, str | None]:
    """The fingerprints of the data a Lightning checkpoint was trained on (`dataset`, `experts`),
    from its data module's saved state (Lightning stores it under the class name); empty when the
    checkpoint records none."""
    for value in checkpoint.values():
        if isinstance(value, Mapping) and isinstance(value.get("fingerprints"), Mapping):
            return dict(value["fingerprints"])
    return {}


def check_same_data(source: str, recorded: Mapping[str, str | None],
                    data: Mapping[str, tuple[str | None, str]]) -> None:
    """Refuse weights that came from other data than the data they are used with: a model scored on
    windows its training held out otherwise reads as better than it is, and a router of another
    sharding sends windows to the wrong experts, each without any error. A fingerprint missing on
    either side (older files, a folder without a manifest) is not compared.

    Args:
        source: the weights and how they came from the data, for the message
            (`the checkpoint was trained on`, `router r.pt comes from`).
        recorded: kind (a key of :data:`DATA_KINDS`) → the fingerprint recorded with the weights.
        data: kind → `(fingerprint, where)` of the data in use; `where` names its folder or setting.

    Raises:
        DataError: a recorded fingerprint differs from the one in use.
    """
    for kind, fingerprint in recorded.items():
        current, where = data.get(kind, (None, ""))
        if fingerprint and current and fingerprint != current:
            name, remedy = DATA_KINDS[kind]
            raise DataError(f"{source} another {name} (fingerprint {fingerprint[:12]}) than {where} "
                            f"(fingerprint {current[:12]}): {remedy}")
