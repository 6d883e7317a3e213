"""Table 5: SOMA against BPTT at N experts, ensemble-validation loss at budgets of update time.

Each run's ensemble-validation curve against its update time (Table 3's U·Σₑ t̄ₑ: updates × the
update time calibrated alone, `soma_pl.analysis.time_basis.update_curve`) is interpolated at each
budget, as the paper's table interpolates measured losses. A run label is `<method>_n<N>`
(`soma_n2`, `bptt_n4`); SOMA N = 1 is monolithic SPSA. Checks compare seed by seed, with a document
interval from each run's validations window by window (`val_windows/`, interpolated at the budget as
the mean is); a run without them leaves its checks inconclusive (`soma_pl.reproduce.verdicts`).

Table 3 reads the same accounting (`compute.json`, `soma_pl.callbacks.compute`) of the main job's runs
under each of the paper's conventions, and checks its fixed-rate formula on the paper's own run.
"""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path

from soma_pl.analysis.time_basis import calibration, interpolate, update_curve, windows_at_seconds
from soma_pl.callbacks.compute import Tally, compute_report
from soma_pl.errors import SomaError
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import (
    number,
    save_figure,
    subplots,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import mean_sd, paired_seeds

TABLE5_FRACTIONS = (0.5, 0.75, 1.0)
"""The budgets, as fractions of the one the runs were stopped at: the paper's 50, 75 and 100 GPU-hours
(paper scale: 100 GPU-hours, sweeps/table5.yaml; cpu: 240 s of update time)."""
RUN = re.compile(r"(?P<method>soma|bptt)_n(?P<experts>\d+)$")


def _runs(labels: list[str]) -> dict[str, dict[int, str]]:
    """Method → N → run label, from labels like `soma_n2`."""
    runs: dict[str, dict[int, str]] = {}
    for label in labels:
        match = RUN.match(label)
        if match:
            runs.setdefault(match["method"], {})[int(match["experts"])] = label
    return runs


def losses_at_budgets(run_dir: Path, budgets: tuple[float, ...]) -> list[float | None]:
    """The run's ensemble-validation loss interpolated at each budget (None outside its curve)."""
    curve = [(seconds, loss) for _, loss, seconds in update_curve(run_dir)]
    return [interpolate(curve, budget) if curve and curve[0][0] <= budget <= curve[-1][0] * (1 + 1e-9) else None
            for budget in budgets]


def complete_mean_sd(values: list[float | None]) -> dict:
    """`mean` and `sd` over seeds, None unless every seed has a value."""
    found = [v for v in values if v is not None]
    return {"mean": statistics.fmean(found) if found and len(found) == len(values) else None,
            "sd": statistics.stdev(found) if len(found) > 1 and len(found) == len(values) else None}


def run_budget_seconds(folders: dict[int, dict[int, str]]) -> float:
    """The device-hour budget the runs were stopped at, in seconds (their `compute.json`): one for all."""
    limits = set()
    for runs in folders.values():
        for run in runs.values():
            path = Path(run) / "compute.json"
            budget = (json.loads(path.read_text()).get("budget") or {}) if path.is_file() else {}
            limits.add((budget.get("limits") or {}).get("device_hours"))
    if len(limits) != 1 or None in limits:
        raise SomaError(f"the runs record device_hours budgets {sorted(map(str, limits))} in their compute.json; "
                        "the budgets read off their curves are fractions of one that every run was stopped at")
    return float(f"{limits.pop() * 3600:.6g}")


def table5_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment,
                  budgets: tuple[float, ...] | None = None) -> dict:
    """Table 5 beside the paper: per N and method, each seed's loss at each budget (seconds of
    update time; default: `TABLE5_FRACTIONS` of the runs' budget), their mean and sd; checks that BPTT
    is lower at every budget and N, and that SOMA N = 2 is lower than N = 1."""
    if budgets is None:
        budgets = tuple(fraction * run_budget_seconds(folders) for fraction in TABLE5_FRACTIONS)
    t7 = report["table7"]
    runs = _runs([str(label) for label in t7["column_labels"]])
    per_seed = t7["per_seed"]
    labels = [label for by_n in runs.values() for label in by_n.values()]
    run_dirs = {label: [Path(folders[entry["trial"][label]][entry["seed"]]) for entry in per_seed] for label in labels}
    losses = {label: [losses_at_budgets(run_dir, budgets) for run_dir in run_dirs[label]] for label in labels}
    windows = {label: [windows_at_seconds(run_dir, budgets) for run_dir in run_dirs[label]] for label in labels}

    def check(claim: str, worse: str, better: str, i: int, **fields) -> dict:
        """Seed by seed `worse − better` at budget `i` where both reach it, with the document interval
        where every such seed kept its validations window by window (`paired_seeds`)."""
        def at(values: dict, label: str) -> list:
            return [seed[i] for seed in values[label]]
        return experiment.claims[claim].check(*paired_seeds(at(losses, worse), at(losses, better), at(windows, worse),
                                                            at(windows, better)), **fields)

    totals = {label: [update_curve(Path(folders[entry["trial"][label]][entry["seed"]]))[-1][2]
                      for entry in per_seed] for label in losses}
    rows = []
    for experts in sorted({n for by_n in runs.values() for n in by_n}):
        row = {"experts": experts}
        for method, by_n in runs.items():
            label = by_n.get(experts)
            if label is not None:
                row[method] = [complete_mean_sd([seed[i] for seed in losses[label]]) for i in range(len(budgets))]
        rows.append(row)
    checks = []
    for experts, soma in sorted(runs.get("soma", {}).items()):
        bptt = runs.get("bptt", {}).get(experts)
        for i, budget in enumerate(budgets if bptt else ()):
            checks.append(check("bptt_lower", soma, bptt, i, experts=experts, budget=budget))
    one, two = runs.get("soma", {}).get(1), runs.get("soma", {}).get(2)
    for i, budget in enumerate(budgets if one and two else ()):
        checks.append(check("two_below_one", one, two, i, budget=budget))
    return {"budgets_seconds": list(budgets), "rows": rows,
            "per_seed": {label: {"seeds": [e["seed"] for e in per_seed], "losses": values,
                                 "total_seconds": totals[label]} for label, values in losses.items()},
            "checks": checks, "seeds": [e["seed"] for e in per_seed]}


def _paper_row(paper: dict, experts: int, largest: int) -> str | None:
    """The paper's row beside ours: the same N, or its largest (8) beside our largest."""
    key = str(experts)
    if key in paper["soma"]:
        return key
    return "8" if experts == largest else None


def table5_markdown(result: dict) -> str:
    """Table 5's layout: N rows, SOMA and BPTT at each budget; the paper's row below ours."""
    budgets = result["budgets_seconds"]
    largest = max(row["experts"] for row in result["rows"])
    table5 = result["paper_summary"]
    lines = [f"Ensemble-validation loss (nats/byte), mean ± sd over seeds {', '.join(map(str, result['seeds']))}, "
             "interpolated at each budget on the run's curve against update time. Below each of our rows, "
             f"the paper's (Table 5: {', '.join(table5['budgets'])}; {table5['note']}).", "",
             *table_head(["N", *(f"{method} {budget:g} s" for budget in budgets for method in ("SOMA", "BPTT"))])]
    for row in result["rows"]:
        cells = []
        for i in range(len(budgets)):
            for method in ("soma", "bptt"):
                stat = row.get(method, [None] * len(budgets))[i]
                cells.append("—" if not stat or stat["mean"] is None else
                             f"{number(stat['mean'])} ± {number(stat['sd'])}")
        lines.append(table_row([str(row["experts"]), *cells]))
        paper = _paper_row(table5, row["experts"], largest)
        if paper:
            lines.append(table_row([f"paper, N = {paper}", *(number(table5[m][paper][i], 4)
                                                           for i in range(len(budgets)) for m in ("soma", "bptt"))]))
    lines += ["", "Update time each run reached when its budget stopped it (s, on the runs' basis): " + "; ".join(
        f"{label} " + ", ".join(f"{t:.0f}" for t in entry["total_seconds"])
        for label, entry in result["per_seed"].items()) + "."]
    return "\n".join(lines) + "\n"


def table5_figure(result: dict, path: Path) -> Path:
    """Ensemble-validation loss against the budget, per method and N (mean over seeds)."""
    fig, axis = subplots(figsize=(7.0, 4.0))
    budgets = result["budgets_seconds"]
    for row in result["rows"]:
        for method, style in (("soma", "-o"), ("bptt", "--s")):
            stats = row.get(method)
            if stats and all(s["mean"] is not None for s in stats):
                axis.errorbar(budgets, [s["mean"] for s in stats], yerr=[s["sd"] or 0.0 for s in stats], fmt=style,
                              capsize=3, label=f"{method.upper()} N = {row['experts']}")
    axis.set_xlabel("update time, U·Σₑ t̄ₑ (s, one thread)")
    axis.set_ylabel("ensemble-validation loss (nats/byte)")
    axis.set_title(f"{result['experiment']} at {result['scale']} scale: mean ± sd over {len(result['seeds'])} seeds")
    axis.legend(fontsize=8)
    return save_figure(fig, path)


TABLE3_ROWS = {"recorded": "Recorded expert mean times, U·Σₑ t̄ₑ (measured beside the other side)",
               "calibrated": "Updates × the update time calibrated alone (the equal-time endpoint basis)",
               "physical": "Physical total, ranks × elapsed training time"}


def table3_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """Table 3: each side's runs' update seconds under each convention (mean ± sd over seeds) and the
    physical and recorded totals over the recorded one; the fixed-rate rows checked on the paper's
    N = 256 run through the accounting's own formula (`compute_report`)."""
    sides = {}
    for per_seed in report["table7"]["per_seed"]:
        for label, trial in per_seed["trial"].items():
            run = Path(folders[trial][per_seed["seed"]])
            compute, rate = json.loads((run / "compute.json").read_text()), calibration(run)
            if rate is None:
                raise SomaError(f"{run}: ran without a calibrated update time (budget.seconds_per_update in its "
                                "compute.json); Table 3 compares the recorded time with it")
            seconds = {"recorded": compute["aggregate_device_hours"] * 3600, "calibrated": compute["updates"] * rate,
                       "physical": compute["physical_device_hours"] * 3600}
            sides.setdefault(label, []).append({**seconds, "updates": compute["updates"],
                                                "experts": compute["experts"]})
    rows = {label: {key: mean_sd([run[key] for run in runs]) for key in (*TABLE3_ROWS, "updates")}
            | {"experts": runs[0]["experts"],
               "physical_over_recorded": mean_sd([run["physical"] / run["recorded"] for run in runs]),
               "recorded_over_calibrated": mean_sd([run["recorded"] / run["calibrated"] for run in runs])}
            for label, runs in sides.items()}
    paper = experiment.paper
    rates = sorted((float(key.split("_")[1]) for key in paper["gpu_hours"] if key.startswith("fixed_")), reverse=True)
    theirs = compute_report([Tally(updates=paper["updates"], experts=paper["experts"])], 0.0, rates)
    checks = [experiment.claims["fixed_rate"].check_count(round(rate.device_hours),
                                                          paper["gpu_hours"][f"fixed_{rate.seconds_per_expert_update:.3f}"],
                                                          seconds=f"{rate.seconds_per_expert_update:.3f}")
              for rate in theirs.fixed_rate]
    return {"rows": rows, "checks": checks,
            "paper_ratio": paper["gpu_hours"]["physical"] / paper["gpu_hours"]["recorded"]}


def table3_markdown(result: dict) -> str:
    """Table 3's rows for each side of the main job, the paper's N = 256 run beside them."""
    labels = list(result["rows"])
    names = {label: f"N = {result['rows'][label]['experts']}" for label in labels}
    paper = result["paper_summary"]["gpu_hours"]
    lines = ["Update seconds of each side's runs (mean ± sd over seeds); the paper's GPU-hours for "
             "its N = 256 checkpoint.", "",
             *table_head(["Accounting method", *(names[label] for label in labels), "Paper (GPU-hours)"])]
    for key, text in TABLE3_ROWS.items():
        cells = [f"{number(result['rows'][label][key]['mean'], 1)} ± {number(result['rows'][label][key]['sd'], 1)}"
                 for label in labels]
        lines.append(table_row([text, *cells, f"{paper[key] / 1e3:.3g}k" if key in paper else "—"]))
    for key, value in paper.items():
        if key.startswith("fixed_"):
            lines.append(table_row([f"Fixed {key.split('_')[1]} s per expert update, E·U·r", *(["—"] * len(labels)),
                                    f"{value / 1e3:.3g}k"]))
    ratio = {label: result["rows"][label]["physical_over_recorded"]["mean"] for label in labels}
    lines += ["", "Physical total over recorded: " + ", ".join(f"{names[label]} {ratio[label]:.3f}" for label in labels)
              + f" (paper {result['paper_ratio']:.3f}); recorded over calibrated (the fits' other work and warm-up): "
              + ", ".join(f"{names[label]} {result['rows'][label]['recorded_over_calibrated']['mean']:.3f}"
                          for label in labels) + ". The fixed-rate conventions have no CPU rate of their own; they "
              "are checked on the paper's run."]
    return "\n".join(lines) + "\n"
