"""Table 5's result drawn from hand-made validation curves: losses interpolated at the budgets of
measured time, the paper's rows beside ours, and the verdicts."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from soma_pl.errors import SomaError
from soma_pl.reproduce.budgets import table5_figure
from soma_pl.reproduce.experiments import load_experiment
from soma_pl.reproduce.verdicts import Verdict

LABELS = ["bptt_n1", "soma_n1", "soma_n2", "soma_n4", "bptt_n2", "bptt_n4"]
START = {"soma_n1": 3.0, "soma_n2": 2.9, "soma_n4": 3.1, "bptt_n1": 2.0, "bptt_n2": 2.1, "bptt_n4": 3.15}
"""Each run's loss at 0 s; every curve falls by 0.001 per second (plus 0.01 per seed)."""


SPREAD = [-1.0, 1.0, -0.5, 0.5]
"""Four validation windows (documents a, a, b, b) around the mean: SOMA's 0.02 times these, BPTT's 0.01."""


def _metrics(folder: Path, label: str, seed: int, every: float, windows: bool = False) -> None:
    """Validations every `every` seconds up to 250 s: loss START − 0.001·t + 0.01·seed, logged as a
    fit logs them (val/loss at update − 1, the update time at the update); with `windows`, each
    validation window by window too (`val_windows/<update>.json`, their mean the loss)."""
    folder.mkdir(parents=True)
    rows, update, seconds = ["step,val/loss,compute/aggregate_device_hours"], 0, 0.0
    scale = 0.02 if label.startswith("soma") else 0.01
    while seconds < 250:
        update, seconds = update + 10, seconds + every
        loss = START[label] - 0.001 * seconds + 0.01 * seed
        rows += [f"{update - 1},{loss},", f"{update},,{seconds / 3600}"]
        if windows:
            (folder / "val_windows").mkdir(exist_ok=True)
            (folder / "val_windows" / f"{update}.json").write_text(json.dumps({
                "updates": update, "k": 1, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"],
                "window_losses": [loss + scale * offset for offset in SPREAD]}))
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def _report(tmp_path: Path, windows: bool = False) -> tuple[dict, dict]:
    per_seed, folders = [], {}
    for seed in range(3):
        trials = {}
        for index, label in enumerate(LABELS):
            trial = 10 * seed + index
            trials[label] = trial
            folders[trial] = {seed: str(tmp_path / f"trial-{trial}")}
            _metrics(tmp_path / f"trial-{trial}", label, seed, 50.0 if label.startswith("soma") else 30.0, windows)
        per_seed.append({"seed": seed, "trial": trials})
    report = {"table7": {"column_labels": LABELS, "per_seed": per_seed}, "trials": {"COMPLETE": 18}, "failed": []}
    return report, folders


def test_table5_interpolates_each_run_at_the_budgets_and_checks_both_claims(tmp_path):
    report, folders = _report(tmp_path)
    result = load_experiment("table5").result(report, folders, budgets=(120.0, 180.0, 240.0))
    rows = {row["experts"]: row for row in result["rows"]}
    assert sorted(rows) == [1, 2, 4]
    for experts, row in rows.items():
        for method in ("soma", "bptt"):
            start = START[f"{method}_n{experts}"]
            for i, budget in enumerate((120.0, 180.0, 240.0)):
                # linear curves: the interpolation is exact; seeds 0, 1 and 2 are 0.01 apart in turn
                assert row[method][i]["mean"] == pytest.approx(start - 0.001 * budget + 0.01)
                assert row[method][i]["sd"] == pytest.approx(0.01)
    assert result["per_seed"]["soma_n2"]["total_seconds"] == [250.0, 250.0, 250.0]
    checks = {check["claim"]: check for check in result["checks"]}
    assert len(checks) == 3 * 3 + 3
    # BPTT lower by 1.0 and 0.8 at N = 1 and 2 (seed-paired differences are exact); at N = 4 BPTT is
    # 0.05 higher; SOMA N = 2 is 0.1 below N = 1.
    for budget in ("120", "180", "240"):
        for experts, gap in ((1, 1.0), (2, 0.8), (4, -0.05)):
            claim = f"BPTT reaches a lower ensemble-validation loss than SOMA at N = {experts}, {budget} s"
            assert checks[claim]["mean"] == pytest.approx(gap)
        claim = f"SOMA N = 2 reaches a lower ensemble-validation loss than SOMA N = 1 (monolithic SPSA), {budget} s"
        assert checks[claim]["mean"] == pytest.approx(0.1)
    # validation curves keep no per-window losses: without a document interval three seeds decide nothing
    assert all(check["verdict"] == Verdict.inconclusive.value and check["seeds"] == 3 and check["p"] is None
               and check["document_interval"] is None and check["split"] == "val" for check in result["checks"])
    text = load_experiment("table5").table({
        **result, "experiment": "table5", "scale": "cpu", "title": "t", "basis": "b",
                            "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2], "trial_minutes": 3.0})
    assert "| 2 | 2.7900 ± 0.0100 | 1.9900 ± 0.0100 | 2.7300 ± 0.0100 |" in text
    assert "| paper, N = 8 | 2.0880 | 1.1826 |" in text  # the paper's Table 5 at 50 GPU-hours
    assert table5_figure({**result, "experiment": "table5", "scale": "cpu"}, tmp_path / "f.png").stat().st_size > 0


def test_validations_kept_window_by_window_give_each_budget_a_document_interval(tmp_path):
    """Each window is interpolated at the budget as the mean is: SOMA's windows spread 0.02·(−1, 1,
    −0.5, 0.5) around its loss and BPTT's 0.01·(...), so SOMA − BPTT per window is the gap plus
    0.01·(−1, 1, −0.5, 0.5), the documents' means gap ± 0 (each document's two windows cancel)."""
    report, folders = _report(tmp_path, windows=True)
    result = load_experiment("table5").result(report, folders, budgets=(120.0, 240.0))
    checks = {check["claim"]: check for check in result["checks"]}
    bptt = "BPTT reaches a lower ensemble-validation loss than SOMA at N = {}, {} s"
    soma = "SOMA N = 2 reaches a lower ensemble-validation loss than SOMA N = 1 (monolithic SPSA), {} s"
    for budget in ("120", "240"):
        for experts, gap, verdict in ((1, 1.0, "holds"), (2, 0.8, "holds"), (4, -0.05, "does not hold")):
            check = checks[bptt.format(experts, budget)]
            assert check["verdict"] == verdict and check["seeds"] == 3
            assert check["document_interval"] == pytest.approx((gap, gap))
        two = checks[soma.format(budget)]
        assert two["verdict"] == Verdict.holds.value and two["document_interval"] == pytest.approx((0.1, 0.1))
    # one run without its windows: no document interval for the comparisons it is in
    for path in (Path(folders[0][0]) / "val_windows").iterdir():
        path.unlink()
    result = load_experiment("table5").result(report, folders, budgets=(120.0,))
    checks = {check["claim"]: check for check in result["checks"]}
    assert checks[bptt.format(1, 120)]["document_interval"] is None
    assert checks[bptt.format(2, 120)]["verdict"] == "holds"


def test_a_budget_before_a_runs_first_validation_is_left_out(tmp_path):
    report, folders = _report(tmp_path)
    result = load_experiment("table5").result(report, folders, budgets=(40.0, 240.0))
    rows = {row["experts"]: row for row in result["rows"]}
    assert rows[1]["soma"][0]["mean"] is None and rows[1]["bptt"][0]["mean"] == pytest.approx(2.0 - 0.04 + 0.01)
    claim = "BPTT reaches a lower ensemble-validation loss than SOMA at N = 1, 40 s"
    check = next(c for c in result["checks"] if c["claim"] == claim)
    assert check["verdict"] == Verdict.inconclusive.value and check["seeds"] == 0


def test_table5_budgets_are_fractions_of_the_budget_the_runs_stopped_at(tmp_path):
    """The paper's 50, 75 and 100 GPU-hours: at CPU scale half, three quarters and all of 240 s."""
    report, folders = _report(tmp_path)

    def record(device_hours: float | None) -> None:
        for runs in folders.values():
            for run in runs.values():
                (Path(run) / "compute.json").write_text(json.dumps({"budget": {"limits": {
                    "device_hours": device_hours, "token_forwards": None}}}))

    record(0.0666666667)
    assert load_experiment("table5").result(report, folders)["budgets_seconds"] == [120.0, 180.0, 240.0]
    (Path(folders[0][0]) / "compute.json").write_text(json.dumps({"budget": {"limits": {"device_hours": 0.1}}}))
    with pytest.raises(SomaError, match="device_hours"):  # runs stopped at different budgets
        load_experiment("table5").result(report, folders)
    record(None)
    with pytest.raises(SomaError, match="device_hours"):
        load_experiment("table5").result(report, folders)


def test_table3_reads_each_runs_accounting_and_checks_the_papers_fixed_rates(tmp_path):
    """Two sides of three seeds: 100 updates, 2 s per update calibrated, the recorded time 10% above it
    and the elapsed time 30% above; the paper's fixed-rate rows follow from its N = 256 and U = 4.16M
    (256 · 4.16M · 0.168 s = 49,698 GPU-hours, 0.140 s: 41,415)."""
    folders, per_seed = {}, []
    for seed in range(3):
        trials = {"1": 2 * seed, "2": 2 * seed + 1}
        for label, trial in trials.items():
            run = tmp_path / f"trial{trial}"
            run.mkdir()
            (run / "compute.json").write_text(json.dumps({
                "updates": 100, "experts": int(label), "aggregate_device_hours": 220 / 3600,
                "physical_device_hours": (260 + seed) / 3600, "budget": {"seconds_per_update": 2.0}}))
            folders[trial] = {seed: str(run)}
        per_seed.append({"seed": seed, "trial": trials})
    report = {"table7": {"per_seed": per_seed}, "trials": {"COMPLETE": 6}, "failed": []}
    experiment = load_experiment("table3")
    result = experiment.result(report, folders)
    assert result["rows"]["2"]["calibrated"]["mean"] == pytest.approx(200.0)
    assert result["rows"]["1"]["recorded_over_calibrated"]["mean"] == pytest.approx(1.1)
    assert result["rows"]["1"]["physical_over_recorded"]["mean"] == pytest.approx(261 / 220)
    assert [(c["verdict"], c["mean"]) for c in result["checks"]] == [(Verdict.holds.value, 49698 - 49700),
                                                                      (Verdict.holds.value, 41415 - 41400)]
    wrong = dataclasses.replace(experiment, paper={**experiment.paper, "experts": 255})
    assert {c["verdict"] for c in wrong.result(report, folders)["checks"]} == {Verdict.does_not_hold.value}
    text = experiment.table({**result, "experiment": "table3", "scale": "cpu", "title": "t", "basis": "b",
                             "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2]})
    assert "| Physical total, ranks × elapsed training time | 261.0 ± 1.0 | 261.0 ± 1.0 | 49.6k |" in text
    assert "| Fixed 0.168 s per expert update, E·U·r | — | — | 49.7k |" in text
