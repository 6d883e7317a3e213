"""Fig. 14, Fig. 15 and Table 13: fixed-size ensembles (about one total parameter count split over
N = 1, 2, 4, 8 experts), what each checkpoint cost to train and what it costs at inference.

- **Fig. 14, the budget map.** Every validation of every run is a validated state (the paper's
  saved checkpoints) with an aggregate update time A (Table 3's U·Σₑ t̄ₑ) and an average
  per-expert time A/N (the elapsed time with one device per expert). For an aggregate budget and a
  per-expert budget, the map shows the expert count of the lowest-loss state that fits both
  (`select`); no interpolation, so its region boundaries come from the states, as the paper's do.
  Cells whose per-expert budget exceeds the aggregate are left out: there only the aggregate binds.
  The paper's claim, N = 1 never selected, is checked on the map's cells (`never_single`); "more
  shards lower loss under a tight per-expert budget" at the per-expert budgets where the 240 s runs
  of N = 2, 4, 8 end (A/N), the aggregate unlimited: N = 1's best state within that per-expert time
  against the best of the others, seed by seed (`per_expert_checks`; the other run is chosen by its
  seed-mean loss on the same numbers, which favours the claim a little).
- **Fig. 15, inference cost against loss.** Each run's last checkpoint, scored on the test split
  (route on the first 256 bytes, average the top k = 4 where N ≥ 4), against the multiply-adds per
  token of the experts it evaluates (min(k, N) × parameters per expert; routing excluded, as the
  paper's; a count, reported beside the losses, not a verdict: at a fixed total size it cannot rise
  with N). The runs stop at the budget (their first update past it), so no loss is interpolated.
  "Training progress changes their ranking" is checked as: N = 8 trails N = 4 at the common budget,
  and Table 13's row says whether it still does at N = 4's elapsed time.
- **Table 13**: the smaller ensemble at its budget beside the larger one at about the same elapsed
  time per expert (twice the aggregate).
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

import numpy as np

from soma_pl.errors import SomaError
from soma_pl.eval.bootstrap import document_bootstrap, paired_document_interval
from soma_pl.reproduce.comparisons import run_test_scores
from soma_pl.reproduce.experiments import Claim, Experiment
from soma_pl.reproduce.scaling import run_curve
from soma_pl.reproduce.tables import (
    interval_text,
    number,
    save_figure,
    subplots,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import MIN_SEEDS, Verdict, mean_sd
from soma_pl.sweeps.final_test import score_run

RUN = re.compile(r"n(?P<experts>\d+)(?P<long>_long)?$")
"""A run's label: `n<N>` at the common budget, `n<N>_long` at a longer one."""
TOP_K = 4
"""Experts averaged per window at inference where N ≥ 4 (the paper's Fig. 15 and Table 13)."""
MAP_CELLS = 48
"""Budget-map cells per axis (log-spaced)."""
def label_experts(label: str) -> tuple[int, bool]:
    """(N, whether it is the longer run) of a run label `n<N>` or `n<N>_long`."""
    match = RUN.match(label)
    if not match:
        raise SomaError(f"Fig. 14: run label {label!r} is not n<N> or n<N>_long")
    return int(match["experts"]), bool(match["long"])


def checkpoints(curves: dict[str, dict]) -> list[dict]:
    """Every validation of one seed's runs as a checkpoint: its N, aggregate and per-expert update
    time, and ensemble-validation loss."""
    return [{"run": label, "experts": curve["experts"], "aggregate": a, "per_expert": p, "loss": loss}
            for label, curve in curves.items()
            for a, p, loss in zip(curve["aggregate_seconds"], curve["per_expert_seconds"], curve["loss"], strict=True)]


def select(points: list[dict], aggregate: float, per_expert: float) -> dict | None:
    """The lowest-loss checkpoint within both budgets (None when none fits)."""
    fitting = [p for p in points if p["aggregate"] <= aggregate and p["per_expert"] <= per_expert]
    return min(fitting, key=lambda p: p["loss"]) if fitting else None


def log_grid(low: float, high: float, cells: int = MAP_CELLS) -> list[float]:
    return [low * (high / low) ** (i / (cells - 1)) for i in range(cells)]


def budget_map(points: list[dict], aggregates: list[float], per_experts: list[float]) -> list[list[int | None]]:
    """`[per-expert budget][aggregate budget]` → the selected checkpoint's N (None: nothing fits)."""
    return [[(chosen := select(points, a, p)) and chosen["experts"] for a in aggregates] for p in per_experts]


def per_expert_checks(seeds: list[list[dict]], budgets: list[float],
                      claim: Claim) -> tuple[list[dict], list[dict]]:
    """At each per-expert budget (aggregate unlimited): N = 1's best checkpoint within it against the
    best of the other runs; difference = N = 1 − the other. Each seed's rival is chosen on the other
    seeds' mean loss, so the run compared is not picked on the numbers it is compared on. A budget
    under N = 1's first checkpoint in some seed is listed without a check: nothing of N = 1 fits
    there, so it cannot be selected."""
    checks, rows = [], []
    for budget in budgets:
        best = {}
        for points in seeds:
            for label in sorted({p["run"] for p in points}):
                chosen = select([p for p in points if p["run"] == label], math.inf, budget)
                best.setdefault(label, []).append(chosen["loss"] if chosen else None)
        single = next((label for label in best if label_experts(label)[0] == 1), None)
        others = {label: values for label, values in best.items()
                  if label_experts(label)[0] > 1 and None not in values}
        if single is None or not others:
            continue
        rivals = [min(others, key=lambda label: statistics.fmean(v for j, v in enumerate(others[label]) if j != i))
                  for i in range(len(seeds))] if len(seeds) > 1 else []
        row = {"per_expert_budget": budget, "single": best[single], "rival": rivals,
               "rival_loss": [others[label][i] for i, label in enumerate(rivals)], "check": None}
        if rivals and None not in best[single]:
            differences = [a - b for a, b in zip(best[single], row["rival_loss"], strict=True)]
            row["check"] = claim.check(differences, budget=budget)
            checks.append(row["check"])
        rows.append(row)
    return checks, rows


def never_single(maps: list[list[list[int | None]]], per_experts: list[float], aggregates: list[float],
                 seeds: int, claim: Claim) -> dict:
    """Fig. 14's "N = 1 is never selected", on the map's cells where the per-expert budget can bind
    (per-expert ≤ aggregate): holds when no seed's map selects N = 1 there, does not hold when every
    seed's does, on `MIN_SEEDS` seeds or more (fewer decide nothing); a count, not an interval, so it
    is not in the experiment's Holm family."""
    counts = [sum(n == 1 for p, line in zip(per_experts, grid, strict=True)
                  for a, n in zip(aggregates, line, strict=True) if p <= a) for grid in maps]
    cells = sum(1 for p in per_experts for a in aggregates if p <= a)
    verdict = Verdict.holds if not any(counts) else Verdict.does_not_hold if all(counts) else Verdict.inconclusive
    if len(counts) < MIN_SEEDS:
        verdict = Verdict.inconclusive
    return {"claim": claim.text(), "verdict": verdict.value,
            "why": f"N = 1 selected in {', '.join(map(str, counts))} of {cells} cells per seed",
            "mean": statistics.fmean(counts), "seeds": seeds,
            "seed_interval": None, "document_interval": None, "basis": claim.basis, "split": claim.split}


def arithmetic_per_token(curve: dict, top_k: int = TOP_K) -> float:
    """Multiply-adds per token of the experts one window is scored by: min(k, N) × parameters per expert."""
    return min(top_k, curve["experts"]) * curve["parameters_per_expert"]


def seed_mean_interval(scores: list[dict]) -> tuple[float, float] | None:
    """The 95% document-bootstrap interval of the seed-mean per-window test loss."""
    if not all("window_losses" in s for s in scores) or len({tuple(s["doc_ids"]) for s in scores}) != 1:
        return None
    windows = np.mean([s["window_losses"] for s in scores], axis=0)
    interval = document_bootstrap(windows, np.asarray(scores[0]["doc_ids"]))
    return interval.low, interval.high


def fig14_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Figs. 14 and 15 and Table 13 beside the paper's claims."""
    t7 = report["table7"]
    per_seed = t7["per_seed"]
    labels = sorted((str(label) for label in t7["column_labels"]), key=label_experts)
    recorded = report.get("test_score_files", {})
    run_dirs = {label: [Path(folders[e["trial"][label]][e["seed"]]) for e in per_seed] for label in labels}
    curves = {label: [run_curve(path) for path in paths] for label, paths in run_dirs.items()}
    scores = {label: [run_test_scores(str(path), recorded.get(e["trial"][label], {}).get(e["seed"]))
                      for path, e in zip(paths, per_seed, strict=True)] for label, paths in run_dirs.items()}
    seeds = [checkpoints({label: curves[label][i] for label in labels}) for i in range(len(per_seed))]
    every = [p for points in seeds for p in points]
    aggregates = log_grid(min(p["aggregate"] for p in every), max(p["aggregate"] for p in every))
    per_experts = log_grid(min(p["per_expert"] for p in every), max(p["per_expert"] for p in every))
    maps = [budget_map(points, aggregates, per_experts) for points in seeds]
    ends = sorted({max(c["per_expert_seconds"][-1] for c in curves[label]) for label in labels
                   if label_experts(label)[0] > 1 and not label_experts(label)[1]})  # every seed's last state fits
    claims = experiment.claims
    checks, tight = per_expert_checks(seeds, ends, claims["tight"])
    rows = []
    for label in labels:
        runs, experts = curves[label], label_experts(label)[0]
        rows.append({"run": label, "experts": experts, "top_k": min(TOP_K, experts),
                     "parameters": runs[0]["parameters"], "parameters_per_expert": runs[0]["parameters_per_expert"],
                     "arithmetic_per_token": arithmetic_per_token(runs[0]),
                     "updates": mean_sd([c["updates"][-1] for c in runs]),
                     "aggregate_seconds": mean_sd([c["aggregate_seconds"][-1] for c in runs]),
                     "per_expert_seconds": mean_sd([c["per_expert_seconds"][-1] for c in runs]),
                     "val": mean_sd([c["loss"][-1] for c in runs]),
                     "test": mean_sd([s["loss"] for s in scores[label]]),
                     "test_95": seed_mean_interval(scores[label]),
                     "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)}})
    checks.insert(0, never_single(maps, per_experts, aggregates, len(per_seed), claims["never_single"]))
    splits = {"test": (scores, lambda claim: claim)}
    if experiment.final_test:  # the runs' last checkpoints scored once on the final test split
        finals = {label: [score_run(path, "final") for path in paths] for label, paths in run_dirs.items()}
        for row in rows:
            row["final"] = mean_sd([s["loss"] for s in finals[row["run"]]])
        splits["final"] = (finals, Claim.on_final)
    table13 = table13_rows(rows)
    if len(table13) == 2:
        near, longer = table13[0]["run"], table13[1]["run"]
        large = next(r["run"] for r in rows if r["experts"] == table13[1]["experts"] and not label_experts(r["run"])[1])
        for split_scores, on_split in splits.values():
            for key, worse, fields in (("ranking", large, {"large": large, "near": near}),
                                       ("not_yet", longer, {"near": near, "longer": longer})):
                differences = [a["loss"] - b["loss"] for a, b in zip(split_scores[worse], split_scores[near],
                                                                     strict=True)]
                checks.append(on_split(claims[key]).check(
                    differences, paired_document_interval(split_scores[worse], split_scores[near]), **fields))
    selected = {str(n): sum(cell == n for grid in maps for p, line in zip(per_experts, grid, strict=True)
                            for a, cell in zip(aggregates, line, strict=True) if p <= a)
                for n in sorted({row["experts"] for row in rows})}
    single = [[(p, a) for p, line in zip(per_experts, grid, strict=True) for a, n in zip(aggregates, line, strict=True)
               if n == 1 and p <= a] for grid in maps]
    where_single = [{"min_per_expert_seconds": min(p for p, _ in cells), "min_share": min(p / a for p, a in cells)}
                    if cells else None for cells in single]
    return {"rows": rows, "table13": table13, "tight": tight, "checks": checks,
            "map": {"aggregate_seconds": aggregates, "per_expert_seconds": per_experts, "selected": maps,
                    "cells": selected, "checkpoints": [len(points) for points in seeds], "single": where_single},
            "curves": curves,
            "seeds": [e["seed"] for e in per_seed]}


def table13_rows(rows: list[dict]) -> list[dict]:
    """Table 13's first two rows: the ensemble below the largest whose elapsed time per expert is
    nearest the largest's longer run, then that longer run. (The paper's third row, the larger
    ensemble trained further still, has no run here.) Empty without a longer run."""
    longer = [row for row in rows if label_experts(row["run"])[1]]
    smaller = [row for row in rows if longer and row["experts"] < longer[0]["experts"]]
    if not smaller:
        return []
    large = longer[0]
    near = min(smaller, key=lambda row: abs(math.log(row["per_expert_seconds"]["mean"]
                                                     / large["per_expert_seconds"]["mean"])))
    return [near, large]


def single_text(where: list[dict | None], seeds: list[int]) -> str:
    """Where the map selects N = 1, per seed: its smallest per-expert budget and per-expert share of
    the aggregate budget (a share near 1: only where the aggregate budget binds)."""
    parts = [f"seed {seed}: never" if cell is None else
             f"seed {seed}: from {cell['min_per_expert_seconds']:.1f} s per expert, and only where the per-expert "
             f"budget is at least {cell['min_share']:.2f} of the aggregate"
             for seed, cell in zip(seeds, where, strict=True)]
    return ("N = 1 is selected " + "; ".join(parts) + ".") if parts else ""


def fig14_markdown(result: dict) -> str:
    """Fig. 14's selections at the tight per-expert budgets and the map's tally; Fig. 15's rows;
    Table 13 beside the paper; then the claims."""
    paper = result["paper_summary"]
    seeds = ", ".join(map(str, result["seeds"]))
    grid = result["map"]
    lines = ["## Fig. 15: inference arithmetic against test loss", "",
             f"Each run's last checkpoint (the budget stops it at its first update past the budget), seeds {seeds}: "
             "test loss mean ± sd and the 95% document-bootstrap interval of the seed-mean per-window loss. "
             f"Multiply-adds per token: min(k, N) × parameters per expert, k = {TOP_K} (routing excluded; a count, "
             "which at a fixed total size cannot rise with N). Paper: "
             f"{paper['fig15']['left']}.", "",
             *table_head(["run", "N", "k", "parameters", "per expert", "multiply-adds per token", "updates",
                          "aggregate (s)", "per expert (s)", "ensemble validation", "test loss", "95% documents",
                          "final test split (used once)"])]
    for row in result["rows"]:
        final = row.get("final")
        lines.append(table_row([row["run"], str(row["experts"]), str(row["top_k"]), f"{row['parameters']:,}",
                                f"{row['parameters_per_expert']:,.0f}", f"{row['arithmetic_per_token']:,.0f}",
                                f"{row['updates']['mean']:.0f}", f"{row['aggregate_seconds']['mean']:.0f}",
                                f"{row['per_expert_seconds']['mean']:.0f}", number(row["val"]["mean"]),
                                f"{number(row['test']['mean'])} ± {number(row['test']['sd'])}",
                                interval_text(row["test_95"], sign=False),
                                f"{number(final['mean'])} ± {number(final['sd'])}" if final else "—"]))
    lines += ["", "## Fig. 14: the budget map", "",
              f"States: every validation of every run ({', '.join(map(str, grid['checkpoints']))} per seed; the "
              f"paper: {paper['fig14']['checkpoints']} saved checkpoints from N = "
              f"{', '.join(map(str, paper['fig14']['experts']))}). Over a {MAP_CELLS} × {MAP_CELLS} log grid of "
              f"aggregate budgets ({grid['aggregate_seconds'][0]:.0f}–{grid['aggregate_seconds'][-1]:.0f} s) and "
              f"per-expert budgets ({grid['per_expert_seconds'][0]:.1f}–{grid['per_expert_seconds'][-1]:.0f} s), the "
              "cells with a per-expert budget at most the aggregate (elsewhere only the aggregate binds), summed over "
              "seeds, each N is selected in: " + ", ".join(f"N = {n}: {count}" for n, count in grid["cells"].items())
              + " (the rest: no state fits). " + single_text(grid.get("single", []), result["seeds"]), "",
              "At the per-expert budgets where the other ensembles' common-budget runs end (aggregate unlimited): "
              "N = 1's best state within the budget and the best other run's, per seed (each seed's other run chosen "
              "by the other seeds' mean loss, not by its own).", "",
              *table_head(["per-expert budget (s)", "N = 1", "best other run", "its loss", "difference", "verdict"])]
    for row in result["tight"]:
        check = row["check"]
        lines.append(table_row([f"{row['per_expert_budget']:.1f}", ", ".join(number(v) for v in row["single"]),
                                ", ".join(row["rival"]) or "—", ", ".join(number(v) for v in row["rival_loss"]),
                                number(check["mean"], sign=True) if check else "—",
                                check["verdict"] if check else "N = 1 has no checkpoint within it"]))
    if result["table13"]:
        lines += ["", "## Table 13: the larger ensemble at about the smaller one's elapsed time per expert", "",
                  f"Test loss mean ± sd over seeds {seeds}; elapsed per expert is the aggregate / N (one device per "
                  "expert). The paper's third row, the larger ensemble trained further, has no run at this scale.", "",
                  *table_head(["run", "parameters", "updates", "elapsed per expert (s)", "aggregate (s)",
                               "multiply-adds per token", "test loss"])]
        for row in result["table13"]:
            lines.append(table_row([row["run"], f"{row['parameters']:,}", f"{row['updates']['mean']:.0f}",
                                    f"{row['per_expert_seconds']['mean']:.0f}",
                                    f"{row['aggregate_seconds']['mean']:.0f}", f"{row['arithmetic_per_token']:,.0f}",
                                    f"{number(row['test']['mean'])} ± {number(row['test']['sd'])}"]))
        lines += ["", "The paper's Table 13 (top-4 routing):", "",
                  *table_head(["model", "parameters", "updates", "elapsed hours", "aggregate GPU-hours", "test loss"])]
        lines += [table_row([r["model"], r["parameters"], r["updates"], str(r["elapsed_hours"]),
                             f"{r['aggregate_gpu_hours']:,}", number(r["test"], 2)])
                  for r in paper["table13"]["rows"]]
    lines += ["", "The paper's statements:", "", *(f"- {paper[key]['claim']}" for key in ("fig14", "fig15", "table13"))]
    return "\n".join(lines) + "\n"


def fig14_figure(result: dict, path: Path) -> Path:
    """The budget map of each seed (colour: the selected N), and Fig. 15's two panels: test loss
    against inference multiply-adds per token at the common budget, and with the longer run."""
    from matplotlib.colors import BoundaryNorm, ListedColormap

    grid = result["map"]
    counts = sorted(int(n) for n in grid["cells"])
    colours = ListedColormap([f"C{i}" for i in range(len(counts))])
    norm = BoundaryNorm([i - 0.5 for i in range(len(counts) + 1)], len(counts))
    panels = len(grid["selected"]) + 2
    fig, axes = subplots(1, panels, figsize=(4.4 * panels, 4.0))
    for axis, seed, selected in zip(axes, result["seeds"], grid["selected"], strict=False):
        index = np.array([[np.nan if n is None or p > a else counts.index(n)
                           for a, n in zip(grid["aggregate_seconds"], line, strict=True)]
                          for p, line in zip(grid["per_expert_seconds"], selected, strict=True)])
        mesh = axis.pcolormesh(grid["aggregate_seconds"], grid["per_expert_seconds"], np.ma.masked_invalid(index),
                               cmap=colours, norm=norm, shading="nearest")
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("aggregate update-time budget, U·Σₑ t̄ₑ (s)", fontsize=8)
        axis.set_ylabel("per-expert budget, U·Σₑ t̄ₑ / N (s)", fontsize=8)
        axis.set_title(f"Fig. 14: selected N, seed {seed} (blank: nothing fits, or per-expert > aggregate)",
                       fontsize=8)
        colourbar = fig.colorbar(mesh, ax=axis, ticks=range(len(counts)))
        colourbar.ax.set_yticklabels([f"N = {n}" for n in counts], fontsize=7)
    largest = max(row["experts"] for row in result["rows"])
    left = [row for row in result["rows"] if not label_experts(row["run"])[1]]
    right = [row for row in result["rows"] if label_experts(row["run"])[1] or row["experts"] < largest]
    for axis, shown in ((axes[-2], left), (axes[-1], right)):
        for row in shown:
            mean = row["test"]["mean"]
            low, high = row["test_95"] or (mean, mean)
            below, above = max(mean - low, 0.0), max(high - mean, 0.0)  # a one-point interval rounds past its mean
            axis.errorbar([row["arithmetic_per_token"]], [mean], yerr=[[below], [above]], fmt="o",
                          capsize=3, label=f"{row['run']} ({row['aggregate_seconds']['mean']:.0f} s aggregate)")
        axis.set_xlabel("multiply-adds per token (selected experts)", fontsize=8)
        axis.set_ylabel("test loss (nats/byte)")
        axis.legend(fontsize=7)
    axes[-2].set_title("Fig. 15 (left): at the common aggregate budget", fontsize=9)
    axes[-1].set_title("Fig. 15 (right): the largest N trained longer", fontsize=9)
    return save_figure(fig, path)
