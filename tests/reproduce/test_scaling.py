"""Figs. 7, 8, 16 and 17 drawn from hand-made runs: the two time bases, the comparisons at the
common elapsed cutoff and at aggregate budgets, and the verdicts, against closed-form values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from soma_pl.reproduce.experiments import load_experiment
from soma_pl.reproduce.scaling import (
    aggregate_check,
    aggregate_comparisons,
    correlation_check,
    fig7_figure,
    topk_check,
)
from soma_pl.reproduce.verdicts import Verdict

CLAIMS = load_experiment("fig7").claims
START = {1: 3.0, 2: 2.9, 4: 2.8}
"""Each N's loss at 0 s; it falls by RATE per second of elapsed time per expert, so by RATE / N per
aggregate second: more experts are lower against elapsed time, and higher at large aggregate budgets."""
RATE = 0.005
UPDATES, EVERY, PARAMETERS_PER_EXPERT = 100, 10, 1000


def _run(folder: Path, experts: int, seed: int, rate: float = RATE, windows: bool = False) -> None:
    """A fit of `UPDATES` updates of 1 s per expert, validated every `EVERY`: loss START − rate·s + 0.01·seed
    at s seconds per expert (with `windows`, each validation window by window too: four windows of
    two documents, N·0.01·(−1, 1, −0.5, 0.5) around the loss); its summary as a fit writes it, and
    saved analyses of its last checkpoint."""
    folder.mkdir(parents=True)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for update in range(EVERY, UPDATES + 1, EVERY):
        loss = START[experts] - rate * update + 0.01 * seed
        rows += [f"{update - 1},{loss},", f"{update},,{update * experts / 3600}"]
        if windows:
            (folder / "val_windows").mkdir(exist_ok=True)
            (folder / "val_windows" / f"{update}.json").write_text(json.dumps({
                "updates": update, "k": 1, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"],
                "window_losses": [loss + 0.01 * experts * offset for offset in (-1.0, 1.0, -0.5, 0.5)]}))
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    summary = {"parameters": PARAMETERS_PER_EXPERT * experts, "last_checkpoint": str(folder / "last.ckpt"),
               "compute": {"experts": experts, "updates": UPDATES, "token_forwards": 64 * experts * UPDATES}}
    (folder / "summary.json").write_text(json.dumps(summary))
    analysis = folder / "analysis"
    analysis.mkdir()
    means = [3.0 - 0.1 * min(k, 3) + 0.01 * seed for k in range(1, experts + 1)]  # best from k = 3 on
    windows = [[m + (0.05 if w % 2 else -0.05) for m in means] for w in range(8)]
    (analysis / "topk.json").write_text(json.dumps({
        "k": list(range(1, experts + 1)), "loss_by_k": means,
        "loss_by_k_bootstrap_95": [[m - 0.1, m + 0.1] for m in means],
        "best_k": 3, "expert_losses": [3.0] * experts, "windows": 8, "documents": 4, "window_loss_by_k": windows,
        "doc_ids": [f"doc{w // 2}" for w in range(8)]}))
    (analysis / "error_correlation.json").write_text(json.dumps({
        "experts": experts, "tokens": 100, "bins": [{"correlation": 0.1, "correlation_range": [0.0, 0.2], "gain": 0.2,
                                                     "gain_stderr": 0.01, "pairs": 3}],
        "gain_correlation_pearson": -0.6 - 0.1 * seed,
        "pairs": [{"experts": [0, 1], "correlation": 0.1, "gain": 0.2, "losses": [3.0, 3.0], "pair_loss": 2.8}]}))


def _report(tmp_path: Path, rate: float = RATE, windows: bool = False) -> tuple[dict, dict]:
    per_seed, folders = [], {}
    for seed in range(3):
        trials = {}
        for experts in START:
            trial = 10 * seed + experts
            trials[str(experts)] = trial
            folders[trial] = {seed: str(tmp_path / f"trial-{trial}")}
            _run(tmp_path / f"trial-{trial}", experts, seed, rate, windows)
        per_seed.append({"seed": seed, "trial": trials})
    return {"table7": {"column_labels": [1, 2, 4], "per_seed": per_seed}, "trials": {"COMPLETE": 9}, "failed": []}, \
        folders


def _log_between(x0: float, y0: float, x1: float, y1: float, x: float) -> float:
    return y0 + (y1 - y0) * math.log(x / x0) / math.log(x1 / x0)


def test_fig7_reads_both_time_bases_and_checks_each_claim(tmp_path):
    report, folders = _report(tmp_path)
    result = load_experiment("fig7").result(report, folders)
    rows = {row["experts"]: row for row in result["rows"]}
    assert result["cutoff_seconds"] == pytest.approx(UPDATES)  # every run: 100 s per expert
    for experts, row in rows.items():
        assert row["at_cutoff"]["mean"] == pytest.approx(START[experts] - RATE * UPDATES + 0.01)
        assert row["aggregate_seconds"]["mean"] == pytest.approx(UPDATES * experts)
        assert row["multiply_adds_per_update"] == pytest.approx(64 * experts * PARAMETERS_PER_EXPERT)
    curve = result["curves"]["4"][0]
    assert curve["per_expert_seconds"][0] == pytest.approx(EVERY) and curve["aggregate_seconds"][0] == pytest.approx(40)
    checks = {check["claim"]: check for check in result["checks"]}
    for smaller, larger in ((1, 2), (2, 4)):
        claim = next(c for c in checks if f"N = {larger} reaches a lower" in c and f"than N = {smaller} at" in c)
        assert checks[claim]["mean"] == pytest.approx(START[smaller] - START[larger]) and checks[claim]["seeds"] == 3
    # validation curves and Fig. 17's r keep no per-window losses: without a document interval three seeds
    # decide nothing
    undecided = [c for c in result["checks"] if "Fig. 16" not in c["claim"]]
    assert len(undecided) == 4 and all(c["verdict"] == Verdict.inconclusive.value and c["document_interval"] is None
                                       and c["p"] is None for c in undecided)
    # Aggregate: N = 2 − N = 1 at X seconds is −0.1 + (RATE/2)·X at validations: below zero at 20 s,
    # above at 100 s; between validations (√2000 s) each curve is interpolated in log time.
    pair = [row for row in result["aggregate"] if (row["smaller"], row["larger"]) == (1, 2)]
    middle = math.sqrt(20 * 100)
    assert [row["budget_seconds"] for row in pair] == pytest.approx([20.0, middle, 100.0])
    one = _log_between(40, START[1] - RATE * 40, 50, START[1] - RATE * 50, middle)
    two = _log_between(40, START[2] - RATE * 20, 60, START[2] - RATE * 30, middle)
    assert [row["check"]["mean"] for row in pair] == pytest.approx([-0.05, two - one, 0.15])
    assert all(row["check"]["verdict"] == "inconclusive" and row["check"]["document_interval"] is None
               and row["check"]["p"] is None for row in result["aggregate"])
    fig8 = next(c for c in result["checks"] if "every aggregate budget" in c["claim"])
    assert fig8["mean"] == pytest.approx(0.15)  # the comparison most in the claim's favour
    fig16 = next(c for c in result["checks"] if "Fig. 16" in c["claim"])
    # k = 2 (N = 4: k = N/2) captures 0.1 of the best k's 0.2: (L₁ − L₂) − 0.5·(L₁ − L_best) = 0.1 − 0.5·0.2 = 0
    assert result["top_k"] == 2 and fig16["mean"] == pytest.approx(0.0)
    assert fig16["document_interval"] == pytest.approx((0.0, 0.0), abs=1e-12)
    fig17 = next(c for c in result["checks"] if "Fig. 17" in c["claim"])
    assert fig17["mean"] == pytest.approx(0.7) and fig17["seeds"] == 3  # r = −0.6, −0.7, −0.8
    text = load_experiment("fig7").table({**result, "experiment": "fig7", "scale": "cpu", "title": "t", "basis": "b",
                          "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2], "trial_minutes": 3.0})
    assert "| 4 | 1,000 | 4,000 | 2.56e+05 | 100 | 2.3100 ± 0.0100 |" in text
    assert "| N = 1 → 2 | 100 | 2.5100 | 2.6600 | +0.1500 | inconclusive |" in text
    assert "Seed 1: 1 pairs, r = -0.700." in text
    assert fig7_figure({**result, "experiment": "fig7", "scale": "cpu"}, tmp_path / "f.png").stat().st_size > 0


def test_validations_window_by_window_give_the_curves_comparisons_a_document_interval(tmp_path):
    """With every run's validations window by window, each comparison of two curves has a document
    interval of its windows interpolated as the mean is: each document's two windows cancel, so it
    is the exact difference and the seeds' sign decides, at the elapsed cutoff and at every budget."""
    report, folders = _report(tmp_path, windows=True)
    result = load_experiment("fig7").result(report, folders)
    elapsed = [c for c in result["checks"] if "Fig. 7 left" in c["claim"]]
    assert len(elapsed) == 2
    for check in elapsed:  # N = 2 below N = 1, N = 4 below N = 2, by 0.1 at 100 s per expert
        assert check["verdict"] == "holds" and check["document_interval"] == pytest.approx((0.1, 0.1))
    for row in result["aggregate"]:
        check = row["check"]
        assert check["document_interval"] == pytest.approx((check["mean"], check["mean"]))
        assert check["verdict"] == ("holds" if check["mean"] > 0 else "does not hold")
    fig8 = next(c for c in result["checks"] if "every aggregate budget" in c["claim"])
    later = [row["check"]["mean"] for row in result["aggregate"] if row["later_half"]]
    assert fig8["verdict"] == "holds" and fig8["p"] == 0.0 and fig8["mean"] in later and fig8["mean"] > 0
    # Fig. 8's claim can fail: where more experts are lower at every later budget, it does not hold
    report, folders = _report(tmp_path / "slow", rate=0.0005, windows=True)
    checks = load_experiment("fig7").result(report, folders)["checks"]
    fig8 = next(c for c in checks if "every aggregate budget" in c["claim"])
    assert fig8["verdict"] == "does not hold"


def test_more_experts_lower_at_every_aggregate_budget_is_the_opposite_of_fig8(tmp_path):
    report, folders = _report(tmp_path, rate=0.0005)  # N = 2 − N = 1 = −0.1 + 0.00025·X < 0 up to 100 s
    result = load_experiment("fig7").result(report, folders)  # and N = 4 − N = 2 = −0.1 + 0.000125·X < 0 up to 200 s
    rows = result["aggregate"]
    assert {(row["smaller"], row["larger"]) for row in rows} == {(1, 2), (2, 4)}
    assert all(row["check"]["mean"] < 0 and row["check"]["seeds"] == 3 for row in rows)
    # validation curves keep no per-window losses: no comparison is decided, so neither is Fig. 8's claim
    assert all(row["check"]["verdict"] == "inconclusive" and row["check"]["document_interval"] is None
               and row["check"]["p"] is None for row in rows)
    fig8 = next(c for c in result["checks"] if "every aggregate budget" in c["claim"])
    assert fig8["verdict"] == Verdict.inconclusive.value
    assert fig8["mean"] == max(row["check"]["mean"] for row in rows) and fig8["p"] is None


def test_mixed_aggregate_comparisons_are_inconclusive():
    rows = [{"smaller": 1, "larger": 2, "budget_seconds": 10.0, "later_half": False,
             "check": {"verdict": "does not hold", "mean": -0.1, "why": "w", "claim": "c", "p": 0.001}},
            {"smaller": 1, "larger": 2, "budget_seconds": 20.0, "later_half": True,
             "check": {"verdict": "inconclusive", "mean": 0.01, "why": "w", "claim": "c", "p": None}}]
    check = aggregate_check(rows, CLAIMS["aggregate"])
    assert check["verdict"] == "inconclusive" and check["mean"] == 0.01
    # only the later half of the pair's range in log time counts: the 20 s comparison
    assert "0 of 1 (pair, budget) comparisons hold, 0 show the opposite" in check["why"]
    rows[1]["check"] = {**rows[1]["check"], "verdict": "does not hold", "mean": -0.02, "p": 0.01}
    assert aggregate_check(rows, CLAIMS["aggregate"])["verdict"] == "does not hold"
    # of the holding comparisons, the one with the smallest p-value is shown and adjusted, not the largest mean
    held = [{"smaller": 1, "larger": 2, "budget_seconds": seconds, "later_half": True,
             "check": {"verdict": "holds", "mean": mean, "why": "w", "claim": "c", "p": p}}
            for seconds, mean, p in ((20.0, 0.3, 0.04), (30.0, 0.1, 0.001))]
    check = aggregate_check(held, CLAIMS["aggregate"])
    assert check["verdict"] == "holds" and check["p"] == 0.001 and check["mean"] == 0.1
    assert aggregate_check([], CLAIMS["aggregate"])["verdict"] == "inconclusive"
    assert aggregate_comparisons({1: []}, CLAIMS["aggregate_budget"]) == []


def test_topk_claim_goes_against_the_paper_when_the_numbers_do_and_correlation_needs_documents():
    flat = {"k": [1, 2, 3, 4], "loss_by_k": [3.0, 2.99, 2.98, 2.7], "window_loss_by_k": [[3.0, 2.99, 2.98, 2.7]] * 4,
            "doc_ids": ["a", "b", "c", "d"]}
    other = {**flat, "loss_by_k": [3.0, 2.98, 2.97, 2.7]}
    third = {**flat, "loss_by_k": [3.0, 2.97, 2.96, 2.7]}
    # k = 2 captures 1/30, 2/30 and 3/30 of the gain of k = 4: (L₁ − L₂) − 0.5·(L₁ − L₄) = −0.14, −0.13, −0.12
    check = topk_check([flat, other, third], 2, CLAIMS["topk"])
    assert check["verdict"] == "does not hold" and check["mean"] == pytest.approx(-0.13)
    half = 4.302653 * 0.01 / 3 ** 0.5  # t(0.975, 2 degrees of freedom) · sd / √3, on the scale of the losses
    assert check["seed_interval"] == pytest.approx((-0.13 - half, -0.13 + half))
    # every window: (3.0 − 2.99) − 0.5·(3.0 − 2.7) = −0.14
    assert check["document_interval"] == pytest.approx((-0.14, -0.14)) and check["seeds"] == 3
    # the seeds' −r go against the paper, but Fig. 17 keeps no per-window losses: no document interval
    correlation = correlation_check([{"gain_correlation_pearson": r} for r in (0.5, 0.52, 0.54)],
                                    CLAIMS["correlation"])
    assert correlation["mean"] == pytest.approx(-0.52) and correlation["seeds"] == 3
    assert correlation["verdict"] == "inconclusive" and correlation["document_interval"] is None
    assert correlation["p"] is None


def _settings_run(folder: Path, n_pert: int, batch: int, seed: int) -> None:
    """120 updates of n_pert·B/8 s per expert each (N = 4), validated every 20: the loss after u updates is
    3 − 0.001·u·log2(n_pert·B) + 0.01·seed, so more directions are lower at equal updates and, costing
    proportionally more time, higher at equal elapsed time."""
    folder.mkdir(parents=True)
    directions, rows = n_pert * batch, ["step,val/loss,compute/aggregate_device_hours"]
    for update in range(20, 121, 20):
        loss = 3.0 - 0.001 * update * math.log2(directions) + 0.01 * seed
        rows += [f"{update - 1},{loss},", f"{update},,{4 * update * directions / 8 / 3600}"]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")
    (folder / "summary.json").write_text(json.dumps({
        "parameters": 4000, "last_checkpoint": None,
        "compute": {"experts": 4, "updates": 120, "token_forwards": 4 * 2 * directions * 1024 * 120}}))


def test_fig7_settings_orders_each_series_and_compares_on_both_bases(tmp_path):
    from soma_pl.reproduce.scaling import fig7_settings_figure

    labels = ["p8_b1", "p16_b1", "p64_b1", "p8_b2", "p8_b8"]
    per_seed, folders = [], {}
    for seed in range(3):
        trials = {}
        for index, label in enumerate(labels):
            trial = 10 * seed + index
            trials[label], folders[trial] = trial, {seed: str(tmp_path / f"t{trial}")}
            n_pert, batch = (int(v) for v in label[1:].split("_b"))
            _settings_run(tmp_path / f"t{trial}", n_pert, batch, seed)
        per_seed.append({"seed": seed, "trial": trials})
    report = {"table7": {"column_labels": labels, "per_seed": per_seed}, "trials": {"COMPLETE": 15}, "failed": []}
    result = load_experiment("fig7_settings").result(report, folders)
    assert result["series"] == {"n_pert": ["p8_b1", "p16_b1", "p64_b1"], "B": ["p8_b1", "p8_b2", "p8_b8"]}
    checks = {check["claim"]: check for check in result["checks"]}
    updates = checks["SOMA improves with larger n_pert (Fig. 7): p64_b1 below p16_b1 after 120 updates"]
    assert updates["mean"] == pytest.approx(0.001 * 120 * (6 - 4)) and updates["seeds"] == 3
    # a pair is compared where its cheaper run ends: p8's 120 updates of 1 s per expert
    timed = checks["SOMA improves with larger n_pert (Fig. 7): p16_b1 below p8_b1 at 120.0 s per expert (where the "
                   "cheaper run ends)"]
    # at 120 s per expert p8 made 120 updates (loss 3 − 0.36), p16 60 (3 − 0.24): p16 is the higher
    assert timed["mean"] == pytest.approx((3 - 0.36) - (3 - 0.24))
    # p16 ends at 240 s per expert, between p64's validations at 160 and 320 s (8 s per update)
    later = checks["SOMA improves with larger n_pert (Fig. 7): p64_b1 below p16_b1 at 240.0 s per expert (where the "
                   "cheaper run ends)"]
    p64 = _log_between(160, 3 - 0.001 * 20 * 6, 320, 3 - 0.001 * 40 * 6, 240)
    assert later["mean"] == pytest.approx((3 - 0.001 * 120 * 4) - p64)
    # validation curves keep no per-window losses: without a document interval three seeds decide nothing
    assert len(checks) == 8 and all(c["verdict"] == "inconclusive" and c["seeds"] == 3 and c["p"] is None
                                    and c["document_interval"] is None for c in checks.values())
    assert {row["setting"]: row["directions"] for row in result["rows"]}["p8_b8"] == 64
    text = load_experiment("fig7_settings").table({
        **result, "experiment": "fig7_settings", "scale": "cpu", "title": "t", "basis": "b",
                                   "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2]})
    assert "| p8_b8 | 8 | 64 | 64 |" not in text and "| p8_b8 | 8 | 8 | 64 |" in text
    assert fig7_settings_figure({**result, "experiment": "fig7_settings", "scale": "cpu"},
                                tmp_path / "f.png").stat().st_size > 0
