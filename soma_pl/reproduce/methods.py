"""Table 4: the methods at one equal budget of update time, test loss at the end.

Each row is a sweep column (`soma_n2`, `spsa_<n_pert>`, `eggroll`, `ddpp`) run per seed until its
budget of aggregate update time (Table 3's U·Σₑ t̄ₑ, every expert and rank counted) is spent, at each
learning rate of the sweep's grid; each seed's run of lowest ensemble-validation loss is selected,
and its trial's own test of the last checkpoint gives the test loss and the per-window losses that
pair it with SOMA's on the same windows. The claim, SOMA N = 2 has the lowest test loss, is declared
in experiments/table4.yaml as a comparison with every other row
(`soma_pl.reproduce.comparisons`); with `final_test`, it is checked again on the final test split,
which the selected runs (and only those) are scored on once.
"""

from __future__ import annotations

import json
from pathlib import Path

from soma_pl.analysis.time_basis import calibration, update_curve
from soma_pl.reproduce.budgets import complete_mean_sd, losses_at_budgets, run_budget_seconds
from soma_pl.reproduce.comparisons import EXTERNAL_TEXT, compare_selected
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import (
    grid_edge_note,
    interval_text,
    number,
    rows_figure,
    save_figure,
    selected_text,
    subplots,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import mean_sd

FIG1_FRACTIONS = (0.25, 0.5, 0.75, 1.0)
"""Fig. 1's budgets, as fractions of the one every run was stopped at: each row's ensemble-validation
loss read off its selected runs' curves there (the paper's curve over aggregate GPU-hours)."""
PAPER_ROW = {"spsa_64": "spsa_32", "spsa_256": "spsa_128", "spsa_1024": "spsa_512"}
"""A paper-scale row (sweeps/table4.yaml names the paper's n_pert) → the key of the paper's numbers."""


def _compute(run_dir: Path) -> dict:
    """The run's updates, aggregate update seconds on its basis (updates × its calibrated update time
    where it has one, else measured), the measured ones and the physical ones (its `compute.json`)."""
    report = json.loads((run_dir / "compute.json").read_text())
    measured = report["aggregate_device_hours"] * 3600
    rate = calibration(run_dir)
    return {"updates": report["updates"], "seconds": measured if rate is None else report["updates"] * rate,
            "measured_seconds": measured, "physical_seconds": report["physical_device_hours"] * 3600}


def table4_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Table 4 beside the paper: per row, each seed's test loss (with its 95% document interval),
    updates and compute (calibrated and measured); the declared comparisons (SOMA N = 2 against every
    other row) checked."""
    t7 = report["table7"]
    labels = [str(label) for label in t7["column_labels"]]
    per_seed = t7["per_seed"]
    all_scores, checks = compare_selected(report, folders, experiment)
    scores = all_scores["test"]
    compute = {label: [_compute(Path(folders[entry["trial"][label]][entry["seed"]])) for entry in per_seed]
               for label in labels}
    rows = []
    for label in labels:
        rows.append({"row": label, "configuration": experiment.names.get(label, label),
                     "test": mean_sd([s["loss"] for s in scores[label]]),
                     "test_95": [s["bootstrap_95"] for s in scores[label]],
                     "updates": mean_sd([c["updates"] for c in compute[label]]),
                     "seconds": mean_sd([c["seconds"] for c in compute[label]]),
                     "measured_seconds": mean_sd([c["measured_seconds"] for c in compute[label]]),
                     "physical_seconds": mean_sd([c["physical_seconds"] for c in compute[label]]),
                     "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)},
                     "selected": [(e.get("selected") or {}).get(label) for e in per_seed],
                     "at_grid_edge": (t7.get("at_grid_edge") or {}).get(label) or [],
                     "paper": experiment.paper.get(PAPER_ROW.get(label, label))})
    budgets = [fraction * run_budget_seconds(folders) for fraction in FIG1_FRACTIONS]
    for row in rows:
        runs = [Path(folders[e["trial"][row["row"]]][e["seed"]]) for e in per_seed]
        row["fig1"] = [complete_mean_sd(values) for values in zip(*(losses_at_budgets(run, budgets) for run in runs),
                                                                   strict=True)]
        row["curves"] = [[[seconds, loss] for _, loss, seconds in update_curve(run)] for run in runs]
    if "final" in all_scores:
        for row in rows:
            row["final"] = mean_sd([s["loss"] for s in all_scores["final"][row["row"]]])
    return {"rows": rows, "checks": checks, "seeds": [e["seed"] for e in per_seed], "fig1_budgets": budgets}


def table4_markdown(result: dict) -> str:
    """Table 4's layout: configuration, n_pert, updates, compute and test loss; the paper's beside."""
    lines = [f"Mean ± sd over seeds {', '.join(map(str, result['seeds']))}; each seed's 95% document interval "
             "follows. Updates are per expert for SOMA; seconds are Table 3's aggregate update time (every expert "
             "and rank counted: updates × the update time calibrated alone where the sweep calibrates), the "
             "measured one beside it, and the physical total (ranks × training wall time). Paper: Table 4 (~150 "
             "aggregate GPU-hours, 8.44M parameters).", "",
             *table_head(["Row", "Configuration", "Selected, per seed", "Updates", "Update time (s)", "Measured (s)",
                          "Physical (s)", "Test loss", "95% documents, per seed", "Final test loss (used once)",
                          "Paper: n_pert", "updates", "GPU-hours", "test loss"])]
    for row in result["rows"]:
        paper, final = row["paper"] or {}, row.get("final")
        lines.append(table_row([row["row"] + ("†" if row.get("at_grid_edge") else ""), row["configuration"],
                                selected_text(row.get("selected") or []), f"{row['updates']['mean']:.0f}",
                                f"{row['seconds']['mean']:.0f}", f"{row['measured_seconds']['mean']:.0f}",
                                f"{row['physical_seconds']['mean']:.0f}",
                                f"{number(row['test']['mean'])} ± {number(row['test']['sd'])}",
                                " ".join(interval_text(i, False) for i in row["test_95"]),
                                f"{number(final['mean'])} ± {number(final['sd'])}" if final else "—",
                                str(paper.get("n_pert") or "—"), str(paper.get("updates", "—")),
                                str(paper.get("gpu_hours", "—")), number(paper.get("test"), 2)]))
    lines += grid_edge_note({row["row"]: row.get("at_grid_edge") for row in result["rows"]})
    lines += ["", "## Fig. 1: ensemble validation over budgets of update time", "",
              "Each row's selected runs read off their curves (mean ± sd over seeds; — where a seed's curve does "
              "not reach the budget: its first validation comes later, or it stopped just before).", "",
              *table_head(["Row", *(f"{budget:.0f} s" for budget in result["fig1_budgets"])])]
    lines += [table_row([row["row"], *("—" if point["mean"] is None else
                                       f"{number(point['mean'])} ± {number(point['sd'])}" for point in row["fig1"])])
              for row in result["rows"]]
    return "\n".join(lines) + "\n"


def table4_figure(result: dict, path: Path) -> Path:
    """Fig. 1: each row's ensemble-validation curves over update time (one line per seed)."""
    fig, axis = subplots(figsize=(7.5, 4.2))
    for index, row in enumerate(result["rows"]):
        for seed, curve in enumerate(row["curves"]):
            axis.plot(*zip(*curve, strict=True), "-o", markersize=2, color=f"C{index}", alpha=0.9 if seed == 0 else 0.4,
                      label=row["row"] if seed == 0 else None)
    axis.set_xlabel("aggregate update time, U·Σₑ t̄ₑ (s, one thread)")
    axis.set_ylabel("ensemble-validation loss (nats/byte)")
    axis.set_title(f"{result['experiment']} at {result['scale']} scale (Fig. 1): equal update time", fontsize=9)
    axis.legend(fontsize=7)
    return save_figure(fig, path)


def table9_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment,
                  text: str = EXTERNAL_TEXT) -> dict:
    """Table 9 beside the paper: Table 4's last checkpoints (chosen by its protocol, before any
    external score exists) evaluated frozen on the external text; the declared comparisons (SOMA
    N = 2 against every other row) checked there."""
    per_seed = report["table7"]["per_seed"]
    all_scores, checks = compare_selected(report, folders, experiment, text)
    scores = all_scores["external"]
    first = next(iter(scores.values()))[0] if scores and per_seed else {}
    rows = [{"row": label, "configuration": experiment.names.get(label, label),
             "external": mean_sd([s["loss"] for s in scores[label]]),
             "external_95": [s["bootstrap_95"] for s in scores[label]],
             "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[label], strict=True)},
             "paper": experiment.paper.get(PAPER_ROW.get(label, label))} for label in scores]
    return {"rows": rows, "checks": checks, "seeds": [e["seed"] for e in per_seed],
            "text": {key: first.get(key) for key in ("text", "documents", "documents_scored", "windows", "bytes")}}


def table9_markdown(result: dict) -> str:
    """Table 9's layout: each checkpoint's frozen loss on the external text; the paper's beside."""
    text = result["text"]
    lines = [f"Frozen next-byte loss (nats/byte) on `{text['text']}` ({text['documents']} documents, "
             f"{text['windows']} windows of 1,025 bytes from {text['documents_scored']} of them), routed on 256 bytes "
             f"and scored on the next 768 as in Table 1; mean ± sd over seeds {', '.join(map(str, result['seeds']))} "
             "and each seed's 95% document interval. Paper: Table 9 (WikiText-103).", "",
             *table_head(["Row", "Configuration", "External text", "95% documents, per seed",
                          "Paper: validation", "Paper: test"])]
    for row in result["rows"]:
        paper = row["paper"] or {}
        lines.append(table_row([row["row"], row["configuration"],
                                f"{number(row['external']['mean'])} ± {number(row['external']['sd'])}",
                                " ".join(interval_text(i, False) for i in row["external_95"]),
                                number(paper.get("validation"), 3), number(paper.get("test"), 3)]))
    return "\n".join(lines) + "\n"


def table9_figure(result: dict, path: Path) -> Path:
    """Each checkpoint's frozen external loss per seed and mean."""
    return rows_figure(result, path, "external", "frozen loss on the external text (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale: {Path(result['text']['text'] or '').name}")
