"""SPSA on closed-form quadratics and on the expert model: bias, variance, grouping, batching; dense
Rademacher directions (the theory's reference) and the paper's sparse probes (App. E, G.1)."""

from dataclasses import dataclass, field, replace

import pytest
import torch

from soma_pl.estimators import (
    DirectionKind,
    SPSAConfig,
    SPSAResult,
    assemble_estimate,
    directions,
    group_sums,
    grouped_relative_error,
    joint_to_separate_ratio,
    relative_error,
    spsa_estimate,
)
from soma_pl.estimators.directions import coordinate_activity
from soma_pl.estimators.theory import sparse_relative_variance
from soma_pl.models import StackedExperts

rademacher = DirectionKind.rademacher


@dataclass
class Quadratic:
    """E independent losses ``L_e(θ) = ½ θᵀA_eθ − b_eᵀθ`` behind the estimator's loss API."""

    a: torch.Tensor  # [E, d, d] symmetric positive definite
    b: torch.Tensor  # [E, d]
    calls: list[int] = field(default_factory=list)  # groups per loss call

    @classmethod
    def random(cls, experts: int, dim: int, seed: int = 0) -> "Quadratic":
        generator = torch.Generator().manual_seed(seed)
        root = torch.randn(experts, dim, dim, generator=generator, dtype=torch.float64) / dim**0.5
        a = root @ root.transpose(1, 2) + torch.eye(dim, dtype=torch.float64)
        return cls(a, torch.randn(experts, dim, generator=generator, dtype=torch.float64))

    def loss_fn(self, params, tokens):
        theta = params["theta"]  # [G, d], groups expert-major
        copies = theta.shape[0] // self.a.shape[0]
        a, b = self.a.repeat_interleave(copies, 0), self.b.repeat_interleave(copies, 0)
        self.calls.append(theta.shape[0])
        return 0.5 * torch.einsum("gi,gij,gj->g", theta, a, theta) - (b * theta).sum(1)

    def gradient(self, theta):
        return torch.einsum("eij,ej->ei", self.a, theta) - self.b

    def estimate(self, theta, config, step=0, seed=0, windows=None) -> SPSAResult:
        # The quadratic ignores the bytes; only the batch's shape matters.
        batch = torch.zeros(theta.shape[0], windows or config.micro_batch, 3, dtype=torch.uint8)
        return spsa_estimate(self.loss_fn, {"theta": theta}, batch, config, step, seed)


def _problem(experts: int, dim: int, seed: int = 0) -> tuple[Quadratic, torch.Tensor]:
    problem = Quadratic.random(experts, dim, seed)
    generator = torch.Generator().manual_seed(seed)
    theta = torch.randn(experts, dim, dtype=torch.float64, generator=generator)
    return problem, theta


def test_sparse_probes_are_the_default():
    assert SPSAConfig().direction is DirectionKind.sparse


def test_mean_estimate_points_along_true_gradient():
    problem, theta = _problem(experts=3, dim=16)
    config = SPSAConfig(eps=1e-2, n_pert=128, micro_batch=4, direction=rademacher)
    estimates = [problem.estimate(theta, config, step).gradient["theta"] for step in range(40)]
    mean = torch.stack(estimates).mean(0)
    cosine = torch.nn.functional.cosine_similarity(mean, problem.gradient(theta), dim=1)
    assert (cosine > 0.99).all(), cosine


@pytest.mark.parametrize("kind", [rademacher, DirectionKind.gaussian])
def test_relative_error_matches_closed_form(kind):
    experts, dim, n_pert = 64, 32, 8
    problem, theta = _problem(experts, dim, seed=1)
    config = SPSAConfig(eps=1e-2, n_pert=n_pert, micro_batch=4, direction=kind)
    true = problem.gradient(theta)
    errors = [
        ((problem.estimate(theta, config, step).gradient["theta"] - true) ** 2).sum(1)
        for step in range(16)
    ]
    measured = (torch.stack(errors) / (true**2).sum(1)).mean().item()
    assert measured == pytest.approx(relative_error(kind, dim, n_pert), rel=0.1)


def test_separate_losses_are_isolated_and_joint_losses_are_not():
    problem, theta = _problem(experts=2, dim=8)
    moved = theta.clone()
    moved[0] += 1.0
    for grouping, isolated in ((1, True), (2, False)):
        config = SPSAConfig(eps=1e-2, n_pert=16, micro_batch=4, loss_grouping=grouping)
        before, after = problem.estimate(theta, config), problem.estimate(moved, config)
        assert torch.equal(before.loss[1], after.loss[1])
        same = torch.allclose(before.gradient["theta"][1], after.gradient["theta"][1])
        assert same == isolated


def test_joint_loss_error_ratio_matches_theory_on_the_same_evaluations():
    experts, dim = 4, 16
    problem, theta = _problem(experts, dim, seed=2)
    config = SPSAConfig(eps=1e-2, n_pert=16, micro_batch=4, direction=rademacher)
    true = problem.gradient(theta)
    separate, joint = [], []
    for step in range(800):
        result = problem.estimate(theta, config, step)
        regrouped = group_sums(result.expert_projected, experts)
        estimate = assemble_estimate({"theta": theta}, regrouped, config, step, 0)["theta"]
        separate.append(((result.gradient["theta"] - true) ** 2).sum())
        joint.append(((estimate - true) ** 2).sum())
    measured = torch.stack(joint).mean() / torch.stack(separate).mean()
    predicted = joint_to_separate_ratio(rademacher, (true**2).sum(1), dim, experts)
    assert predicted == pytest.approx((experts * dim - 1) / (dim - 1))
    assert measured.item() == pytest.approx(predicted, rel=0.1)


def test_grouped_estimate_equals_regrouped_separate_estimate():
    problem, theta = _problem(experts=4, dim=6)
    config = SPSAConfig(eps=1e-2, n_pert=8, micro_batch=4)
    separate = problem.estimate(theta, config, step=2, seed=9)
    grouped = problem.estimate(theta, replace(config, loss_grouping=2), step=2, seed=9)
    regrouped = group_sums(separate.expert_projected, 2)
    rebuilt = assemble_estimate({"theta": theta}, regrouped, config, 2, 9)
    torch.testing.assert_close(grouped.gradient["theta"], rebuilt["theta"])
    torch.testing.assert_close(grouped.projected, regrouped)


def test_micro_batches_use_fresh_directions():
    problem, theta = _problem(experts=2, dim=8)
    config = SPSAConfig(eps=1e-2, n_pert=5, micro_batch=4, direction=rademacher)
    result = problem.estimate(theta, config, step=4, seed=6, windows=8)
    assert result.projected.shape == (2, 10)
    z = directions(rademacher, 6, 4, torch.arange(2), torch.arange(10), 8, dtype=torch.float64)
    assert len({tuple(row.tolist()) for row in z[0]}) == 10
    expected = torch.einsum("ek,ekd->ed", result.projected, z) / 10
    torch.testing.assert_close(result.gradient["theta"], expected)


def test_direction_chunks_give_the_same_estimate_with_bounded_calls():
    problem, theta = _problem(experts=3, dim=10)
    config = SPSAConfig(eps=1e-2, n_pert=12, micro_batch=4)
    whole = problem.estimate(theta, config, step=1, seed=2, windows=8)
    assert problem.calls == [3 * 2 * 12] * 2  # one call per micro-batch
    problem.calls.clear()
    rows = 3 * 2 * 5 * 4  # five directions per call
    chunked = problem.estimate(theta, replace(config, max_rows=rows), step=1, seed=2, windows=8)
    assert max(problem.calls) * 4 <= rows and len(problem.calls) == 6
    torch.testing.assert_close(chunked.gradient["theta"], whole.gradient["theta"])
    torch.testing.assert_close(chunked.projected, whole.projected)
    torch.testing.assert_close(chunked.loss, whole.loss)


def test_expert_model_estimate_shapes_and_isolation():
    torch.manual_seed(0)
    model = StackedExperts(2, 8, num_layers=2)
    batch = torch.randint(0, 256, (2, 4, 9), dtype=torch.uint8)
    params = {name: p.detach().clone() for name, p in model.expert_parameters().items()}
    config = SPSAConfig(eps=1e-3, n_pert=6, micro_batch=2, max_rows=2 * 2 * 3 * 2)
    result = spsa_estimate(model.loss_per_group, params, batch, config, 0, 0)
    for name, param in params.items():
        assert result.gradient[name].shape == param.shape
    with torch.no_grad():
        plain = model.loss_per_group({}, batch)
    torch.testing.assert_close(result.loss, plain, atol=1e-3, rtol=0)
    params["w_hh"][0] += 0.1
    moved = spsa_estimate(model.loss_per_group, params, batch, config, 0, 0)
    torch.testing.assert_close(moved.gradient["w_hh"][1], result.gradient["w_hh"][1])
    assert not torch.allclose(moved.gradient["w_hh"][0], result.gradient["w_hh"][0])


def test_batch_must_split_into_micro_batches():
    problem, theta = _problem(experts=1, dim=4)
    with pytest.raises(ValueError, match="micro_batch"):
        problem.estimate(theta, SPSAConfig(micro_batch=4), windows=6)


def test_grouped_theory_closed_forms():
    norms, dims = [1.0, 3.0, 0.5, 2.0], [10, 20, 30, 40]
    total = sum(norms)
    separate = sum((d - 1) * g for d, g in zip(dims, norms, strict=False)) / (8 * total)
    assert grouped_relative_error(rademacher, norms, dims, 1, 8) == pytest.approx(separate)
    pairs = ((10 + 20 + 1) * 4.0 + (30 + 40 + 1) * 2.5) / (8 * total)
    assert grouped_relative_error(DirectionKind.gaussian, norms, dims, 2, 8) == pytest.approx(pairs)
    single = grouped_relative_error(rademacher, [2.0], 50, 1, 7)
    assert single == pytest.approx(relative_error(rademacher, 50, 7))


def test_expert_model_estimate_projects_onto_the_autograd_gradient():
    torch.manual_seed(0)
    model = StackedExperts(1, 8, num_layers=1).double()
    batch = torch.randint(0, 256, (1, 2, 9), dtype=torch.uint8)
    model.loss_per_group({}, batch).sum().backward()
    exact = torch.cat([p.grad.reshape(-1) for p in model.expert_parameters().values()])
    params = {name: p.detach() for name, p in model.expert_parameters().items()}
    config = SPSAConfig(eps=1e-4, n_pert=1024, micro_batch=2, max_rows=2 * 256 * 2, direction=rademacher)
    result = spsa_estimate(model.loss_per_group, params, batch, config, 0, 0)
    estimate = torch.cat([result.gradient[name].reshape(-1) for name in params])
    # E[ĝ] = g, so ĝ·g/‖g‖² = 1 ± sqrt(2/n_pert) for Rademacher directions.
    assert (estimate @ exact / (exact @ exact)).item() == pytest.approx(1.0, abs=0.2)
    # Each δ_k equals z_kᵀg up to the O(ε²·‖z‖²) central-difference error (ε‖z‖ ≈ 0.01 here).
    z = directions(rademacher, 0, 0, torch.tensor([0]), torch.arange(4), exact.numel())
    torch.testing.assert_close(result.projected[0, :4], z[0].double() @ exact, rtol=1e-3, atol=0)


LAYOUT = {"norm_gains": torch.Size([4]), "w_ih": torch.Size([2, 6])}
"""Four norm gains (q = 1) and twelve ordinary weights (q = 1/2 under sparse probes)."""


class FixedGradient:
    """``L_e(θ) = g_eᵀθ`` over named zero tensors laid out as `shapes`: a fixed gradient g ``[E, D]``
    whose central differences are exactly ``zᵀg``."""

    def __init__(self, gradient: torch.Tensor, shapes: dict[str, torch.Size]):
        self.gradient, self.shapes = gradient, shapes

    def loss_fn(self, params, tokens):
        flat = torch.cat([params[name].flatten(1) for name in self.shapes], 1)  # [G, D]
        return (flat * self.gradient.repeat_interleave(flat.shape[0] // self.gradient.shape[0], 0)).sum(1)

    def estimate(self, config: SPSAConfig, step: int = 0) -> torch.Tensor:
        """``[E, D]`` flat estimates; every expert's directions are independent of the others'."""
        experts = self.gradient.shape[0]
        params = {name: torch.zeros(experts, *shape, dtype=torch.float64) for name, shape in self.shapes.items()}
        batch = torch.zeros(experts, config.micro_batch, 2, dtype=torch.uint8)
        result = spsa_estimate(self.loss_fn, params, batch, config, step, seed=5)
        return torch.cat([result.gradient[name].flatten(1) for name in self.shapes], 1)


def _gradients(rows: int, dim: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, dim, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def test_sparse_mean_estimate_is_activity_times_gradient():
    # E[ĝ] = q ⊙ g: q = 1 on the gains, 1/2 on the weights (no rescaling). One gradient, 4,096 experts
    # of 16 directions each: 65,536 directions, so the mean is within ~1% of ‖g‖.
    g = _gradients(1, 16, seed=3)[0]
    mean = FixedGradient(g.expand(4096, -1), LAYOUT).estimate(SPSAConfig(eps=1e-2, n_pert=16, micro_batch=1)).mean(0)
    q = coordinate_activity(DirectionKind.sparse, LAYOUT)
    assert q.tolist() == [1.0] * 4 + [0.5] * 12
    gains = (mean[:4] @ g[:4] / (g[:4] @ g[:4])).item()
    weights = (mean[4:] @ g[4:] / (g[4:] @ g[4:])).item()
    assert gains == pytest.approx(1.0, abs=0.03) and weights == pytest.approx(0.5, abs=0.03)
    assert ((mean - q * g).norm() / (q * g).norm()).item() < 0.03


@pytest.mark.parametrize("grouping", [1, 2])
def test_sparse_relative_variance_matches_monte_carlo(grouping):
    # App. G.1: E‖ĝ − q ⊙ g‖² / ‖g‖² = Σ q_j (1 + s − 2 q_j) g_j² / (n ‖g‖²), measured on 4,096
    # independent draws of a pair of experts (s = 4 + 12/2 = 10 per expert; a joint loss of two: s_G = 20).
    pair, n_pert = _gradients(2, 16, seed=4), 4
    problem = FixedGradient(pair.repeat(4096, 1), LAYOUT)
    config = SPSAConfig(eps=1e-2, n_pert=n_pert, micro_batch=1, loss_grouping=grouping)
    q = coordinate_activity(DirectionKind.sparse, LAYOUT)
    errors = (problem.estimate(config) - q * problem.gradient).pow(2).sum(1).view(-1, 2).sum(1)
    relative = errors / pair.pow(2).sum()
    measured, stderr = relative.mean().item(), (relative.std() / relative.numel() ** 0.5).item()
    predicted = sparse_relative_variance(pair.pow(2), q, grouping, n_pert)
    assert measured == pytest.approx(predicted, rel=0.03)
    assert abs(measured - predicted) < 4 * stderr


def test_sparse_formula_is_rademacher_when_every_coordinate_is_a_gain():
    # q = 1 everywhere is the dense Rademacher probe: (D_G − 1) ‖g_G‖² / n.
    grad_sq = torch.rand(4, 10, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for grouping in (1, 2, 4):
        dense = grouped_relative_error(rademacher, grad_sq.sum(1), 10, grouping, 7)
        assert sparse_relative_variance(grad_sq, torch.ones(10), grouping, 7) == pytest.approx(dense, rel=1e-12)
    # The estimator agrees: on a layout of gains only, sparse probes are ±1 and unbiased.
    g = _gradients(1, 4, seed=1)[0]
    problem = FixedGradient(g.expand(4096, -1), {"norm_gains": torch.Size([4])})
    relative = (problem.estimate(SPSAConfig(eps=1e-2, n_pert=2, micro_batch=1)) - g).pow(2).sum(1) / (g @ g)
    measured, stderr = relative.mean().item(), (relative.std() / relative.numel() ** 0.5).item()
    predicted = relative_error(rademacher, 4, 2)
    assert abs(measured - predicted) < 4 * stderr


def test_dense_closed_forms_refuse_sparse_probes():
    with pytest.raises(ValueError, match="sparse"):
        relative_error(DirectionKind.sparse, 10, 4)
