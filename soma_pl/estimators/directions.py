"""Perturbation directions regenerated from counters instead of stored.

Every coordinate of every direction is a pure function of ``(seed, step, expert, direction,
coordinate)``: a SplitMix64 stream keyed by a hash of the first four counters. Nothing depends on
global RNG state, any chunk of directions (or of coordinates) can be produced on its own, and the
integer arithmetic is plain wrapping int64 arithmetic, so a CPU and a CUDA device give the same
bits. Rademacher and sparse entries are therefore identical across devices; Gaussian entries go
through ``log``/``cos`` and agree to float rounding.

Coordinates are numbered within one expert's flat parameter vector: a parameter tensor that starts
at flat offset ``o`` asks for coordinates ``o .. o + numel - 1`` of the same stream, so splitting
the vector into tensors (or chunks) never changes the direction. A Rademacher coordinate ``j`` is
bit ``j mod 64`` of stream word ``j div 64`` (one hash serves 64 coordinates); Gaussian coordinates
``2w`` and ``2w + 1`` are the two Box-Muller outputs of word ``w``; a sparse coordinate ``j`` is the
bit pair ``2(j mod 32), 2(j mod 32) + 1`` of word ``j div 32`` (sign, then whether it is non-zero).

Sparse probes (the paper's training probe, §4 and App. E) treat the two kinds of coordinates apart:
a normalisation gain is never zeroed. Which parameter tensors are gains is decided by name, by
:func:`is_gain` alone, so a parameter vector's directions depend on its layout of named tensors
(:func:`parameter_directions`) and not only on its length.
"""

from __future__ import annotations

from collections.abc import Mapping
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
    sparse = "sparse"
    """The paper's training probe (§4, App. E): a normalisation gain's entries are ±1 (½ each), every
    other entry 0 with probability ½ and ±1 with ¼ each. Not rescaled, so ``E[ĝ] = q ⊙ ∇L`` with
    q = 1 on gains and ½ elsewhere (:func:`coordinate_activity`)."""


GAIN_PARAMETERS = frozenset({"norm_gains"})
"""Names of the parameters whose coordinates are normalisation gains (``StackedExperts.norm_gains``):
sparse probes never zero them (App. E)."""
SPARSE_ACTIVITY = 0.5
"""q of an ordinary coordinate under sparse probes: the probability that its entry is non-zero."""


def is_gain(name: str) -> bool:
    """Whether parameter ``name`` holds normalisation gains (the one rule; see GAIN_PARAMETERS)."""
    return name in GAIN_PARAMETERS


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


def _sparse(keys: Tensor, offset: int, numel: int, dtype: torch.dtype, gain: bool) -> Tensor:
    # Four bit pairs per byte, low bits first (little-endian as in _rademacher): the low bit of a pair
    # is the sign, the high bit whether an ordinary coordinate is non-zero; a gain keeps its sign only.
    first, skip = divmod(offset, 32)
    count = (skip + numel + 31) // 32
    words = stream_words(keys, first, count)
    shifts = torch.arange(0, 8, 2, dtype=torch.uint8, device=keys.device)
    pairs = (words.view(torch.uint8)[..., None] >> shifts) & 3
    pairs = pairs.reshape(*keys.shape, count * 32)[..., skip : skip + numel]
    z = (pairs & 1).to(dtype).mul_(-2.0).add_(1.0)
    return z if gain else z.mul_((pairs >> 1).to(dtype))


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
    kind: DirectionKind,
    keys: Tensor,
    offset: int,
    numel: int,
    dtype: torch.dtype = torch.float32,
    gain: bool = False,
) -> Tensor:
    """Coordinates ``offset .. offset+numel-1`` of the directions keyed by ``keys``.

    Args:
        kind: entry distribution.
        keys: ``[E, K]`` int64 from :func:`direction_keys`.
        offset: flat index of the first coordinate within the expert's parameter vector.
        numel: number of coordinates.
        dtype: floating dtype of the result.
        gain: the coordinates are normalisation gains (sparse probes then give ±1; other kinds
            ignore it).

    Returns:
        z: ``[E, K, numel]`` on ``keys.device``.
    """
    if kind == DirectionKind.rademacher:
        return _rademacher(keys, offset, numel, dtype)
    if kind == DirectionKind.gaussian:
        return _gaussian(keys, offset, numel, dtype)
    if kind == DirectionKind.sparse:
        return _sparse(keys, offset, numel, dtype, gain)
    raise ValueError(f"unknown direction kind {kind!r}")


def parameter_directions(
    kind: DirectionKind, keys: Tensor, shapes: Mapping[str, torch.Size], dtype: torch.dtype = torch.float32
) -> dict[str, Tensor]:
    """The directions of an expert's parameter vector laid out as the named tensors ``shapes``.

    Tensor ``name`` takes the coordinates after those of the tensors before it (dict order) and is
    a gain or not by :func:`is_gain`; the flat vector is the same whether it is cut into these
    tensors or generated whole by :func:`flat_directions`.

    Args:
        kind: entry distribution.
        keys: ``[E, K]`` int64 from :func:`direction_keys`.
        shapes: name → per-expert shape (without ``E``), in flat-vector order.
        dtype: floating dtype of the result.

    Returns:
        name → ``[E, K, *shape]``.
    """
    out, offset = {}, 0
    for name, shape in shapes.items():
        numel = torch.Size(shape).numel()
        z = directions_from_keys(kind, keys, offset, numel, dtype, gain=is_gain(name))
        out[name] = z.view(*keys.shape, *shape)
        offset += numel
    return out


def flat_directions(
    kind: DirectionKind,
    seed: int,
    step: int,
    experts: Tensor,
    dirs: Tensor,
    shapes: Mapping[str, torch.Size],
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """:func:`parameter_directions` of ``(seed, step, experts[e], dirs[k])`` as flat vectors.

    Args:
        experts: ``[E]`` integer expert indices (the result lives on their device).
        dirs: ``[K]`` integer direction indices.
        shapes: name → per-expert shape, in flat-vector order.

    Returns:
        z: ``[E, K, D]`` with D the sum of the tensors' sizes.
    """
    keys = direction_keys(seed, step, experts, dirs.to(experts.device))
    parts = parameter_directions(kind, keys, shapes, dtype).values()
    return torch.cat([part.reshape(*keys.shape, -1) for part in parts], dim=-1)


def coordinate_activity(
    kind: DirectionKind, shapes: Mapping[str, torch.Size], dtype: torch.dtype = torch.float64
) -> Tensor:
    """``q_j = E[z_j²]`` of every coordinate of the layout ``shapes``: ``[D]``.

    1 everywhere for Rademacher and Gaussian directions; for sparse probes 1 on gains and
    SPARSE_ACTIVITY elsewhere (App. G.1's "coordinate activity"). ``E[ĝ] = q ⊙ ∇L``.
    """
    parts = []
    for name, shape in shapes.items():
        ordinary = kind == DirectionKind.sparse and not is_gain(name)
        parts.append(torch.full((torch.Size(shape).numel(),), SPARSE_ACTIVITY if ordinary else 1.0, dtype=dtype))
    return torch.cat(parts)


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
    gain: bool = False,
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
        gain: the coordinates are normalisation gains (see :func:`directions_from_keys`).

    Returns:
        z: ``[E, K, numel]``.
    """
    device = experts.device if device is None else torch.device(device)
    keys = direction_keys(seed, step, experts.to(device), dirs.to(device))
    return directions_from_keys(kind, keys, offset, numel, dtype, gain)
