"""The pinned corpus: fixed bytes in memory, served in the batch structures `ByteDataModule` yields.

The pinned-loss tests guard the training arithmetic, not the data pipeline, so their windows never
pass through `prepare` or `shard`: every byte is a pure function of the constants below (words
picked by a 64-bit linear congruential generator, no library RNG), and `PinnedData` hands them to a
plain `lightning.Trainer` as `ByteDataModule` would:

- training: `[E, B, 1025] uint8`, row block e from expert e's own text (E = 1: a text of both genres);
- validation loader 0 (the ensemble-validation set): `(windows [b, 1025] uint8, index [b])`, windows
  of both genres in turn;
- validation loader 1 (each expert's held-out split): `(windows [E, b, 1025] uint8, valid [E, b])`.

The two genres are disjoint vocabularies, so a router on the first 256 bytes (`pinned_router`) sends
each window to its genre's expert.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from soma_pl import WINDOW_BYTES
from soma_pl.models.router import HashedNgramEncoder, Router

SEA = ("tide wave salt shore gull harbour sail current reef anchor keel mast spray dune lighthouse "
       "buoy ebb foam").split()
CODE = ("function return value loop index array compile branch stack parse token module import "
        "class yield lambda").split()
GENRES = {"sea": (SEA,), "code": (CODE,), "mixed": (SEA, CODE)}
"""A genre's vocabularies; a `mixed` text draws each sentence's vocabulary in turn."""
EXPERT_GENRES = {1: ("mixed",), 2: ("sea", "code")}
"""The genre of each expert's training and held-out text, by number of experts."""
SENTENCE_WORDS = 7
_MULTIPLIER, _INCREMENT, _MASK = 6364136223846793005, 1442695040888963407, (1 << 64) - 1
"""Knuth's MMIX linear congruential generator: fixed integer arithmetic on every platform."""


def text(genre: str, windows: int, seed: int) -> bytes:
    """At least `windows · 1025` bytes of sentences of the genre's words, fixed by `seed`."""
    vocabularies = GENRES[genre]
    state, sentences, size = seed, [], 0
    while size < windows * WINDOW_BYTES:
        vocabulary = vocabularies[len(sentences) % len(vocabularies)]
        words = []
        for _ in range(SENTENCE_WORDS):
            state = (state * _MULTIPLIER + _INCREMENT) & _MASK
            words.append(vocabulary[(state >> 33) % len(vocabulary)])
        sentence = " ".join(words).capitalize() + ". "
        sentences.append(sentence)
        size += len(sentence)
    return "".join(sentences).encode()


def windows(genre: str, count: int, seed: int) -> torch.Tensor:
    """`[count, 1025] uint8`: consecutive windows of one text."""
    data = torch.frombuffer(bytearray(text(genre, count, seed)[: count * WINDOW_BYTES]), dtype=torch.uint8)
    return data.view(count, WINDOW_BYTES).clone()


class FixedBatches(IterableDataset):
    """The training batches, in order: an iterable, so that under DDP every rank reads all of them
    (Lightning deals out only map-style datasets), as DDPP's replicated stream does."""

    def __init__(self, batches: list[torch.Tensor]):
        self.batches = batches

    def __iter__(self):
        return iter(self.batches)


class IndexedWindows(Dataset):
    """Item i is `(window [1025] uint8, i)`, as the ensemble-validation set's."""

    def __init__(self, rows: torch.Tensor):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.rows[index], index


class ExpertBatches(Dataset):
    """Item i is batch i of every expert's held-out windows: `([E, b, 1025] uint8, valid [E, b])`."""

    def __init__(self, rows: torch.Tensor, batch_size: int):
        self.batches = [(part, torch.ones(part.shape[:2], dtype=torch.bool)) for part in rows.split(batch_size, dim=1)]

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.batches[index]


class PinnedData(L.LightningDataModule):
    """The pinned corpus for E experts.

    Args:
        experts: E (1 or 2).
        batch_size: training windows per expert per batch (B).
        steps: training batches (one per update).
        eval_batch_size: windows per validation batch.
        val_windows: ensemble-validation windows (half of each genre).
        expert_val_windows: held-out windows per expert.
    """

    def __init__(self, experts: int, batch_size: int, steps: int, eval_batch_size: int = 4, val_windows: int = 8,
                 expert_val_windows: int = 4):
        super().__init__()
        genres = EXPERT_GENRES[experts]
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        train = torch.stack([windows(genre, steps * batch_size, 100 + e) for e, genre in enumerate(genres)])
        self.train = list(train.split(batch_size, dim=1))
        self.expert_val = torch.stack([windows(genre, expert_val_windows, 200 + e) for e, genre in enumerate(genres)])
        sea, code = windows("sea", val_windows // 2, 300), windows("code", val_windows // 2, 301)
        self.val = torch.stack([sea, code], dim=1).reshape(-1, WINDOW_BYTES)  # sea, code, sea, code, ...

    def train_dataloader(self) -> DataLoader:
        return DataLoader(FixedBatches(self.train), batch_size=None)

    def val_dataloader(self) -> list[DataLoader]:
        return [DataLoader(IndexedWindows(self.val), batch_size=self.eval_batch_size, shuffle=False),
                DataLoader(ExpertBatches(self.expert_val, self.eval_batch_size), batch_size=None)]


def pinned_router(folder: Path) -> str:
    """A two-expert router (hashed byte n-grams; expert 0's centroid a sea window, expert 1's a code
    window) saved as `<folder>/router.pt`; its path."""
    encoder = HashedNgramEncoder(dim=64, orders=(1, 2, 3), seed=0)
    centroids = encoder.encode(torch.cat([windows("sea", 1, 400), windows("code", 1, 401)]))
    return str(Router(encoder, centroids).save(Path(folder) / "router.pt"))
