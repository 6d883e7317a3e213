"""Equal measured update time: interpolation of a (seconds, loss) curve against hand-computed values,
a side's standing at a budget, and the validation windows interpolated with it."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from soma_pl import VAL_WINDOWS
from soma_pl.analysis.time_basis import (
    interpolate,
    measured_curve,
    update_curve,
    window_curve,
    windows_at_seconds,
)
from soma_pl.errors import SomaError
from soma_pl.sweeps.equal_time import equal_time_table
from soma_pl.sweeps.report import build_report, stats
from soma_pl.sweeps.study import SWEEP_ATTR

CURVE = [{"step": 0, "device_seconds": 0.0, "val_loss": 5.5}, {"step": 50, "device_seconds": 40.0, "val_loss": 3.5},
         {"step": 100, "device_seconds": 100.0, "val_loss": 3.0}]


def test_interpolation_is_linear_between_points_and_exact_at_the_ends():
    points = [(p["device_seconds"], p["val_loss"]) for p in CURVE]
    assert interpolate(points, 70.0) == pytest.approx(3.25)  # halfway from 40 s to 100 s
    assert interpolate(points, 10.0) == pytest.approx(5.0)
    assert interpolate([(0.430399, 2.9)], 0.430399 * (1 + 1e-12)) == 2.9  # a one-point curve at its own time
    with pytest.raises(SomaError, match="outside the curve's range"):
        interpolate(points, 101.0)


def _fit(folder: Path, start: float, spread: float, seconds_per_update: float) -> None:
    """Validations at updates 10, 20, 30: loss start − 0.01·u, update time u·seconds_per_update; its
    windows (documents a, a, b, b) spread·(−1, 1, 2, −2) around the loss."""
    (folder / VAL_WINDOWS).mkdir(parents=True)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for update in (10, 20, 30):
        loss = start - 0.01 * update
        rows += [f"{update - 1},{loss},", f"{update},,{update * seconds_per_update / 3600}"]
        (folder / VAL_WINDOWS / f"{update}.json").write_text(json.dumps({
            "updates": update, "k": 1, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"],
            "window_losses": [loss + spread * offset for offset in (-1.0, 1.0, 2.0, -2.0)]}))
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def test_windows_are_interpolated_at_a_time_as_the_loss_is(tmp_path):
    _fit(tmp_path, 3.0, 0.1, 2.0)
    record, outside = windows_at_seconds(tmp_path, [50.0, 61.0])  # 50 s: halfway from update 20 (40 s) to 30
    assert record["window_losses"] == pytest.approx([2.65, 2.85, 2.95, 2.55])  # (60 s), loss 2.75
    assert record["doc_ids"] == ["a", "a", "b", "b"] and outside is None
    (tmp_path / VAL_WINDOWS / "20.json").unlink()
    assert window_curve(tmp_path) is None and windows_at_seconds(tmp_path, [50.0]) == [None]


def test_a_calibrated_run_is_placed_at_updates_times_its_calibrated_time(tmp_path):
    """Measured 2 s per update under load; calibrated alone at 1.5 s: the curve's seconds are
    15, 30, 45 at updates 10, 20, 30, and the windows are read at those times."""
    _fit(tmp_path, 3.0, 0.1, 2.0)
    assert [seconds for _, _, seconds in update_curve(tmp_path)] == pytest.approx([20.0, 40.0, 60.0])
    (tmp_path / "compute.json").write_text(json.dumps({"budget": {"seconds_per_update": 1.5}}))
    assert [seconds for _, _, seconds in update_curve(tmp_path)] == pytest.approx([15.0, 30.0, 45.0])
    assert [seconds for _, _, seconds in measured_curve(tmp_path)] == pytest.approx([20.0, 40.0, 60.0])
    record, = windows_at_seconds(tmp_path, [37.5])  # halfway from update 20 (30 s) to 30 (45 s): loss 2.75
    assert record["window_losses"] == pytest.approx([2.65, 2.85, 2.95, 2.55])


def test_the_equal_time_table_bootstraps_the_documents_of_its_difference(tmp_path):
    """Two seeds of a baseline (2 s per update) against a faster side (1 s per update, 0.2 higher at
    the start): at T = 30 s, the faster run's end (update 30; the baseline's update 15), baseline −
    other = (3.0 − 0.15) − (3.2 − 0.30) = −0.05 per document, the spreads differing only within one."""
    folders = {}
    for seed in (0, 1):
        _fit(tmp_path / f"base{seed}", 3.0, 0.1, 2.0)
        _fit(tmp_path / f"fast{seed}", 3.2, 0.05, 1.0)
        folders[2 * seed], folders[2 * seed + 1] = {seed: str(tmp_path / f"base{seed}")}, \
            {seed: str(tmp_path / f"fast{seed}")}
    per_seed = [{"seed": seed, "trial": {"base": 2 * seed, "fast": 2 * seed + 1}} for seed in (0, 1)]
    table = equal_time_table(per_seed, folders, "base", stats)
    assert table["difference"]["fast"]["mean"] == pytest.approx(-0.05)
    document = table["document"]["fast"]
    assert (document["low"], document["mean"], document["high"]) == pytest.approx((-0.05, -0.05, -0.05))
    assert document["p_zero"] == 0.0 and document["documents"] == 2


@pytest.mark.parametrize("budget", [{}, {"device_hours": 0.01}])
def test_the_report_compares_at_equal_time_only_where_a_budget_of_time_did_not_already(tmp_path, budget):
    """An unbudgeted sweep's selections (here 2 s and 1 s per update, 30 updates each) are also compared at
    the faster one's 30 s; a sweep that stopped every run at one budget of update time is not compared again."""
    labels = {"side": ["base", "fast"]}
    study = optuna.create_study(study_name="timed")
    study.set_user_attr(SWEEP_ATTR, {"factors": ["side"], "ranges": [], "seeds": [0, 1], "columns": "side",
                                     "baseline": "base", "labels": labels, "sweep_file": "x.yaml", "budget": budget})
    for seed in (0, 1):
        for side, start, rate in (("base", 3.0, 2.0), ("fast", 3.2, 1.0)):
            _fit(tmp_path / f"{side}{seed}", start, 0.1, rate)
            runs = [{"seed": seed, "val_loss": start - 0.3, "test_loss": start - 0.3, "global_step": 30,
                     "run_dir": str(tmp_path / f"{side}{seed}")}]
            study.add_trial(create_trial(params={"side": side}, distributions={"side": CategoricalDistribution(
                labels["side"])}, value=start - 0.3, user_attrs={"runs": runs, "seed": seed, "test_loss": start - 0.3,
                                                                  "point": json.dumps({"side": side, "seed": seed})}))
    t7 = build_report(study, "memory")["table7"]
    if budget:
        assert "equal_time" not in t7
    else:
        assert [row["budget_seconds"] for row in t7["equal_time"]["per_seed"]] == pytest.approx([30.0, 30.0])
        assert t7["equal_time"]["difference"]["fast"]["mean"] == pytest.approx(-0.05)
