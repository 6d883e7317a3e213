"""Tables 6 → 7: each seed's learning rate selected on ensemble validation for monolithic SPSA and
SOMA N = 2, every trial at one budget of update time (calibrated alone), the selected runs tested
(on the test split, and once on the final test split). The main job (`demo`) is the same comparison
at one learning rate per side, the selection's, with each side's validation curves drawn against
updates and update time."""

from __future__ import annotations

from pathlib import Path

from soma_pl.analysis.time_basis import update_curve
from soma_pl.reproduce.comparisons import compare_selected
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import (
    grid_edge_note,
    interval_text,
    number,
    save_figure,
    subplots,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import mean_sd
from soma_pl.sweeps.report import table6_lines


def table7_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Table 7 beside the paper: per seed, the selected runs' test losses and SPSA − SOMA, on the test
    split and on the final split, and the declared comparison (SOMA below SPSA) checked on each."""
    t7 = report["table7"]
    base, other = str(t7["baseline"]), next(str(c) for c in t7["column_labels"] if str(c) != str(t7["baseline"]))
    per_seed = t7["per_seed"]
    rows = []
    for index, entry in enumerate(per_seed):
        paper = {key: experiment.paper[key][index] for key in ("spsa", "soma", "difference")} \
            if index < len(experiment.paper["seeds"]) else {}
        rows.append({"seed": entry["seed"], "ours": {"spsa": entry["test"][base], "soma": entry["test"][other],
                                                     "difference": entry["difference"][other]},
                     "paper": paper, "selected": entry["selected"], "at_grid_edge": entry["at_grid_edge"]})
    summary = {key: mean_sd([row["ours"][key] for row in rows]) for key in ("spsa", "soma", "difference")}
    scores, checks = compare_selected(report, folders, experiment)
    blocks = {}
    for split, label in (("test", "test split"), ("final", "final test split (used once)")):
        if split not in scores:
            continue
        spsa, soma = scores[split][base], scores[split][other]
        differences = [a["loss"] - b["loss"] for a, b in zip(spsa, soma, strict=True)]
        blocks[split] = {"label": label, "per_seed": [{"seed": e["seed"], "spsa": a["loss"], "soma": b["loss"],
                                                       "difference": d, "spsa_95": a["bootstrap_95"],
                                                       "soma_95": b["bootstrap_95"]}
                                                      for e, a, b, d in zip(per_seed, spsa, soma, differences,
                                                                            strict=True)],
                         **{key: mean_sd(values) for key, values in
                            (("spsa", [a["loss"] for a in spsa]), ("soma", [b["loss"] for b in soma]),
                             ("difference", differences))}}
    return {"labels": {"spsa": base, "soma": other}, "rows": rows, "summary": summary, "table6": report["table6"],
            "blocks": blocks,
            "checks": checks,
            "at_grid_edge": t7["at_grid_edge"]}


TABLE7_INTRO = ("Test loss after each seed's selection on ensemble validation (nats/byte); difference = monolithic "
                "SPSA − SOMA. Paper: its Table 7 (seeds 1–3).")
MAIN_JOB_INTRO = ("Test loss of each seed's run at the learning rate seed 0 of the demo's Table 6 selection chose "
                  "for its side (nats/byte); difference = monolithic SPSA − SOMA. Paper: its Table 7 (seeds 1–3), "
                  "the same comparison at 8.44M parameters.")


def table7_markdown(result: dict, intro: str = TABLE7_INTRO, table6: bool = True) -> str:
    """Table 7's layout for the demo pair: each seed's selected test losses, ours beside the paper's,
    and (`table6`) the grid they were selected from."""
    lines = [intro, "",
             *table_head(["Optimization seed", "SPSA (ours)", "SOMA N = 2 (ours)", "Difference (ours)",
                     "SPSA (paper)", "SOMA N = 2 (paper)", "Difference (paper)"])]
    for row in result["rows"]:
        edge = {side: "†" if row["at_grid_edge"].get(label) else "" for side, label in result["labels"].items()}
        lines.append(table_row([str(row["seed"]), number(row["ours"]["spsa"]) + edge["spsa"],
                           number(row["ours"]["soma"]) + edge["soma"], number(row["ours"]["difference"]),
                           *(number(row["paper"].get(k)) for k in ("spsa", "soma", "difference"))]))
    for name, key in (("Mean", "mean"), ("Sample standard deviation", "sd")):
        ours = [result["summary"][k][key] for k in ("spsa", "soma", "difference")]
        paper = [result["paper_summary"][key][k] for k in ("spsa", "soma", "difference")]
        lines.append(table_row([name, *map(number, ours), *map(number, paper)]))
    lines += grid_edge_note({side.upper(): result["at_grid_edge"].get(label)
                             for side, label in result["labels"].items()})
    if table6 and result.get("table6"):
        lines += ["", "## Table 6: ensemble validation per setting", "",
                  "Each side's grid (its ensemble-validation loss, mean ± sample standard deviation over seeds, "
                  "nats/byte), from which each seed's setting above was selected. The paper's Table 6 entries are not "
                  "in the text this reproduction was built from, so none stand beside them.", "",
                  *table6_lines(result["table6"])]
    for block in result["blocks"].values():
        lines += ["", f"## {block['label']}", ""]
        lines += table_head(["Optimization seed", "SPSA (95% documents)", "SOMA N = 2 (95% documents)", "Difference"])
        for entry in block["per_seed"]:
            lines.append(table_row([str(entry["seed"]),
                                    f"{number(entry['spsa'])} {interval_text(entry['spsa_95'], False)}",
                                    f"{number(entry['soma'])} {interval_text(entry['soma_95'], False)}",
                                    number(entry["difference"])]))
        lines.append(table_row(["Mean ± sd", *(f"{number(block[k]['mean'])} ± {number(block[k]['sd'])}"
                                          for k in ("spsa", "soma", "difference"))]))
    return "\n".join(lines) + "\n"


def table7_figure(result: dict, path: Path) -> Path:
    """Each check's per-seed differences, their mean and 95% seed interval, beside the paper's."""
    blocks = list(result["blocks"].items())
    fig, axis = subplots(figsize=(7.5, 3.8))
    paper = result["paper_summary"]
    axis.axhspan(paper["mean"]["difference"] - paper["sd"]["difference"],
                 paper["mean"]["difference"] + paper["sd"]["difference"], color="tab:green", alpha=0.15)
    axis.axhline(paper["mean"]["difference"], color="tab:green", label="paper, Table 7 (mean ± sd)")
    axis.axhline(0.0, color="black", linewidth=0.8)
    for x, (key, block) in enumerate(blocks):
        values = [entry["difference"] for entry in block["per_seed"]]
        axis.scatter([x] * len(values), values, color="tab:blue", zorder=3, label="ours, per seed" if x == 0 else None)
        check = next((c for c in result["checks"] if c["split"] == key), None)
        if check and check["seed_interval"]:
            low, high = check["seed_interval"]
            axis.errorbar([x + 0.12], [check["mean"]], yerr=[[check["mean"] - low], [high - check["mean"]]],
                          fmt="o", color="tab:red", capsize=4, label="ours, mean (95% over seeds)" if x == 0 else None)
    axis.set_xticks(range(len(blocks)), [block["label"].replace(" (used once)", "\n(used once)")
                                         for _, block in blocks], fontsize=8)
    axis.set_ylabel("SPSA − SOMA (nats/byte)")
    axis.set_title(f"{result['experiment']} at {result['scale']} scale")
    axis.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def main_job_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Table 7's result of the main job's runs, with each side's ensemble-validation curve per seed
    (`[update, loss, update time]`, the time calibrated alone) for its figure."""
    result = table7_result(report, folders, experiment)
    runs = {side: [Path(folders[entry["trial"][label]][entry["seed"]]) for entry in report["table7"]["per_seed"]]
            for side, label in result["labels"].items()}
    result["curves"] = {side: [[list(point) for point in update_curve(run)] for run in side_runs]
                        for side, side_runs in runs.items()}
    return result


def main_job_markdown(result: dict) -> str:
    """Table 7's layout at one learning rate per side."""
    return table7_markdown(result, MAIN_JOB_INTRO, table6=False)


def main_job_figure(result: dict, path: Path) -> Path:
    """Each side's ensemble-validation curves (one line per seed) against updates and against update
    time (updates × the update time calibrated alone)."""
    fig, axes = subplots(1, 2, figsize=(11, 3.8), sharey=True)
    names = {"spsa": "monolithic SPSA", "soma": "SOMA N = 2"}
    for index, (side, curves) in enumerate(result["curves"].items()):
        for seed, curve in enumerate(curves):
            updates, losses, seconds = zip(*curve, strict=True)
            for axis, x in zip(axes, (updates, [s / 60 for s in seconds]), strict=True):
                axis.plot(x, losses, "-o", markersize=2, color=f"C{index}", alpha=0.9 if seed == 0 else 0.4,
                          label=names[side] if seed == 0 else None)
    for axis, label in zip(axes, ("updates", "update time U·Σₑ t̄ₑ, calibrated alone (minutes)"), strict=True):
        axis.set_xlabel(label)
        axis.grid(alpha=0.3)
    axes[0].set_ylabel("ensemble-validation loss (nats/byte)")
    axes[0].legend()
    fig.suptitle(f"The main job at {result['scale']} scale: one line per seed")
    return save_figure(fig, path)
