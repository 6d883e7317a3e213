"""What the analyses read: stacked experts (and a router) from a checkpoint, evaluation windows.

A router or prepared dataset given beside a checkpoint must be the one its experts were trained on
(`check_same_data`, as `evaluate --router` and `--ckpt_path` check).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from soma_pl import WINDOW_BYTES
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import load_eval_set, open_prepared
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.checkpoints import check_same_data, load_checkpoint, trained_on
from soma_pl.models.router import Router
from soma_pl.models.stacked import HeadMode, StackedExperts

ENSEMBLE_VAL_FILE = "ensemble_val.npz"
"""The prepared dataset's ensemble-validation windows (see `soma_pl.data.preparation.prepare`)."""


@dataclass
class LoadedExperts:
    """The stacked experts of a checkpoint and, for SOMA checkpoints, their router."""

    model: StackedExperts
    router: Router | None
    path: str
    trained_on: dict[str, str | None] = field(default_factory=dict)
    """The fingerprints of the data the experts were trained on (`dataset`, `experts`)."""

    @property
    def sharding(self) -> str | None:
        """The sharding the experts were trained on: their own router's, or the recorded one."""
        return (self.router.sharding if self.router is not None else None) or self.trained_on.get("experts")


def load_experts(path: str | Path, dtype: torch.dtype = torch.float32) -> LoadedExperts:
    """Rebuild the `StackedExperts` of any soma_pl checkpoint from its weights' shapes.

    Args:
        path: a Lightning checkpoint (SPSA, BPTT, SOMA, ...) whose `state_dict` holds `model.*`.
        dtype: dtype of the returned model.

    Raises:
        DataError: missing or unreadable file. ConfigError: no stacked-expert model inside.
    """
    path = Path(path).expanduser()
    checkpoint = load_checkpoint(path)
    state = {k.removeprefix("model."): v for k, v in checkpoint.get("state_dict", {}).items()
             if k.startswith("model.")}
    if "w_ih" not in state or "head" not in state:
        raise ConfigError(f"checkpoint {path}: no stacked-expert model (need model.w_ih and model.head)")
    w_ih = state["w_ih"]
    head = HeadMode.shared if state["head"].dim() == 2 else HeadMode.per_expert
    model = StackedExperts(int(w_ih.shape[0]), int(w_ih.shape[-1]), int(state["head"].shape[-1]),
                           int(w_ih.shape[1]), head)
    try:
        model.load_state_dict(state)
    except RuntimeError as error:
        raise ConfigError(f"checkpoint {path}: {str(error).strip().splitlines()[0]}") from error
    router = None
    if "router" in checkpoint:
        router = Router.load_from(io.BytesIO(checkpoint["router"]), f"in checkpoint {path}")
    return LoadedExperts(model.to(dtype).requires_grad_(False), router, str(path), trained_on(checkpoint))


def load_router(loaded: LoadedExperts, router_path: str | None) -> Router:
    """The router to rank experts with: `router_path` if given (of the sharding the experts were
    trained on), else the checkpoint's own."""
    router = Router.load(router_path) if router_path else loaded.router
    if router is None:
        raise ConfigError(f"checkpoint {loaded.path} holds no router: pass --router <experts_dir>/router.pt")
    if router_path:
        trained = f"the one the experts of checkpoint {loaded.path} were trained on"
        check_same_data(f"router {router_path} comes from", {"experts": router.sharding},
                        {"experts": (loaded.sharding, trained)})
    if router.num_experts != loaded.model.num_experts:
        raise ConfigError(f"router has {router.num_experts} centroids, checkpoint {loaded.path} has "
                          f"{loaded.model.num_experts} experts")
    return router


def ensemble_val_windows(data_dir: str | Path, limit: int | None = None,
                         weights: LoadedExperts | None = None) -> EvalSet:
    """The ensemble-validation set of a prepared dataset folder, optionally its first `limit` windows;
    refused when `weights` were trained on another prepared dataset (their held-out windows differ)
    or when the file is not the one its manifest recorded."""
    folder = Path(data_dir).expanduser()
    manifest = open_prepared(folder, "--data")
    if weights is not None:
        check_same_data(f"checkpoint {weights.path} was trained on", weights.trained_on,
                        {"dataset": (manifest["fingerprint"], f"--data {data_dir}")})
    evalset = load_eval_set(folder, manifest, "ensemble_val")
    if len(evalset) == 0:
        raise DataError(f"{Path(data_dir) / ENSEMBLE_VAL_FILE} holds no windows")
    if limit is not None:
        evalset = EvalSet(*(array[:limit] for array in
                            (evalset.windows, evalset.doc_ids, evalset.sources, evalset.offsets)))
    return evalset


def window_pool(data_dir: str | Path | None, count: int, seed: int) -> Tensor:
    """`count` distinct windows `[count, 1025] uint8`: ensemble-validation windows, or random bytes.

    Windows are drawn without replacement (seeded) from the prepared set when `data_dir` is given.
    Raises DataError when the set has fewer than `count` windows.
    """
    generator = torch.Generator().manual_seed(seed)
    if data_dir is None:
        return torch.randint(0, 256, (count, WINDOW_BYTES), generator=generator, dtype=torch.uint8)
    windows = ensemble_val_windows(data_dir).windows
    if len(windows) < count:
        raise DataError(f"{Path(data_dir) / ENSEMBLE_VAL_FILE} has {len(windows)} windows, {count} needed")
    picks = torch.randperm(len(windows), generator=generator)[:count]
    return torch.from_numpy(np.ascontiguousarray(windows))[picks]
