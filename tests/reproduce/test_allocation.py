"""Fig. 13, Table 10 and Table 11 drawn from hand-made runs: the threshold and the compute to reach
it, the linear and log interpolations, and the equivalence verdict, against closed-form values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from soma_pl import VAL_WINDOWS
from soma_pl.eval.bootstrap import Interval
from soma_pl.reproduce.allocation import (
    equivalence,
    fig13_figure,
    loss_range,
    seconds_to,
    table11_figure,
    threshold_of,
)
from soma_pl.reproduce.experiments import Claim, load_experiment

SECONDS = {"p2_b16": 1.0, "p8_b4": 1.5, "p32_b1": 2.0}
"""Aggregate seconds per update: a larger batch updates faster here, at the same multiply-adds."""


def _fit(folder: Path, label: str, seed: int) -> None:
    """10 updates validated every 2: loss 3 − 0.1·u + 0.01·seed, whatever the allocation."""
    folder.mkdir(parents=True)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for update in range(2, 11, 2):
        rows += [f"{update - 1},{3 - 0.1 * update + 0.01 * seed},", f"{update},,{update * SECONDS[label] / 3600}"]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    (folder / "summary.json").write_text(json.dumps({
        "parameters": 800, "last_checkpoint": None,
        "compute": {"experts": 8, "updates": 10, "token_forwards": 8 * 64 * 10}}))


def _report(tmp_path: Path, make, seeds: int = 2) -> tuple[dict, dict]:
    per_seed, folders = [], {}
    for seed in range(seeds):
        trials = {}
        for index, label in enumerate(SECONDS):
            trial = 10 * seed + index
            trials[label], folders[trial] = trial, {seed: str(tmp_path / f"t{trial}")}
            make(tmp_path / f"t{trial}", label, seed)
        per_seed.append({"seed": seed, "trial": trials})
    return {"table7": {"column_labels": list(SECONDS), "per_seed": per_seed}, "trials": {"COMPLETE": 3 * seeds},
            "failed": []}, folders


OFFSET = {"p2_b16": -0.05, "p8_b4": 0.0, "p32_b1": 0.02}
"""Each allocation's validation windows sit this far from the common curve at every validation."""


def _fit_with_windows(folder: Path, label: str, seed: int) -> None:
    """`_fit`'s run shifted by OFFSET, each validation window by window: four windows of two
    documents, ±0.1 and ±0.2 around the loss."""
    _fit(folder, label, seed)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for update in range(2, 11, 2):
        loss = 3 - 0.1 * update + 0.01 * seed + OFFSET[label]
        rows += [f"{update - 1},{loss},", f"{update},,{update * SECONDS[label] / 3600}"]
        (folder / VAL_WINDOWS).mkdir(exist_ok=True)
        (folder / VAL_WINDOWS / f"{update}.json").write_text(json.dumps({
            "updates": update, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"],
            "window_losses": [loss + d for d in (-0.1, 0.1, -0.2, 0.2)]}))
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_table10_claims_compare_at_equal_updates_with_a_document_interval(tmp_path):
    """The largest batch 0.05 below the middle allocation and 0.07 below the smallest on every window
    at every validation: each of Table 10's checks holds, with both intervals at that gap."""
    report, folders = _report(tmp_path, _fit_with_windows, seeds=3)
    checks = load_experiment("fig13").result(report, folders)["checks"][1:]
    assert len(checks) == 6 and all(check["verdict"] == "holds" for check in checks)
    gaps = [check["mean"] for check in checks]
    assert gaps == pytest.approx([0.07, 0.05] * 3)
    for check, gap in zip(checks, gaps, strict=True):
        assert check["document_interval"] == pytest.approx((gap, gap)) and check["claim"].endswith("log compute)")


def test_the_threshold_is_crossed_mid_curve_by_every_run_and_the_crossing_interpolated_in_log_time():
    curves = {"a": [{"updates": [10, 20, 30, 40], "loss": [4.0, 3.0, 2.5, 2.4]}],
              "b": [{"updates": [10, 20, 30, 40], "loss": [4.0, 3.2, 2.6, 2.2]}]}
    assert threshold_of(curves) == pytest.approx(3.2)  # the higher of 3.0 and 3.2 at 20 updates
    curves["b"][0]["loss"][1] = 3.2001
    assert threshold_of(curves) == pytest.approx(3.21)
    curve = {"aggregate_seconds": [10.0, 20.0, 40.0], "loss": [3.0, 2.5, 2.4]}
    assert seconds_to(curve, 2.75) == pytest.approx(10 * 2 ** 0.5)  # halfway down, halfway in log time
    assert seconds_to(curve, 3.5) == 10.0 and seconds_to(curve, 2.39) is None


def test_table10_brackets_the_linear_and_log_interpolations():
    curve = {"updates": [10, 40], "loss": [3.0, 2.0], "multiply_adds_per_update": 1.0}
    low, high = loss_range(curve, 20.0)
    linear = 3.0 - (20 - 10) / 30
    logarithmic = 3.0 - math.log(2) / math.log(4)
    assert (low, high) == pytest.approx((min(linear, logarithmic), max(linear, logarithmic)))
    assert loss_range(curve, 40.0) == pytest.approx((2.0, 2.0)) and loss_range(curve, 41.0) is None


def test_fig13_favours_the_allocation_that_updates_fastest(tmp_path):
    report, folders = _report(tmp_path, _fit, seeds=3)
    result = load_experiment("fig13").result(report, folders)
    # at half the updates (5) every run is at 2.5 + 0.01·seed: the threshold is 2.52; seed 0 crosses
    # it 0.4 of the way from update 4 (2.6) to 6 (2.4), seed 1 0.45 of the way, seed 2 halfway, in log time
    assert result["threshold"] == pytest.approx(2.52)
    crossings = [4 * 1.5 ** 0.4, 4 * 1.5 ** 0.45, 4 * 1.5 ** 0.5]  # in updates
    rows = {row["allocation"]: row for row in result["rows"]}
    assert rows["p2_b16"]["seconds_to_threshold"] == pytest.approx(crossings)
    assert rows["p32_b1"]["seconds_to_threshold"] == pytest.approx([2 * c for c in crossings])
    assert result["ratio"] == pytest.approx(2.0)
    fig13 = result["checks"][0]
    assert fig13["mean"] == pytest.approx(sum(crossings) / 3) and fig13["seeds"] == 3
    # these validation curves keep no per-window losses: no document interval, so three seeds decide nothing
    assert all(check["verdict"] == "inconclusive" and check["document_interval"] is None and check["p"] is None
               for check in result["checks"])
    # Table 10: equal multiply-adds per update and equal curves: no allocation is favoured
    per_update = 8 * 64 * 800 / 8  # token-forwards per update × parameters per expert
    assert result["budgets"] == pytest.approx([0.95 * 10 * per_update / d for d in (4, 2, 1)])
    assert all(check["mean"] == pytest.approx(0.0) for check in result["checks"][1:])
    text = load_experiment("fig13").table({**result, "experiment": "fig13", "scale": "cpu", "title": "t", "basis": "b",
                           "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2]})
    assert "| p2_b16 | 2 | 16 | 5.12e+04 | 5, 5, 5 |" in text and "2.00x (paper: 1.55x)" in text
    assert fig13_figure({**result, "experiment": "fig13", "scale": "cpu"}, tmp_path / "f.png").stat().st_size > 0


def _documents(low: float, high: float) -> Interval:
    """A document bootstrap of the paired difference reaching from `low` to `high` (it reaches zero)."""
    return Interval((low + high) / 2, low, high, 10, 40, 0.5)


CLAIM = Claim("equal within ±{margin:g}", "equal multiply-adds", "test")


def test_equivalence_needs_every_interval_inside_the_margin():
    inside = equivalence(CLAIM, [0.001, 0.002, 0.0015], _documents(-0.004, 0.005), 0.01)
    assert inside["verdict"] == "holds" and inside["document_interval"] == (-0.004, 0.005)
    assert (inside["claim"], inside["basis"], inside["split"]) == ("equal within ±0.01", "equal multiply-adds", "test")
    assert equivalence(CLAIM, [0.001, 0.002, 0.0015], _documents(-0.004, 0.011), 0.01)["verdict"] == "inconclusive"
    assert equivalence(CLAIM, [0.03, 0.031, 0.0305], _documents(0.02, 0.04), 0.01)["verdict"] == "does not hold"
    # too few seeds, or no document interval: nothing decided
    assert equivalence(CLAIM, [0.03, 0.031], _documents(0.02, 0.04), 0.01)["verdict"] == "inconclusive"
    assert equivalence(CLAIM, [0.03, 0.031, 0.0305], None, 0.01)["verdict"] == "inconclusive"


def _scored(folder: Path, label: str, seed: int) -> None:
    """A continuation's test scores: four windows of two documents, loss 2.0 + offset per allocation;
    its config names the start checkpoint, whose own scores (test loss 2.5) lie beside it."""
    start = folder.parent / "start"
    (folder / "config.yaml").parent.mkdir(parents=True, exist_ok=True)
    (folder / "config.yaml").write_text(f"ckpt_path: {start / 'checkpoints' / 'last.ckpt'}\n")
    if not (start / "start_test").is_dir():
        (start / "start_test" / "version_0").mkdir(parents=True)
        (start / "start_test" / "version_0" / "test_scores.json").write_text(json.dumps({
            "loss": 2.5, "bootstrap_95": [2.4, 2.6]}))
    offset = {"p2_b16": 0.0, "p8_b4": 0.001, "p32_b1": 0.05}[label] + 0.002 * seed
    losses = [2.0 + offset + 0.1 * (w % 2) for w in range(4)]
    scores = folder / "test_windows" / "version_0"
    scores.mkdir(parents=True)
    (scores / "test_scores.json").write_text(json.dumps({
        "loss": sum(losses) / 4, "window_losses": losses, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"],
        "bootstrap_95": [2.0, 2.2]}))


def test_table11_checks_each_pair_of_allocations_for_equality(tmp_path):
    report, folders = _report(tmp_path, _scored, seeds=3)
    result = load_experiment("table11").result(report, folders)
    rows = {row["allocation"]: row for row in result["rows"]}
    assert rows["p8_b4"]["test"]["mean"] == pytest.approx(2.05 + 0.001 + 0.002)
    assert result["spread"] == pytest.approx(0.05)
    # the allocations' mean is 2.069, 0.431 below the start: the margin is a tenth of that
    assert result["gain"] == pytest.approx(2.5 - (2.052 + 2.053 + 2.102) / 3)
    assert result["margin"] == pytest.approx(0.1 * result["gain"])
    verdicts = {check["claim"].split(" end")[0]: check["verdict"] for check in result["checks"]}
    assert verdicts == {"p8_b4 and p2_b16": "holds", "p32_b1 and p2_b16": "does not hold",
                        "p32_b1 and p8_b4": "does not hold"}
    text = load_experiment("table11").table({
        **result, "experiment": "table11", "scale": "cpu", "title": "t", "basis": "b",
                             "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2]})
    assert "| 2 | 16 | 2.050000 | 2.052000 | 2.054000 | 2.052000 | 64 | 1024 | 2.376587 |" in text
    # two seeds decide nothing
    report, folders = _report(tmp_path / "two", _scored)
    checks = load_experiment("table11").result(report, folders)["checks"]
    assert {check["verdict"] for check in checks} == {"inconclusive"}
    assert table11_figure({**result, "experiment": "table11", "scale": "cpu"}, tmp_path / "f.png").stat().st_size > 0
