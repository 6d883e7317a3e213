"""Held-out evaluation sets: which documents are held out, their windows, and the overlap screen.

Held-out documents are the ones with the smallest seeded hash of their id, found in one streaming
pass with a bounded heap, so the choice is deterministic for a seed and independent of corpus order.
Test candidates are screened against every training document: a candidate sharing any 50-byte
shingle (64-bit polynomial hash) with a training document is excluded (Table 1: "screened for
training overlap").
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

import numpy as np

from soma_pl import WINDOW_BYTES
from soma_pl.data.documents import Document

_SHINGLE_BASE = np.uint64(1_099_511_628_211)


def document_rank(seed: int, doc_id: str) -> int:
    """A seeded 64-bit hash of a document id: the held-out order."""
    digest = hashlib.blake2b(f"{seed}\x00{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def seeded_hash(seed: int, salt: str, doc_id: str) -> int:
    """A 64-bit hash of a document id under a seed; `salt` keeps independent uses uncorrelated."""
    digest = hashlib.blake2b(f"{seed}\0{salt}\0{doc_id}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


@dataclass(order=True)
class _Held:
    neg_rank: int
    document: Document = field(compare=False)


class HeldOutSelector:
    """Keep the `count` eligible documents of smallest rank seen in a stream (bounded memory).

    Only the first `keep_bytes` bytes of each held document are kept: evaluation needs no more.
    """

    def __init__(self, seed: int, count: int, keep_bytes: int):
        self.seed = seed
        self.count = count
        self.keep_bytes = keep_bytes
        self._heap: list[_Held] = []

    def offer(self, document: Document) -> None:
        if self.count == 0:
            return
        rank = document_rank(self.seed, document.doc_id)
        trimmed = Document(document.text[: self.keep_bytes], document.source, document.doc_id, document.title)
        item = _Held(-rank, trimmed)
        if len(self._heap) < self.count:
            heapq.heappush(self._heap, item)
        elif -rank > self._heap[0].neg_rank:
            heapq.heapreplace(self._heap, item)

    def selected(self) -> list[Document]:
        """The held documents in rank order (smallest first)."""
        return [held.document for held in sorted(self._heap, key=lambda h: -h.neg_rank)]


def test_window_offset(seed: int, document: Document, window: int = WINDOW_BYTES) -> int:
    """Where a test document's one window starts: a seeded uniform position in the document.

    Not its start: openings are formulaic (salutations, headers) and would fail the overlap screen
    far more often than the body does.
    """
    return document_rank(seed + 1, document.doc_id) % (len(document.text) - window + 1)


def shingle_hashes(data: bytes, shingle_bytes: int) -> np.ndarray:
    """64-bit polynomial hashes of every `shingle_bytes`-long substring of `data`: `[len - s + 1]`."""
    array = np.frombuffer(data, dtype=np.uint8).astype(np.uint64)
    count = len(array) - shingle_bytes + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    hashes = np.zeros(count, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for offset in range(shingle_bytes):
            hashes = hashes * _SHINGLE_BASE + array[offset : offset + count]
    return hashes


class OverlapScreen:
    """Marks test candidate windows that share a shingle with any screened training document."""

    def __init__(self, windows: list[bytes], shingle_bytes: int):
        self.shingle_bytes = shingle_bytes
        per_window = [np.unique(shingle_hashes(w, shingle_bytes)) for w in windows]
        owners = np.concatenate([np.full(len(h), i, dtype=np.int64) for i, h in enumerate(per_window)] or [[]])
        hashes = np.concatenate(per_window or [np.empty(0, dtype=np.uint64)])
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        self._owners = owners[order].astype(np.int64)
        self.contaminated = np.zeros(len(windows), dtype=bool)

    def screen(self, document: bytes) -> None:
        if self._hashes.size == 0:
            return
        found = np.unique(shingle_hashes(document, self.shingle_bytes))
        hits = found[np.isin(found, self._hashes, assume_unique=True)]
        if hits.size:
            left = np.searchsorted(self._hashes, hits, side="left")
            right = np.searchsorted(self._hashes, hits, side="right")
            for start, stop in zip(left.tolist(), right.tolist()):
                self.contaminated[self._owners[start:stop]] = True


def validation_windows(documents: list[Document], count: int, window: int) -> list[tuple[int, int]]:
    """Pick `count` non-overlapping windows round-robin over documents: `(document index, offset)`.

    Round 0 takes each document's first window, round 1 its second, and so on, so the windows spread
    over all documents (paper: 976 windows from 202 documents).
    """
    available = [len(d.text) // window for d in documents]
    picks: list[tuple[int, int]] = []
    for round_index in range(max(available, default=0)):
        for index, windows_here in enumerate(available):
            if round_index < windows_here and len(picks) < count:
                picks.append((index, round_index * window))
    return picks
