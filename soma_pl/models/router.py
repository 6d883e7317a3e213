"""The router: an encoder of a window's first 256 bytes plus N centroids; top-k expert selection.

At inference a window goes to the experts whose centroids are nearest to the encoding of its first
256 input bytes (Table 1: routing sees 256 bytes, k = 4 experts are averaged). Two encoders:

- :class:`SeedEncoder`: the frozen monolithic seed model; a prefix is the mean of its final d_E-wide
  features over the 256 positions (the paper's semantic embedding).
- :class:`HashedNgramEncoder`: counts of hashed byte n-grams, for when there is no seed model yet.

The router is not part of any expert: Table 2's model sizes do not count it, and the seed model it
wraps stays frozen (its parameters have ``requires_grad=False``).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from torch import Tensor, nn

from soma_pl import ROUTE_BYTES
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.checkpoints import monolithic_state, read_weights_only
from soma_pl.models.stacked import HeadMode, StackedExperts

ROUTER_FORMAT = 1
_HASH_PRIME = 2_147_483_647  # 2³¹ − 1: products with coefficients below it stay inside int64
_BYTE_BASE = 257


class EncoderKind(str, Enum):
    """Which encoder embeds a window's first 256 bytes (configs write the lowercase names)."""

    seed = "seed"
    hashed = "hashed"


def _route_prefix(windows: Tensor) -> Tensor:
    """`windows: [b, >=256]` uint8 → the routed prefix `[b, 256]` as int64."""
    if windows.dim() != 2 or windows.shape[1] < ROUTE_BYTES:
        raise ValueError(f"windows of shape {tuple(windows.shape)}: expected [b, >={ROUTE_BYTES}] bytes")
    return windows[:, :ROUTE_BYTES].long()


def _unit(x: Tensor) -> Tensor:
    """Rows scaled to unit L2 norm (a zero row stays zero)."""
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12)


def prefix_batch(texts: Sequence[bytes], device: torch.device | str = "cpu") -> Tensor:
    """The first 256 bytes of each text as `[b, 256] uint8` (every text must have that many)."""
    short = [i for i, text in enumerate(texts) if len(text) < ROUTE_BYTES]
    if short:
        raise ValueError(f"{len(short)} texts shorter than the {ROUTE_BYTES} routed bytes")
    rows = np.frombuffer(b"".join(text[:ROUTE_BYTES] for text in texts), dtype=np.uint8)
    return torch.from_numpy(rows.reshape(len(texts), ROUTE_BYTES).copy()).to(device)


class HashedNgramEncoder(nn.Module):
    """Counts of hashed byte n-grams of the first 256 bytes, log1p-scaled and L2-normalised.

    Each n-gram is read as a base-257 number modulo the prime 2³¹−1 and bucketed by a universal
    hash `((a·x + c) mod p) mod dim` whose coefficients `(a, c)` are drawn per order from `seed`:
    integer arithmetic only, so every device gives the same buckets. :meth:`fit_center` can then
    remove a corpus's mean encoding (a `center` buffer, saved with the router): what all text of a
    corpus shares (common English n-grams) otherwise dominates the distances k-means sees.

    Args:
        dim: number of buckets (the encoding width).
        orders: n-gram lengths counted.
        seed: draws the hash coefficients.
    """

    kind = EncoderKind.hashed

    def __init__(self, dim: int = 256, orders: Sequence[int] = (1, 2, 3), seed: int = 0):
        super().__init__()
        if dim < 1 or not orders or min(orders) < 1 or max(orders) > ROUTE_BYTES:
            raise ConfigError(f"hashed encoder: dim={dim} must be >= 1 and orders={list(orders)} in [1, {ROUTE_BYTES}]")
        self.dim, self.orders, self.seed = int(dim), tuple(int(n) for n in orders), int(seed)
        rng = np.random.default_rng(self.seed)
        self._coefficients = [(int(rng.integers(1, _HASH_PRIME)), int(rng.integers(0, _HASH_PRIME)))
                              for _ in self.orders]
        self.register_buffer("center", torch.zeros(self.dim))

    @property
    def output_dim(self) -> int:
        return self.dim

    def config(self) -> dict:
        return {"dim": self.dim, "orders": list(self.orders), "seed": self.seed}

    @torch.no_grad()
    def encode(self, windows: Tensor) -> Tensor:
        """`windows: [b, >=256]` uint8 → `[b, dim]` float32, unit L2 norm."""
        prefix = _route_prefix(windows).to(self.center.device)
        batch = prefix.shape[0]
        rows = torch.arange(batch, device=prefix.device)[:, None] * self.dim
        flat = []
        for order, (scale, shift) in zip(self.orders, self._coefficients, strict=False):
            code = torch.zeros_like(prefix[:, : ROUTE_BYTES - order + 1])
            for offset in range(order):
                code = (code * _BYTE_BASE + prefix[:, offset : offset + code.shape[1]]) % _HASH_PRIME
            flat.append((rows + (code * scale + shift) % _HASH_PRIME % self.dim).reshape(-1))
        counts = torch.bincount(torch.cat(flat), minlength=batch * self.dim).view(batch, self.dim)
        return _unit(_unit(torch.log1p(counts.float())) - self.center)

    @torch.no_grad()
    def fit_center(self, encodings: Tensor) -> Tensor:
        """Centre this encoder on a corpus.

        Args:
            encodings: `[n, dim]` encodings of the corpus made by this encoder before any centring.

        Returns:
            the same encodings re-centred, `[n, dim]`, as :meth:`encode` now gives them.
        """
        if bool(self.center.any()):
            raise ValueError("the hashed encoder is already centred")
        self.center.copy_(encodings.mean(0))
        return _unit(encodings - self.center)


class SeedEncoder(nn.Module):
    """The frozen monolithic seed model: mean of its final d_E features over the first 256 bytes.

    Args:
        model: a `StackedExperts` with one expert (E = 1).
    """

    kind = EncoderKind.seed

    def __init__(self, model: StackedExperts):
        super().__init__()
        if model.num_experts != 1:
            raise ConfigError(f"a seed model is monolithic (1 expert), got {model.num_experts} experts")
        self.model = model.requires_grad_(False).eval()

    @property
    def output_dim(self) -> int:
        return self.model.embed_dim

    def config(self) -> dict:
        m = self.model
        return {"width": m.width, "num_layers": m.num_layers, "embed_dim": m.embed_dim, "head": m.head_mode.value}

    @classmethod
    def from_config(cls, config: dict, state: dict[str, Tensor] | None = None) -> SeedEncoder:
        model = StackedExperts(1, config["width"], config["embed_dim"], config["num_layers"], HeadMode(config["head"]))
        if state is not None:
            model.load_state_dict(state)
        return cls(model)

    @classmethod
    def from_checkpoint(cls, path: str | Path) -> SeedEncoder:
        """The seed model of a monolithic Lightning checkpoint (`model.*` weights).

        Raises:
            DataError: the file is missing or unreadable.
            ConfigError: it does not hold a monolithic stacked-expert model.
        """
        state, config = monolithic_state(path)
        try:
            return cls.from_config(config, state)
        except RuntimeError as error:
            raise ConfigError(f"seed checkpoint {path}: {_first_line(error)}") from error

    @torch.no_grad()
    def encode(self, windows: Tensor) -> Tensor:
        """`windows: [b, >=256]` uint8 → `[b, d_E]` float32."""
        tokens = _route_prefix(windows).to(self.model.head.device)[None]
        params = self.model.group_parameters({}, 1)
        total = sum(chunk.sum(dim=2) for chunk in self.model.features(params, tokens))
        return (total[0] / ROUTE_BYTES).float()


def encoder_from_saved(kind: str, config: dict, state: dict[str, Tensor]) -> nn.Module:
    """An encoder rebuilt from its kind (`EncoderKind` value), `config()` and state dict."""
    seed = EncoderKind(kind) is EncoderKind.seed
    encoder = SeedEncoder.from_config(config) if seed else HashedNgramEncoder(**config)
    encoder.load_state_dict(state)
    return encoder


class Router(nn.Module):
    """Nearest-centroid routing of a window's first 256 bytes to N experts.

    Args:
        encoder: a `SeedEncoder` or `HashedNgramEncoder`.
        centroids: `[N, D]`, D the encoder's output width; expert e's centroid is row e.
        sharding: the fingerprint of the sharding that fitted it (`experts.json`'s `fingerprint`),
            saved with it so that a router of another sharding can be told apart; None: unknown.
    """

    def __init__(self, encoder: nn.Module, centroids: Tensor, sharding: str | None = None):
        super().__init__()
        if centroids.dim() != 2 or centroids.shape[1] != encoder.output_dim:
            raise ConfigError(f"centroids of shape {tuple(centroids.shape)}: expected [N, {encoder.output_dim}]")
        self.encoder = encoder
        self.sharding = sharding
        self.register_buffer("centroids", centroids.detach().float().clone())

    @property
    def num_experts(self) -> int:
        return self.centroids.shape[0]

    @torch.no_grad()
    def scores(self, windows: Tensor) -> Tensor:
        """Negative squared distance of each window's encoding to each centroid: `[b, >=256]` → `[b, N]`."""
        encoded = self.encoder.encode(windows).to(self.centroids.device)
        return -(encoded[:, None, :] - self.centroids[None]).pow(2).sum(-1)

    def ranking(self, windows: Tensor) -> Tensor:
        """Expert indices best first, ties broken by the lower index: `[b, >=256]` → `[b, N]` int64."""
        return torch.sort(self.scores(windows), dim=1, descending=True, stable=True).indices

    def top_k(self, windows: Tensor, k: int) -> Tensor:
        """The k best experts of each window: `[b, >=256]` → `[b, k]` int64 (paper: k = 4)."""
        if not 1 <= k <= self.num_experts:
            raise ConfigError(f"top_k: k={k} must be in [1, {self.num_experts}]")
        return self.ranking(windows)[:, :k]

    def save_to(self, target: str | Path | BinaryIO) -> None:
        """Write the router (encoder kind, config and state, centroids) to a path or binary stream."""
        payload = {
            "format": ROUTER_FORMAT,
            "encoder": {"kind": self.encoder.kind.value, "config": self.encoder.config(),
                        "state": {k: v.detach().cpu() for k, v in self.encoder.state_dict().items()}},
            "centroids": self.centroids.cpu(),
            "sharding": self.sharding,
        }
        torch.save(payload, target)

    def save(self, path: str | Path) -> Path:
        """Write the router to one `.pt` file atomically (a temporary file, then a rename)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        try:
            self.save_to(temporary)
            os.replace(temporary, path)
        except BaseException:
            temporary.unlink(missing_ok=True)  # a full disk must not keep a half-written temporary
            raise
        return path

    @classmethod
    def load_from(cls, source: str | Path | BinaryIO, name: str, map_location: torch.device | str = "cpu") -> Router:
        """Read a router written by :meth:`save_to`; `name` says where it came from in errors.

        Raises:
            DataError: the content is corrupt or not a router.
        """
        try:
            payload = read_weights_only(source, map_location)
            if payload.get("format") != ROUTER_FORMAT:
                raise ValueError(f"format {payload.get('format')!r}, expected {ROUTER_FORMAT}")
            encoder = payload["encoder"]
            return cls(encoder_from_saved(encoder["kind"], encoder["config"], encoder["state"]), payload["centroids"],
                       payload.get("sharding"))
        except Exception as error:  # a damaged pickle/zip raises many types; all mean the same here
            raise DataError(f"corrupt router {name}: {_first_line(error)}") from error

    @classmethod
    def load(cls, path: str | Path, map_location: torch.device | str = "cpu") -> Router:
        """Read a router file written by :meth:`save`.

        Raises:
            DataError: the file is missing, corrupt, or not a router.
        """
        path = Path(path)
        if not path.is_file():
            raise DataError(f"router file not found: {path}")
        return cls.load_from(path, f"file {path}", map_location)


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
