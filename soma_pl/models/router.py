"""The router: an encoder of a window's first 256 bytes plus N centroids; top-k expert selection.

At inference a window goes to the experts whose centroids are nearest to the encoding of its first
256 input bytes (Table 1: routing sees 256 bytes, k = 4 experts are averaged). Two encoders:

- :class:`TfidfEncoder`: the paper's: word-level tf–idf, a 128-dimensional truncated SVD, the mean
  removed, unit length (§4, App. D); with unit centroids, nearest is most cosine-similar.
- :class:`HashedNgramEncoder`: counts of hashed byte n-grams, an ablation that needs no fitting.

The router is not part of any expert: Table 2's model sizes do not count it. It runs on the CPU
on sparse features whatever device the experts use.
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
from soma_pl.models.checkpoints import read_weights_only

ROUTER_FORMAT = 1
_HASH_PRIME = 2_147_483_647  # 2³¹ − 1: products with coefficients below it stay inside int64
_BYTE_BASE = 257


class EncoderKind(str, Enum):
    """Which encoder embeds a window's first 256 bytes (configs write the lowercase names)."""

    tfidf = "tfidf"
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
    integer arithmetic only, so every device gives the same buckets. An ablation encoder that needs
    no fitting (the tests' routers); sharding fits :class:`TfidfEncoder`.

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
        self.register_buffer("device_marker", torch.zeros(0), persistent=False)

    @property
    def output_dim(self) -> int:
        return self.dim

    def config(self) -> dict:
        return {"dim": self.dim, "orders": list(self.orders), "seed": self.seed}

    @torch.no_grad()
    def encode(self, windows: Tensor) -> Tensor:
        """`windows: [b, >=256]` uint8 → `[b, dim]` float32, unit L2 norm."""
        prefix = _route_prefix(windows).to(self.device_marker.device)
        batch = prefix.shape[0]
        rows = torch.arange(batch, device=prefix.device)[:, None] * self.dim
        flat = []
        for order, (scale, shift) in zip(self.orders, self._coefficients, strict=False):
            code = torch.zeros_like(prefix[:, : ROUTE_BYTES - order + 1])
            for offset in range(order):
                code = (code * _BYTE_BASE + prefix[:, offset : offset + code.shape[1]]) % _HASH_PRIME
            flat.append((rows + (code * scale + shift) % _HASH_PRIME % self.dim).reshape(-1))
        counts = torch.bincount(torch.cat(flat), minlength=batch * self.dim).view(batch, self.dim)
        return _unit(torch.log1p(counts.float()))


VECTORIZER = {"sublinear_tf": True, "stop_words": "english", "decode_error": "ignore"}
"""The tf–idf settings every fitted vocabulary shares (App. D): sublinear term frequencies, English
stop words, bytes decoded as UTF-8 with invalid sequences left out of the features."""


class TfidfEncoder(nn.Module):
    """The paper's router features (§4, App. D): word-level tf–idf → truncated SVD → mean removed,
    L2-normalised.

    A text's bytes are decoded as UTF-8 ignoring errors (the model still reads and scores every
    byte); its tf–idf row (the fitted vocabulary and idf, L2-normalised) is projected on the SVD's
    components, the fitted mean is subtracted and the row scaled to unit length. `fit` lives with the
    sharding that fits it (`soma_pl.data.sharding.assign.fit_router`).

    Args:
        vocabulary: the fitted terms, in column order.
        dim: SVD dimensions (paper: 128).
    """

    kind = EncoderKind.tfidf

    def __init__(self, vocabulary: Sequence[str] = (), dim: int = 128):
        super().__init__()
        self.vocabulary = list(vocabulary)
        self.register_buffer("idf", torch.ones(len(self.vocabulary), dtype=torch.float64))
        self.register_buffer("components", torch.zeros(dim, len(self.vocabulary), dtype=torch.float64))
        self.register_buffer("mean", torch.zeros(dim, dtype=torch.float64))
        self._cached = None

    @property
    def output_dim(self) -> int:
        return self.components.shape[0]

    def config(self) -> dict:
        return {"vocabulary": self.vocabulary, "dim": self.output_dim}

    def load_state_dict(self, *args, **kwargs):  # the cached vectorizer holds the old idf
        self._cached = None
        return super().load_state_dict(*args, **kwargs)

    def _vectorizer(self):
        if self._cached is None:
            from sklearn.feature_extraction.text import TfidfVectorizer

            vectorizer = TfidfVectorizer(vocabulary=self.vocabulary, **VECTORIZER)
            vectorizer.idf_ = self.idf.cpu().numpy()
            self._cached = (vectorizer, self.components.cpu().numpy().T.copy(), self.mean.cpu().numpy())
        return self._cached

    def features(self, texts: Sequence[bytes]) -> np.ndarray:
        """`[n, dim]` float32 unit rows (a text with no known term gets minus the mean, normalised)."""
        vectorizer, components_t, mean = self._vectorizer()
        reduced = np.asarray(vectorizer.transform(list(texts)) @ components_t) - mean
        return (reduced / np.maximum(np.linalg.norm(reduced, axis=1, keepdims=True), 1e-12)).astype(np.float32)

    @torch.no_grad()
    def encode(self, windows: Tensor) -> Tensor:
        """`windows: [b, >=256]` uint8 → `[b, dim]` float32 from the first 256 bytes, on the CPU."""
        prefix = _route_prefix(windows).to(torch.uint8).cpu().numpy()
        return torch.from_numpy(self.features([row.tobytes() for row in prefix])).to(self.mean.device)


def encoder_from_saved(kind: str, config: dict, state: dict[str, Tensor]) -> nn.Module:
    """An encoder rebuilt from its kind (`EncoderKind` value), `config()` and state dict."""
    encoder = (TfidfEncoder if EncoderKind(kind) is EncoderKind.tfidf else HashedNgramEncoder)(**config)
    encoder.load_state_dict(state)
    return encoder


class Router(nn.Module):
    """Nearest-centroid routing of a window's first 256 bytes to N experts.

    Args:
        encoder: a `TfidfEncoder` or `HashedNgramEncoder`.
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
