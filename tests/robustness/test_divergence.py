"""A diverged run does not end green: weights or a loss beyond sane bounds stop `fit` with one line
and exit status 2 before a checkpoint of them is written; `--divergence.enabled false` turns it off."""

from __future__ import annotations

import math

import pytest
import torch

from soma_pl.callbacks.divergence import UNIFORM_LOSS, DivergenceCheck
from soma_pl.eval.checks import largest_weights
from soma_pl.models.stacked import HeadMode, StackedExperts
from tests.lit.conftest import corpus_dir, final_weights, fit_args  # noqa: F401
from tests.robustness.cli import cli, one_error

HUGE_LR = "--model.init_args.optimizer.init_args.lr=1e6"
FIRST_STEP = ("--divergence.every_n_steps=1", "--trainer.max_steps=1")
"""One update at HUGE_LR moves weights far past the bound while the loss stays finite; a second, from
the loss of those weights, overflows them (the MLP's products are unbounded)."""


def _largest(run) -> float:
    return max(value.abs().max().item() for name, value in final_weights(run).items()
               if name.startswith("model.") and value.is_floating_point())


def test_weights_beyond_the_bound_stop_the_run_with_one_line(corpus_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    line = one_error(cli(capsys, *fit_args(corpus_dir, tmp_path / "data", run, HUGE_LR, *FIRST_STEP)),
                     "diverged at step 1", "expert 0's largest weight", "--divergence.max_abs_weight",
                     "--divergence.enabled false")
    assert float(line.split("largest weight is ")[1].split(" ")[0]) > 1e4
    assert not (run / "checkpoints").exists() or not list((run / "checkpoints").iterdir())
    assert not (run / "summary.json").exists()


def test_the_check_turned_off_lets_the_same_run_end_green(corpus_dir, tmp_path, capsys):  # noqa: F811
    """What the check stops: the same run without it exits 0 with weights far beyond any trained model's."""
    run = tmp_path / "run"
    code, errors = cli(capsys, *fit_args(corpus_dir, tmp_path / "data", run, HUGE_LR, *FIRST_STEP,
                                         "--divergence.enabled=false"))
    assert (code, errors) == (0, [])
    assert math.isfinite(_largest(run)) and _largest(run) > DivergenceCheck().max_abs_weight


def test_a_loss_beyond_its_bound_stops_the_run(corpus_dir, tmp_path, capsys):  # noqa: F811
    """A sane run's loss starts near ln 256 = 5.55 nats/byte: a bound of 1.0 is crossed at the first check,
    and the line gives the loss it saw."""
    run = tmp_path / "run"
    line = one_error(cli(capsys, *fit_args(corpus_dir, tmp_path / "data", run, "--divergence.max_loss=1.0")),
                     "diverged at step 4", "loss is", "(bound 1, --divergence.max_loss)")
    seen = float(line.split("loss is ")[1].split(" ")[0])
    assert 4.0 < seen < 2 * math.log(256)


def test_a_sane_run_passes_and_stays_far_inside_the_weight_bound(corpus_dir, tmp_path, capsys):  # noqa: F811
    run = tmp_path / "run"
    assert cli(capsys, *fit_args(corpus_dir, tmp_path / "data", run, "--divergence.every_n_steps=1")) == (0, [])
    assert _largest(run) < 10


@pytest.mark.parametrize(("setting", "fragment"), [("--divergence.max_loss=-1", "divergence.max_loss=-1.0"),
                                                   ("--divergence.max_abs_weight=0", "divergence.max_abs_weight=0.0"),
                                                   ("--divergence.every_n_steps=0", "divergence.every_n_steps=0")])
def test_a_bound_that_cannot_work_is_one_line(setting, fragment, corpus_dir, tmp_path, capsys):  # noqa: F811
    one_error(cli(capsys, *fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", setting)), fragment)


def test_largest_weights_is_each_experts_largest_magnitude():
    model = StackedExperts(num_experts=3, width=8, embed_dim=8, num_layers=1, head=HeadMode.shared, time_chunk=8)
    with torch.no_grad():
        for param in model.parameters():
            param.clamp_(-0.5, 0.5)
        model.w_hh[1, 0, 0] = -7.5
        model.w_hh[2, 0, 0] = float("nan")
        model.head[3, 2] = 2.0  # the shared head counts for every expert
    largest = largest_weights(model)
    assert largest.dtype == torch.float64
    assert largest[0].item() == 2.0 and largest[1].item() == 7.5 and math.isnan(largest[2].item())


def test_the_default_bounds_are_far_outside_training():
    check = DivergenceCheck()
    assert check.enabled and check.max_abs_weight == 1e4 and check.max_loss == pytest.approx(2 * math.log(256))
    assert UNIFORM_LOSS == pytest.approx(5.545177)
