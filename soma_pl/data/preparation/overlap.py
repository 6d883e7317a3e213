"""The overlap screen's one index: which test candidate windows share a `shingle_bytes`-long substring
with a training document (Table 1: "screened for training overlap").

Every s-byte shingle of the candidate windows is one sorted 64-bit key (`OverlapIndex`); every
s-byte shingle of a screened document is hashed and looked up, most dismissed by a filter of packed
bits in front of the keys, and a found one is confirmed on the bytes. The screen is exact: hash
collisions cost comparisons, never a wrong answer. The planning task of `prepare` builds the index
once (`save`); each write task maps it (`load`) and screens its documents (`find`).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from soma_pl.data.runner.task_files import save_npy

_BASE = np.uint64(0x9E3779B97F4A7C15)
_INVERSE = np.uint64(pow(0x9E3779B97F4A7C15, -1, 1 << 64))
_FINISH = (np.uint64(0xFF51AFD7ED558CCD), np.uint64(0xC4CEB9FE1A85EC53), None)


def word_view(data: np.ndarray) -> np.ndarray:
    """The little-endian 8-byte word starting at every byte of `data` (uint8, 1-D), zero past its end:
    `[len(data) + 1] <u8`, a strided view of one padded copy."""
    padded = np.concatenate([data, np.zeros(8, dtype=np.uint8)])
    return np.ndarray((padded.size - 7,), dtype="<u8", buffer=padded, strides=(1,))


HASH_CHUNK = 1 << 15
"""Positions hashed (or filtered) at once: the chunk's temporaries stay in a core's cache, which
made hashing every position of real text 2.5x faster than whole-array passes."""


def _powers(base: np.uint64, count: int) -> np.ndarray:
    """`[count] uint64`: base**0, base**1, ... modulo 2**64."""
    powers = np.full(count, base, dtype=np.uint64)
    powers[0] = 1
    return np.cumprod(powers, out=powers)


def shingle_hashes(data: np.ndarray, width: int) -> np.ndarray:
    """64-bit hashes of every `width`-byte string of `data` (uint8, 1-D): `[len(data) - width + 1]`,
    equal for equal strings wherever they lie.

    A rolling polynomial hash modulo 2**64, sum_j data[i + j] * q**j with q the inverse of an odd base p,
    for all positions of a chunk at once: one running sum G of data[k] * q**k gives each string's sum
    as G[i + width] - G[i] = q**i * hash(i), and multiplying by p**i leaves hash(i), whatever i is.
    MurmurHash3's finisher then mixes every bit into the top ones the screen's filter reads. Equal
    strings always hash equal, which is all the screen needs: a collision only costs a byte comparison.
    """
    count = data.size - width + 1
    if count <= 0:
        return np.empty(0, dtype=np.uint64)
    chunk = min(count, HASH_CHUNK)
    inverse, base = _powers(_INVERSE, chunk + width - 1), _powers(_BASE, chunk)
    hashes = np.empty(count, dtype=np.uint64)
    running = np.zeros(chunk + width, dtype=np.uint64)
    spare = np.empty(chunk, dtype=np.uint64)
    for first in range(0, count, HASH_CHUNK):
        size = min(count, first + HASH_CHUNK) - first
        out, scratch, sums = hashes[first : first + size], spare[:size], running[1 : size + width]
        np.multiply(data[first : first + size + width - 1], inverse[: size + width - 1], out=sums)
        np.cumsum(sums, out=sums)
        np.subtract(running[width : width + size], running[:size], out=out)
        np.multiply(out, base[:size], out=out)
        for factor in _FINISH:
            np.right_shift(out, np.uint64(33), out=scratch)
            np.bitwise_xor(out, scratch, out=out)
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
    for first in range(0, hashes.size, HASH_CHUNK):  # as int64: `np.take` gathers them fastest
        slot = (hashes[first : first + HASH_CHUNK] >> np.uint64(64 - bits)).view(np.int64)
        byte = np.take(filter_bits, slot >> 3)
        np.greater_equal(byte << (slot & 7).astype(np.uint8), 128, out=passed[first : first + HASH_CHUNK])
    return passed


QUERY_BLOCK = 1 << 20
"""Document positions looked up and confirmed at once (each confirmation compares `shingle_bytes` bytes)."""


class OverlapIndex:
    """Marks the candidate windows that share any `shingle_bytes`-long substring with a screened document.

    Every s-byte shingle of the windows is one sorted 64-bit key: the top bits of its hash, then where
    it starts in the windows' bytes (one `np.sort`, no argsort and gathers). Every s-byte shingle of a
    screened document is looked up (most are dismissed by a filter of packed bits in front of the
    keys). A found shingle is confirmed on the bytes, 8 at a time, against one occurrence of the
    indexed shingle, and then marks every window holding it: a shingle repeated across many windows
    (indentation, licence headers, rules of dashes) costs one comparison per document position, not
    one per window. Where different shingles of the windows share a hash (found when the index is
    built), the document's shingle is confirmed against each of them. It holds no marks: `find`
    returns the windows, so one index serves several screens of the same windows.
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
        """A filter in front of the sorted keys (`key_filter`), built on first use or given."""
        if self._filter is None:
            self._filter = key_filter(self.keys, self._bits)
        return self._filter

    FILES = ("keys", "impure", "filter")

    def save(self, folder: Path) -> None:
        """Write the index as `.npy` files in `folder` (atomically), for `load` in other processes."""
        for name, array in zip(self.FILES, (self.keys, self.impure, self.filter_bits()), strict=True):
            save_npy(folder / f"overlap_{name}.npy", array)

    @classmethod
    def load(cls, folder: Path, windows: list[bytes], shingle_bytes: int) -> OverlapIndex:
        """The index `save` wrote for these `windows`, mapped, not read: its keys come from the page
        cache, shared by the tasks of a machine."""
        arrays = (np.load(folder / f"overlap_{name}.npy", mmap_mode="r") for name in cls.FILES)
        return cls(windows, shingle_bytes, *arrays)

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
            spans = np.ones(groups.size, dtype=np.int64)  # most shingles lie in one window: searched no further
            more = np.flatnonzero((keys[np.minimum(groups + 1, keys.size - 1)] ^ keys[groups]) <= low)
            more = more[groups[more] + 1 < keys.size]
            spans[more] = np.searchsorted(keys, keys[groups[more]] | low, side="right") - groups[more]
            entries = np.repeat(groups - (np.cumsum(spans) - spans), spans) + np.arange(spans.sum())
            held.append((keys[entries] & low).astype(np.int64))
        return np.concatenate(held)


