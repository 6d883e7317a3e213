"""The torch optimizer a module steps, kept in its hyperparameters as data.

The CLI hands a module an optimizer factory (`functools.partial` of the class with its init
arguments). A checkpoint's hyperparameters hold it as `{"class_path", "init_args"}`, so
`Module.load_from_checkpoint(path)` rebuilds the same optimizer (class, learning rate and all)
instead of falling back to the signature's default.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from soma_pl.errors import ConfigError
from soma_pl.lit.args import KEY, require

LR_KEY = f"{KEY}.optimizer.init_args.lr"


def check_positive_lr(lr: float) -> None:
    """A learning rate must be a positive finite number (0 would also divide ε's schedule by zero)."""
    lr = float(lr)
    require(math.isfinite(lr) and lr > 0, LR_KEY, f"{lr:g}", "a positive finite number")


def optimizer_spec(factory: Callable | dict) -> dict | None:
    """`{"class_path", "init_args"}` of an optimizer factory; None for one that is not a class
    with keyword arguments (e.g. a lambda)."""
    if isinstance(factory, dict):
        return factory
    keywords: dict[str, Any] = {}
    if isinstance(factory, functools.partial):
        classes = [a for a in factory.args if isinstance(a, type)]  # the CLI wraps the class in a helper
        keywords = dict(factory.keywords)
        factory = classes[-1] if classes else factory.func
    if not isinstance(factory, type):
        return None
    return {"class_path": f"{factory.__module__}.{factory.__qualname__}", "init_args": keywords}


def optimizer_factory(optimizer: Callable | dict) -> Callable:
    """A factory from a factory (returned as is) or from an `optimizer_spec` dict."""
    if not isinstance(optimizer, dict):
        return optimizer
    module_name, _, name = str(optimizer.get("class_path", "")).rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError, ValueError) as error:
        raise ConfigError(f"optimizer class_path {optimizer.get('class_path')!r} cannot be imported") from error
    return functools.partial(cls, **optimizer.get("init_args", {}))


class ZOAdam(torch.optim.Adam):
    """Adam on the zero-order estimate, as the paper steps every zero-order model (Eq. 8, Table 1,
    App. E, I.2): moments β = (0.9, 0.999), stabiliser δ = 1e-8, bias-corrected, and coupled weight
    decay λ = 1e-4 added to the estimate before the moments (`torch.optim.Adam`'s `weight_decay`).
    The moments are elementwise, so each expert of an `[E, ...]` weight keeps its own state.

    Args:
        params: the trained weights.
        lr: η, the initial learning rate (1e-3 in the width-32 sweeps, §4; 0.0025 for the seed and
            the wide controls, App. D, I.1).
        betas: (β1, β2).
        eps: δ_Adam.
        weight_decay: λ.
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-4):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
