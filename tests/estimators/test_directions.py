"""Counter-based directions: determinism, independence of the counters, moments, pinned bits, the
sparse probe's two kinds of coordinates."""

import math

import pytest
import torch

from soma_pl.estimators import DirectionKind, direction_keys, directions
from soma_pl.estimators.directions import coordinate_activity, flat_directions, parameter_directions

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


def _reference_sparse(seed, step, expert, direction, coordinate, gain=False) -> float:
    word = _reference_word(seed, step, expert, direction, coordinate // 32)
    pair = (word >> (2 * (coordinate % 32))) & 3
    sign = -1.0 if pair & 1 else 1.0
    return sign if gain else sign * (pair >> 1)


def _reference_gaussian(seed, step, expert, direction, coordinate) -> float:
    word = _reference_word(seed, step, expert, direction, coordinate // 2)
    u1 = ((word >> 40) + 1) * 2.0**-24
    u2 = ((word >> 16) & 0xFFFFFF) * 2.0**-24
    trig = math.cos if coordinate % 2 == 0 else math.sin
    return math.sqrt(-2 * math.log(u1)) * trig(2 * math.pi * u2)


def _draw(kind=DirectionKind.rademacher, seed=7, step=3, experts=(0, 1), dirs=(0, 1, 2), **kw):
    kw.setdefault("numel", 200)
    return directions(kind, seed, step, torch.tensor(experts), torch.tensor(dirs), **kw)


REFERENCES = {DirectionKind.rademacher: _reference_rademacher, DirectionKind.gaussian: _reference_gaussian,
              DirectionKind.sparse: _reference_sparse}


@pytest.mark.parametrize("kind,gain", [(kind, False) for kind in DirectionKind] + [(DirectionKind.sparse, True)])
def test_values_match_plain_python_reference(kind, gain):
    seed, step = 2**40 + 5, 123
    z = directions(kind, seed, step, torch.tensor([0, 9]), torch.tensor([4, 700]), 150, offset=61, gain=gain)
    for e, expert in enumerate((0, 9)):
        for k, direction in enumerate((4, 700)):
            for j in (0, 2, 3, 31, 64, 149):
                extra = {"gain": gain} if gain else {}
                expected = REFERENCES[kind](seed, step, expert, direction, 61 + j, **extra)
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


def test_sparse_entries_have_the_closed_form_moments():
    # Ordinary coordinates: P(0) = 1/2, P(±1) = 1/4, mean 0, E z² = E z⁴ = 1/2; gains: ±1, E z² = 1.
    z = _draw(DirectionKind.sparse, experts=(0, 1, 2, 3), dirs=tuple(range(16)), numel=20_000, dtype=torch.float64)
    count = z.numel()  # 1.28M entries: the standard error of a frequency near 1/4 is 4e-4
    frequencies = {value: (z == value).sum().item() / count for value in (-1.0, 0.0, 1.0)}
    assert set(z.unique().tolist()) == {-1.0, 0.0, 1.0}
    assert frequencies == pytest.approx({-1.0: 0.25, 0.0: 0.5, 1.0: 0.25}, abs=0.002)
    assert abs(z.mean().item()) < 0.002
    assert z.pow(2).mean().item() == pytest.approx(0.5, abs=0.002)
    assert z.pow(4).mean().item() == pytest.approx(0.5, abs=0.002)
    assert abs((z[..., :-1] * z[..., 1:]).mean().item()) < 0.002  # neighbours (adjacent bit pairs) uncorrelated
    assert abs((z[..., :-1].abs() * z[..., 1:].abs()).mean().item() - 0.25) < 0.002  # activity bits independent
    gains = _draw(DirectionKind.sparse, experts=(0, 1, 2, 3), dirs=tuple(range(16)), numel=20_000,
                  dtype=torch.float64, gain=True)
    assert set(gains.unique().tolist()) == {-1.0, 1.0}
    assert gains.pow(2).mean().item() == 1.0 and abs(gains.mean().item()) < 0.002
    # A gain keeps the sign bit of the ordinary entry at the same coordinate.
    assert torch.equal(gains[z != 0], z[z != 0])


SHAPES = {"w_ih": torch.Size([3, 5]), "norm_gains": torch.Size([2, 7]), "w_hh": torch.Size([70])}


@pytest.mark.parametrize("kind", list(DirectionKind))
def test_parameter_layout_gives_one_vector_whole_per_tensor_or_in_chunks(kind):
    experts, dirs = torch.tensor([0, 3]), torch.arange(6)
    whole = flat_directions(kind, 7, 2, experts, dirs, SHAPES)  # [E, K, 99]
    per_tensor = parameter_directions(kind, direction_keys(7, 2, experts, dirs), SHAPES)
    assert whole.shape == (2, 6, 99) and per_tensor["w_ih"].shape == (2, 6, 3, 5)
    torch.testing.assert_close(torch.cat([z.flatten(2) for z in per_tensor.values()], -1), whole, rtol=0, atol=0)
    ordinary = _draw(kind, seed=7, step=2, experts=(0, 3), dirs=tuple(range(6)), numel=99)
    gain = _draw(kind, seed=7, step=2, experts=(0, 3), dirs=tuple(range(6)), numel=99, gain=True)
    assert torch.equal(whole[..., :15], ordinary[..., :15]) and torch.equal(whole[..., 29:], ordinary[..., 29:])
    assert torch.equal(whole[..., 15:29], gain[..., 15:29])
    if kind is not DirectionKind.sparse:
        assert torch.equal(whole, ordinary)  # only sparse probes tell gains apart
    for first in range(0, 6, 4):  # chunks of directions
        chunk = flat_directions(kind, 7, 2, experts, dirs[first : first + 4], SHAPES)
        assert torch.equal(chunk, whole[:, first : first + 4])


def test_coordinate_activity_is_the_mean_square_of_the_entries():
    z = flat_directions(DirectionKind.sparse, 1, 0, torch.arange(8), torch.arange(512), SHAPES, torch.float64)
    activity = coordinate_activity(DirectionKind.sparse, SHAPES)
    assert activity.tolist() == [0.5] * 15 + [1.0] * 14 + [0.5] * 70
    torch.testing.assert_close(z.pow(2).mean((0, 1)), activity, rtol=0, atol=0.05)  # 4,096 draws per coordinate
    assert torch.equal(coordinate_activity(DirectionKind.rademacher, SHAPES), torch.ones(99, dtype=torch.float64))


def test_dtype_and_device_follow_arguments():
    z = _draw(DirectionKind.gaussian, dtype=torch.float64, device="cpu")
    assert z.dtype == torch.float64 and z.shape == (2, 3, 200)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("kind", list(DirectionKind))
def test_cuda_matches_cpu(kind):
    cpu = _draw(kind, numel=5000)
    cuda = _draw(kind, numel=5000, device="cuda").cpu()
    if kind != DirectionKind.gaussian:
        assert torch.equal(cpu, cuda)
    else:
        torch.testing.assert_close(cpu, cuda, atol=1e-5, rtol=1e-5)
