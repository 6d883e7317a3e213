"""EGGROLL: the low-rank forward against materialised weights, noise, shaping, closed-form updates, and
the reference's (HyperscaleES) shaping and step on identical noise."""

from __future__ import annotations

import math
import statistics
from dataclasses import replace

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from soma_pl.estimators.eggroll import (
    EGGROLLConfig,
    FitnessShaping,
    MemberNoise,
    StepConvention,
    assemble_update,
    chunk_noise,
    eggroll_estimate,
    lowrank_relative_error,
    member_noise,
    pair_noise,
    shape_fitness,
    sign_test_step,
)
from soma_pl.models import HeadMode, StackedExperts, recurrence
from soma_pl.models.stacked import LOW_RANK_MATRICES, population_losses

IDS = torch.arange(1)


def _model(experts: int = 2, width: int = 12, head: HeadMode = HeadMode.per_expert) -> StackedExperts:
    torch.manual_seed(0)
    model = StackedExperts(experts, width, embed_dim=8, num_layers=2, head=head, time_chunk=4).double()
    with torch.no_grad():  # away from the init so every weight matters
        for param in model.parameters():
            param.add_(0.1 * torch.randn_like(param))
    return model


def _materialised(model: StackedExperts, noise: MemberNoise, members: int) -> dict[str, torch.Tensor]:
    """Each member's full weights ``W + A·Bᵀ`` (and ``g + δ``) as ``[E·M, ...]`` groups."""
    full = {}
    for name, param in model.expert_parameters().items():
        base = param[:, None].expand(param.shape[0], members, *param.shape[1:])
        if name in noise.factors:
            a, b = noise.factors[name]
            base = base + a @ b.transpose(-1, -2)
        elif name in noise.offsets:
            base = base + noise.offsets[name]
        full[name] = base.flatten(0, 1)
    return full


@pytest.mark.parametrize("head", list(HeadMode))
def test_lowrank_forward_equals_the_forward_with_materialised_weights(head):
    experts, members, rank = 2, 4, 2
    model = _model(experts, head=head)
    params = model.expert_parameters()
    matrices = [name for name in params if name in LOW_RANK_MATRICES]
    noise = member_noise(pair_noise(params, matrices, rank, 5, 1, torch.arange(experts), torch.arange(2)), 0.3, rank)
    tokens = torch.randint(0, 256, (experts, members, 3, 11), dtype=torch.uint8)
    low = population_losses(model, tokens, noise.factors, noise.offsets, score_from=2)
    reference = model.window_losses(tokens.flatten(0, 1), 2, _materialised(model, noise, members)).mean(1)
    torch.testing.assert_close(low, reference.view(experts, members), rtol=1e-10, atol=1e-10)
    unperturbed = population_losses(model, tokens, {}, {}, score_from=2)
    base = model.window_losses(tokens.flatten(0, 1), 2, {n: p.repeat_interleave(members, 0) for n, p in params.items()})
    torch.testing.assert_close(unperturbed, base.mean(1).view(experts, members), rtol=1e-10, atol=1e-10)


def _float_members(width: int, rank: int, perturbed: tuple[str, ...], windows: int = 3):
    """Two float32 models of 2 experts (the second on the PyTorch loop, the reference), rank-r member
    noise on the `perturbed` matrices (the gains too unless none), 4 members × `windows` windows of
    11 bytes."""
    experts, members = 2, 4
    model, reference = _model(experts, width).float(), _model(experts, width).float()
    reference.kernel = recurrence.Kernel.python
    params = model.expert_parameters()
    matrices = [name for name in params if name in LOW_RANK_MATRICES]
    noise = member_noise(pair_noise(params, matrices, rank, 5, 1, torch.arange(experts), torch.arange(2)), 0.3, rank)
    factors = {name: pair for name, pair in noise.factors.items() if name in perturbed}
    tokens = torch.randint(0, 256, (experts, members, windows, 11), dtype=torch.uint8,
                           generator=torch.Generator().manual_seed(3))
    return model, reference, factors, noise.offsets if perturbed else {}, tokens


@pytest.mark.parametrize(("width", "rank", "perturbed"),
                         [(20, 2, LOW_RANK_MATRICES), (12, 1, ("w_hh",)), (12, 1, ()), (100, 1, LOW_RANK_MATRICES)])
def test_native_member_forward_equals_the_pytorch_loop_in_float32(width, rank, perturbed):
    """Float32 on the CPU runs the members' layers on the native kernel (an expert's members one
    bundle of rows on its packed weights, each row's rank-r terms and norm gains its member's own);
    the PyTorch loop is the reference. Width 20: two unit blocks, the second a 4-unit tail; 3
    windows: row blocks that straddle members; only w_hh perturbed: the input factors zero; none:
    no rank-r terms at all; width 100: seven unit blocks."""
    native, reference, factors, offsets, tokens = _float_members(width, rank, perturbed)
    params = native.expert_parameters()
    with torch.no_grad():
        assert recurrence.native_applies(native.kernel, *params.values())
        assert not recurrence.native_applies(reference.kernel, *params.values())
        got = population_losses(native, tokens, factors, offsets, score_from=2)
        expected = population_losses(reference, tokens, factors, offsets, score_from=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("width", "rank", "perturbed"), [(20, 2, LOW_RANK_MATRICES), (12, 3, LOW_RANK_MATRICES),
                                                        (12, 1, ("w_hh",)), (12, 1, ("w_ih",)), (12, 1, ())])
def test_triton_member_forward_equals_the_pytorch_loop_in_float32(width, rank, perturbed, monkeypatch):
    """The members' layers on the Triton kernel (in its interpreter on the CPU; on a GPU `auto`
    takes it): an expert's members its rows on the shared recurrent weights, each row adding its
    member's rank-r recurrent term inside the step, the input terms joined to the projections. 4
    members of 5 windows: 20 rows, the last member's rows straddling the two 16-row blocks; rank 3:
    three terms per step; only w_ih: no recurrent terms in the kernel; none: no factors."""
    triton_lstm = pytest.importorskip("soma_pl.models.triton_lstm")
    pytest.importorskip("triton")
    calls, chunk = [], triton_lstm.triton_chunk
    def counted(*args, **kwargs):
        calls.append(kwargs["low_rank"] is not None)
        return chunk(*args, **kwargs)

    monkeypatch.setattr(triton_lstm, "triton_chunk", counted)
    model, reference, factors, offsets, tokens = _float_members(width, rank, perturbed, windows=5)
    model.kernel = recurrence.Kernel.triton
    params = model.expert_parameters()
    with torch.no_grad():
        assert recurrence.resolve_kernel(model.kernel, params, low_rank=True) is recurrence.Kernel.triton
        assert recurrence.resolve_kernel(recurrence.Kernel.auto, params, low_rank=True) is recurrence.Kernel.native
        got = population_losses(model, tokens, factors, offsets, score_from=2)
        expected = population_losses(reference, tokens, factors, offsets, score_from=2)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert calls == ["w_hh" in perturbed] * (2 * 3)  # 2 layers × 3 time chunks of 4; recurrent factors if any


def test_pairs_are_antithetic_and_regenerated_from_counters():
    model = _model(1)
    params = model.expert_parameters()
    noise = pair_noise(params, LOW_RANK_MATRICES, 2, 7, 3, IDS, torch.arange(4))
    members = member_noise(noise, 0.5, 2)
    a, b = members.factors["w_hh"]
    torch.testing.assert_close(a[:, 0::2], -a[:, 1::2])  # + and − of each pair
    torch.testing.assert_close(b[:, 0::2], b[:, 1::2])
    torch.testing.assert_close(a[:, 0::2], noise["w_hh"][0] * 0.5 / math.sqrt(2))
    torch.testing.assert_close(members.offsets["norm_gains"][:, 1::2], -0.5 * noise["norm_gains"])
    again = pair_noise(params, LOW_RANK_MATRICES, 2, 7, 3, IDS, torch.tensor([2, 3]))  # any chunk alone
    torch.testing.assert_close(again["w_ih"][0], noise["w_ih"][0][:, 2:])
    later = pair_noise(params, LOW_RANK_MATRICES, 2, 7, 4, IDS, torch.arange(4))
    assert not torch.allclose(later["head"][0], noise["head"][0])
    assert noise["w_ih"][0].shape == (1, 4, 2, 48, 2) and noise["w_ih"][1].shape == (1, 4, 2, 12, 2)


def test_shaping_z_scores_over_the_population_or_each_group():
    losses = torch.randn(2, 12, generator=torch.Generator().manual_seed(0)) * 3 + 5
    config = EGGROLLConfig(population=12, group_size=4, fitness=FitnessShaping.population)
    whole = shape_fitness(losses, config)
    torch.testing.assert_close(whole.mean(1), torch.zeros(2, dtype=torch.float64))
    torch.testing.assert_close(whole.std(1, unbiased=False), torch.ones(2, dtype=torch.float64))
    own = shape_fitness(losses, replace(config, fitness=FitnessShaping.group_own_std)).view(2, 3, 4)
    torch.testing.assert_close(own.mean(2), torch.zeros(2, 3, dtype=torch.float64))
    torch.testing.assert_close(own.std(2, unbiased=False), torch.ones(2, 3, dtype=torch.float64))
    # The reference's group shaping: each group centred, all divided by the population's √(var + 1e-5).
    grouped = shape_fitness(losses, replace(config, fitness=FitnessShaping.group)).view(2, 3, 4)
    torch.testing.assert_close(grouped.mean(2), torch.zeros(2, 3, dtype=torch.float64))
    spread = (losses.double().var(1, unbiased=False) + 1e-5).sqrt()
    centred = losses.double().view(2, 3, 4) - losses.double().view(2, 3, 4).mean(2, keepdim=True)
    torch.testing.assert_close(grouped, centred / spread.view(2, 1, 1))
    raw = shape_fitness(losses, replace(config, fitness=FitnessShaping.none))
    torch.testing.assert_close(raw, losses.double())


def test_the_default_shaping_is_the_references_with_its_variance_term():
    """HyperscaleES `convert_fitnesses` by hand: each group of 2 centred on its own mean, all divided
    by √(population variance + 1e-5). The losses' variance is 1.5e-5, so the +1e-5 matters: a z-score
    (`population`) or a floored std would not match."""
    from soma_pl.lit import EGGROLLArgs

    values = [1.994, 2.000, 1.997, 2.003, 2.000, 2.006]  # pairs ±0.003 around 1.997, 2.000, 2.003
    mean = sum(values) / 6
    variance = sum((v - mean) ** 2 for v in values) / 6  # the biased variance, as jnp.var
    pair_means = [(values[i] + values[i + 1]) / 2 for i in (0, 2, 4)]
    expected = [(v - pair_means[i // 2]) / math.sqrt(variance + 1e-5) for i, v in enumerate(values)]
    losses = torch.tensor([values], dtype=torch.float64)
    for config in (EGGROLLConfig(population=6, group_size=2), EGGROLLArgs(population=6, group_size=2)):
        assert config.fitness is FitnessShaping.group
        torch.testing.assert_close(shape_fitness(losses, config), torch.tensor([expected], dtype=torch.float64))
    # variance 0.003² + (2/3)·0.003² = 1.5e-5: -0.003 / √(2.5e-5) = -0.6 (without the +1e-5: -0.775).
    assert variance == pytest.approx(1.5e-5) and expected[0] == pytest.approx(-0.6)


class MatrixQuadratic:
    """``L(W) = ½‖W − W*‖²_H + c`` in one ``rows × cols`` matrix behind the member-loss API."""

    def __init__(self, rows: int, cols: int, seed: int = 0, curvature: float = 1.0):
        generator = torch.Generator().manual_seed(seed)
        self.target = torch.randn(1, rows, cols, generator=generator, dtype=torch.float64)
        self.curvature = curvature * torch.rand(rows, cols, generator=generator, dtype=torch.float64)

    def loss(self, weights):
        return (0.5 * self.curvature * (weights - self.target) ** 2).sum((-1, -2)) + 3.0

    def member_losses(self, theta):
        def loss_fn(noise, tokens):
            a, b = noise.factors["w"]
            return self.loss(theta[:, None] + a @ b.transpose(-1, -2))
        return loss_fn

    def gradient(self, theta):
        return (self.curvature * (theta - self.target))[0]


def _update(problem, theta, config, step):
    """One update of every expert (each draws its own noise): ``[E, rows, cols]``."""
    batch = torch.zeros(theta.shape[0], config.windows, 3, dtype=torch.uint8)  # the quadratic ignores bytes
    result = eggroll_estimate(problem.member_losses(theta), {"w": theta}, ["w"], batch, config, step, seed=11)
    return result.gradient["w"]


def _full_rank_es(problem, theta, pairs, sigma):
    """Independent reference: antithetic ES with full Gaussian matrices, raw losses. → ``[E, rows, cols]``"""
    generator = torch.Generator().manual_seed(0)
    eps = torch.randn(theta.shape[0], pairs, *theta.shape[1:], generator=generator, dtype=theta.dtype)
    delta = problem.loss(theta[:, None] + sigma * eps) - problem.loss(theta[:, None] - sigma * eps)
    return (delta[..., None, None] * eps).sum(1) / (2 * sigma * pairs)


def test_update_converges_to_the_full_rank_es_update_as_rank_grows():
    # 1,000 independent draws at once: experts with their own noise stand in for repeated steps.
    rows, cols, pairs, draws, sigma = 3, 2, 4, 1000, 1e-2
    problem = MatrixQuadratic(rows, cols)
    theta = torch.zeros(draws, rows, cols, dtype=torch.float64)
    true = problem.gradient(theta[:1]).flatten()
    base = EGGROLLConfig(sigma=sigma, population=2 * pairs, group_size=2 * pairs, fitness=FitnessShaping.none,
                         step_convention=StepConvention.mean_over_sigma)  # the Monte-Carlo gradient estimate

    def statistics(updates):
        flat = updates.flatten(1)
        error = ((flat - true) ** 2).sum(1).mean() / (true**2).sum()
        cosine = F.cosine_similarity(flat, true[None], dim=1).mean()
        return error.item(), cosine.item(), flat.mean(0)

    full_error, full_cosine, _ = statistics(_full_rank_es(problem, theta, pairs, sigma))
    assert full_error == pytest.approx((rows * cols + 1) / pairs, rel=0.15)  # Gaussian ES: (d + 1) / K
    cosines = {}
    for rank in (1, 4, 64):
        config = replace(base, rank=rank)
        error, cosines[rank], mean = statistics(_update(problem, theta, config, step=0))
        assert error == pytest.approx(lowrank_relative_error(rows, cols, rank, pairs), rel=0.15), rank
        assert F.cosine_similarity(mean, true, 0) > 0.98, rank  # E[ĝ] = g for every r
    assert cosines[1] < cosines[4] < cosines[64]
    assert cosines[1] < full_cosine - 0.04
    assert cosines[64] == pytest.approx(full_cosine, abs=0.02)


@pytest.mark.parametrize("fitness", [FitnessShaping.population, FitnessShaping.group])
def test_expected_update_on_a_linear_model_points_along_the_true_gradient(fitness):
    generator = torch.Generator().manual_seed(3)
    slope = {"w": torch.randn(1, 5, 4, generator=generator, dtype=torch.float64),
             "g": torch.randn(1, 6, generator=generator, dtype=torch.float64)}
    draws = 256  # experts with their own noise: 256 independent updates in one call
    params = {name: torch.zeros(draws, *value.shape[1:], dtype=value.dtype) for name, value in slope.items()}

    def loss_fn(noise, tokens):  # L = ⟨S_w, W⟩ + ⟨s_g, g⟩ + the window's own offset
        a, b = noise.factors["w"]
        weights = a @ b.transpose(-1, -2)
        offset = tokens[..., 0, 0].double()
        return (weights * slope["w"][:, None]).sum((-1, -2)) + noise.offsets["g"] @ slope["g"][0] + offset

    config = EGGROLLConfig(sigma=0.1, rank=2, population=64, group_size=16, fitness=fitness)
    batch = torch.arange(4, dtype=torch.uint8).view(1, 4, 1).expand(draws, 4, 2) * 50
    update = eggroll_estimate(loss_fn, params, ["w"], batch, config, step=0, seed=0).gradient
    mean = torch.cat([update[name].mean(0).flatten() for name in ("w", "g")])
    true = torch.cat([slope["w"].flatten(), slope["g"].flatten()])
    assert F.cosine_similarity(mean, true, 0) > 0.99


def test_z_scored_update_is_the_raw_update_over_the_spread():
    problem = MatrixQuadratic(4, 3, seed=2)
    theta = torch.zeros(1, 4, 3, dtype=torch.float64)
    config = EGGROLLConfig(sigma=0.05, rank=2, population=16, group_size=16, fitness=FitnessShaping.none)
    batch = torch.zeros(1, 1, 3, dtype=torch.uint8)
    raw = eggroll_estimate(problem.member_losses(theta), {"w": theta}, ["w"], batch, config, 0, seed=1)
    zscored = assemble_update({"w": theta}, ["w"], shape_fitness(raw.losses, replace(config, fitness="population")),
                              config, 0, 1, IDS)
    spread = raw.losses.std(1, unbiased=False)
    torch.testing.assert_close(zscored["w"], raw.gradient["w"] / spread)  # antithetic pairs cancel the mean


class LinearQuadratic:
    """Members' losses ``L = ⟨S, W⟩ + ½c‖W‖² + ⟨s, g⟩ + o_w`` in a matrix W and a vector g; window w adds
    its own offset ``o_w`` (its difficulty), so groups differ by far more than their members do."""

    def __init__(self, rows: int, cols: int, size: int, windows: int):
        generator = torch.Generator().manual_seed(5)
        self.slope = torch.randn(rows, cols, generator=generator, dtype=torch.float64)
        self.gain_slope = torch.randn(size, generator=generator, dtype=torch.float64)
        self.offsets = 3 * torch.rand(windows, generator=generator, dtype=torch.float64)
        self.theta = {"w": 0.3 * torch.randn(1, rows, cols, generator=generator, dtype=torch.float64),
                      "g": 0.3 * torch.randn(1, size, generator=generator, dtype=torch.float64)}

    def loss(self, w, g, window):
        """Any leading dims; window: the member's window index, same leading dims."""
        return ((w * self.slope).sum((-1, -2)) + 0.5 * (w**2).sum((-1, -2)) + g @ self.gain_slope
                + self.offsets[window])

    def loss_fn(self, noise, tokens):
        a, b = noise.factors["w"]
        weights = self.theta["w"][:, None] + a @ b.transpose(-1, -2)
        gains = self.theta["g"][:, None] + noise.offsets["g"]
        return self.loss(weights, gains, tokens[..., 0, 0].long())


def _hyperscalees_step(scores, lora_a, lora_b, noise, sigma, rank, group_size, lr):
    """A numpy port of HyperscaleES ``noiser/eggroll.py`` (``EggRoll.convert_fitnesses`` with a group
    size, ``_simple_lora_update``, ``_simple_full_update``, ``_do_update``) and ``optax.sgd(lr)``.

    Thread i is sign ``+`` (i even) or ``−`` (i odd) of noise ``i // 2``.

    Args:
        scores: ``[N]`` raw fitness (higher is better). lora_a: ``[N/2, out, r]``; lora_b: ``[N/2, in, r]``;
            noise: ``[N/2, size]`` the vector's full noise.

    Returns:
        The parameter changes ``(ΔW [out, in], Δg [size])``.
    """
    n = scores.size
    groups = scores.reshape(-1, group_size)
    fitness = ((groups - groups.mean(-1, keepdims=True)) / np.sqrt(np.var(scores) + 1e-5)).ravel()
    thread = np.arange(n)
    sign = np.where(thread % 2 == 0, 1.0, -1.0)
    a = lora_a[thread // 2] * (sign * sigma / np.sqrt(rank))[:, None, None]
    lora = np.einsum("nir,njr->ij", fitness[:, None, None] * a, lora_b[thread // 2]) / n
    full = np.mean(fitness[:, None] * noise[thread // 2] * (sign * sigma)[:, None], axis=0)
    gradients = [-(update * np.sqrt(n)) for update in (lora, full)]
    return tuple(-lr * gradient for gradient in gradients)  # optax.sgd's updates, added to the params


def test_group_shaping_and_step_equal_a_numpy_port_of_the_reference_on_identical_noise():
    rows, cols, size, rank, sigma, lr = 5, 4, 6, 2, 0.05, 0.3
    population, group_size = 48, 8
    problem = LinearQuadratic(rows, cols, size, population // group_size)
    config = EGGROLLConfig(sigma=sigma, rank=rank, population=population, group_size=group_size,
                           fitness=FitnessShaping.group)  # the default step convention: the reference's
    batch = torch.arange(config.windows, dtype=torch.uint8).view(1, -1, 1).expand(1, -1, 2)
    result = eggroll_estimate(problem.loss_fn, problem.theta, ["w"], batch, config, step=4, seed=9)
    ours = torch.cat([-lr * result.gradient[name].flatten() for name in ("w", "g")])  # SGD: θ −= lr·.grad

    # The port evaluates its own members from the same pair noise, then shapes and steps as the reference.
    noise = pair_noise(problem.theta, ["w"], rank, 9, 4, IDS, torch.arange(population // 2))
    lora_a, lora_b, vector = noise["w"][0][0], noise["w"][1][0], noise["g"][0]
    sign = torch.tensor([1.0, -1.0], dtype=torch.float64).repeat(population // 2)
    pair = torch.arange(population) // 2
    weights = problem.theta["w"][0] + (sign * sigma / math.sqrt(rank)).view(-1, 1, 1) * (
        lora_a[pair] @ lora_b[pair].transpose(-1, -2))
    gains = problem.theta["g"][0] + (sign * sigma).view(-1, 1) * vector[pair]
    scores = -problem.loss(weights, gains, torch.arange(population) // group_size).numpy()
    torch.testing.assert_close(torch.from_numpy(-scores), result.losses[0], rtol=1e-12, atol=1e-12)
    step_w, step_g = _hyperscalees_step(scores, lora_a.numpy(), lora_b.numpy(), vector.numpy(), sigma, rank,
                                        group_size, lr)
    reference = torch.from_numpy(np.concatenate([step_w.ravel(), step_g.ravel()]))
    assert F.cosine_similarity(ours, reference, 0).item() == pytest.approx(1.0, abs=1e-12)
    assert ours.norm().item() == pytest.approx(reference.norm().item(), rel=1e-10)
    torch.testing.assert_close(ours, reference, rtol=1e-10, atol=1e-14)


def _materialised_noise(params, config, step, seed):
    """Every member's ε_m, ``s_m A_k B_kᵀ/√r`` or ``s_m ε_k``, flattened: ``[N, d]``."""
    noise = pair_noise(params, ["w"], config.rank, seed, step, IDS, torch.arange(config.population // 2))
    a, b = noise["w"]
    matrices = (a[0] @ b[0].transpose(-1, -2) / math.sqrt(config.rank)).flatten(1)
    flat = torch.cat([matrices, noise["g"][0]], dim=1)
    sign = torch.tensor([1.0, -1.0], dtype=flat.dtype).repeat(config.population // 2)
    return sign[:, None] * flat.repeat_interleave(2, dim=0)


@pytest.mark.parametrize("fitness", [FitnessShaping.population, FitnessShaping.group])
def test_step_conventions_are_the_closed_forms_with_the_configured_sigma(fitness):
    # The members are perturbed with σ = 0.02 while the step's σ₀ stays 0.05, as under a σ schedule.
    problem = LinearQuadratic(4, 3, 5, 4)
    lr, step_sigma, population = 0.2, 0.05, 32
    config = EGGROLLConfig(sigma=0.02, rank=2, population=population, group_size=8, fitness=fitness,
                           step_sigma=step_sigma)
    batch = torch.arange(config.windows, dtype=torch.uint8).view(1, -1, 1).expand(1, -1, 2)
    epsilon = _materialised_noise(problem.theta, config, step=1, seed=2)
    steps = {}
    for convention in StepConvention:
        result = eggroll_estimate(problem.loss_fn, problem.theta, ["w"], batch,
                                  replace(config, step_convention=convention), step=1, seed=2)
        steps[convention] = torch.cat([-lr * result.gradient[name].flatten() for name in ("w", "g")])
        fitness_values = -result.fitness[0]  # EGGROLL's maximised fitness: the shaped loss negated
    torch.testing.assert_close(steps[StepConvention.reference],  # Δθ = +lr·σ₀/√N·Σ f_m ε_m
                               lr * step_sigma / math.sqrt(population) * fitness_values @ epsilon)
    torch.testing.assert_close(steps[StepConvention.mean_over_sigma],  # Δθ = +lr/(Nσ₀)·Σ f_m ε_m
                               lr / (population * step_sigma) * fitness_values @ epsilon)
    # lr_mean_over_sigma = lr_reference · σ₀²·√N gives the same step.
    torch.testing.assert_close(steps[StepConvention.mean_over_sigma] * step_sigma**2 * math.sqrt(population),
                               steps[StepConvention.reference])


def test_rank_one_members_add_up_to_a_full_rank_update():
    problem = MatrixQuadratic(8, 6, seed=4)
    theta = torch.zeros(1, 8, 6, dtype=torch.float64)
    config = EGGROLLConfig(sigma=0.05, rank=1, population=32, group_size=32)
    update = _update(problem, theta, config, step=0)[0]
    assert torch.linalg.matrix_rank(update).item() == 6


def test_chunks_of_members_give_the_same_update_and_bound_each_forward():
    model = _model(1, width=8)
    params = model.expert_parameters()
    batch = torch.randint(0, 256, (1, 3, 9), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    config = EGGROLLConfig(sigma=0.05, rank=2, population=24, group_size=8, fitness=FitnessShaping.group)
    sizes = []

    def loss_fn(noise, tokens):
        sizes.append(tokens.shape[1])
        return population_losses(model, tokens, noise.factors, noise.offsets)

    whole = eggroll_estimate(loss_fn, params, LOW_RANK_MATRICES, batch, config, 2, seed=0)
    assert sizes == [24]
    sizes.clear()
    chunked = eggroll_estimate(loss_fn, params, LOW_RANK_MATRICES, batch, replace(config, max_members=7), 2, seed=0)
    assert sizes == [6, 6, 6, 6]  # whole pairs, at most max_members
    torch.testing.assert_close(chunked.losses, whole.losses)
    for name in params:
        torch.testing.assert_close(chunked.gradient[name], whole.gradient[name])
    # Members 0-7 read window 0, 8-15 window 1, 16-23 window 2: a window's members agree with it alone.
    alone = population_losses(model, batch[:, 1:2, None].expand(1, 8, 1, 9), *_noise(params, config, range(4, 8)))
    torch.testing.assert_close(alone, whole.losses[:, 8:16])


def _noise(params, config, pairs):
    noise = pair_noise(params, LOW_RANK_MATRICES, config.rank, 0, 2, IDS, torch.tensor(list(pairs)))
    members = member_noise(noise, config.sigma, config.rank)
    return members.factors, members.offsets


def test_bad_settings_and_batches_are_refused():
    for settings in ({"population": 10, "group_size": 4}, {"group_size": 3}, {"sigma": 0.0}, {"max_members": 1},
                     {"step_sigma": 0.0}):
        with pytest.raises(ValueError):
            EGGROLLConfig(**{"population": 16, "group_size": 8, **settings})
    problem = MatrixQuadratic(2, 2)
    theta = torch.zeros(1, 2, 2, dtype=torch.float64)
    with pytest.raises(ValueError, match="needs 2"):
        eggroll_estimate(problem.member_losses(theta), {"w": theta}, ["w"], torch.zeros(1, 3, 3, dtype=torch.uint8),
                         EGGROLLConfig(population=16, group_size=8), 0, seed=0)


# The GRU recipe's vote (nano-egg's `fast_fitness` update in FP32): each pair votes for its better
# member, and a coordinate moves where the votes' sum Z = Σ f_k ε_k passes |Z| ≥ Φ⁻¹(1 − α/2)·√K.


def _vote_params() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(4)
    return {"w": torch.randn(1, 2, 5, 7, generator=generator), "v": torch.randn(1, 9, generator=generator)}


def test_vote_step_equals_a_loop_over_the_pairs_with_materialised_noise():
    params, rank, alpha = _vote_params(), 2, 0.2
    config = EGGROLLConfig(sigma=1 / 16, rank=rank, population=24, group_size=6, max_members=10)
    losses = torch.randn(1, 24, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    step = sign_test_step(params, ["w"], losses, alpha, config, step=3, seed=1, ids=IDS)
    z = {name: torch.zeros_like(param[0]) for name, param in params.items()}
    for k in range(12):
        vote = 1.0 if losses[0, 2 * k] < losses[0, 2 * k + 1] else -1.0
        noise = pair_noise(params, ["w"], rank, 1, 3, IDS, torch.tensor([k]))
        a, b = noise["w"]
        z["w"] += vote * a[0, 0] @ b[0, 0].transpose(-1, -2) / math.sqrt(rank)
        z["v"] += vote * noise["v"][0, 0]
    threshold = statistics.NormalDist().inv_cdf(1 - alpha / 2) * math.sqrt(12)
    for name, value in z.items():
        expected = torch.where(value.abs() >= threshold, -torch.sign(value), torch.zeros_like(value))
        assert torch.equal(step[name][0], expected), name
    assert step["w"].count_nonzero() > 0 and step["w"].abs().max() == 1


def test_with_no_signal_a_coordinate_moves_with_probability_alpha():
    # Gaussian vector noise and votes independent of it: each coordinate of Z is exactly N(0, K).
    params = {"v": torch.zeros(1, 200_000)}
    config = EGGROLLConfig(sigma=1 / 16, population=64, group_size=64)
    losses = torch.randn(1, 64, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    for alpha in (0.01, 0.1):
        moved = sign_test_step(params, [], losses, alpha, config, step=0, seed=5, ids=IDS)["v"].count_nonzero()
        spread = 4 * math.sqrt(alpha * (1 - alpha) / 200_000)  # four binomial standard deviations
        assert abs(moved.item() / 200_000 - alpha) < spread


def test_votes_on_a_linear_loss_step_against_its_gradient():
    generator = torch.Generator().manual_seed(6)
    gradient = torch.randn(1, 25, generator=generator)
    params, config = {"v": torch.zeros(1, 25)}, EGGROLLConfig(sigma=1 / 16, population=2048, group_size=2048)
    offsets = chunk_noise(params, [], config, 0, 7, IDS, torch.arange(2048)).offsets["v"]  # [1, N, 25]
    losses = (offsets * gradient[:, None]).sum(-1).double()  # L_m = ⟨g, θ + σ ε_m⟩ − ⟨g, θ⟩
    step = sign_test_step(params, [], losses, 0.01, config, step=0, seed=7, ids=IDS)["v"]
    moved = step != 0
    # E[Z_i] = −K·√(2/π)·g_i/‖g‖ (about 160·g_i here) against a threshold of 2.58·√K = 82: most
    # coordinates move, and θ ← θ − lr·step moves each against its gradient's sign
    assert moved.sum() >= 15 and torch.equal(step[moved], torch.sign(gradient[moved]))
