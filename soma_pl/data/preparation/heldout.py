"""Held-out evaluation sets: which documents are held out, their windows, and the expert-validation choice.

Held-out documents are the ones with the smallest seeded hash of their id, found in one streaming
pass with a bounded heap, so the choice is deterministic for a seed and independent of corpus order.
Which test candidates training overlaps is `soma_pl.data.preparation.overlap`'s.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.documents import Document


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
    offset: int = field(default=0, compare=False)


class HeldOutSelector:
    """Keep the `count` eligible documents of smallest rank seen in a stream (bounded memory).

    Only the first `keep_bytes` bytes of each held document are kept: evaluation needs no more.
    With `test_window`, only its test window (`test_window_offset` of those bytes) is kept: what a
    test candidate needs, 1,025 bytes however long the document.
    """

    def __init__(self, seed: int, count: int, keep_bytes: int, test_window: bool = False):
        self.seed = seed
        self.count = count
        self.keep_bytes = keep_bytes
        self.test_window = test_window
        self._heap: list[_Held] = []

    def offer(self, document: Document, rank: int | None = None) -> None:
        """Offer a document (`rank`: its `document_rank`, when already known)."""
        if self.count == 0:
            return
        rank = document_rank(self.seed, document.doc_id) if rank is None else rank
        if len(self._heap) == self.count and -rank <= self._heap[0].neg_rank:
            return
        trimmed = Document(document.text[: self.keep_bytes], document.source, document.doc_id, document.title)
        offset = 0
        if self.test_window:
            offset = test_window_offset(self.seed, trimmed)
            trimmed = Document(trimmed.text[offset : offset + WINDOW_BYTES], trimmed.source, trimmed.doc_id,
                               trimmed.title)
        item = _Held(-rank, trimmed, offset)
        if len(self._heap) < self.count:
            heapq.heappush(self._heap, item)
        else:
            heapq.heapreplace(self._heap, item)

    def selected(self) -> list[Document]:
        """The held documents in rank order (smallest first)."""
        return [held.document for held in self._sorted()]

    def offsets(self) -> list[int]:
        """With `test_window`: each selected document's window offset, in `selected()` order."""
        return [held.offset for held in self._sorted()]

    def _sorted(self) -> list[_Held]:
        return sorted(self._heap, key=lambda h: -h.neg_rank)


def test_window_offset(seed: int, document: Document, window: int = WINDOW_BYTES) -> int:
    """Where a test document's one window starts: a seeded uniform position in the document.

    Not its start: openings are formulaic (salutations, headers) and would fail the overlap screen
    far more often than the body does.
    """
    return document_rank(seed + 1, document.doc_id) % (len(document.text) - window + 1)


class ExpertValChoice:
    """Which training documents form the expert-validation split, decided one document at a time.

    A document is held out when its seeded hash falls below `fraction` of the hash range; the
    document of smallest hash is held out too, so the split is never empty. Pass 1 offers every
    eligible id (a bounded heap keeps the `keep` smallest hashes; parallel tasks each keep their own
    and the union of their `smallest()` is offered again) and then excludes the documents held out
    for evaluation; pass 2 asks `holds(id)`.
    """

    def __init__(self, seed: int, fraction: float, keep: int):
        self.seed, self.threshold, self.keep = seed, int(fraction * 2**64), keep
        self._smallest: list[tuple[int, str]] = []  # max-heap by hash: (-hash, id)
        self.fallback: str | None = None

    def hash(self, doc_id: str) -> int:
        return seeded_hash(self.seed, "expert_val", doc_id)

    def offer(self, doc_id: str) -> None:
        item = (-self.hash(doc_id), doc_id)
        if len(self._smallest) < self.keep:
            heapq.heappush(self._smallest, item)
        elif item > self._smallest[0]:
            heapq.heapreplace(self._smallest, item)

    def smallest(self) -> list[str]:
        """The ids of the `keep` smallest hashes offered so far."""
        return sorted(doc_id for _, doc_id in self._smallest)

    def exclude(self, held_ids: set[str]) -> None:
        """Fix the fallback: the smallest-hash training document that is not held out."""
        eligible = sorted((-negative, doc_id) for negative, doc_id in self._smallest if doc_id not in held_ids)
        self.fallback = eligible[0][1] if eligible else None

    def holds(self, doc_id: str) -> bool:
        return doc_id == self.fallback or self.hash(doc_id) < self.threshold


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
