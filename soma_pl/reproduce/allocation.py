"""Fig. 13, Table 10 and Table 11: how N = 8 experts spend a fixed number of direction-window
evaluations per update, between more directions (n_pert) and more windows (B).

Every allocation evaluates the same n_pert × B direction-windows per update (each window of a batch
with its own n_pert directions, as the paper's accumulated batches of 64 are), so equal updates are
equal multiply-adds:

- **Fig. 13**: from the width-32 seed, the aggregate update time (Table 3's U·Σₑ t̄ₑ) each
  allocation needs to reach a loss threshold. The paper's 1.90 line is one every curve crosses;
  the demo's analogue is one every run crosses mid-curve (`threshold_of`), and the crossing is
  interpolated in log time (the paper reads its first plotted point at or below the line; our
  validations are too sparse for that to resolve the differences).
- **Table 10**: the same curves' loss at three doubling budgets of multiply-adds (a quarter, half
  and all of `BUDGET_SHARE` of the shortest run's, so that they fall between validations),
  interpolated there linearly and in log compute: the table gives the range of the two, the
  claims compare the log-compute value (the figures' axis), with the validation windows
  interpolated alike for the document interval (`scaling.compare_at`). The multiply-adds are the
  runs' own count; with the shared head frozen, as in the paper's fixed-width runs, it is the same
  per update for every allocation.
- **Table 11**: one checkpoint continued for a fixed number of further updates under each
  allocation, paired seeds (the same seeds and start for every allocation), test loss with
  per-window scores, beside the start checkpoint's own. The paper's claim, nearly equal, is an
  equivalence: it holds when every pairwise difference's 95% intervals lie inside ±margin, the
  margin `EQUIVALENT_SHARE` of what the continuation gained.
"""

from __future__ import annotations

import math
import re
import statistics
from pathlib import Path

from soma_pl.errors import SomaError
from soma_pl.eval.bootstrap import Interval, paired_document_interval
from soma_pl.reproduce.experiments import Claim, Experiment
from soma_pl.reproduce.scaling import compare_at, curve_value, run_curve
from soma_pl.reproduce.tables import (
    interval_text,
    number,
    save_figure,
    subplots,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import MIN_SEEDS, Verdict, mean_sd, seed_interval
from soma_pl.sweeps.final_test import score_checkpoint, score_run

ALLOCATION = re.compile(r"p(?P<n_pert>\d+)_b(?P<batch>\d+)$")
BUDGET_SHARE = 0.95
"""Table 10's largest budget as a share of the shortest run's multiply-adds."""
EQUIVALENT_SHARE = 0.1
"""Two allocations count as equal when they differ by less than this share of what the continuation
gained (the start checkpoint's test loss − the allocations' mean): a margin fixed by the run itself.
The paper's three differ by 5e-5, under 1/1000 of what its continuation could move them."""


def _allocations(labels: list[str]) -> list[tuple[str, int, int]]:
    """`(label, n_pert, B)` by increasing B (decreasing n_pert)."""
    found = [(label, int(m["n_pert"]), int(m["batch"])) for label in labels if (m := ALLOCATION.match(label))]
    return sorted(found, key=lambda item: item[2])


def threshold_of(curves: dict[str, list[dict]]) -> float:
    """A level every run crosses mid-curve: the highest of the runs' losses at half their updates
    (interpolated between validations), rounded up to 0.01."""
    levels = []
    for runs in curves.values():
        for curve in runs:
            half = max(curve["updates"][-1] / 2, curve["updates"][0])
            levels.append(curve_value(curve["updates"], curve["loss"], half, log=False))
    return math.ceil(max(levels) * 100 - 1e-9) / 100


def seconds_to(curve: dict, threshold: float) -> float | None:
    """The aggregate update time at which the run's curve first falls to `threshold`, interpolated
    between the validations around the crossing in log time (the figure's axis); None when the run
    never gets there."""
    points = list(zip(curve["aggregate_seconds"], curve["loss"], strict=True))
    if points and points[0][1] <= threshold:
        return points[0][0]
    for (s0, l0), (s1, l1) in zip(points, points[1:], strict=False):
        if l0 > threshold >= l1:
            share = (l0 - threshold) / (l0 - l1)
            return math.exp(math.log(s0) + share * (math.log(s1) - math.log(s0)))
    return None


def loss_range(curve: dict, operations: float) -> tuple[float, float] | None:
    """The loss at `operations` multiply-adds, interpolated linearly and in log compute: (low, high)."""
    xs = [u * curve["multiply_adds_per_update"] for u in curve["updates"]]
    values = [curve_value(xs, curve["loss"], operations, log) for log in (False, True)]
    return None if None in values else (min(values), max(values))


def fig13_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Fig. 13 and Table 10 beside the paper."""
    t7 = report["table7"]
    per_seed = t7["per_seed"]
    allocations = _allocations([str(label) for label in t7["column_labels"]])
    curves = {label: [run_curve(Path(folders[entry["trial"][label]][entry["seed"]])) for entry in per_seed]
              for label, _, _ in allocations}
    threshold = threshold_of(curves)
    reached = {label: [seconds_to(c, threshold) for c in runs] for label, runs in curves.items()}
    shortest = min(c["updates"][-1] * c["multiply_adds_per_update"] for runs in curves.values() for c in runs)
    budgets = [BUDGET_SHARE * shortest / 4, BUDGET_SHARE * shortest / 2, BUDGET_SHARE * shortest]
    table10 = {label: [[loss_range(c, budget) for budget in budgets] for c in runs] for label, runs in curves.items()}
    checks = []
    largest, smallest = allocations[-1][0], allocations[0][0]
    differences = [a - b for a, b in zip(reached[smallest], reached[largest], strict=True)
                   if a is not None and b is not None]
    checks.append(experiment.claims["threshold"].check(differences, threshold=threshold, largest=largest,
                                                       smallest=smallest))
    for budget in budgets:
        for label, _, _ in allocations[:-1]:
            differences, document = compare_at(curves[label], curves[largest], "multiply_adds", budget)
            checks.append(experiment.claims["budget"].check(differences, document, budget=budget, largest=largest,
                                                            label=label))
    rows = []
    for label, n_pert, batch in allocations:
        runs = curves[label]
        rows.append({"allocation": label, "n_pert": n_pert, "B": batch,
                     "multiply_adds_per_update": runs[0]["multiply_adds_per_update"],
                     "seconds_to_threshold": reached[label],
                     "table10": [[list(r) if r else None for r in ranges] for ranges in zip(*table10[label],
                                                                                           strict=True)],
                     "final": mean_sd([c["loss"][-1] for c in runs]),
                     "aggregate_seconds": mean_sd([c["aggregate_seconds"][-1] for c in runs])})
    found = [statistics.fmean(v) for v in (reached[smallest], reached[largest]) if v and None not in v]
    return {"rows": rows, "curves": curves, "threshold": threshold, "budgets": budgets,
            "ratio": found[0] / found[1] if len(found) == 2 and found[1] else None, "checks": checks,
            "seeds": [e["seed"] for e in per_seed]}


def fig13_markdown(result: dict) -> str:
    paper = result["paper_summary"]
    seeds = ", ".join(map(str, result["seeds"]))
    lines = [f"## Fig. 13: aggregate update time to reach {result['threshold']:.2f} nats/byte", "",
             f"The threshold is the demo's analogue of the paper's {paper['threshold']:.2f}: a level every run crosses "
             f"mid-curve (the highest of the runs' ensemble-validation losses at half their updates, rounded up to "
             f"0.01). Seconds of aggregate update time (U·Σₑ t̄ₑ, one thread) where each run's curve crosses "
             f"it, interpolated in log time between the validations around the crossing, seeds "
             f"{seeds}. Paper: {paper['gpu_hours']['64x1024']} GPU-hours for (64, 1024) against "
             f"{paper['gpu_hours']['1024x64']} for (1024, 64), {paper['ratio']}x.", "",
             *table_head(["allocation", "n_pert", "B", "multiply-adds per update", "s to the threshold",
                          "final loss", "s aggregate (final)"])]
    for row in result["rows"]:
        reached = ", ".join("—" if s is None else f"{s:.0f}" for s in row["seconds_to_threshold"])
        lines.append(table_row([row["allocation"], str(row["n_pert"]), str(row["B"]),
                                f"{row['multiply_adds_per_update']:.3g}", reached,
                                f"{number(row['final']['mean'])} ± {number(row['final']['sd'])}",
                                f"{row['aggregate_seconds']['mean']:.0f}"]))
    ratio = result["ratio"]
    lines += ["", f"Smallest-B over largest-B time to the threshold (seed means): "
                  f"{'—' if ratio is None else f'{ratio:.2f}x'} (paper: {paper['ratio']}x).", "",
              "## Table 10: loss at three budgets of multiply-adds", "",
              "Ensemble-validation loss, per seed, interpolated linearly and in log compute between validations "
              "(the range of the two). Paper (operations, estimated ensemble-validation loss): " + "; ".join(
                  f"{ops}: {low}–{high}" for ops, (low, high) in zip(paper["table10"]["operations"],
                                                                    paper["table10"]["loss"], strict=True)) +
              f", favouring {paper['table10']['favoured']}.", "",
              *table_head(["allocation", *(f"{budget:.3g} multiply-adds" for budget in result["budgets"])])]
    for row in result["rows"]:
        cells = ["; ".join("—" if r is None else f"{r[0]:.4f}–{r[1]:.4f}" for r in per_budget)
                 for per_budget in row["table10"]]
        lines.append(table_row([row["allocation"], *cells]))
    lines += ["", "The paper's statements:", "", *(f"- {claim}" for claim in paper["claims"].values())]
    return "\n".join(lines) + "\n"


def fig13_figure(result: dict, path: Path) -> Path:
    """Loss against aggregate update time per allocation, the threshold dotted (Fig. 13)."""
    fig, axis = subplots(figsize=(7.5, 4.2))
    for index, (label, runs) in enumerate(result["curves"].items()):
        for seed, curve in enumerate(runs):
            axis.plot(curve["aggregate_seconds"], curve["loss"], "-o", markersize=3, color=f"C{index}",
                      alpha=0.9 if seed == 0 else 0.5, label=label if seed == 0 else None)
    axis.axhline(result["threshold"], color="black", linestyle=":", linewidth=0.8)
    axis.set_xscale("log")
    axis.set_xlabel("aggregate update time, U·Σₑ t̄ₑ (s, one thread)")
    axis.set_ylabel("ensemble-validation loss (nats/byte)")
    axis.set_title(f"{result['experiment']} at {result['scale']} scale: N = 8, equal multiply-adds per update",
                   fontsize=9)
    axis.legend(fontsize=7)
    return save_figure(fig, path)


def equivalence(claim: Claim, differences: list[float], bootstrap: Interval | None, margin: float,
                **fields) -> dict:
    """Two sides equal within ±`margin`: holds when the seeds' and the documents' 95% intervals both
    lie inside it, does not hold when one lies wholly outside it, inconclusive otherwise (fewer than
    `MIN_SEEDS` seeds or no document interval among them, as for `decide`)."""
    seeds = seed_interval(differences)
    document = None if bootstrap is None else (bootstrap.low, bootstrap.high)
    mean = statistics.fmean(differences) if differences else None
    intervals = [seeds, document]
    shown = (f"seeds {interval_text(seeds)}, documents {interval_text(document)}, margin ±{margin:g}")
    if len(differences) < MIN_SEEDS or document is None:
        verdict, why = Verdict.inconclusive, f"{len(differences)} seed(s), at least {MIN_SEEDS} and a document " \
                                             f"interval needed ({shown})"
    elif all(-margin < low and high < margin for low, high in intervals):
        verdict, why = Verdict.holds, f"every 95% interval inside the margin ({shown})"
    elif any(low >= margin or high <= -margin for low, high in intervals):
        verdict, why = Verdict.does_not_hold, f"a 95% interval wholly outside the margin ({shown})"
    else:
        verdict, why = Verdict.inconclusive, f"a 95% interval reaches past the margin ({shown})"
    return {"claim": claim.text(margin=margin, **fields), "verdict": verdict.value, "why": why, "mean": mean,
            "seeds": len(differences), "seed_interval": seeds, "document_interval": document, "basis": claim.basis,
            "split": claim.split}


def start_checkpoint(run_dir: Path) -> str:
    """The checkpoint a continuation trial resumed: its config's `ckpt_path`."""
    import yaml

    config = run_dir / "config.yaml"
    checkpoint = yaml.safe_load(config.read_text()).get("ckpt_path")
    if not checkpoint:
        raise SomaError(f"{config}: no ckpt_path; a continuation's trials resume one checkpoint")
    return checkpoint


def one_start(run_dirs: list[Path]) -> dict:
    """The one checkpoint every continuation in `run_dirs` resumed, with its own test loss (scored
    once, beside it); refused when they resumed several."""
    starts = {start_checkpoint(path) for path in run_dirs}
    if len(starts) != 1:
        raise SomaError(f"the continuations resume {len(starts)} checkpoints ({', '.join(sorted(starts))}); "
                        "they must resume one")
    path = starts.pop()
    scores = score_checkpoint(run_dirs[0] / "config.yaml", path, Path(path).parent.parent / "start_test")
    return {"checkpoint": path, "test": scores["loss"], "bootstrap_95": scores.get("bootstrap_95")}


def table11_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Table 11 beside the paper: each allocation's test loss after the continuation, per seed and
    mean, and the start checkpoint's; each pair of allocations checked for equality within the
    margin (`EQUIVALENT_SHARE` of the continuation's gain)."""
    t7 = report["table7"]
    per_seed = t7["per_seed"]
    allocations = _allocations([str(label) for label in t7["column_labels"]])
    run_dirs = {label: [Path(folders[entry["trial"][label]][entry["seed"]]) for entry in per_seed]
                for label, _, _ in allocations}
    start = one_start([path for paths in run_dirs.values() for path in paths])
    scores = {label: [score_run(path, "test") for path in paths] for label, paths in run_dirs.items()}
    rows = [{"allocation": label, "n_pert": n_pert, "B": batch,
             "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)},
             "test": mean_sd([s["loss"] for s in scores[label]]),
             "bootstrap_95": [s["bootstrap_95"] for s in scores[label]]} for label, n_pert, batch in allocations]
    means = [row["test"]["mean"] for row in rows if row["test"]["mean"] is not None]
    gain = start["test"] - statistics.fmean(means) if means else None
    margin = max(EQUIVALENT_SHARE * gain, 0.0) if gain is not None else 0.0
    checks = []
    for index, (first, _, _) in enumerate(allocations):
        for second, _, _ in allocations[index + 1:]:
            differences = [a["loss"] - b["loss"] for a, b in zip(scores[first], scores[second], strict=True)]
            checks.append(equivalence(experiment.claims["equal"], differences,
                                      paired_document_interval(scores[first], scores[second]), margin, first=first,
                                      second=second, share=EQUIVALENT_SHARE,
                                      spread=experiment.paper["spread"]))
    return {"rows": rows, "spread": max(means) - min(means) if means else None, "checks": checks,
            "start": start,
            "gain": gain, "margin": margin, "seeds": [e["seed"] for e in per_seed]}


def table11_markdown(result: dict) -> str:
    paper = result["paper_summary"]
    lines = [f"Test loss (nats/byte) after the continuation, per seed ({', '.join(map(str, result['seeds']))}) and "
             f"mean; the paper's rows ({paper['updates']} further updates, two paired seeds, 4,096 test documents) "
             "below ours.", "",
             *table_head(["n_pert", "B", *(f"seed {s}" for s in result["seeds"]), "mean", "paper n_pert", "paper B",
                          "paper test loss"])]
    for row, theirs in zip(result["rows"], sorted(paper["rows"], key=lambda r: r["B"]), strict=False):  # by B
        lines.append(table_row([str(row["n_pert"]), str(row["B"]),
                                *(number(row["per_seed"][str(s)], 6) for s in result["seeds"]),
                                number(row["test"]["mean"], 6), str(theirs["n_pert"]), str(theirs["B"]),
                                number(theirs["test"], 6)]))
    spread, start = result["spread"], result["start"]
    apart = [c["claim"].split(" end")[0] for c in result["checks"]
             if c["document_interval"] and (c["document_interval"][0] > 0 or c["document_interval"][1] < 0)]
    sds = [row["test"]["sd"] for row in result["rows"] if row["test"]["sd"] is not None]
    lines += ["", f"Start checkpoint (`{start['checkpoint']}`): test loss {start['test']:.6f}; the continuation gained "
                  f"{number(result['gain'], 6)} nats/byte on average, so the margin of equality is "
                  f"±{result['margin']:.4f} ({EQUIVALENT_SHARE:.0%} of that gain). Spread of the means: "
                  f"{'—' if spread is None else f'{spread:.6f}'} nats/byte (paper: {paper['spread']:g}). The paper's "
                  f"spread is not the margin: it is the paper's three means after {paper['updates']} updates of "
                  f"n_pert · B = 65,536, while one allocation's seeds here differ by "
                  f"{'—' if not sds else f'{max(sds):.4f}'} (largest sd), so a margin of {paper['spread']:g} could "
                  "not be met by any run of this size whatever the allocations do.",
              "", ("Distinguishable on documents (95% interval excluding zero), though inside the margin where the "
                   "verdict says so: " + "; ".join(apart) + ".") if apart else
              "No pair is distinguishable on documents (every 95% interval reaches zero).",
              "", "The paper's statement:", "", f"- {paper['claim']}"]
    return "\n".join(lines) + "\n"


def table11_figure(result: dict, path: Path) -> Path:
    from soma_pl.reproduce.tables import rows_figure

    shown = {**result, "rows": [{**row, "row": row["allocation"]} for row in result["rows"]]}
    return rows_figure(shown, path, "test", "test loss (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale: equal multiply-adds")
