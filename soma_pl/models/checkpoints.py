"""Reading model weights out of Lightning checkpoints (seed models for warm starts and routers)."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor

from soma_pl.errors import ConfigError, DataError


def monolithic_state(path: str | Path) -> tuple[dict[str, Tensor], dict]:
    """The `StackedExperts` weights (`model.` prefix removed) of a monolithic (E = 1) checkpoint.

    Returns:
        `(state, config)`: the weights, and `width`, `num_layers`, `embed_dim`, `head`
        ("per_expert" or "shared") read off their shapes.

    Raises:
        DataError: the file is missing or unreadable.
        ConfigError: it holds no monolithic stacked-expert model, or its hyperparameters disagree
            with its weights.
    """
    path = Path(path).expanduser()
    if not path.is_file():
        raise DataError(f"seed checkpoint not found: {path}")
    try:
        checkpoint = torch.load(path, weights_only=False, map_location="cpu")
        state = {k.removeprefix("model."): v for k, v in checkpoint["state_dict"].items() if k.startswith("model.")}
        hparams = checkpoint.get("hyper_parameters", {})
    except Exception as error:  # torch.load raises many types for a damaged file
        raise DataError(f"unreadable seed checkpoint {path}: {str(error).strip().splitlines()[0]}") from error
    if "w_ih" not in state or state["w_ih"].shape[0] != 1:
        raise ConfigError(f"seed checkpoint {path}: no monolithic model (need model.w_ih of shape [1, ...])")
    config = {"width": int(state["w_ih"].shape[-1]), "num_layers": int(state["w_ih"].shape[1]),
              "embed_dim": int(state["head"].shape[-1]), "head": "shared" if state["head"].dim() == 2 else "per_expert"}
    for key in ("width", "num_layers", "embed_dim"):
        if key in hparams and int(hparams[key]) != config[key]:
            raise ConfigError(f"seed checkpoint {path}: hyper_parameters {key}={hparams[key]}, weights say {config[key]}")
    return state, config
