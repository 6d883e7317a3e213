"""Held-out evaluation sets: which documents are held out, their windows, and the overlap screen.

Held-out documents are the ones with the smallest seeded hash of their id, found in one streaming
pass with a bounded heap, so the choice is deterministic for a seed and independent of corpus order.
Test candidates are screened against every training document: a candidate sharing any 50-byte
substring with a training document is excluded (Table 1: "screened for training overlap"). The
screen is exact (see `OverlapScreen`) and runs in every task of `prepare` over its own documents.
"""

from __future__ import annotations

import hashlib
import heapq
from dataclasses import dataclass, field

import numpy as np

from soma_pl import WINDOW_BYTES
from soma_pl.data.documents import Document

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


_MIX = (np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))


def gram_hashes(grams: np.ndarray) -> np.ndarray:
    """64-bit hashes of byte strings of one length: `grams: [m, g] uint8` -> `[m] uint64`.

    The rows are read 8 bytes at a time (zero-padded) and folded with multiply-xor steps; equal rows
    always hash equal, which is all the screen needs (a collision only costs a byte comparison).
    """
    rows, width = grams.shape
    words = -(-width // 8)
    padded = np.zeros((rows, words * 8), dtype=np.uint8)
    padded[:, :width] = grams
    lanes = padded.view("<u8")
    hashes = np.full(rows, _MIX[0], dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in range(words):
            hashes = (hashes ^ lanes[:, column]) * _MIX[1]
        hashes ^= hashes >> np.uint64(31)
        hashes *= _MIX[2]
        hashes ^= hashes >> np.uint64(29)
    return hashes


class OverlapScreen:
    """Exact overlap screen: marks the test candidate windows that share any `shingle_bytes`-long
    substring with a screened (training) document.

    Any shared substring of s bytes contains, at a document position that is a multiple of
    g = ceil(s / 2), a whole g-byte gram. So the screen indexes every g-gram of the candidate
    windows (all offsets) and looks up only the document's grams at multiples of g, 1/g of its
    positions. Each lookup hit is verified on the bytes: the match is extended left and right and
    counts when it reaches s bytes. Hash collisions cost a comparison, never a wrong answer.

    Attributes:
        contaminated: `[n] bool`, per candidate window, set by `screen`.
    """

    def __init__(self, windows: list[bytes], shingle_bytes: int):
        self.windows = [bytes(w) for w in windows]
        self.shingle_bytes = shingle_bytes
        self.gram = (shingle_bytes + 1) // 2
        hashes, owners, offsets = [], [], []
        for index, window in enumerate(self.windows):
            count = len(window) - self.gram + 1
            if len(window) < shingle_bytes or count <= 0:
                continue
            array = np.frombuffer(window, dtype=np.uint8)
            grams = np.lib.stride_tricks.sliding_window_view(array, self.gram)
            hashes.append(gram_hashes(grams))
            owners.append(np.full(count, index, dtype=np.int32))
            offsets.append(np.arange(count, dtype=np.int32))
        hashes = np.concatenate(hashes) if hashes else np.empty(0, dtype=np.uint64)
        order = np.argsort(hashes, kind="stable")
        self._hashes = hashes[order]
        self._owners = np.concatenate(owners)[order] if owners else np.empty(0, dtype=np.int32)
        self._offsets = np.concatenate(offsets)[order] if offsets else np.empty(0, dtype=np.int32)
        self.contaminated = np.zeros(len(self.windows), dtype=bool)

    def screen(self, document: bytes) -> None:
        """Screen one document (see `screen_many`)."""
        self.screen_many([document])

    def screen_many(self, documents: list[bytes]) -> None:
        """Mark every candidate window sharing `shingle_bytes` bytes with one of `documents`."""
        if self._hashes.size == 0 or not documents:
            return
        text = b"".join(documents)
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        starts = np.cumsum(lengths) - lengths
        counts = np.maximum(lengths - self.gram, -1) // self.gram + 1
        counts[lengths < self.shingle_bytes] = 0
        if not counts.sum():
            return
        first = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + self.gram * (np.arange(counts.sum()) - first)
        array = np.frombuffer(text, dtype=np.uint8)
        queries = gram_hashes(array[positions[:, None] + np.arange(self.gram)])
        left = np.searchsorted(self._hashes, queries, side="left")
        found = left < self._hashes.size
        found[found] = self._hashes[left[found]] == queries[found]
        if not found.any():
            return
        right = np.searchsorted(self._hashes, queries[found], side="right")
        spans = right - left[found]
        entries = np.repeat(left[found] - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
        where = np.repeat(positions[found], spans)
        document = np.repeat(np.repeat(np.arange(len(documents)), counts)[found], spans)
        owners = self._owners[entries]
        keep = ~self.contaminated[owners]
        for owner, offset, position, doc in zip(owners[keep].tolist(), self._offsets[entries][keep].tolist(),
                                                where[keep].tolist(), document[keep].tolist()):
            if not self.contaminated[owner]:
                self.contaminated[owner] = self._extends(text, int(starts[doc]), int(starts[doc] + lengths[doc]),
                                                         position, self.windows[owner], offset)

    def _extends(self, text: bytes, begin: int, end: int, position: int, window: bytes, offset: int) -> bool:
        """Whether the gram at `text[position]` == `window[offset]` lies inside a common substring
        of `shingle_bytes` bytes (the document spans `text[begin:end]`)."""
        gram, need = self.gram, self.shingle_bytes
        if text[position : position + gram] != window[offset : offset + gram]:
            return False  # a hash collision
        left = 0
        while (left < need - gram and position - left > begin and offset - left > 0
               and text[position - left - 1] == window[offset - left - 1]):
            left += 1
        right, tail, stop = 0, position + gram, offset + gram
        while (left + gram + right < need and tail + right < end and stop + right < len(window)
               and text[tail + right] == window[stop + right]):
            right += 1
        return left + gram + right >= need


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
