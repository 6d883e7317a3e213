"""Experiments of measurements at fixed weights (`commands`): Table 2 run end to end through
`reproduce`, and Figs. 10 and 11 decided on hand-made measurements."""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
from pathlib import Path

import pytest

from soma_pl.cli import main
from soma_pl.errors import SomaError
from soma_pl.reproduce import command
from soma_pl.reproduce.experiments import REPOSITORY, load_experiment
from soma_pl.reproduce.measurements import _ratio
from soma_pl.reproduce.tables import reproduction_page
from soma_pl.reproduce.verdicts import Verdict


def test_table2_runs_its_command_and_every_count_holds_as_the_paper_gives_it(tmp_path, capsys):
    main(["reproduce", "table2", "--results", str(tmp_path), "--progress", "false"])
    result = json.loads((tmp_path / "table2" / "result.json").read_text())
    assert [row["N"] for row in result["rows"]] == [1, 2, 8, 256]
    # App. C: 32·d_t² + 5·d_t per body; d_t = 32 gives 32,928 (the paper's 32.9k), N = 256 shares one head
    assert result["rows"][-1]["expert_body_params"] == 32 * 32 ** 2 + 5 * 32
    assert [c["verdict"] for c in result["checks"]] == [Verdict.holds.value] * 9
    assert all(c["over"] == "exact count" and c.get("holm_p") is None for c in result["checks"])
    folder = os.path.relpath(tmp_path / "table2", REPOSITORY)  # the commands run in the repository root
    assert result["commands"] == [f"python -m soma_pl.cli analyze params --out {folder}/params.json"]
    assert (tmp_path / "table2" / "table.md").is_file() and not (tmp_path / "table2" / "figure.png").exists()
    page = reproduction_page(tmp_path, tmp_path / "page.md")
    assert "8,333,905 is 8.33e+06 to 3 significant figures; the paper gives 8.33e+06" in page
    # a rerun reuses the finished command (same arguments) and rebuilds the result from its output
    output = tmp_path / "table2" / "params.json"
    stamp = output.stat().st_mtime_ns
    main(["reproduce", "table2", "--results", str(tmp_path), "--progress", "false"])
    again = json.loads((tmp_path / "table2" / "result.json").read_text())
    assert output.stat().st_mtime_ns == stamp and again["command_seconds"] == result["command_seconds"]
    assert again["checks"] == result["checks"]


def test_a_dry_run_lists_the_commands_and_runs_nothing(tmp_path, capsys):
    main(["reproduce", "fig10", "--dry_run", "true", "--results", str(tmp_path)])
    printed = capsys.readouterr().out
    assert printed.count("python -m soma_pl.cli analyze variance") == 2 and "--direction sparse" in printed
    assert list(tmp_path.iterdir()) == []


def test_a_ratio_of_two_measured_errors_has_the_delta_methods_standard_error():
    ratio, stderr, predicted = _ratio({"relative_error": 10.0, "stderr": 1.0, "predicted": 12.0},
                                      {"relative_error": 5.0, "stderr": 0.5, "predicted": 4.0})
    assert (ratio, predicted) == (2.0, 3.0) and stderr == pytest.approx(2.0 * (0.01 + 0.01) ** 0.5)


def _point(error: float, stderr: float, **fields) -> dict:
    return {"relative_error": error, "stderr": stderr, "predicted": error, **fields}


def _variance(folder: Path, joint: float) -> None:
    settings = {"repeats": 32, "batch_repeats": 16, "context": 16}
    curves = [{"loss_grouping": g, "points": [_point(100.0 * g, 5.0, n_pert=8), _point(50.0 * g, 2.0, n_pert=16)]}
              for g in (1, 4)]
    common = {"settings": settings, "weights": "a checkpoint"}
    (folder / "sparse.json").write_text(json.dumps({**common, "experts": {"points": [
        _point(80.0, 4.0, num_experts=1, width=7, params_per_expert=2051),
        _point(10.0, 0.5, num_experts=8, width=2, params_per_expert=256)]},
        "n_pert": {"curves": curves, "doubling": [{"n_pert": 8, "ratio": 2.0, "stderr": 0.05, "predicted": 2.0}]}}))
    (folder / "dense.json").write_text(json.dumps({**common, "n_pert": {
        "curves": curves, "joint_vs_separate": {"loss_grouping": 4, "n_pert": 16, "ratio": joint, "stderr": 0.2,
                                                "predicted": 4.0}},
        "batch": {"probe_coordinates": 128, "pool_windows": 32, "budget": 256, "nu": 8.0, "curves": [
            {"loss_grouping": 1, "points": [_point(9.0, 1.0, batch=1), _point(7.0, 1.0, batch=2)]}]}}))


def test_fig10_decides_each_ratio_against_one_and_reports_the_best_batch(tmp_path):
    _variance(tmp_path, joint=0.9)
    result = load_experiment("fig10").result(tmp_path)
    shards, shards_predicted, doubling, doubling_predicted, separate, separate_predicted = result["checks"]
    assert shards["verdict"] == Verdict.holds.value and shards["mean"] == pytest.approx(7.0)  # 80 / 10 − 1
    assert "N = 1 over N = 8" in shards["claim"] and "measured 8" in shards["claim"] and shards["seeds"] == 32
    assert doubling["verdict"] == Verdict.holds.value and "from 8" in doubling["claim"]
    assert separate["verdict"] == Verdict.inconclusive.value  # 0.9 ± 0.41: summed not shown worse
    # the predictions (each point's own: 80 / 10 = 8, the doubling 2, separate/summed 4), ±10%:
    # 8 ± 2.04·0.566 reaches past ±0.8; 2 ± 2.04·0.05 lies inside ±0.2; 0.9 against 4 lies wholly outside
    assert shards_predicted["verdict"] == Verdict.inconclusive.value and shards_predicted["mean"] == 0.0
    assert doubling_predicted["verdict"] == Verdict.holds.value and "±10%" in doubling_predicted["claim"]
    assert separate_predicted["verdict"] == Verdict.does_not_hold.value
    assert all(check.get("p") is None for check in (shards_predicted, doubling_predicted, separate_predicted))
    assert result["best_batch"] == [{"loss_grouping": 1, "measured": 2, "predicted": 2}]
    _variance(tmp_path, joint=0.5)
    assert load_experiment("fig10").result(tmp_path)["checks"][4]["verdict"] == Verdict.does_not_hold.value


def _bench_row(experts: int, per_round: list[float], top_k: int) -> dict:
    return {"model": f"N={experts}", "experts": experts, "parameters": 8_400_000, "top_k": top_k, "batch_size": 16,
            "tokens_per_s": statistics.median(per_round), "tokens_per_s_per_round": per_round, "latency_ms": 3000.0,
            "routing_share": 0.01, "peak_above_baseline_bytes": 2 ** 28}


def test_table12_compares_the_largest_ensemble_with_each_smaller_one_round_by_round(tmp_path):
    settings = {"repeats": 7, "rounds": 3, "threads": 1}
    (tmp_path / "inference.json").write_text(json.dumps({"machine": {}, "load_average_after": [1, 1, 1],
                                                         "settings": settings, "results": [
        _bench_row(1, [3000.0, 3300.0, 3000.0], 1), _bench_row(8, [3000.0, 1000.0, 3000.0], 4),
        _bench_row(256, [33000.0, 33000.0, 3000.0], 4)]}))
    result = load_experiment("table12").result(tmp_path)
    against_8, against_1 = result["checks"]
    assert "N = 256 top-4 serves more tokens/s than N = 8 top-4 (the paper: 9.18×)" == against_8["claim"]
    # round by round 11, 33, 1 (mean 15, sd 16.37, t(0.975, 2) = 4.3027: 14 ± 40.7 reaches zero); paired
    # otherwise the mean would differ
    assert against_8["mean"] == pytest.approx(14.0) and against_8["verdict"] == Verdict.inconclusive.value
    assert against_8["seeds"] == 3 and against_8["over"] == "timing rounds"
    # against N = 1: 11, 10, 1 → mean 22/3
    assert "N = 1 top-1" in against_1["claim"] and "(the paper: 4.25×)" in against_1["claim"]
    assert against_1["mean"] == pytest.approx(22 / 3 - 1)


def _fig14_result(folder: Path, rows: list[dict], lowest: dict[int, list[float]]) -> None:
    """A saved Fig. 14 result holding a run of each bench row's shape, and a longer N = 8 run."""
    runs = [{"run": f"n{row['experts']}", "experts": row["experts"], "parameters": row["parameters"],
             "top_k": row["top_k"]} for row in rows]
    curves = {f"n{n}": [{"experts": n, "loss": [3.0, low, low + 0.1]} for low in lows] for n, lows in lowest.items()}
    runs.append({**runs[-1], "run": "n8_long"})
    curves["n8_long"] = [{"experts": 8, "loss": [1.0]}]  # twice the budget: not one of the paired runs
    (folder / "fig14").mkdir()
    (folder / "fig14" / "result.json").write_text(json.dumps({"rows": runs, "curves": curves}))


def _fig6_bench(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir()
    (folder / "inference.json").write_text(json.dumps({"machine": {}, "load_average_after": [1, 1, 1], "settings": {
        "repeats": 7, "rounds": 3, "threads": 1}, "results": rows}))
    return folder


def test_fig6_pairs_each_ensembles_throughput_with_its_runs_lowest_loss(tmp_path):
    rows = [_bench_row(1, [3000.0, 3300.0, 3000.0], 1), _bench_row(2, [1000.0, 3000.0, 1500.0], 2),
            _bench_row(8, [2000.0, 1000.0, 1000.0], 4)]
    folder = _fig6_bench(tmp_path / "fig6", rows)
    _fig14_result(tmp_path, rows, {1: [2.6, 2.7, 2.8], 2: [2.5, 2.4, 2.6], 8: [2.9, 2.9, 3.0]})
    result = load_experiment("fig6").result(folder)
    assert [row["lowest_loss"] for row in result["rows"]] == [[2.6, 2.7, 2.8], [2.5, 2.4, 2.6], [2.9, 2.9, 3.0]]
    assert [row["run"] for row in result["rows"]] == ["n1", "n2", "n8"] and result["rows"][0]["validations"] == 3
    one_two, two_eight = result["checks"]
    # rounds 3, 1.1, 2 (mean 2.0333) over 1: +1.0333; 0.5, 3, 1.5 (mean 5/3) over 1: +0.6667
    assert one_two["mean"] == pytest.approx(61 / 30 - 1) and two_eight["mean"] == pytest.approx(5 / 3 - 1)
    # the paper's pairs from Table 12: 555k / 468k and 468k / 257k
    assert "N = 1 serves more tokens/s than N = 2 top-2" in one_two["claim"] and "(the paper: 1.19×)" in one_two[
        "claim"]
    assert "N = 2 serves more tokens/s than N = 8 top-4" in two_eight["claim"] and "1.82×" in two_eight["claim"]
    assert all(check["over"] == "timing rounds" for check in result["checks"])


def test_fig6_refuses_a_throughput_of_another_shape_than_the_runs(tmp_path):
    folder = _fig6_bench(tmp_path / "fig6", [_bench_row(1, [3000.0], 1)])
    _fig14_result(tmp_path, [{**_bench_row(1, [1.0], 1), "parameters": 8_400_001}], {1: [2.6]})
    with pytest.raises(SomaError) as refused:
        load_experiment("fig6").result(folder)
    assert str(folder / "inference.json") in str(refused.value) and "N = 1" in str(refused.value)


def test_fig6_without_fig14s_result_names_the_command_that_makes_it(tmp_path):
    folder = _fig6_bench(tmp_path / "fig6", [_bench_row(1, [3000.0], 1)])
    with pytest.raises(SomaError) as refused:
        load_experiment("fig6").result(folder)
    assert str(tmp_path / "fig14" / "result.json") in str(refused.value) and "reproduce fig14" in str(refused.value)


def test_a_failing_command_stops_the_experiment_with_its_log_named(tmp_path, monkeypatch):
    broken = dataclasses.replace(load_experiment("table2"),
                                 commands={"cpu": [["analyze", "params", "--nonsense", "1"]]})
    with pytest.raises(SomaError) as stopped:
        command.run_commands(broken, "cpu", tmp_path)
    assert "analyze params --nonsense 1 failed" in str(stopped.value)
    assert str(tmp_path / "table2" / "logs" / "run0-analyze.log") in str(stopped.value)
    assert not (tmp_path / "table2" / "result.json").exists()


def test_a_missing_output_is_one_error_naming_it(tmp_path):
    with pytest.raises(SomaError) as stopped:
        load_experiment("table12").result(tmp_path)
    assert str(tmp_path / "inference.json") in str(stopped.value)


def _reference_point(experts: int, n_pert: int, batch: int, error: float, stderr: float) -> dict:
    return {"experts": experts, "n_pert": n_pert, "batch": batch, "width": 8, "relative_error": error,
            "stderr": stderr, "relative_error_independent_reference": error * 1.02,
            "multiply_adds": 1000 * n_pert * batch * experts, "seconds": 0.01}


def test_fig5_compares_the_largest_n_with_the_monolith_at_more_directions_or_windows(tmp_path):
    points = [_reference_point(1, 8, 2, 1000.0, 50.0), _reference_point(1, 64, 2, 150.0, 10.0),
              _reference_point(1, 8, 16, 500.0, 30.0), _reference_point(8, 8, 2, 100.0, 5.0)]
    (tmp_path / "reference.json").write_text(json.dumps({"settings": {"repeats": 32}, "reference": {
        "base": {"n_pert": 8, "batch": 2}, "scales": [1, 8], "context": 16, "reference_windows": 128, "pool": 32,
        "points": points, "table8": [{"experts": 1, "reference_windows": 128, "cosine_distance": 0.29}]}}))
    result = load_experiment("fig5").result(tmp_path)
    against_npert, against_batch, npert, batch = result["checks"]
    # 150 / 100 = 1.5, its standard error 1.5 · √((10/150)² + (5/100)²) = 0.125: 0.5 ± 2.04 · 0.125 holds
    assert against_npert["mean"] == pytest.approx(0.5) and against_npert["verdict"] == Verdict.holds.value
    assert against_npert["seed_interval"][0] == pytest.approx(0.5 - 2.039513 * 0.125, abs=1e-5)
    assert "8x the n_pert (ratio 1.5; at 1x its multiply-adds)" in against_npert["claim"]
    assert against_batch["mean"] == pytest.approx(4.0) and "8x the batch" in against_batch["claim"]
    assert npert["mean"] == pytest.approx(1000 / 150 - 1) and "(by 85%; paper, 16x: 94%)" in npert["claim"]
    assert batch["mean"] == pytest.approx(1.0) and "(by 50%" in batch["claim"]
    shown = {**result, "experiment": "fig5", "scale": "cpu", "title": "t", "basis": "b", "wall_seconds": 1.0,
             "load_average": [1.0, 1.0], "commands": ["x"]}
    text = load_experiment("fig5").table(shown)
    assert "| 8 | 8 | 8 | 2 | 100 ± 5 | 102 | 1.28e+05 | 0.01 |" in text and "moves R by up to 2%" in text
