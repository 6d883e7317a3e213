"""Routed top-k evaluation for modules of several experts (SOMA, BPTT with N > 1).

A mixin placed before the module's base class: it loads the sharding's router, ranks each window's
experts on its first 256 bytes, sets the evaluated ensemble size k, and keeps the router inside
checkpoints. Scoring itself is `ByteLMModule`'s, so every ensemble is evaluated by one code path.
"""

from __future__ import annotations

import io
from pathlib import Path

from torch import Tensor

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError
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

    @property
    def routed(self) -> bool:
        return self.model.num_experts > 1

    def setup(self, stage: str) -> None:
        super().setup(stage)
        if self.routed and self.router is None and self.trainer.ckpt_path is None:  # a checkpoint brings its own
            self.router = Router.load(self.router_path or self._default_router_path())
        if self.router is not None and self.router.num_experts != self.model.num_experts:
            raise ConfigError(f"router has {self.router.num_experts} centroids, the model {self.model.num_experts} experts")

    def _default_router_path(self) -> str:
        experts_dir = getattr(self.trainer.datamodule, "experts_dir", None) if self._trainer else None
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
