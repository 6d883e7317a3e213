"""`bench zo`: throughput of batched zero-order (SPSA) updates against plain inference and a naive loop.

Every record times whole updates on random bytes: an update is :func:`spsa_estimate`, the estimate
written into ``.grad`` and one ``torch.optim.SGD`` step. Token-forwards per update are
``2 · n_pert · B · T`` per expert (± evaluations of ``B`` windows of ``T`` predicted bytes). Each
time is the median of ``repeats`` runs after ``warmup`` untimed ones, on this process's threads.

Records:
    ``zo``: one expert of width d_t, batched SPSA vs inference of the unperturbed model on the
    same rows and vs a naive MeZO-style loop (one direction and sign at a time).
    ``soma_batched_vs_sequential``: E experts updated as one batched module vs one after another.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor

from soma_pl.estimators.directions import DirectionKind, directions
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.models.experts import StackedExperts

ROW_CANDIDATES: tuple[int | None, ...] = (None, 1024, 512, 256, 128)
"""Chunk sizes (windows per loss call) tried when ``max_rows`` is not given; None = all at once.
On CPU small chunks can win: 128 perturbed copies of a d_t = 181 body overflow the cache."""


@dataclass(frozen=True)
class ZOBenchSettings:
    """What one record measures; shared by all records of a run."""

    n_pert: int = 64
    """Directions per update."""
    micro_batch: int = 8
    """Windows per expert per update (B; one micro-batch)."""
    context: int = 256
    """Predicted bytes per window (T); windows hold T + 1 bytes."""
    repeats: int = 3
    """Timed runs per measurement (the median is reported)."""
    warmup: int = 1
    """Untimed runs before each measurement (allocator, caches, thread pool)."""
    max_rows: int | None = None
    """Windows per loss call; None: the fastest of :data:`ROW_CANDIDATES`, measured on the spot."""
    naive_directions: int = 8
    """Directions the naive loop is timed on; its time is scaled to n_pert."""
    embed_dim: int = 32
    num_layers: int = 4
    eps: float = 1e-3
    lr: float = 1e-3
    seed: int = 0


def median_seconds(run: Callable[[], object], repeats: int, warmup: int) -> float:
    """Median wall time of ``run()`` over ``repeats`` calls after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def random_windows(experts: int, settings: ZOBenchSettings) -> Tensor:
    """Seeded random bytes: ``[E, B, T + 1]`` uint8."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (experts, settings.micro_batch, settings.context + 1)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8)


def build_model(experts: int, width: int, settings: ZOBenchSettings) -> StackedExperts:
    """Seeded experts of width d_t with a per-expert head (every parameter perturbed)."""
    torch.manual_seed(settings.seed)
    return StackedExperts(experts, width, settings.embed_dim, settings.num_layers)


class Updater:
    """One model, its SGD optimizer and windows; each call runs one update (a fresh step)."""

    def __init__(self, model: StackedExperts, windows: Tensor, settings: ZOBenchSettings) -> None:
        self.model, self.windows, self.settings = model, windows, settings
        self.params = model.expert_parameters()
        self.optimizer = torch.optim.SGD(self.params.values(), lr=settings.lr)
        self.step = 0

    def spsa(self, max_rows: int | None) -> None:
        """Batched update: all ± evaluations of a chunk of directions in one loss call."""
        config = SPSAConfig(eps=self.settings.eps, n_pert=self.settings.n_pert,
                            micro_batch=self.settings.micro_batch, max_rows=max_rows)
        result = spsa_estimate(self.model.loss_per_group, self.params, self.windows, config,
                               step=self.step, seed=self.settings.seed)
        self._apply(result.gradient)

    @torch.no_grad()
    def naive(self, count: int) -> None:
        """MeZO-style update on ``count`` directions: perturb in place, one forward per sign.

        Directions come from the same counter-based generator as :meth:`spsa` (one at a time).
        """
        eps, experts = self.settings.eps, self.model.num_experts
        ids = torch.arange(experts)
        gradient = {name: torch.zeros_like(param) for name, param in self.params.items()}
        for k in range(count):
            z = self._direction_views(ids, k)
            self._perturb(z, eps)
            plus = self.model.loss_per_group({}, self.windows)
            self._perturb(z, -2 * eps)
            minus = self.model.loss_per_group({}, self.windows)
            self._perturb(z, eps)
            delta = (plus - minus) / (2 * eps)
            for name, grad in gradient.items():
                grad += delta.view(experts, *[1] * (grad.dim() - 1)) * z[name]
        self._apply({name: grad / count for name, grad in gradient.items()})

    def _direction_views(self, ids: Tensor, k: int) -> dict[str, Tensor]:
        """Direction k of every expert, split into parameter-shaped ``[E, ...]`` views."""
        shapes = self.model.expert_param_shapes()
        sizes = [shape.numel() for shape in shapes.values()]
        flat = directions(DirectionKind.RADEMACHER, self.settings.seed, self.step, ids,
                          torch.tensor([k]), sum(sizes))[:, 0]
        parts = flat.split(sizes, dim=1)
        return {name: part.view(-1, *shape) for (name, shape), part in zip(shapes.items(), parts)}

    def _perturb(self, z: dict[str, Tensor], scale: float) -> None:
        for name, param in self.params.items():
            param.add_(z[name], alpha=scale)

    def _apply(self, gradient: dict[str, Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = gradient[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
