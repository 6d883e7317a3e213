"""Fig. 14, Fig. 15 and Table 13 drawn from hand-made fixed-size runs: the budget map's selection,
the per-expert checks, the inference arithmetic and Table 13's pairing, against closed-form values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from soma_pl.reproduce import inference
from soma_pl.reproduce.experiments import load_experiment
from soma_pl.reproduce.inference import (
    budget_map,
    fig14_figure,
    per_expert_checks,
    select,
)

SLOPE = {"n1": 0.10, "n2": 0.09, "n4": 0.08, "n8": 0.07, "n8_long": 0.07}
"""Validation loss falls by this much per update; every update costs 1 s of aggregate time."""
UPDATES = {"n1": 10, "n2": 10, "n4": 10, "n8": 10, "n8_long": 20}
TEST = {"n1": 2.50, "n2": 2.40, "n4": 2.30, "n8": 2.45, "n8_long": 2.35}
"""Each run's test loss per window before the seed's offset."""
WINDOWS, DOCUMENTS = 6, [0, 0, 1, 1, 2, 2]


def _experts(label: str) -> int:
    return int(label[1:].split("_")[0])


def _fit(folder: Path, label: str, seed: int, trial: int) -> str:
    """A run validated every 2 updates at loss 3 − slope·u + 0.01·seed, 1 s of aggregate time per
    update; 800 parameters split over its experts; its test record per window."""
    folder.mkdir(parents=True)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for update in range(2, UPDATES[label] + 1, 2):
        rows += [f"{update - 1},{3 - SLOPE[label] * update + 0.01 * seed},", f"{update},,{update / 3600}"]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    experts = _experts(label)
    (folder / "summary.json").write_text(json.dumps({
        "parameters": 800, "last_checkpoint": None,
        "compute": {"experts": experts, "updates": UPDATES[label], "token_forwards": 64 * experts * UPDATES[label]}}))
    # windows alternate ±0.1 around the loss and documents lie 0.03 apart around it, so their mean is the
    # loss itself (and the documents' bootstrap interval around it is not a single point)
    losses = [TEST[label] + 0.01 * seed + (0.1 if i % 2 else -0.1) + 0.03 * (DOCUMENTS[i] - 1) for i in range(WINDOWS)]
    record = folder / "test_scores.json"
    record.write_text(json.dumps({"loss": sum(losses) / WINDOWS, "bootstrap_95": [0.0, 9.0],
                                  "window_index": list(range(WINDOWS)), "window_losses": losses,
                                  "doc_ids": DOCUMENTS}))
    return str(record)


def _report(tmp_path: Path) -> tuple[dict, dict]:
    per_seed, folders, files = [], {}, {}
    for seed in range(3):
        trials = {}
        for index, label in enumerate(SLOPE):
            trial = 10 * seed + index
            trials[label], folders[trial] = trial, {seed: str(tmp_path / f"t{trial}")}
            files[trial] = {seed: _fit(tmp_path / f"t{trial}", label, seed, trial)}
        per_seed.append({"seed": seed, "trial": trials})
    return {"table7": {"column_labels": list(SLOPE), "per_seed": per_seed}, "test_score_files": files,
            "trials": {"COMPLETE": 15}, "failed": []}, folders


def test_the_map_selects_the_lowest_loss_checkpoint_within_both_budgets():
    points = [{"run": "n1", "experts": 1, "aggregate": 4.0, "per_expert": 4.0, "loss": 2.6},
              {"run": "n2", "experts": 2, "aggregate": 4.0, "per_expert": 2.0, "loss": 2.7},
              {"run": "n2", "experts": 2, "aggregate": 8.0, "per_expert": 4.0, "loss": 2.3}]
    assert select(points, 4.0, 4.0)["loss"] == 2.6  # N = 2's better point costs 8 s in all
    assert select(points, 8.0, 4.0)["loss"] == 2.3
    assert select(points, 8.0, 3.0)["loss"] == 2.7  # N = 1's point costs 4 s of one expert
    assert select(points, 3.0, 3.0) is None
    assert budget_map(points, [3.0, 4.0, 8.0], [3.0, 4.0]) == [[None, 2, 2], [None, 1, 2]]


def test_under_a_per_expert_budget_n1_is_compared_with_the_best_other_run_in_closed_form():
    # three seeds of N = 1 (loss 3 − 0.1·a) and N = 2 (3.05 − 0.1·a) validated at a = 2, 4, ..., 10
    seeds = [[{"run": label, "experts": n, "aggregate": a, "per_expert": a / n, "loss": base - 0.1 * a + 0.01 * s}
              for label, n, base in (("n1", 1, 3.0), ("n2", 2, 3.05)) for a in range(2, 11, 2)] for s in range(3)]
    checks, rows = per_expert_checks(seeds, [1.0, 4.0, 5.0], load_experiment("fig14").claims["tight"])
    assert rows[0]["check"] is None and rows[0]["single"] == [None, None, None]  # nothing of N = 1 fits within 1 s
    # 4 s per expert: N = 1's best is a = 4 (2.6), N = 2's a = 8 (2.25): 0.35 in each seed
    assert [round(v, 12) for v in rows[1]["single"]] == [2.6, 2.61, 2.62] and rows[1]["rival"] == ["n2"] * 3
    assert checks[0]["mean"] == pytest.approx(0.35) and checks[0]["seeds"] == 3
    assert checks[1]["mean"] == pytest.approx((3 - 0.4) - (3.05 - 1.0))  # 5 s: a = 4 against a = 10
    assert len(checks) == 2
    # each seed's rival is chosen on the other seeds: a run N = 3 with N = 2's curve shifted by +0.3
    # (−0.4 in seed 0 alone) reaches a = 10 within 4 s per expert: 2.35 (1.65) against N = 2's 2.25 at
    # a = 8. Seeds 1 and 2 see seed 0 among the others (mean 2.0): their rival is N = 3; seed 0's is N = 2
    def n3(points: list[dict], seed: int) -> list[dict]:
        return [{**p, "run": "n3", "experts": 3, "per_expert": p["aggregate"] / 3,
                 "loss": p["loss"] + (-0.4 if seed == 0 else 0.3)} for p in points if p["run"] == "n2"]
    with_n3 = [points + n3(points, seed) for seed, points in enumerate(seeds)]
    _, rows = per_expert_checks(with_n3, [4.0], load_experiment("fig14").claims["tight"])
    assert rows[0]["rival"] == ["n2", "n3", "n3"]
    # validation states keep no per-window losses: without a document interval three seeds decide nothing
    assert all(check["verdict"] == "inconclusive" and check["document_interval"] is None and check["p"] is None
               for check in checks)


def _final_scores(run_dir: Path, split: str) -> dict:
    """The final split as the test split, but N = 8's common-budget run 0.2 lower on every window."""
    scores = json.loads((Path(run_dir) / "test_scores.json").read_text())
    shift = -0.2 if split == "final" and Path(run_dir).name in {f"t{10 * s + 3}" for s in range(3)} else 0.0
    return {**scores, "loss": scores["loss"] + shift, "window_losses": [x + shift for x in scores["window_losses"]]}


def test_fig14_result_counts_arithmetic_pairs_table13_and_draws(tmp_path, monkeypatch):
    report, folders = _report(tmp_path)
    monkeypatch.setattr(inference, "score_run", _final_scores)
    result = load_experiment("fig14").result(report, folders)
    rows = {row["run"]: row for row in result["rows"]}
    assert {label: rows[label]["arithmetic_per_token"] for label in rows} == \
        {"n1": 800, "n2": 800, "n4": 800, "n8": 400, "n8_long": 400}  # top-4 of 8 experts of 100
    assert rows["n8_long"]["per_expert_seconds"]["mean"] == pytest.approx(20 / 8)
    assert rows["n4"]["test"]["mean"] == pytest.approx(2.31)
    assert rows["n2"]["val"]["mean"] == pytest.approx(3 - 0.9 + 0.01)
    # Table 13: N = 8's longer run (2.5 s per expert) beside N = 4 (2.5 s), not N = 2 (5 s)
    assert [row["run"] for row in result["table13"]] == ["n4", "n8_long"]
    checks = {check["claim"].split(" (")[0]: check for check in result["checks"] if check["split"] != "final"}
    # N = 1 (the steepest curve at equal aggregate time) wins cells where the aggregate budget binds
    never = checks["N = 1 is never selected"]
    assert never["verdict"] == "does not hold" and never["mean"] > 0
    # at the common budget N = 8 (2.45) trails N = 4 (2.30) on every window by 0.15
    ranking = checks["Training progress changes the ranking"]
    assert ranking["mean"] == pytest.approx(2.45 - 2.30) and ranking["verdict"] == "holds" and ranking["seeds"] == 3
    later = next(c for claim, c in checks.items() if claim.startswith("At about n4"))
    assert later["mean"] == pytest.approx(2.35 - 2.30) and later["verdict"] == "holds"
    assert later["document_interval"] == pytest.approx((0.05, 0.05))  # the same windows move by the same 0.05
    # scored once on the final split too: there N = 8 (2.25) is below N = 4 (2.30), the ranking's opposite
    finals = {check["claim"].split(" (")[0]: check for check in result["checks"] if check["split"] == "final"}
    assert finals["Training progress changes the ranking"]["verdict"] == "does not hold"
    assert finals["Training progress changes the ranking"]["mean"] == pytest.approx(2.25 - 2.30)
    assert rows["n8"]["final"]["mean"] == pytest.approx(2.26) and len(finals) == 2
    # the per-expert budgets are where N = 2, 4, 8's runs end: 5, 2.5, 1.25 s
    assert [row["per_expert_budget"] for row in result["tight"]] == pytest.approx([1.25, 2.5, 5.0])
    # at 2.5 s per expert: N = 1's best is a = 2 (2.8); N = 8's longer run's is a = 20 (1.6)
    at = result["tight"][1]
    assert at["rival"] == ["n8_long"] * 3 and at["check"]["mean"] == pytest.approx(2.8 - 1.6)
    assert at["check"]["claim"].startswith("More shards lower loss under a tight per-expert budget")
    # validation states keep no per-window losses: no document interval, so inconclusive on three seeds
    assert at["check"]["verdict"] == "inconclusive" and at["check"]["seeds"] == 3
    assert at["check"]["document_interval"] is None and at["check"]["p"] is None
    assert result["tight"][0]["check"] is None  # N = 1's first checkpoint costs 2 s
    # every cell of the map either selects a run's N or has nothing that fits
    cells = result["map"]["cells"]
    grid = result["map"]
    bound = sum(1 for p in grid["per_expert_seconds"] for a in grid["aggregate_seconds"] if p <= a)
    assert sum(cells.values()) <= 3 * bound < 3 * 48 * 48 and set(cells) == {"1", "2", "4", "8"}
    singles = [sum(n == 1 for p, line in zip(grid["per_expert_seconds"], selected, strict=True)
                   for a, n in zip(grid["aggregate_seconds"], line, strict=True) if p <= a)
               for selected in grid["selected"]]
    assert never["why"] == f"N = 1 selected in {singles[0]}, {singles[1]}, {singles[2]} of {bound} cells per seed"
    assert cells["1"] == sum(singles) > 0
    assert result["map"]["checkpoints"] == [5 * 4 + 10] * 3
    # N = 1 (the steepest curve at equal aggregate time) wins only where the aggregate budget binds
    # and it has a checkpoint: from its first, 2 s, and where the per-expert budget is most of the aggregate
    for where in result["map"]["single"]:
        assert where["min_per_expert_seconds"] >= 2 and where["min_share"] > 0.5
    result.update(experiment="fig14", scale="cpu", title="t", basis="b", wall_seconds=1.0, load_average=[0.0, 0.0],
                  workers=2)
    text = load_experiment("fig14").table(result)
    assert "| n8 | 8 | 4 | 800 | 100 | 400 |" in text and "## Table 13" in text and "| 2.2600 ± 0.0100 |" in text
    assert fig14_figure(result, tmp_path / "f.png").stat().st_size > 0
    assert math.isfinite(result["map"]["aggregate_seconds"][-1])
