"""Fig. 9: what SOMA's ingredients are worth (semantic shards, warm start, how the tied head trains).

Each condition changes one thing against the reference (semantic shards, warm start from the seed
model, each expert's head trained); every condition runs the same updates of the same arithmetic
(the figure's basis: training steps). The figure draws ensemble-validation loss at the validated
steps, mean and standard error over seeds; each claim is checked on the test split at the last step,
`condition − reference` per seed, with the paired document interval over the test windows.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from soma_pl.analysis.time_basis import measured_curve
from soma_pl.config_files import read_yaml
from soma_pl.reproduce.comparisons import compare_selected
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import (
    grid_edge_note,
    number,
    save_figure,
    selected_text,
    subplots,
    table_head,
    table_row,
)

REFERENCE = "reference"
"""The condition every other one is compared with."""


def _mean_se(values: list[float]) -> dict:
    """Mean and standard error of the mean (None below two values)."""
    return {"mean": statistics.fmean(values),
            "se": statistics.stdev(values) / len(values) ** 0.5 if len(values) > 1 else None}


def seed_model(run_dir: Path) -> dict | None:
    """The seed model a warm run started from: its checkpoint, steps and the ensemble-validation loss
    its own fit recorded there (every expert a copy of it, so the warm curves' value at update 0);
    None for a cold run, or when the seed's fit summary is gone."""
    config = run_dir / "config.yaml"
    arguments = ((read_yaml(config, "run config").get("model") or {}).get("init_args") or {}) if config.is_file() \
        else {}
    checkpoint = arguments.get("seed_checkpoint")
    if arguments.get("init") != "seed" or not checkpoint:
        return None
    path = Path(checkpoint).resolve()
    for summary in sorted(path.parent.parent.glob("version_*/summary.json")):
        record = json.loads(summary.read_text())
        if record.get("last_checkpoint") and Path(record["last_checkpoint"]).resolve() == path:
            return {"checkpoint": checkpoint, "steps": record["global_step"], "method": record.get("method"),
                    "val_loss": record["metrics"].get("val/loss")}
    return None


def _curves(per_seed: list[dict], folders: dict[int, dict[int, str]], labels: list[str]) -> dict:
    """Condition → the validated steps and the ensemble-validation loss's mean and standard error
    over seeds at each (steps that every seed's run validated)."""
    curves = {}
    for label in labels:
        runs = [{step: loss for step, loss, _ in measured_curve(Path(folders[entry["trial"][label]][entry["seed"]]))}
                for entry in per_seed]
        steps = sorted(set.intersection(*(set(run) for run in runs)))
        points = [_mean_se([run[step] for run in runs]) for step in steps]
        curves[label] = {"steps": steps, "mean": [p["mean"] for p in points], "se": [p["se"] for p in points]}
    return curves


def fig9_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Fig. 9 beside the paper: the curves, each condition's last-step losses and its difference from
    the reference, and its declared comparisons checked (each condition against the reference)."""
    t7 = report["table7"]
    labels = [str(label) for label in t7["column_labels"]]
    per_seed = t7["per_seed"]
    scores, checks = compare_selected(report, folders, experiment)
    rows = []
    for label in labels:
        test = [s["loss"] for s in scores["test"][label]]
        row = {"condition": label, "val": _mean_se([entry["val"][label] for entry in per_seed]),
               "selected": [(entry.get("selected") or {}).get(label) for entry in per_seed],
               "at_grid_edge": (t7.get("at_grid_edge") or {}).get(label) or [],
               "test": _mean_se(test), "per_seed": {str(e["seed"]): t for e, t in zip(per_seed, test, strict=True)}}
        if label != REFERENCE:
            row["difference"] = _mean_se([t - s["loss"] for t, s in zip(test, scores["test"][REFERENCE], strict=True)])
            row["paper_difference"] = experiment.paper.get(label)
        if "final" in scores:
            row["final"] = _mean_se([s["loss"] for s in scores["final"][label]])
        rows.append(row)
    reference_run = Path(folders[per_seed[0]["trial"][REFERENCE]][per_seed[0]["seed"]]) if per_seed else None
    return {"conditions": labels, "reference": REFERENCE, "rows": rows, "curves": _curves(per_seed, folders, labels),
            "checks": checks, "seed_model": seed_model(reference_run) if reference_run else None,
            "seeds": [entry["seed"] for entry in per_seed]}


def fig9_markdown(result: dict) -> str:
    """Fig. 9 as a table: each condition's last-step losses and its difference from the reference."""
    steps = result["curves"][result["reference"]]["steps"]
    lines = [f"Mean ± standard error over seeds {', '.join(map(str, result['seeds']))} (nats/byte): ensemble "
             f"validation at update {steps[-1] if steps else '—'}, test split at the end, and each condition's test "
             "loss minus the reference's (paired by seed). Paper: Fig. 9.", "",
             *table_head(["Condition", "Selected, per seed", "Ensemble validation", "Test", "Test − reference (ours)",
                          "Final test (used once)", "Paper"])]
    for row in result["rows"]:
        difference, final = row.get("difference"), row.get("final")
        shown = f"{number(difference['mean'], sign=True)} ± {number(difference['se'])}" if difference else "—"
        paper = number(row.get("paper_difference"), 3, sign=True) if row.get("paper_difference") is not None else \
            ("—" if row["condition"] == result["reference"] else "higher (figure)")
        lines.append(table_row([row["condition"] + ("†" if row.get("at_grid_edge") else ""),
                                selected_text(row.get("selected") or []),
                                f"{number(row['val']['mean'])} ± {number(row['val']['se'])}",
                           f"{number(row['test']['mean'])} ± {number(row['test']['se'])}", shown,
                           f"{number(final['mean'])} ± {number(final['se'])}" if final else "—",
                           paper]))
    lines += grid_edge_note({row["condition"]: row.get("at_grid_edge") for row in result["rows"]})
    seed = result.get("seed_model")
    if seed and seed["val_loss"] is not None:
        lines += ["", f"Every warm condition starts from the seed model (`{seed['checkpoint']}`, {seed['steps']} "
                      f"updates of {seed.get('method') or 'its method'}), whose ensemble-validation loss is "
                      f"{number(seed['val_loss'])}: the warm curves' value at update 0."]
    lines += ["", "## Ensemble validation at the figure's steps", "",
              *table_head(["Condition", *(f"update {step}" for step in steps)])]
    for label, curve in result["curves"].items():
        lines.append(table_row([label, *(f"{number(m)} ± {number(s)}" for m, s in zip(curve["mean"], curve["se"],
                                                                              strict=True))]))
    return "\n".join(lines) + "\n"


def fig9_figure(result: dict, path: Path) -> Path:
    """Ensemble-validation loss against training steps per condition, mean ± standard error."""
    fig, axis = subplots(figsize=(7.0, 4.0))
    for label, curve in result["curves"].items():
        se = [s or 0.0 for s in curve["se"]]
        axis.errorbar(curve["steps"], curve["mean"], yerr=se, marker="o", capsize=3, label=label)
    seed = result.get("seed_model")
    if seed and seed["val_loss"] is not None:
        axis.axhline(seed["val_loss"], color="grey", linestyle=":", label="seed model (warm start, update 0)")
    axis.set_xlabel("training step (update)")
    axis.set_ylabel("ensemble-validation loss (nats/byte)")
    axis.set_title(f"{result['experiment']} at {result['scale']} scale: mean ± s.e. over {len(result['seeds'])} seeds")
    axis.legend(fontsize=8)
    return save_figure(fig, path)
