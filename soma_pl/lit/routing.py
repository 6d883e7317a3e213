"""Routed top-k evaluation for modules of several experts (SOMA, BPTT with N > 1).

A mixin placed before the module's base class: it loads the sharding's router, ranks each window's
experts on its first 256 bytes, sets the evaluated ensemble size k, and keeps the router inside
checkpoints. Scoring itself is `ByteLMModule`'s, so every ensemble is evaluated by one code path.

A router records the sharding that fitted it. One from another sharding than the experts were
trained on (the checkpoint's router) or are trained and validated on (`data.experts_dir`) routes
windows to the wrong experts without any error, so it is refused.
"""

from __future__ import annotations

import io
from pathlib import Path

from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.contracts import ReadsExpertShards
from soma_pl.data.formats.expert_sets import read_experts_manifest
from soma_pl.errors import ConfigError
from soma_pl.models.checkpoints import check_same_data
from soma_pl.models.router import Router


class RoutedEnsemble:
    """Router and top-k for a module of `model.num_experts` experts; a no-op for one expert.

    The host calls `init_routing(top_k, router_path)` in its constructor.
    """

    def init_routing(self, top_k: int, router_path: str | None) -> None:
        if top_k < 1:
            raise ConfigError(f"top_k={top_k} must be >= 1")
        self.top_k = top_k
        self.router_path = router_path
        self.router: Router | None = None
        self.trained_sharding: str | None = None
        """The sharding of the router a loaded checkpoint carries: the one its experts learned."""

    @property
    def routed(self) -> bool:
        return self.model.num_experts > 1

    def setup(self, stage: str) -> None:
        super().setup(stage)
        origin = "the router"
        if self.routed and self.router is None and self.trainer.ckpt_path is None:  # a checkpoint brings its own
            path = self.router_path or self._default_router_path()
            self.router, origin = Router.load(path), f"router {path}"
        self.check_router(origin)

    def check_router(self, origin: str = "the router") -> None:
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
        if router.num_experts != self.model.num_experts:
            raise ConfigError(f"{origin} has {router.num_experts} centroids, "
                              f"the model {self.model.num_experts} experts")
        experts_dir = self._experts_dir()
        expected = [(self.trained_sharding, "the one this checkpoint's experts were trained on")]
        if experts_dir is not None:
            expected.append((read_experts_manifest(Path(experts_dir).expanduser()).get("fingerprint"),
                             f"data.init_args.experts_dir={experts_dir}"))
        for sharding, where in expected:
            check_same_data(f"{origin} comes from", {"experts": router.sharding}, {"experts": (sharding, where)})

    def _experts_dir(self) -> str | None:
        """The sharded dataset the trainer's data module reads (None: none, or no trainer yet)."""
        data = self._trainer.datamodule if self._trainer is not None else None
        return data.experts_dir if isinstance(data, ReadsExpertShards) else None

    def _default_router_path(self) -> str:
        experts_dir = self._experts_dir()
        if experts_dir is None:
            raise ConfigError(f"{type(self).__name__} of {self.model.num_experts} experts needs a router: set "
                              f"model.init_args.router_path or data.init_args.experts_dir")
        return str(Path(experts_dir) / "router.pt")

    @property
    def eval_k(self) -> int:
        return min(self.top_k, self.model.num_experts)

    def ranking(self, windows: Tensor) -> Tensor:
        if not self.routed:
            return super().ranking(windows)
        self.router.to(windows.device)
        return self.router.ranking(windows[:, :ROUTE_BYTES])

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        super().on_save_checkpoint(checkpoint)
        if self.router is not None:
            buffer = io.BytesIO()
            self.router.save_to(buffer)
            checkpoint["router"] = buffer.getvalue()

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        super().on_load_checkpoint(checkpoint)
        if "router" in checkpoint:
            self.router = Router.load_from(io.BytesIO(checkpoint["router"]), "in checkpoint")
            self.trained_sharding = self.router.sharding
            self.check_router("the checkpoint's router")
