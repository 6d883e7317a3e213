"""`analyze variance`: measured SPSA errors against closed forms where everything is exact."""

from __future__ import annotations

import itertools
import json

import pytest
import torch

from soma_pl.analysis.gradient_error import (
    ProbedLoss,
    central_difference_deviation,
    draw_errors,
    exact_gradient,
    flatten,
    mean_with_error,
    per_window_gradients,
    ratio_with_error,
    regrouped_estimates,
)
from soma_pl.analysis.variance_panels import (
    Measurement,
    body_params,
    n_pert_panel,
    pool_batches,
    probe_coordinates,
    width_for_total,
)
from soma_pl.cli import main
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, assemble_estimate, group_sums, spsa_estimate
from soma_pl.estimators.theory import (
    batch_noise_relative_error,
    grouped_relative_error,
    sampled_batch_variance,
    sparse_batch_noise_relative_error,
    sparse_relative_variance,
)
from soma_pl.models.stacked import HeadMode, StackedExperts
from tests.analysis.conftest import save_checkpoint, tiny_experts

KINDS = (DirectionKind.rademacher, DirectionKind.gaussian)


class DiagonalQuadratic:
    """``L_e(θ) = ½ Σ a_e θ² − b_eᵀθ`` per expert: central differences are exact directional derivatives."""

    def __init__(self, experts: int, dim: int, seed: int = 0):
        generator = torch.Generator().manual_seed(seed)
        self.a = torch.rand(experts, dim, generator=generator, dtype=torch.float64) + 0.5
        self.b = torch.randn(experts, dim, generator=generator, dtype=torch.float64)
        self.theta = torch.randn(experts, dim, generator=generator, dtype=torch.float64)

    def __call__(self, params, tokens):
        theta = params["theta"]
        copies = theta.shape[0] // self.a.shape[0]
        a, b = self.a.repeat_interleave(copies, 0), self.b.repeat_interleave(copies, 0)
        return 0.5 * (a * theta**2).sum(1) - (b * theta).sum(1)

    def gradient(self):
        return self.a * self.theta - self.b


class GainedQuadratic(DiagonalQuadratic):
    """The same loss with its first `gains` coordinates named ``norm_gains`` (q = 1 under sparse probes)."""

    def __init__(self, experts: int, dim: int, gains: int, seed: int = 0):
        super().__init__(experts, dim, seed)
        self.gains = gains

    def params(self) -> dict[str, torch.Tensor]:
        return {"norm_gains": self.theta[:, : self.gains], "theta": self.theta[:, self.gains :]}

    def __call__(self, params, tokens):
        return super().__call__({"theta": torch.cat([params["norm_gains"], params["theta"]], 1)}, tokens)


@pytest.mark.parametrize("kind", KINDS)
def test_measured_error_matches_closed_form_for_every_n_pert_and_grouping(kind):
    experts, dim, draws = 4, 12, 250
    loss = DiagonalQuadratic(experts, dim)
    reference = loss.gradient()
    norms = reference.pow(2).sum(1)
    tokens = torch.zeros(experts, 1, 2, dtype=torch.uint8)  # the quadratic ignores the bytes
    config = SPSAConfig(eps=1e-3, direction=kind)
    n_perts, groupings = [4, 8], [1, 2, 4]
    errors = torch.stack([draw_errors(loss, {"theta": loss.theta}, tokens, reference, n_perts, groupings, config,
                                      step=r, seed=3) for r in range(draws)])
    relative = errors.sum(-1) / norms.sum()
    for (i, n_pert), (j, grouping) in itertools.product(enumerate(n_perts), enumerate(groupings)):
        measured = mean_with_error(relative[:, i, j])
        predicted = grouped_relative_error(kind, norms, dim, grouping, n_pert)
        assert abs(measured.mean - predicted) < 4 * measured.stderr, (n_pert, grouping, measured, predicted)


def test_sparse_measured_error_matches_app_g1_for_every_n_pert_and_grouping():
    # Around the estimator's mean q ⊙ g (q = 1 on the four gains, 1/2 on the eight weights).
    experts, draws = 4, 400
    loss = GainedQuadratic(experts, 12, gains=4)
    reference, params = loss.gradient(), loss.params()
    tokens = torch.zeros(experts, 1, 2, dtype=torch.uint8)
    measurement = Measurement(SPSAConfig(eps=1e-3, direction=DirectionKind.sparse), draws, seed=3)
    activity = measurement.activity(params)
    assert activity.tolist() == [1.0] * 4 + [0.5] * 8
    n_perts, groupings = [4, 8], [1, 2, 4]
    errors = torch.stack([draw_errors(loss, params, tokens, reference * activity, n_perts, groupings,
                                      measurement.config, step=r, seed=3) for r in range(draws)])
    relative = errors.sum(-1) / reference.pow(2).sum()
    for (i, n_pert), (j, grouping) in itertools.product(enumerate(n_perts), enumerate(groupings)):
        measured = mean_with_error(relative[:, i, j])
        predicted = measurement.predicted(reference, activity, grouping, n_pert)
        assert predicted == sparse_relative_variance(reference.pow(2), activity, grouping, n_pert)
        assert abs(measured.mean - predicted) < 4 * measured.stderr, (n_pert, grouping, measured, predicted)


def test_n_pert_panel_predicts_sparse_probes_by_app_g1():
    model = tiny_experts(2).double()
    tokens = torch.randint(0, 256, (2, 2, 9), generator=torch.Generator().manual_seed(5), dtype=torch.uint8)
    measurement = Measurement(SPSAConfig(eps=1e-5, direction=DirectionKind.sparse, max_rows=64), 2, seed=1)
    panel = n_pert_panel(model, tokens, [2, 4], [1, 2], measurement)
    params = {name: p.detach() for name, p in model.expert_parameters().items()}
    reference = exact_gradient(model.loss_per_group, params, tokens)
    # q by hand: 1 on the norm gains' coordinates, 1/2 on every other parameter's.
    q = torch.cat([torch.full((p[0].numel(),), 1.0 if name == "norm_gains" else 0.5) for name, p in params.items()])
    joint = panel["curves"][1]["points"][1]
    assert joint["predicted"] == pytest.approx(sparse_relative_variance(reference.pow(2), q, 2, 4), rel=1e-9)
    assert joint["predicted"] != pytest.approx(grouped_relative_error(DirectionKind.rademacher,
                                                                      reference.pow(2).sum(1), q.numel(), 2, 4))
    assert panel["doubling"][0]["predicted"] == 2.0 and panel["central_difference_deviation"] < 1e-4


def test_regrouping_uses_the_same_evaluations_as_a_joint_loss_run():
    model = tiny_experts(4).double()
    params = {name: p.detach() for name, p in model.expert_parameters().items()}
    tokens = torch.randint(0, 256, (4, 2, 9), generator=torch.Generator().manual_seed(1), dtype=torch.uint8)
    config = SPSAConfig(eps=1e-5, n_pert=6, micro_batch=2)
    separate = spsa_estimate(model.loss_per_group, params, tokens, config, step=5, seed=7)  # sparse probes
    shapes = {name: param.shape[1:] for name, param in params.items()}
    estimates = regrouped_estimates(separate.expert_projected, [3, 6], [1, 2, 4], config.direction, 5, 7, shapes)
    for (i, n_pert), (j, grouping) in itertools.product(enumerate([3, 6]), enumerate([1, 2, 4])):
        projected = group_sums(separate.expert_projected[:, :n_pert], grouping)
        expected = flatten(assemble_estimate(params, projected, config, 5, 7))
        torch.testing.assert_close(estimates[:, i * 3 + j], expected, rtol=1e-10, atol=1e-12)
    for j, grouping in enumerate([1, 2, 4]):
        joint = spsa_estimate(model.loss_per_group, params, tokens, SPSAConfig(
            eps=1e-5, n_pert=6, micro_batch=2, loss_grouping=grouping), step=5, seed=7)
        torch.testing.assert_close(estimates[:, 3 + j], flatten(joint.gradient), rtol=1e-10, atol=1e-12)


def test_central_differences_match_autograd_directional_derivatives():
    model = tiny_experts(2).double()
    params = {name: p.detach() for name, p in model.expert_parameters().items()}
    tokens = torch.randint(0, 256, (2, 3, 12), generator=torch.Generator().manual_seed(2), dtype=torch.uint8)
    reference = exact_gradient(model.loss_per_group, params, tokens)
    config = SPSAConfig(eps=1e-5, n_pert=8, micro_batch=3)
    result = spsa_estimate(model.loss_per_group, params, tokens, config, step=0, seed=4)
    shapes = {name: param.shape[1:] for name, param in params.items()}
    assert central_difference_deviation(result.expert_projected, reference, shapes, config, 0, 4) < 1e-6
    # A far too large ε leaves the quadratic regime: the check must notice.
    coarse = spsa_estimate(model.loss_per_group, params, tokens, SPSAConfig(eps=0.5, n_pert=8, micro_batch=3), 0, 4)
    assert central_difference_deviation(coarse.expert_projected, reference, shapes, config, 0, 4) > 1e-3


def test_probed_gradients_are_the_full_gradient_at_the_probed_coordinates():
    model = tiny_experts(2).double()
    params = {name: p.detach() for name, p in model.expert_parameters().items()}
    pool = torch.randint(0, 256, (2, 5, 10), generator=torch.Generator().manual_seed(3), dtype=torch.uint8)
    full = exact_gradient(model.loss_per_group, params, pool)
    coordinates = probe_coordinates(model, 7, seed=0)
    probed = ProbedLoss(model, coordinates)
    torch.testing.assert_close(exact_gradient(probed, probed.probe(), pool), full.gather(1, coordinates))
    per_window = per_window_gradients(probed, probed.probe(), pool)
    assert per_window.shape == (2, 5, 7)
    torch.testing.assert_close(per_window.mean(1), full.gather(1, coordinates))


@pytest.mark.parametrize("kind", KINDS)
def test_batch_noise_prediction_by_monte_carlo(kind):
    experts, dim, pool, batch, n_pert, draws = 2, 6, 6, 2, 3, 40_000
    generator = torch.Generator().manual_seed(0)
    windows = torch.randn(pool, experts, dim, generator=generator, dtype=torch.float64) + 1.0
    mean = windows.mean(0)
    sigma2 = (windows - mean).pow(2).sum(2).mean(0)
    picks = torch.rand(draws, pool, generator=generator).argsort(1)[:, :batch]
    batch_grad = windows[picks].mean(1)  # [R, E, d]
    if kind is DirectionKind.rademacher:
        z = torch.randint(0, 2, (draws, n_pert, experts, dim), generator=generator).double() * 2 - 1
    else:
        z = torch.randn(draws, n_pert, experts, dim, generator=generator, dtype=torch.float64)
    own = torch.einsum("rked,red->rke", z, batch_grad)
    for grouping, delta in ((1, own), (2, own.sum(2, keepdim=True).expand_as(own))):
        estimate = torch.einsum("rke,rked->red", delta, z) / n_pert
        relative = (estimate - mean).pow(2).sum((1, 2)) / mean.pow(2).sum()
        measured = mean_with_error(relative)
        variance = sampled_batch_variance(sigma2, batch, pool)
        predicted = batch_noise_relative_error(kind, mean.pow(2).sum(1), variance, dim, grouping, n_pert)
        assert abs(measured.mean - predicted) < 4 * measured.stderr, (grouping, measured, predicted)


def test_sparse_batch_noise_prediction_by_monte_carlo():
    # Sparse probes drawn here by torch's RNG (q = 1 on two gain coordinates, 1/2 on four weights);
    # the error is measured around q ⊙ g of the pool-mean gradient g.
    experts, dim, pool, batch, n_pert, draws = 2, 6, 6, 2, 3, 40_000
    generator = torch.Generator().manual_seed(1)
    windows = torch.randn(pool, experts, dim, generator=generator, dtype=torch.float64) + 1.0
    mean = windows.mean(0)
    sigma2 = (windows - mean).pow(2).mean(0)  # [E, d] per coordinate
    q = torch.tensor([1.0, 1.0, 0.5, 0.5, 0.5, 0.5], dtype=torch.float64)
    picks = torch.rand(draws, pool, generator=generator).argsort(1)[:, :batch]
    batch_grad = windows[picks].mean(1)  # [R, E, d]
    signs = torch.randint(0, 2, (draws, n_pert, experts, dim), generator=generator).double() * 2 - 1
    z = signs * (torch.rand(draws, n_pert, experts, dim, generator=generator, dtype=torch.float64) < q)
    own = torch.einsum("rked,red->rke", z, batch_grad)
    for grouping, delta in ((1, own), (2, own.sum(2, keepdim=True).expand_as(own))):
        estimate = torch.einsum("rke,rked->red", delta, z) / n_pert
        relative = (estimate - q * mean).pow(2).sum((1, 2)) / mean.pow(2).sum()
        measured = mean_with_error(relative)
        variance = sampled_batch_variance(sigma2, batch, pool)
        predicted = sparse_batch_noise_relative_error(mean.pow(2), variance, q, grouping, n_pert)
        assert abs(measured.mean - predicted) < 4 * measured.stderr, (grouping, measured, predicted)
    dense = sparse_batch_noise_relative_error(mean.pow(2), variance, torch.ones(dim), 2, n_pert)
    assert dense == pytest.approx(batch_noise_relative_error(DirectionKind.rademacher, mean.pow(2).sum(1),
                                                             variance.sum(1), dim, 2, n_pert), rel=1e-12)


def test_sampled_batch_variance_by_enumerating_every_batch():
    values = torch.tensor([[0.0, 1.0], [2.0, -1.0], [4.0, 3.0], [1.0, 1.0], [-3.0, 0.5]], dtype=torch.float64)
    mean = values.mean(0)
    sigma2 = float((values - mean).pow(2).sum(1).mean())
    for batch in (1, 2, 3, 5):
        subsets = [values[list(s)].mean(0) for s in itertools.combinations(range(5), batch)]
        exact = float(torch.stack([(s - mean).pow(2).sum() for s in subsets]).mean())
        assert sampled_batch_variance(sigma2, batch, 5) == pytest.approx(exact)


def test_pool_batches_are_distinct_and_cover_the_pool_evenly():
    batches = pool_batches(8, 2, 8, torch.Generator().manual_seed(0))
    assert len(batches) == 8 and all(len(set(b.tolist())) == 2 for b in batches)
    assert sorted(torch.cat(batches[:4]).tolist()) == list(range(8))  # one pass covers the pool once


def test_ratio_standard_error_of_identical_draws_is_zero_and_means_are_exact():
    a = torch.tensor([1.0, 2.0, 3.0, 6.0])
    assert ratio_with_error(2 * a, a).mean == pytest.approx(2.0)
    assert ratio_with_error(2 * a, a).stderr == pytest.approx(0.0, abs=1e-12)
    assert mean_with_error(a).stderr == pytest.approx(float(a.std() / 2))


def test_body_params_and_equal_total_widths():
    for width in (10, 32, 44):
        model = StackedExperts(1, width, head=HeadMode.shared, device="meta")
        assert body_params(width) == sum(p.numel() for p in model.expert_parameters().values())
    assert body_params(509) == 8_325_713  # Table 2
    width = width_for_total(100_000, 4)
    best = abs(4 * body_params(width) - 100_000)
    assert best <= min(abs(4 * body_params(w) - 100_000) for w in (width - 1, width + 1))


TINY_CLI = ["--context", "4", "--batch", "1", "--experts", "2", "--loss_groupings", "[1, 2]", "--n_pert", "[2, 4]",
            "--repeats", "2", "--expert_counts", "[1, 2]", "--total_params", "3000", "--pool", "4",
            "--probe_coordinates", "8", "--budget", "4", "--batch_sizes", "[1, 2]", "--batch_repeats", "2",
            "--width", "3"]


def test_cli_writes_every_panel_with_predictions(tmp_path, prepared, capsys):
    checkpoint = save_checkpoint(tmp_path / "three.ckpt", tiny_experts(3), None)
    out = tmp_path / "variance.json"
    main(["analyze", "variance", *TINY_CLI, "--checkpoint", str(checkpoint), "--data", str(prepared),
          "--out", str(out)])
    result = json.loads(out.read_text())
    printed = capsys.readouterr()
    assert json.loads(printed.out) == result, "stdout holds the JSON only; progress goes to stderr"
    # 2 expert counts x 2 repeats + 2 repeats (n_pert panel) + 2 batch sizes x 2 batch repeats.
    assert "analyze variance" in printed.err and "10/10" in printed.err
    assert result["weights"].endswith("(experts [0, 1])")
    panel = result["n_pert"]
    assert [c["loss_grouping"] for c in panel["curves"]] == [1, 2]
    dim, norms = panel["params_per_expert"], panel["grad_sq_norms"]
    joint = panel["curves"][1]["points"][1]
    assert joint["predicted"] == pytest.approx(grouped_relative_error(DirectionKind.rademacher, norms, dim, 2, 4))
    assert result["npert_doubling_at"] == [2, 4] and result["predicted_npert_doubling_ratio"] == 2.0
    assert result["predicted_separate_vs_joint_ratio"] == pytest.approx((2 * dim - 1) / (dim - 1))
    assert result["separate_vs_joint_ratio"] > 0 and panel["central_difference_deviation"] < 1e-4
    assert [p["num_experts"] for p in result["experts"]["points"]] == [1, 2]
    # the widths whose two-block bodies come nearest to 3,000 parameters: 32·d² + 5·d + 64·d at d = 9 and 2 × d = 6
    assert [(p["width"], p["ensemble_params"]) for p in result["experts"]["points"]] == [(9, 3213), (6, 3132)]
    assert [p["batch"] for p in result["batch"]["curves"][0]["points"]] == [1, 2]
    assert result["batch"]["nu"] > 0


def test_cli_rejects_a_grouping_that_does_not_divide_the_experts(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "variance", *TINY_CLI, "--loss_groupings", "[3]", "--out", str(tmp_path / "v.json")])
    assert exit_info.value.code == 2
    assert "loss_grouping must divide experts" in capsys.readouterr().err
    assert not (tmp_path / "v.json").exists()


def test_the_reference_panel_measures_every_curve_point_and_table8(tmp_path, prepared, capsys):
    out = tmp_path / "reference.json"
    main(["analyze", "variance", "--panels", "[reference]", "--data", str(prepared), "--context", "4",
          "--n_pert", "[2]", "--batch", "1", "--scales", "[1, 2]", "--pool", "4", "--reference_windows", "6",
          "--expert_counts", "[1, 2]", "--total_params", "3000", "--repeats", "2", "--direction", "sparse",
          "--out", str(out)])
    panel = json.loads(out.read_text())["reference"]
    # the base (2, 1) at N = 1 and 2; N = 1 also at 2x n_pert and 2x B
    assert sorted((p["experts"], p["n_pert"], p["batch"]) for p in panel["points"]) == [
        (1, 2, 1), (1, 2, 2), (1, 4, 1), (2, 2, 1)]
    for point in panel["points"]:
        model = StackedExperts(point["experts"], point["width"], head=HeadMode.shared, device="meta")
        per_token = sum(p[0].numel() if not model.is_shared(n) else p.numel()
                        for n, p in model.named_parameters() if n != "norm_gains")
        # 2 · n_pert · B · T byte forwards per expert, each one multiply-add per weight
        assert point["multiply_adds"] == 2 * point["n_pert"] * point["batch"] * 4 * point["experts"] * per_token
        assert point["relative_error"] > 0 and point["stderr"] >= 0 and point["seconds"] > 0
    assert [row["experts"] for row in panel["table8"]] == [1, 2]
    assert all(0 <= row["cosine_distance"] <= 2 for row in panel["table8"])
    assert "analyze variance" in capsys.readouterr().err


@pytest.mark.parametrize(("settings", "named"), [
    (["--batch", "2", "--scales", "[1, 4]", "--pool", "8"], "pool"),  # every draw of B = 8 would be the whole pool
    (["--scales", "[2, 4]"], "scales"),  # no base point to compare with
    (["--expert_counts", "[1]"], "expert_counts"),  # no larger N
    (["--expert_counts", "[2, 4]"], "expert_counts"),  # no N = 1
])
def test_the_reference_panel_refuses_settings_it_cannot_compare(settings, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["analyze", "variance", "--panels", "[reference]", *settings, "--out", str(tmp_path / "r.json")])
    error = capsys.readouterr().err
    assert exit_info.value.code == 2 and named in error and len(error.strip().splitlines()) == 1
