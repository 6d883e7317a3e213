"""Perturbation directions regenerated from counters instead of stored.

Every coordinate of every direction is a pure function of ``(seed, step, expert, direction,
coordinate)``: a SplitMix64 stream keyed by a hash of the first four counters. Nothing depends on
global RNG state, any chunk of directions (or of coordinates) can be produced on its own, and the
integer arithmetic is plain wrapping int64 arithmetic, so a CPU and a CUDA device give the same
bits. Rademacher entries are therefore identical across devices; Gaussian entries go through
``log``/``cos`` and agree to float rounding.

Coordinates are numbered within one expert's flat parameter vector: a parameter tensor that starts
at flat offset ``o`` asks for coordinates ``o .. o + numel - 1`` of the same stream, so splitting
the vector into tensors (or chunks) never changes the direction. A Rademacher coordinate ``j`` is
bit ``j mod 64`` of stream word ``j div 64`` (one hash serves 64 coordinates); Gaussian coordinates
``2w`` and ``2w + 1`` are the two Box-Muller outputs of word ``w``.
"""

from __future__ import annotations

from enum import Enum

import torch
from torch import Tensor

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
"""SplitMix64 increment (2^64 / golden ratio)."""
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_UNIFORM_BITS = 24
"""Bits per Box-Muller uniform: integers below 2^24 are exact in float32, so both halves of the
transform see the same values on every device (tails are cut near 5.8 sigma, probability 1e-8)."""


class DirectionKind(str, Enum):
    """Distribution of the entries of a perturbation direction ``z`` (member names are what configs write)."""

    rademacher = "rademacher"
    """Independent ±1 entries; ``E‖z‖² = d`` with no spread, the lowest-variance choice."""
    gaussian = "gaussian"
    """Independent standard normal entries (Box-Muller on two hashed uniforms)."""


def _as_signed(value: int) -> int:
    """The int64 with the same 64 bits as the unsigned ``value``."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: Tensor, bits: int) -> Tensor:
    """Logical right shift of int64 bit patterns (torch's ``>>`` is arithmetic on signed ints)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def _mix64_(x: Tensor) -> Tensor:
    """SplitMix64 finaliser, in place on an int64 tensor; multiplication wraps modulo 2^64.

    In place because a fresh multi-hundred-megabyte int64 buffer per operation costs far more
    (page faults) than the arithmetic itself.
    """
    x ^= _shift_right(x, 30)
    x *= _as_signed(_MIX1)
    x ^= _shift_right(x, 27)
    x *= _as_signed(_MIX2)
    x ^= _shift_right(x, 31)
    return x


def _mix64_int(x: int) -> int:
    """``_mix64_`` on a Python int (seed and step are folded in exactly, before any tensor)."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


def direction_keys(seed: int, step: int, experts: Tensor, dirs: Tensor) -> Tensor:
    """Stream keys of the directions ``(seed, step, e, k)`` for all ``e`` in experts, ``k`` in dirs.

    Args:
        seed: run seed.
        step: update counter (each update draws fresh directions).
        experts: ``[E]`` integer expert indices; the keys live on this tensor's device.
        dirs: ``[K]`` integer direction indices (micro-batch ``m`` uses ``m·n_pert + k``).

    Returns:
        keys: ``[E, K]`` int64.
    """
    scalar = _GOLDEN
    for word in (seed, step):
        scalar = _mix64_int((scalar ^ (word & _MASK64)) + _GOLDEN)
    golden = _as_signed(_GOLDEN)
    by_expert = _mix64_((experts.to(torch.int64) ^ _as_signed(scalar)) + golden)
    by_dir = (by_expert[:, None] ^ dirs.to(experts.device, torch.int64)[None, :]) + golden
    return _mix64_(by_dir)


def stream_words(keys: Tensor, first: int, count: int) -> Tensor:
    """SplitMix64 outputs ``first+1 .. first+count`` of the streams seeded with ``keys``.

    Args:
        keys: ``[E, K]`` int64 from :func:`direction_keys`.
        first: index of the first word.
        count: number of words.

    Returns:
        words: ``[E, K, count]`` int64 (uniform 64-bit patterns).
    """
    counters = torch.arange(first + 1, first + count + 1, dtype=torch.int64, device=keys.device)
    state = counters * _as_signed(_GOLDEN)
    return _mix64_(state + keys[..., None])


def _rademacher(keys: Tensor, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
    # The byte view is little-endian on every device torch supports: bit b of byte i is bit 8i+b.
    first, skip = divmod(offset, 64)
    count = (skip + numel + 63) // 64
    words = stream_words(keys, first, count)
    shifts = torch.arange(8, dtype=torch.uint8, device=keys.device)
    bits = (words.view(torch.uint8)[..., None] >> shifts) & 1
    bits = bits.reshape(*keys.shape, count * 64)[..., skip : skip + numel]
    return bits.to(dtype).mul_(-2.0).add_(1.0)


def _gaussian(keys: Tensor, offset: int, numel: int, dtype: torch.dtype) -> Tensor:
    first, skip = divmod(offset, 2)
    count = (skip + numel + 1) // 2
    words = stream_words(keys, first, count)
    work = torch.float64 if dtype == torch.float64 else torch.float32
    scale = 2.0**-_UNIFORM_BITS
    low_mask = (1 << _UNIFORM_BITS) - 1
    # u1 in (0, 1] keeps log finite; u2 in [0, 1) is the angle.
    u1 = (_shift_right(words, 64 - _UNIFORM_BITS).to(work) + 1.0) * scale
    angle = (_shift_right(words, 64 - 2 * _UNIFORM_BITS) & low_mask).to(work)
    angle *= 2.0 * torch.pi * scale
    del words
    radius = torch.sqrt(u1.log_().mul_(-2.0))
    cosine = radius * torch.cos(angle)
    sine = radius.mul_(torch.sin(angle))
    pairs = torch.stack((cosine, sine), dim=-1)
    return pairs.reshape(*keys.shape, count * 2)[..., skip : skip + numel].to(dtype)


def directions_from_keys(
    kind: DirectionKind, keys: Tensor, offset: int, numel: int, dtype: torch.dtype = torch.float32
) -> Tensor:
    """Coordinates ``offset .. offset+numel-1`` of the directions keyed by ``keys``.

    Args:
        kind: entry distribution.
        keys: ``[E, K]`` int64 from :func:`direction_keys`.
        offset: flat index of the first coordinate within the expert's parameter vector.
        numel: number of coordinates.
        dtype: floating dtype of the result.

    Returns:
        z: ``[E, K, numel]`` on ``keys.device``.
    """
    if kind == DirectionKind.rademacher:
        return _rademacher(keys, offset, numel, dtype)
    if kind == DirectionKind.gaussian:
        return _gaussian(keys, offset, numel, dtype)
    raise ValueError(f"unknown direction kind {kind!r}")


def directions(
    kind: DirectionKind,
    seed: int,
    step: int,
    experts: Tensor,
    dirs: Tensor,
    numel: int,
    offset: int = 0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """Directions ``z[e, k, j]`` for ``(seed, step, experts[e], dirs[k], offset + j)``.

    Generates only the requested experts, directions and coordinates; call it per chunk of
    directions to bound memory.

    Args:
        kind: entry distribution.
        seed: run seed.
        step: update counter.
        experts: ``[E]`` integer expert indices.
        dirs: ``[K]`` integer direction indices.
        numel: number of coordinates.
        offset: flat index of the first coordinate within the expert's parameter vector.
        device: where to generate; defaults to ``experts.device``.
        dtype: floating dtype of the result.

    Returns:
        z: ``[E, K, numel]``.
    """
    device = experts.device if device is None else torch.device(device)
    keys = direction_keys(seed, step, experts.to(device), dirs.to(device))
    return directions_from_keys(kind, keys, offset, numel, dtype)
