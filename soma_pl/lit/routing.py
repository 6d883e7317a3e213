"""Routed top-k evaluation for modules of several experts (SOMA, BPTT with N > 1).

`Routing` is a field of the module (`module.routing`, a submodule): it loads the sharding's router, ranks each
window's experts on its first 256 bytes, sets the evaluated ensemble size k, and keeps the router
inside checkpoints. Scoring itself is `ByteLMModule`'s, so every ensemble is evaluated by one code path.

A router records the sharding that fitted it. One from another sharding than the experts were
trained on (the checkpoint's router) or are trained and validated on (`data.experts_dir`) routes
windows to the wrong experts without any error, so it is refused.
"""

from __future__ import annotations

import io
from pathlib import Path

import torch
from torch import Tensor, nn

from soma_pl import ROUTE_BYTES
from soma_pl.contracts import ReadsExpertShards
from soma_pl.data.formats.expert_sets import read_experts_manifest
from soma_pl.errors import ConfigError
from soma_pl.models.checkpoints import check_same_data
from soma_pl.models.router import Router

PREFIX = "routing.router."
"""Where the router's tensors sit in a module's state dict."""


class Routing(nn.Module):
    """Router and top-k of a model of `num_experts` experts; one expert is not routed.

    A submodule of the host: the router's tensors are in the host's state dict (`routing.router.*`)
    and, whole, in its checkpoints (`save`, `load`).

    Args:
        num_experts: the host model's experts.
        top_k: experts averaged in evaluation (capped at N).
        router_path: the sharding's `router.pt`; None: `<data.experts_dir>/router.pt`.
    """

    def __init__(self, num_experts: int, top_k: int, router_path: str | None):
        super().__init__()
        if top_k < 1:
            raise ConfigError(f"top_k={top_k} must be >= 1")
        self.num_experts = num_experts
        self.top_k = top_k
        self.router_path = router_path
        self.router: Router | None = None
        self.experts_dir: str | None = None
        """The sharded dataset the trainer's data module reads (set by `setup`; None: none)."""
        self.trained_sharding: str | None = None
        """The sharding of the router a loaded checkpoint carries: the one its experts learned."""

    @property
    def routed(self) -> bool:
        return self.num_experts > 1

    @property
    def eval_k(self) -> int:
        """Ensemble size whose loss is `val/loss` and `test/loss`."""
        return min(self.top_k, self.num_experts)

    def setup(self, data: object, resuming: bool) -> None:
        """Note the data module's sharded dataset; load the configured (or the data's) router for a
        fresh run (a checkpoint brings its own) and check it."""
        self.experts_dir = data.experts_dir if isinstance(data, ReadsExpertShards) else None
        origin = "the router"
        if self.routed and self.router is None and not resuming:
            path = self.router_path or self._default_router_path()
            self.router, origin = Router.load(path), f"router {path}"
        self.check(origin)

    def check(self, origin: str = "the router") -> None:
        """Refuse a router that does not fit the model or comes from another sharding than the
        checkpoint's experts or the data's (a router or sharding recording none is not compared).

        Args:
            origin: where the router came from, for the message.

        Raises:
            ConfigError: another number of centroids than experts.
            DataError: another sharding (`check_same_data`).
        """
        router = self.router
        if router is None:
            return
        if router.num_experts != self.num_experts:
            raise ConfigError(f"{origin} has {router.num_experts} centroids, the model {self.num_experts} experts")
        expected = [(self.trained_sharding, "the one this checkpoint's experts were trained on")]
        if self.experts_dir is not None:
            expected.append((read_experts_manifest(Path(self.experts_dir).expanduser()).get("fingerprint"),
                             f"data.init_args.experts_dir={self.experts_dir}"))
        for sharding, where in expected:
            check_same_data(f"{origin} comes from", {"experts": router.sharding}, {"experts": (sharding, where)})

    def use(self, path: str | Path, origin: str) -> None:
        """Route with the router saved at `path` from now on (checked; `origin` names it in messages)."""
        self.router = Router.load(path)
        self.check(origin)

    def _default_router_path(self) -> str:
        if self.experts_dir is None:
            raise ConfigError(f"a model of {self.num_experts} experts needs a router: set "
                              f"model.init_args.router_path or data.init_args.experts_dir")
        return str(Path(self.experts_dir) / "router.pt")

    def ranking(self, windows: Tensor) -> Tensor:
        """Expert order per window, best first: `[b, E]` (one expert: `[b, 1]` of zeros)."""
        if not self.routed:
            return torch.zeros(windows.shape[0], 1, dtype=torch.long, device=windows.device)
        self.router.to(windows.device)
        return self.router.ranking(windows[:, :ROUTE_BYTES])

    def save(self, checkpoint: dict) -> None:
        """Keep the router inside `checkpoint`."""
        if self.router is not None:
            buffer = io.BytesIO()
            self.router.save_to(buffer)
            checkpoint["router"] = buffer.getvalue()

    def load(self, checkpoint: dict) -> None:
        """Take the router a checkpoint carries (before its state dict is loaded), and remember the
        sharding it was trained on."""
        if "router" in checkpoint:
            self.router = Router.load_from(io.BytesIO(checkpoint["router"]), "in checkpoint")
            self.trained_sharding = self.router.sharding
            self.check("the checkpoint's router")
