"""The endless training stream: `[E, B, 1025] uint8` batches, row block e from expert e's shards.

Each expert's stream reads its shards in a freshly shuffled order every pass and mixes their windows
through a shuffle buffer. A sharded dataset's records are its windows already (1,024-byte sequences
and the byte after each, `soma_pl.data.sharding`); a prepared dataset's documents are cut the same
way, per shard file (`cut_sequences`: joined end to end, a window every 1,024 bytes), so no document
is dropped for being short and no tail is lost. Every consumer (DataLoader worker × DDP rank) reads
a disjoint part of each expert's data: whole shards when there are enough of them, otherwise every
consumer reads all shards and keeps every `consumers`-th window. The stream is a pure function of
(seed, consumer layout), so a resumed run replays it and skips the batches already consumed
(`skip_batches`).

How DDP ranks share the data depends on the training mode (`RankSplit`): plain data parallelism
gives each rank disjoint windows; DDPP gives every rank the one global stream, from which each
rank evaluates its own micro-batches; expert-parallel SOMA gives rank r only its own experts' streams,
each exactly the stream a single process would read for that expert.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from soma_pl import WINDOW_BYTES
from soma_pl.data.formats.tar_shards import iter_shard_documents
from soma_pl.data.sharding.assign import cut_sequences, sequence_keys
from soma_pl.errors import DataError


def consumer_slice(shards: Sequence[Path], consumer: int, consumers: int) -> tuple[list[Path], int, int]:
    """The part of `shards` one consumer reads: `(shards, document stride, document offset)`.

    With at least as many shards as consumers, shards are dealt out round-robin and every document
    of them is kept (stride 1); with fewer, all shards are read and documents are dealt out.
    """
    if len(shards) >= consumers:
        return list(shards[consumer::consumers]), 1, 0
    return list(shards), consumers, consumer


def shard_windows(path: Path, joined: bool, subset: float = 1.0) -> np.ndarray:
    """The windows of one shard file `[n, 1025]` uint8.

    Args:
        joined: the records are documents (a prepared dataset): join and cut them (`cut_sequences`);
            otherwise every record is one window (a sharded dataset).
        subset: keep the windows whose seeded key falls in this fraction (a seed run's subset).

    Raises:
        DataError: a record of a sharded dataset is not one window.
    """
    texts = [document.text for document in iter_shard_documents(path)]
    if joined:
        windows = cut_sequences(texts)[0]
    else:
        if any(len(text) != WINDOW_BYTES for text in texts):
            raise DataError(f"{path}: a record is not one {WINDOW_BYTES}-byte window: shard the dataset again")
        windows = np.frombuffer(b"".join(texts), dtype=np.uint8).reshape(-1, WINDOW_BYTES)
    if subset < 1:
        keys = sequence_keys(0, zlib.crc32(path.name.encode()), len(windows))
        windows = windows[keys < np.uint64(int(subset * 2**64))]
    return windows


def fixed_windows(shards: Sequence[Path], count: int | None = None, joined: bool = False) -> torch.Tensor:
    """The windows of `shards` (`shard_windows`), all of them or `count` evenly spaced over them:
    `[n, 1025]`, the same on every call.

    Raises:
        DataError: the shards hold no window.
    """
    windows = [shard_windows(path, joined) for path in shards]
    rows = np.concatenate(windows) if windows else np.zeros((0, WINDOW_BYTES), dtype=np.uint8)
    if not len(rows):
        raise DataError(f"no {WINDOW_BYTES}-byte window in validation shards {[str(s) for s in shards]}")
    if count is not None and count < len(rows):
        rows = rows[np.linspace(0, len(rows) - 1, count).round().astype(np.int64)]
    return torch.from_numpy(np.ascontiguousarray(rows))


class ExpertWindows:
    """One expert's endless window iterator for one consumer."""

    def __init__(self, shards: Sequence[Path], consumer: int, consumers: int, buffer_size: int,
                 rng: np.random.Generator, joined: bool = False, subset: float = 1.0):
        if not shards:
            raise DataError("an expert stream has no training shards")
        self.shards, self.stride, self.offset = consumer_slice(shards, consumer, consumers)
        self.joined, self.subset = joined, subset
        self.buffer_size = max(1, buffer_size)
        self.rng = rng
        self.buffer: list[np.ndarray] = []
        self._source = self._windows()

    def _windows(self) -> Iterator[np.ndarray]:
        while True:
            produced = 0
            for shard_index in self.rng.permutation(len(self.shards)).tolist():
                windows = shard_windows(self.shards[shard_index], self.joined, self.subset)[self.offset :: self.stride]
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
        joined: the shards hold documents to cut (a prepared dataset), not windows (`shard_windows`).
        subset: the fraction of windows read (`shard_windows`).
    """

    def __init__(self, shard_sets: Sequence[Sequence[Path]], batch_size: int, seed: int = 0,
                 shuffle_buffer: int = 1024, rank: int = 0, world_size: int = 1, skip_batches: int = 0,
                 expert_ids: Sequence[int] | None = None, joined: bool = False, subset: float = 1.0):
        super().__init__()
        self.joined, self.subset = joined, subset
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
                          np.random.default_rng([self.seed, expert, consumer, consumers]), self.joined, self.subset)
            for expert, shards in zip(self.expert_ids, self.shard_sets, strict=True)
        ]
        index = role
        while True:
            batch = np.stack([expert.take(self.batch_size) for expert in experts])
            if index >= self.skip_batches:
                yield torch.from_numpy(batch)
            index += workers
