"""The endless training stream: `[E, B, 1025] uint8` batches, row block e from expert e's shards.

Each expert's stream reads its shards in a freshly shuffled order every pass, cuts each document
into consecutive 1,025-byte windows from a random start, and mixes them through a shuffle buffer.
Every consumer (DataLoader worker × DDP rank) reads a disjoint part of each expert's data: whole
shards when there are enough of them, otherwise every consumer reads all shards and keeps every
`consumers`-th document. The stream is a pure function of (seed, consumer layout), so a resumed run
replays it and skips the batches already consumed (`skip_batches`).

How DDP ranks share the data depends on the training mode (`RankSplit`): plain data parallelism
gives each rank disjoint documents; DDPP gives every rank the one global stream, from which each
rank evaluates its own micro-batches; expert-parallel SOMA gives rank r only its own experts' streams,
each exactly the stream a single process would read for that expert.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from soma_pl import WINDOW_BYTES
from soma_pl.data.formats.tar_shards import iter_shard_documents
from soma_pl.errors import DataError


def consumer_slice(shards: Sequence[Path], consumer: int, consumers: int) -> tuple[list[Path], int, int]:
    """The part of `shards` one consumer reads: `(shards, document stride, document offset)`.

    With at least as many shards as consumers, shards are dealt out round-robin and every document
    of them is kept (stride 1); with fewer, all shards are read and documents are dealt out.
    """
    if len(shards) >= consumers:
        return list(shards[consumer::consumers]), 1, 0
    return list(shards), consumers, consumer


def document_windows(text: bytes, rng: np.random.Generator, window: int = WINDOW_BYTES) -> list[np.ndarray]:
    """Consecutive non-overlapping windows of `text` from a random start in `[0, window)`."""
    data = np.frombuffer(text, dtype=np.uint8)
    spare = len(data) - window
    if spare < 0:
        return []
    start = int(rng.integers(0, min(spare, window - 1) + 1))
    return [data[offset : offset + window] for offset in range(start, len(data) - window + 1, window)]


def fixed_windows(shards: Sequence[Path], count: int | None = None) -> torch.Tensor:
    """The windows of the shards' documents, each document cut from its start into consecutive
    1,025-byte windows: `[n, 1025]`, all of them, or `count` spread over the documents.

    With `count`, every document gives its first windows in turn, as evenly as their lengths allow
    (k each from the documents that have k, one more from the first ones until `count`), so a
    capped split measures all its documents rather than the first one or two. The same on every call;
    memory is O(count) windows.

    Raises:
        DataError: the shards hold no document long enough for a window.
    """
    lengths = [len(d.text) // WINDOW_BYTES for shard in shards for d in iter_shard_documents(shard)]
    if not any(lengths):
        raise DataError(f"no {WINDOW_BYTES}-byte window in validation shards {[str(s) for s in shards]}")
    take = lengths if count is None else _spread(lengths, count)
    rows: list[np.ndarray] = []
    documents = (d for shard in shards for d in iter_shard_documents(shard))
    for document, k in zip(documents, take, strict=False):
        data = np.frombuffer(document.text, dtype=np.uint8)
        rows.extend(data[i * WINDOW_BYTES : (i + 1) * WINDOW_BYTES] for i in range(k))
    return torch.from_numpy(np.stack(rows))


def _spread(lengths: list[int], count: int) -> list[int]:
    """Windows to take from each document: the largest level k with Σ min(n, k) ≤ count, then one
    more from the first documents that have more, until `count` (or every window) is taken."""
    level = 0
    while level < max(lengths) and sum(min(n, level + 1) for n in lengths) <= count:
        level += 1
    take = [min(n, level) for n in lengths]
    left = count - sum(take)
    for i, n in enumerate(lengths):
        if left > 0 and n > take[i]:
            take[i] += 1
            left -= 1
    return take


class ExpertWindows:
    """One expert's endless window iterator for one consumer."""

    def __init__(self, shards: Sequence[Path], consumer: int, consumers: int, buffer_size: int,
                 rng: np.random.Generator):
        if not shards:
            raise DataError("an expert stream has no training shards")
        self.shards, self.stride, self.offset = consumer_slice(shards, consumer, consumers)
        self.buffer_size = max(1, buffer_size)
        self.rng = rng
        self.buffer: list[np.ndarray] = []
        self._source = self._windows()

    def _windows(self) -> Iterator[np.ndarray]:
        while True:
            produced = 0
            for shard_index in self.rng.permutation(len(self.shards)).tolist():
                for number, document in enumerate(iter_shard_documents(self.shards[shard_index])):
                    if number % self.stride == self.offset:
                        windows = document_windows(document.text, self.rng)
                        produced += len(windows)
                        yield from windows
            if produced == 0:
                raise DataError(f"no {WINDOW_BYTES}-byte window in shards {self.shards[0].parent}")

    def take(self, count: int) -> np.ndarray:
        """`count` windows drawn through the shuffle buffer: `[count, 1025] uint8`."""
        rows = np.empty((count, WINDOW_BYTES), dtype=np.uint8)
        for row in range(count):
            while len(self.buffer) < self.buffer_size:
                self.buffer.append(next(self._source))
            pick = int(self.rng.integers(len(self.buffer)))
            rows[row] = self.buffer[pick]
            self.buffer[pick] = self.buffer[-1]
            self.buffer.pop()
        return rows


class WindowStream(IterableDataset):
    """Endless `[E, B, 1025] uint8` training batches for E experts (E = 1: monolithic).

    Args:
        shard_sets: per expert, its training shard paths.
        batch_size: rows per expert per batch (B).
        seed: the stream's seed; with the consumer layout it fixes every batch.
        shuffle_buffer: windows held per expert for shuffling.
        rank, world_size: this process's DDP rank and the number of ranks reading disjoint documents
            (0 and 1 when every rank reads whole streams: `RankSplit.replicated`, `experts`).
        skip_batches: batches to skip from the start (a resumed run's consumed batches).
        expert_ids: the global index of each shard set's expert (default `0..E-1`); it seeds that
            expert's stream, so a rank holding experts 4..7 reads what one process reads for them.
    """

    def __init__(self, shard_sets: Sequence[Sequence[Path]], batch_size: int, seed: int = 0,
                 shuffle_buffer: int = 1024, rank: int = 0, world_size: int = 1, skip_batches: int = 0,
                 expert_ids: Sequence[int] | None = None):
        super().__init__()
        self.shard_sets = [list(shards) for shards in shard_sets]
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle_buffer = shuffle_buffer
        self.rank = rank
        self.world_size = world_size
        self.skip_batches = skip_batches
        self.expert_ids = list(range(len(self.shard_sets)) if expert_ids is None else expert_ids)

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        # A DataLoader takes batches from its workers round-robin starting at worker 0, so global
        # batch i comes from the worker playing role i % workers. Rotating roles by the skip makes
        # worker 0 play the role that owns batch `skip_batches`, the first one a resumed run needs.
        role = (worker + self.skip_batches) % workers
        consumer, consumers = self.rank * workers + role, self.world_size * workers
        experts = [
            ExpertWindows(shards, consumer, consumers, self.shuffle_buffer,
                          np.random.default_rng([self.seed, expert, consumer, consumers]))
            for expert, shards in zip(self.expert_ids, self.shard_sets, strict=True)
        ]
        index = role
        while True:
            batch = np.stack([expert.take(self.batch_size) for expert in experts])
            if index >= self.skip_batches:
                yield torch.from_numpy(batch)
            index += workers
