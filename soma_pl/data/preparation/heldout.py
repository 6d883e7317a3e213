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


def word_view(data: np.ndarray) -> np.ndarray:
    """The little-endian 8-byte word starting at every byte of `data` (uint8, 1-D), zero past its end:
    `[len(data) + 1] <u8`, a strided view of one padded copy."""
    padded = np.concatenate([data, np.zeros(8, dtype=np.uint8)])
    return np.ndarray((padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))


HASH_CHUNK = 1 << 15
"""Positions hashed (or filtered) at once: the chunk's temporaries stay in a core's cache, which
made hashing every position of real text 2.5x faster than whole-array passes."""


def shingle_hashes(data: np.ndarray, width: int) -> np.ndarray:
    """64-bit hashes of every `width`-byte string of `data` (uint8, 1-D): `[len(data) - width + 1]`,
    equal for equal strings wherever they lie.

    Each string is read 8 bytes at a time (the last word masked to its bytes) as unaligned little-endian
    words: for all positions of a chunk at once, word j of every string is one contiguous view of the data
    shifted by 8·j bytes, folded in place with a xor-multiply-xorshift step, then mixed so that the top bits
    the screen's filter reads depend on every byte. Equal strings always hash equal, which is all the
    screen needs: a collision only costs a byte comparison.
    """
    count = data.size - width + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    words = word_view(data)
    lanes = -(-width // 8)
    tail = np.uint64((1 << (8 * (width - 8 * (lanes - 1)))) - 1)
    hashes = np.empty(count, dtype=np.uint64)
    scratch = np.empty(min(count, HASH_CHUNK), dtype=np.uint64)
    for first in range(0, count, HASH_CHUNK):
        end = min(count, first + HASH_CHUNK)
        out, spare = hashes[first:end], scratch[: end - first]
        out.fill(_MIX[0])
        for lane in range(lanes):
            word = words[first + 8 * lane : end + 8 * lane]
            if lane == lanes - 1 and width % 8:
                word = np.bitwise_and(word, tail, out=spare)
            np.bitwise_xor(out, word, out=out)
            np.multiply(out, _MIX[1], out=out)
            np.right_shift(out, np.uint64(29), out=spare)  # a product carries differences only upward:
            np.bitwise_xor(out, spare, out=out)  # fold the high bits back down before the next word
        for shift, factor in ((31, _MIX[2]), (29, _MIX[1]), (32, None)):
            np.right_shift(out, np.uint64(shift), out=spare)
            np.bitwise_xor(out, spare, out=out)
            if factor is not None:
                np.multiply(out, factor, out=out)
    return hashes


def sort_keys(keys: np.ndarray, threads: int = 1) -> np.ndarray:
    """`keys` (uint64, 1-D) sorted, in place when `threads` is 1. With more, the keys are split by their
    top bit into two ranges sorted side by side (NumPy's sort releases the GIL): for the planning
    task, which runs alone (5M keys: 0.32 s -> 0.23 s on 2 cores)."""
    if threads < 2 or keys.size < 1 << 20:
        keys.sort()
        return keys
    from concurrent.futures import ThreadPoolExecutor

    high = keys >= np.uint64(1 << 63)
    split = keys.size - int(np.count_nonzero(high))
    ranges = np.empty_like(keys)
    ranges[:split], ranges[split:] = keys[~high], keys[high]
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(np.ndarray.sort, (ranges[:split], ranges[split:])))
    return ranges


def filter_size(keys: int) -> int:
    """Bits of hash a key filter is indexed by: about 16 slots per key (10 to 27 bits)."""
    return int(min(27, max(10, np.ceil(np.log2(max(keys, 1))) + 4)))


def key_filter(keys: np.ndarray, bits: int) -> np.ndarray:
    """A filter in front of 64-bit keys, as packed bits: bit i is set when some key has top bits i,
    so most hashes that are no key are dismissed by one lookup (`passes`). Set `HASH_CHUNK` keys at
    a time (their temporaries stay in cache)."""
    table = np.zeros(1 << (bits - 3), dtype=np.uint8)
    for first in range(0, keys.size, HASH_CHUNK):
        slots = (keys[first : first + HASH_CHUNK] >> np.uint64(64 - bits)).astype(np.uint32)
        np.bitwise_or.at(table, slots >> 3, np.uint8(128) >> (slots & 7).astype(np.uint8))
    return table


def passes(filter_bits: np.ndarray, hashes: np.ndarray, bits: int) -> np.ndarray:
    """`[n] bool`: whether each hash's top `bits` bits are set in `key_filter`'s packed bits
    (`HASH_CHUNK` hashes at a time)."""
    passed = np.empty(hashes.size, dtype=bool)
    for first in range(0, hashes.size, HASH_CHUNK):
        slot = hashes[first : first + HASH_CHUNK] >> np.uint64(64 - bits)
        byte = filter_bits[slot >> np.uint64(3)]
        np.greater_equal(byte << (slot & np.uint64(7)).astype(np.uint8), 128, out=passed[first : first + HASH_CHUNK])
    return passed


CONFIRM_BLOCK = 1 << 14
"""Lookup hits confirmed on the bytes at once (each compares 2·shingle_bytes − gram bytes)."""
HITS_PER_BYTE = 0.125
"""Above this many gram hits per screened byte (repetitive text: indentation, licence headers,
markup), a batch is screened by the full-shingle index instead (`ShingleIndex`), built on first need."""


class OverlapScreen:
    """Exact overlap screen: marks the test candidate windows that share any `shingle_bytes`-long
    substring with a screened (training) document.

    Any shared substring of s bytes contains, at a document position that is a multiple of
    g = ceil(s / 2), a whole g-byte gram. So the screen indexes every g-gram of the candidate
    windows (all offsets) and looks up only the document's grams at multiples of g, 1/g of its
    positions. Each lookup hit is verified on the bytes, `CONFIRM_BLOCK` hits at once: the match is
    extended left and right and counts when it reaches s bytes. Hash collisions cost a comparison,
    never a wrong answer.

    Text that repeats itself makes many hits per position, each a comparison; a batch with more
    than `HITS_PER_BYTE` per byte is screened by `ShingleIndex` instead, which looks up every
    position's whole s-byte shingle and confirms a shingle once however many windows hold it. Both
    are exact, so the switch changes the time, never the answer.

    Attributes:
        contaminated: `[n] bool`, per candidate window, set by `screen`.
    """

    def __init__(self, windows: list[bytes], shingle_bytes: int, index: np.ndarray | None = None,
                 filter_bits: np.ndarray | None = None, share_with: OverlapScreen | None = None,
                 shingles: ShingleIndex | None = None, threads: int = 1):
        """`index`, `filter_bits`: `index_keys()` and `filter_bits()` of a screen built on the same
        windows and `shingle_bytes` (built once, e.g. saved by a planning task and loaded by every
        screening task). `share_with`: a screen of the same windows in this process whose
        `ShingleIndex`, once either needs it, serves both (each keeps its own marks). `shingles`: a
        `ShingleIndex` of the same windows (e.g. chosen by the planning task, `prefers_shingles`)
        that screens every batch; no gram index is built or read. `threads`: for sorting the index
        (`sort_keys`)."""
        self.windows = [bytes(w) for w in windows]
        self.shingle_bytes, self.threads = shingle_bytes, threads
        self._bytes = np.frombuffer(b"".join(self.windows), dtype=np.uint8)
        self._lengths = np.fromiter(map(len, self.windows), dtype=np.int64, count=len(self.windows))
        self._starts = np.cumsum(self._lengths) - self._lengths
        self._shared: dict[str, ShingleIndex] = {} if share_with is None else share_with._shared
        if shingles is not None:
            self._shared["shingles"] = shingles
        self.contaminated = np.zeros(len(self.windows), dtype=bool)
        self.only_shingles = shingles is not None
        if self.only_shingles:
            return
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
        self._bits = filter_size(self._keys.size)

    def filter_bits(self) -> np.ndarray:
        """A filter in front of the sorted keys, as packed bits: bit i is set when some indexed gram's
        hash has top bits i; about 16 slots per gram, so most of a document's grams are dismissed by
        one lookup. Built on first use, or given (`filter_bits` of a screen of the same windows)."""
        if self._filter is None:
            self._filter = key_filter(self._keys, self._bits)
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
        return sort_keys(np.concatenate(keys), self.threads) if keys else np.empty(0, dtype=np.uint64)

    def index_keys(self) -> np.ndarray:
        """The sorted gram keys, to pass as `index` to a screen of the same windows elsewhere."""
        return self._keys

    def screen(self, document: bytes) -> None:
        """Screen one document (see `screen_many`)."""
        self.screen_many([document])

    def screen_many(self, documents: list[bytes]) -> None:
        """Mark every candidate window sharing `shingle_bytes` bytes with one of `documents`."""
        if not documents:
            return
        if self.only_shingles:
            self.contaminated[self._shared["shingles"].find(documents)] = True
            return
        looked_up = self._look_up_grams(documents)
        if looked_up is None:
            return
        text, lengths, starts, positions, source, left, found, spans = looked_up
        if spans.sum() > HITS_PER_BYTE * len(text):
            if "shingles" not in self._shared:
                self._shared["shingles"] = ShingleIndex(self.windows, self.shingle_bytes)
            self.contaminated[self._shared["shingles"].find(documents)] = True
            return
        entries = np.repeat(left[found] - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
        where = np.repeat(positions[found], spans)
        document = np.repeat(source[found], spans)
        keys = self._keys[entries]
        owners = (keys >> np.uint64(self._offset_bits)) & np.uint64((1 << (self._low - self._offset_bits)) - 1)
        offsets = keys & np.uint64((1 << self._offset_bits) - 1)
        data = np.frombuffer(text, dtype=np.uint8)
        owners, offsets = owners.astype(np.int64), offsets.astype(np.int64)
        for first in range(0, owners.size, CONFIRM_BLOCK):
            block = slice(first, first + CONFIRM_BLOCK)
            live = ~self.contaminated[owners[block]]  # a window already marked needs no more hits
            owner, doc = owners[block][live], document[block][live]
            begin = starts[doc]
            hit = self._confirm(data, begin, begin + lengths[doc], where[block][live].astype(np.int64), owner,
                                offsets[block][live])
            self.contaminated[owner[hit]] = True

    def gram_hits(self, documents: list[bytes]) -> int:
        """How many (document gram, indexed gram) pairs `screen_many` would confirm on the bytes for
        `documents`: the work of the gram screen, which `HITS_PER_BYTE` weighs against their bytes."""
        looked_up = None if self.only_shingles else self._look_up_grams(documents)
        return 0 if looked_up is None else int(looked_up[-1].sum())

    def _look_up_grams(self, documents: list[bytes]) -> tuple | None:
        """The documents' grams at multiples of `gram` looked up in the sorted keys: `(text, lengths,
        starts, positions, source, left, found, spans)`, with each found query's first key (`left`)
        and number of keys (`spans`); None when nothing can be found."""
        if self._keys.size == 0 or not documents:
            return None
        text = b"".join(documents)
        lengths = np.fromiter(map(len, documents), dtype=np.int64, count=len(documents))
        starts = np.cumsum(lengths) - lengths
        counts = np.maximum(lengths - self.gram, -1) // self.gram + 1
        counts[lengths < self.shingle_bytes] = 0
        if not counts.sum():
            return None
        first = np.repeat(np.cumsum(counts) - counts, counts)
        positions = np.repeat(starts, counts) + self.gram * (np.arange(counts.sum()) - first)
        queries = hashes_at(np.frombuffer(text, dtype=np.uint8), positions, self.gram)
        maybe = passes(self.filter_bits(), queries, self._bits)
        positions, queries = positions[maybe], queries[maybe]
        source = np.repeat(np.arange(len(documents)), counts)[maybe]  # each query's document
        # The keys of a hash lie in [its top bits, then zeros; its top bits, then ones].
        low = np.uint64((1 << self._low) - 1)
        queries &= ~low
        left = np.searchsorted(self._keys, queries, side="left")
        right = np.searchsorted(self._keys, queries | low, side="right")
        found = right > left
        if not found.any():
            return None
        return text, lengths, starts, positions, source, left, found, right[found] - left[found]

    def _confirm(self, text: np.ndarray, begin: np.ndarray, end: np.ndarray, position: np.ndarray,
                 owner: np.ndarray, offset: np.ndarray) -> np.ndarray:
        """`[hits] bool`: whether the gram at `text[position]`, found at `offset` in window `owner`,
        lies inside a common substring of `shingle_bytes` bytes (each document spans `text[begin:end]`).

        The bytes from `shingle_bytes − gram` before the gram to as many after it are compared at
        once for every hit: the gram itself must match (else a hash collision), and the runs of equal
        bytes reaching out from it on each side, inside both the document and the window, must make
        up `shingle_bytes` with it."""
        gram, need = self.gram, self.shingle_bytes
        reach = need - gram
        span = np.arange(-reach, gram + reach, dtype=np.int64)
        at_text = position[:, None] + span  # [hits, span]
        at_window = offset[:, None] + span
        inside = ((at_text >= begin[:, None]) & (at_text < end[:, None]) & (at_window >= 0)
                  & (at_window < self._lengths[owner][:, None]))
        ours = text[np.clip(at_text, 0, text.size - 1)]
        theirs = self._bytes[np.clip(self._starts[owner][:, None] + at_window, 0, self._bytes.size - 1)]
        same = inside & (ours == theirs)
        left = np.cumprod(same[:, :reach][:, ::-1], axis=1, dtype=np.int32).sum(1)
        right = np.cumprod(same[:, reach + gram :], axis=1, dtype=np.int32).sum(1)
        return same[:, reach : reach + gram].all(1) & (left + gram + right >= need)


QUERY_BLOCK = 1 << 20
"""Document positions looked up and confirmed at once (each confirmation compares `shingle_bytes` bytes)."""


class ShingleIndex:
    """The exact screen for repetitive text (`OverlapScreen` switches a batch to it): marks the
    candidate windows that share any `shingle_bytes`-long substring with a screened document.

    Every s-byte shingle of the windows is one sorted 64-bit key: the top bits of its hash, then where
    it starts in the windows' bytes (one `np.sort`, no argsort and gathers). Every s-byte shingle of a
    screened document is looked up (most are dismissed by a filter of packed bits in front of the
    keys). A found shingle is confirmed on the bytes, 8 at a time, against one occurrence of the
    indexed shingle, and then marks every window holding it: a shingle repeated across many windows
    (indentation, licence headers, rules of dashes) costs one comparison per document position, not
    one per window. Where different shingles of the windows share a hash (found when the index is
    built), the document's shingle is confirmed against each of them. Hash collisions cost
    comparisons, never a wrong answer. It holds no marks, so two screens of the same windows share
    one (`OverlapScreen(share_with=...)`).
    """

    def __init__(self, windows: list[bytes], shingle_bytes: int, keys: np.ndarray | None = None,
                 impure: np.ndarray | None = None, filter_bits: np.ndarray | None = None, threads: int = 1):
        """Index `windows`: built here (`threads`: for sorting, `sort_keys`), or given (`keys`,
        `impure`, `filter_bits` of an index of the same windows and `shingle_bytes`, e.g. saved by the
        planning task and mapped by each task)."""
        self.shingle_bytes, self.threads = shingle_bytes, threads
        self._bytes = np.frombuffer(b"".join(windows), dtype=np.uint8)
        self._words = word_view(self._bytes)
        self._lengths = np.fromiter(map(len, windows), dtype=np.int64, count=len(windows))
        self._starts = np.cumsum(self._lengths) - self._lengths
        self._low = np.uint64((1 << max(1, self._bytes.size.bit_length())) - 1)  # a key's position bits
        if keys is None:
            self.keys, self.impure = self._build_index()
        else:
            self.keys = np.asarray(keys, dtype=np.uint64)
            self.impure = np.empty(0, dtype=np.uint64) if impure is None else np.asarray(impure, dtype=np.uint64)
        self._filter = filter_bits
        self._bits = filter_size(self.keys.size)

    def filter_bits(self) -> np.ndarray:
        """A filter in front of the sorted keys, as `OverlapScreen.filter_bits` is in front of its."""
        if self._filter is None:
            self._filter = key_filter(self.keys, self._bits)
        return self._filter

    def _build_index(self) -> tuple[np.ndarray, np.ndarray]:
        """`[m] uint64`, sorted: every shingle's hash bits above `_low`, then its start in the windows'
        bytes; and the hash bits (sorted) that different shingles share."""
        need, low = self.shingle_bytes, self._low
        counts = np.maximum(self._lengths - need + 1, 0)  # the shingles of each window
        if not counts.sum():
            return np.empty(0, dtype=np.uint64), np.empty(0, dtype=np.uint64)
        if (counts == counts[0]).all():  # windows of one length: one broadcast
            where = (self._starts[:, None] + np.arange(counts[0], dtype=np.int64)[None, :]).reshape(-1)
        else:
            where = np.repeat(self._starts, counts) + (np.arange(counts.sum()) - np.repeat(np.cumsum(counts) - counts,
                                                                                          counts))
        keys = shingle_hashes(self._bytes, need)[where]
        keys &= ~low
        keys |= where.astype(np.uint64)
        del where
        keys = sort_keys(keys, self.threads)
        shared = (keys[1:] ^ keys[:-1]) <= low  # an entry whose hash is its predecessor's
        repeated = np.flatnonzero(shared) + 1
        first = np.flatnonzero(np.r_[True, ~shared])
        del shared
        representative = first[np.searchsorted(first, repeated, side="right") - 1]
        differs = repeated[~self._same((keys[repeated] & low).astype(np.int64),
                                       (keys[representative] & low).astype(np.int64))]
        return keys, np.unique(keys[differs] & ~low)

    def _same(self, ours: np.ndarray, theirs: np.ndarray, text: np.ndarray | None = None) -> np.ndarray:
        """Whether the shingles at `ours` (in `text`, a `word_view`, else in the windows' bytes) equal
        those at `theirs` in the windows' bytes, compared 8 bytes at a time."""
        source = self._words if text is None else text
        same = np.ones(ours.size, dtype=bool)
        for lane in range(-(-self.shingle_bytes // 8)):
            differ = source[ours + 8 * lane] ^ self._words[theirs + 8 * lane]
            left = self.shingle_bytes - 8 * lane
            if left < 8:
                differ &= np.uint64((1 << (8 * left)) - 1)
            same &= differ == 0
        return same

    def find(self, documents: list[bytes]) -> np.ndarray:
        """The windows (indices, possibly repeated) sharing `shingle_bytes` bytes with one of `documents`."""
        need = self.shingle_bytes
        text = b"".join(documents)
        if self.keys.size == 0 or len(text) < need:
            return np.empty(0, dtype=np.int64)
        data = np.frombuffer(text, dtype=np.uint8)
        ends = np.cumsum(np.fromiter(map(len, documents), dtype=np.int64, count=len(documents)))
        hashes = shingle_hashes(data, need)
        positions = np.flatnonzero(passes(self.filter_bits(), hashes, self._bits))
        # a shingle counts only inside one document: it must end at or before its document's end
        positions = positions[positions + need <= ends[np.searchsorted(ends, positions, side="right")]]
        words = word_view(data)
        held = [np.empty(0, dtype=np.int64)]
        for first in range(0, positions.size, QUERY_BLOCK):
            block = positions[first : first + QUERY_BLOCK]
            held.append(self._look_up(words, block, hashes[block]))
        held = np.concatenate(held)
        return np.searchsorted(self._starts, held, side="right") - 1  # the window each shingle starts in

    def _look_up(self, words: np.ndarray, positions: np.ndarray, queries: np.ndarray) -> np.ndarray:
        """Where, in the windows' bytes, the shingles at `positions` of a document's bytes (`words`, its
        `word_view`; hashed `queries`) also start: every occurrence of each one found."""
        low, keys = self._low, self.keys
        # each distinct hash searched once, in order: repeated text repeats hashes, and sorted needles
        # keep the binary searches in one part of the keys
        distinct, back = np.unique(queries & ~low, return_inverse=True)
        at = np.searchsorted(keys, distinct, side="left")
        hit = at < keys.size
        hit[hit] = (keys[at[hit]] ^ distinct[hit]) <= low
        found = hit[back]
        positions, back = positions[found], back[found]
        held = [np.empty(0, dtype=np.int64)]
        impure = np.isin(distinct, self.impure)[back] if self.impure.size else np.zeros(back.size, dtype=bool)
        if impure.any():  # each entry of a shared hash on its own
            left = at[back[impure]]
            spans = np.searchsorted(keys, distinct[back[impure]] | low, side="right") - left
            entries = np.repeat(left - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
            where = np.repeat(positions[impure], spans)
            starts = (keys[entries] & low).astype(np.int64)
            held.append(starts[self._same(where, starts, words)])
        # A pure hash is one shingle of the windows, found when any position holding the hash has its
        # bytes: one position per hash is compared, the others only where that one was a collision.
        pure = np.flatnonzero(~impure)
        tried = np.full(distinct.size, -1, dtype=np.int64)
        tried[back[pure]] = pure  # some position of each hash (which one does not matter)
        tried = tried[tried >= 0]
        matched = np.zeros(distinct.size, dtype=bool)
        matched[back[tried]] = self._same(positions[tried], (keys[at[back[tried]]] & low).astype(np.int64), words)
        rest = pure[~matched[back[pure]]]
        matched[back[rest[self._same(positions[rest], (keys[at[back[rest]]] & low).astype(np.int64), words)]]] = True
        groups = at[matched]  # sorted and distinct: the first keys of distinct sorted hashes
        if groups.size:  # every window holding a found shingle
            spans = np.searchsorted(keys, keys[groups] | low, side="right") - groups
            entries = np.repeat(groups - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
            held.append((keys[entries] & low).astype(np.int64))
        return np.concatenate(held)


def prefers_shingles(windows: list[bytes], documents: list[bytes], shingle_bytes: int, sample: int = 8) -> bool:
    """Whether text like `documents` (held-out documents of the corpus, not in `windows`) would send
    the gram screen of `windows` to its full-shingle index: more than `HITS_PER_BYTE` gram hits per
    byte, estimated against every `sample`-th window (hits add up over windows, so the count scales).
    The planning task asks, and builds the `ShingleIndex` once for every screening task if so."""
    probe = OverlapScreen(windows[::sample], shingle_bytes)
    return probe.gram_hits(documents) * sample > HITS_PER_BYTE * sum(map(len, documents))


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
