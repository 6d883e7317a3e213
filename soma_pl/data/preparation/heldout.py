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
from soma_pl.data.corpus.documents import Document
from soma_pl.errors import DataError


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


def hashes_at(data: np.ndarray, starts: np.ndarray | None, width: int,
              rows: tuple[int, int] | None = None) -> np.ndarray:
    """`gram_hashes` of the `width`-byte strings of `data` (uint8, 1-D) starting at `starts`,
    without copying them out: each 8-byte lane is one unaligned little-endian load, the last one
    masked to its bytes, which is what `gram_hashes` reads from a zero-padded row.

    `rows=(n, length)` instead of `starts`: `data` is n rows of `length` bytes and every string of
    every row is hashed (`[n * (length - width + 1)]`, row-major), through strided views.
    """
    padded = np.concatenate([data, np.zeros(8, dtype=np.uint8)])
    words = np.ndarray((len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))  # a word at every byte
    if rows is not None:
        count, length = rows[0], rows[1]
        shape, strides = (count, length - width + 1), (length, 1)
        lane_words = [np.lib.stride_tricks.as_strided(words[8 * lane:], shape, strides)
                      for lane in range(-(-width // 8))]
    else:
        lane_words = [words[starts + 8 * lane] for lane in range(-(-width // 8))]
    hashes = _MIX[0]
    with np.errstate(over="ignore"):
        for lane, word in enumerate(lane_words):
            left = width - 8 * lane
            if left < 8:
                word = word & np.uint64((1 << (8 * left)) - 1)
            hashes = (hashes ^ word) * _MIX[1]
        hashes = np.asarray(hashes, dtype=np.uint64).reshape(-1)
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

    def __init__(self, windows: list[bytes], shingle_bytes: int, index: np.ndarray | None = None,
                 filter_bits: np.ndarray | None = None):
        """`index`, `filter_bits`: `index_keys()` and `filter_bits()` of a screen built on the same
        windows and `shingle_bytes` (built once, e.g. saved by a planning task and loaded by every
        screening task)."""
        self.windows = [bytes(w) for w in windows]
        self.shingle_bytes = shingle_bytes
        self.gram = (shingle_bytes + 1) // 2
        # Each indexed gram is one uint64 key: the top bits of its hash, then its window, then its
        # offset in the window; sorting the keys sorts by hash (np.sort: no argsort and gathers).
        self._offset_bits = max(1, int(max((len(w) for w in self.windows), default=1) - 1).bit_length())
        self._low = self._offset_bits + max(1, (len(self.windows) - 1).bit_length())
        if self._low > 32:
            raise DataError(f"{len(self.windows)} screened windows of up to {max(map(len, self.windows))} bytes "
                            "leave the overlap screen under 32 hash bits")
        self._keys = self._build_index() if index is None else np.asarray(index, dtype=np.uint64)
        self._filter = filter_bits
        self._bits = int(min(27, max(10, np.ceil(np.log2(max(self._keys.size, 1))) + 4)))
        self.contaminated = np.zeros(len(self.windows), dtype=bool)

    def filter_bits(self) -> np.ndarray:
        """A filter in front of the sorted keys, as packed bits: bit i is set when some indexed gram's
        hash has top bits i; about 16 slots per gram, so most of a document's grams are dismissed by
        one lookup. Built on first use, or given (`filter_bits` of a screen of the same windows)."""
        if self._filter is None:
            table = np.zeros(1 << self._bits, dtype=bool)
            table[self._keys >> np.uint64(64 - self._bits)] = True  # sorted keys: a sequential scatter
            self._filter = np.packbits(table)
        return self._filter

    def _build_index(self) -> np.ndarray:
        """Every g-gram of every window as a key, sorted (windows of one length at once)."""
        keys = []
        high = np.uint64(((1 << 64) - 1) ^ ((1 << self._low) - 1))
        usable = [(i, w) for i, w in enumerate(self.windows) if len(w) >= self.shingle_bytes and len(w) >= self.gram]
        for length in sorted({len(w) for _, w in usable}):
            group = [(i, w) for i, w in usable if len(w) == length]
            count = length - self.gram + 1
            data = np.frombuffer(b"".join(w for _, w in group), dtype=np.uint8)
            owners = np.array([i for i, _ in group], dtype=np.uint64) << np.uint64(self._offset_bits)
            places = (owners[:, None] | np.arange(count, dtype=np.uint64)[None, :]).reshape(-1)  # window, offset
            keys.append((hashes_at(data, None, self.gram, rows=(len(group), length)) & high) | places)
        return np.sort(np.concatenate(keys)) if keys else np.empty(0, dtype=np.uint64)

    def index_keys(self) -> np.ndarray:
        """The sorted gram keys, to pass as `index` to a screen of the same windows elsewhere."""
        return self._keys

    def screen(self, document: bytes) -> None:
        """Screen one document (see `screen_many`)."""
        self.screen_many([document])

    def screen_many(self, documents: list[bytes]) -> None:
        """Mark every candidate window sharing `shingle_bytes` bytes with one of `documents`."""
        if self._keys.size == 0 or not documents:
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
        queries = hashes_at(np.frombuffer(text, dtype=np.uint8), positions, self.gram)
        slot = queries >> np.uint64(64 - self._bits)
        maybe = ((self.filter_bits()[slot >> np.uint64(3)] >> (7 - (slot & np.uint64(7))).astype(np.uint8))
                 & 1).astype(bool)
        positions, queries = positions[maybe], queries[maybe]
        source = np.repeat(np.arange(len(documents)), counts)[maybe]  # each query's document
        # The keys of a hash lie in [its top bits, then zeros; its top bits, then ones].
        low = np.uint64((1 << self._low) - 1)
        queries &= ~low
        left = np.searchsorted(self._keys, queries, side="left")
        right = np.searchsorted(self._keys, queries | low, side="right")
        found = right > left
        if not found.any():
            return
        spans = right[found] - left[found]
        entries = np.repeat(left[found] - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
        where = np.repeat(positions[found], spans)
        document = np.repeat(source[found], spans)
        keys = self._keys[entries]
        owners = (keys >> np.uint64(self._offset_bits)) & np.uint64((1 << (self._low - self._offset_bits)) - 1)
        offsets = keys & np.uint64((1 << self._offset_bits) - 1)
        keep = ~self.contaminated[owners]
        for owner, offset, position, doc in zip(owners[keep].tolist(), offsets[keep].tolist(),
                                                where[keep].tolist(), document[keep].tolist(), strict=False):
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
