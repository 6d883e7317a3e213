"""Counter-based directions: determinism, independence of the counters, moments, pinned bits."""

import math

import pytest
import torch

from soma_pl.estimators import DirectionKind, directions

MASK = (1 << 64) - 1
GOLDEN, MIX1, MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _mix(x: int) -> int:
    x = ((x ^ (x >> 30)) * MIX1) & MASK
    x = ((x ^ (x >> 27)) * MIX2) & MASK
    return x ^ (x >> 31)


def _reference_word(seed: int, step: int, expert: int, direction: int, word: int) -> int:
    """The documented scheme in plain Python integers (independent of torch's int64 wrapping)."""
    key = GOLDEN
    for counter in (seed, step, expert, direction):
        key = _mix(((key ^ counter) + GOLDEN) & MASK)
    return _mix((key + (word + 1) * GOLDEN) & MASK)


def _reference_rademacher(seed, step, expert, direction, coordinate) -> float:
    word = _reference_word(seed, step, expert, direction, coordinate // 64)
    bit = (word >> (coordinate % 64)) & 1
    return -1.0 if bit else 1.0


def _reference_gaussian(seed, step, expert, direction, coordinate) -> float:
    word = _reference_word(seed, step, expert, direction, coordinate // 2)
    u1 = ((word >> 40) + 1) * 2.0**-24
    u2 = ((word >> 16) & 0xFFFFFF) * 2.0**-24
    trig = math.cos if coordinate % 2 == 0 else math.sin
    return math.sqrt(-2 * math.log(u1)) * trig(2 * math.pi * u2)


def _draw(kind=DirectionKind.rademacher, seed=7, step=3, experts=(0, 1), dirs=(0, 1, 2), **kw):
    kw.setdefault("numel", 200)
    return directions(kind, seed, step, torch.tensor(experts), torch.tensor(dirs), **kw)


@pytest.mark.parametrize("kind", list(DirectionKind))
def test_values_match_plain_python_reference(kind):
    reference = _reference_rademacher if kind == DirectionKind.rademacher else _reference_gaussian
    seed, step = 2**40 + 5, 123
    z = directions(kind, seed, step, torch.tensor([0, 9]), torch.tensor([4, 700]), 150, offset=61)
    for e, expert in enumerate((0, 9)):
        for k, direction in enumerate((4, 700)):
            for j in (0, 2, 3, 64, 149):
                expected = reference(seed, step, expert, direction, 61 + j)
                assert z[e, k, j].item() == pytest.approx(expected, abs=1e-5)


@pytest.mark.parametrize("kind", list(DirectionKind))
def test_same_counters_same_directions_regardless_of_global_rng(kind):
    torch.manual_seed(0)
    first = _draw(kind)
    torch.manual_seed(1)
    torch.rand(10)
    assert torch.equal(first, _draw(kind))


@pytest.mark.parametrize("kind", list(DirectionKind))
def test_any_counter_changes_the_direction(kind):
    base = _draw(kind, experts=(0,), dirs=(0,))[0, 0]
    variants = [
        _draw(kind, seed=8, experts=(0,), dirs=(0,)),
        _draw(kind, step=4, experts=(0,), dirs=(0,)),
        _draw(kind, experts=(1,), dirs=(0,)),
        _draw(kind, experts=(0,), dirs=(1,)),
    ]
    for other in variants:
        assert (other[0, 0] != base).float().mean() > 0.3


@pytest.mark.parametrize("kind", list(DirectionKind))
def test_offsets_and_chunks_give_the_same_stream(kind):
    whole = _draw(kind, numel=500)
    part = _draw(kind, numel=137, offset=201)
    assert torch.equal(whole[..., 201:338], part)
    assert torch.equal(whole[:, 1:], _draw(kind, dirs=(1, 2), numel=500))


def test_rademacher_entries_and_moments():
    z = _draw(experts=(0, 1, 2, 3), dirs=tuple(range(16)), numel=20_000)
    assert set(z.unique().tolist()) == {-1.0, 1.0}
    assert abs(z.mean().item()) < 0.005
    correlation = (z[:, :-1] * z[:, 1:]).mean().item()
    assert abs(correlation) < 0.005


def test_gaussian_moments():
    z = _draw(DirectionKind.gaussian, experts=(0, 1, 2, 3), dirs=tuple(range(16)), numel=20_000)
    assert abs(z.mean().item()) < 0.005
    assert z.var().item() == pytest.approx(1.0, abs=0.01)
    assert (z**4).mean().item() == pytest.approx(3.0, abs=0.05)
    assert abs((z[..., 0::2] * z[..., 1::2]).mean().item()) < 0.005  # cos/sin halves uncorrelated


def test_dtype_and_device_follow_arguments():
    z = _draw(DirectionKind.gaussian, dtype=torch.float64, device="cpu")
    assert z.dtype == torch.float64 and z.shape == (2, 3, 200)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(DirectionKind))
def test_cuda_matches_cpu(kind):
    cpu = _draw(kind, numel=5000)
    cuda = _draw(kind, numel=5000, device="cuda").cpu()
    if kind == DirectionKind.rademacher:
        assert torch.equal(cpu, cuda)
    else:
        torch.testing.assert_close(cpu, cuda, atol=1e-5, rtol=1e-5)
