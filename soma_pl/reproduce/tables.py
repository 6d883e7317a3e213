"""An experiment's result as markdown (the paper's layout, the paper's numbers beside ours) and as
a figure, and `docs/reproduction.md` drawn from every saved result."""

from __future__ import annotations

import io
import json
import os
from pathlib import Path

from soma_pl.distributed import Accounting
from soma_pl.errors import ConfigError
from soma_pl.io import check_apart, write_atomic


def number(value: float | None, digits: int = 4, sign: bool = False) -> str:
    if value is None:
        return "—"
    return f"{value:+.{digits}f}" if sign else f"{value:.{digits}f}"


def table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cells) + " |"


def table_head(cells: list[str]) -> list[str]:
    return [table_row(cells), "|" + "---|" * len(cells)]


def interval_text(values: list[float] | tuple[float, float] | None, sign: bool = True) -> str:
    """`[low, high]`; signed for differences."""
    return "—" if values is None else f"[{number(values[0], sign=sign)}, {number(values[1], sign=sign)}]"


def heading(result: dict) -> list[str]:
    """The first lines of every experiment's table: its name, scale and title, then its compute basis."""
    return [f"# {result['experiment']} ({result['scale']} scale): {result['title']}", "",
            f"Equal compute: {result['basis']}.", ""]


def checks_table(checks: list[dict]) -> list[str]:
    """One line per claim: its verdict, mean difference, the two 95% intervals and its p-value after
    Holm's adjustment over the experiment's claims (`soma_pl.reproduce.verdicts.family`)."""
    lines = table_head(["Claim", "Verdict", "Mean difference", "Over", "95% over them", "95% over documents",
                        "p (Holm)"])
    for check in checks:
        digits = 0 if check.get("over") == "exact count" else 4
        lines.append(table_row([check["claim"], f"**{check['verdict']}**", number(check["mean"], digits, sign=True),
                           f"{check['seeds']} {check.get('over', 'seeds')}", interval_text(check["seed_interval"]),
                           interval_text(check["document_interval"]), holm_text(check)]))
    return lines


def evidence_text(check: dict) -> str:
    """What decided a check, in one cell: the mean difference and its intervals (over seeds and
    documents, or over direction draws), or an exact count's rule."""
    over = check.get("over", "seeds")
    if over == "exact count":
        return check["why"]
    text = f"{number(check['mean'], sign=True)} {interval_text(check['seed_interval'])} over {check['seeds']} {over}"
    return text + (f", {interval_text(check['document_interval'])} over documents" if over == "seeds" else "")


def selected_text(selected: list[dict | None]) -> str:
    """Each seed's selected setting (`lr=0.005`), or — where the sweep selects nothing."""
    shown = [", ".join(f"{key}={value:g}" if isinstance(value, float) else f"{key}={value}"
                       for key, value in chosen.items()) for chosen in selected if chosen]
    return "; ".join(shown) or "—"


def grid_edge_note(edges: dict[str, list[str]]) -> list[str]:
    """A footnote to the rows marked † (label → the factors selected at an edge of their grid)."""
    edges = {label: names for label, names in edges.items() if names}
    return ["", "† Selected at an edge of its grid (" + "; ".join(
        f"{label}: {', '.join(names)}" for label, names in edges.items()) + "): the best setting may lie outside "
            "the grid."] if edges else []


def holm_text(check: dict) -> str:
    """A check's p-value after Holm's adjustment, or — where it has none."""
    p = check.get("holm_p")
    return "—" if p is None else f"{p:.3g}" if p >= 1e-12 else "< 1e-12"


def run_footer(result: dict) -> str:
    """The closing line of every experiment's table: wall time, workers, load average, trial time, trial states."""
    workers = result.get("workers")
    line = f"This run: {result['wall_seconds']:.0f} s"
    if workers:
        line += f" on {workers} worker{'s' if workers > 1 else ''} (one thread per process)"
    line += (f" (finished trials reused), load average {result['load_average'][0]:.2f} before, "
             f"{result['load_average'][1]:.2f} after")
    if "trial_minutes" in result:
        line += f"; the study's trials took {result['trial_minutes']:.0f} minutes in all (summed over trials)"
    if "sweep_wall_seconds" in result:
        line += f", {result['sweep_wall_seconds']:.0f} s of wall time while any ran (the sweep's own, kept on a rerun)"
    if "trials" in result:
        line += ". Trials: " + ", ".join(f"{k} {v}" for k, v in sorted(result["trials"].items()))
    if result.get("accounting"):
        line += ". Compute accounting of the runs: " + "; ".join(
            f"{count} with {Accounting(kind).meaning}" for kind, count in result["accounting"].items())
    return line + "." + calibration_text(result)


def commands_footer(result: dict) -> str:
    """The closing line of a measurement's table: its commands and what each took when it ran (a
    rerun reuses finished ones), this run's wall time and load average."""
    took = result.get("command_seconds")
    commands = "; ".join(f"`{c}`" + ("" if took is None else f" ({s:.0f} s)")
                         for c, s in zip(result["commands"], took or [None] * len(result["commands"]), strict=True))
    return (f"This run: {result['wall_seconds']:.0f} s (finished commands reused), load average "
            f"{result['load_average'][0]:.2f} before, {result['load_average'][1]:.2f} after; {commands}.")


def calibration_text(result: dict) -> str:
    """The update times the result's time basis rests on (calibrated alone), and how far the runs'
    measured times strayed from them; empty for a result whose sweep does not calibrate."""
    points = result.get("calibration")
    if not points:
        return ""
    first = next(iter(points.values()))
    times = "; ".join(f"{', '.join(f'{k} = {v}' for k, v in json.loads(key).items()) or 'every run'}: "
                      f"{entry['seconds_per_update']:.4g} s" for key, entry in points.items())
    text = (f" Update time calibrated alone ({first['threads']} thread per process, {first['updates']} updates "
            f"timed after {first['warmup']}), per update: {times}.")
    spread = result.get("measured_over_calibrated")
    if spread:
        text += (f" The runs' measured update time over their calibrated one: {spread['mean']:.2f} on average "
                 f"({spread['min']:.2f}–{spread['max']:.2f}, {spread['runs']} runs).")
    return text


def subplots(*grid: int, **options):
    """`matplotlib.pyplot.subplots` on the file-only Agg backend (matplotlib is imported on a
    figure's first use: a result without a figure never loads it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(*grid, **options)


def rows_figure(result: dict, path: Path, key: str, ylabel: str, title: str) -> Path:
    """Each row's score per seed and its mean ± sd (`key`: the score's field in a row)."""
    fig, axis = subplots(figsize=(7.5, 3.8))
    for x, row in enumerate(result["rows"]):
        values = list(row["per_seed"].values())
        axis.scatter([x] * len(values), values, color="tab:blue", zorder=3, label="ours, per seed" if x == 0 else None)
        axis.errorbar([x + 0.1], [row[key]["mean"]], yerr=[row[key]["sd"] or 0.0], fmt="o", color="tab:red",
                      capsize=4, label="ours, mean ± sd" if x == 0 else None)
    axis.set_xticks(range(len(result["rows"])), [row["row"] for row in result["rows"]], fontsize=8)
    axis.set_ylabel(ylabel)
    axis.set_title(title)
    axis.legend(fontsize=7, loc="best")
    return save_figure(fig, path)


def save_figure(fig, path: Path) -> Path:
    """Lay out and write a matplotlib figure atomically (temporary file, then rename), then close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=110)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(buffer.getvalue(), path)
    return path


def reproduction_page(results: Path, page: Path) -> str:
    """`docs/reproduction.md`: one row per claim of every saved result, then each result's table."""
    found = sorted(results.glob("*/result.json"))
    if not found:
        raise ConfigError(f"reproduce docs: no {results}/*/result.json yet; run `python -m soma_pl.cli reproduce "
                          "<experiment>` first")
    saved = [json.loads(path.read_text()) for path in found]
    lines = ["# The paper's experiments at CPU scale", "",
             "Generated by `python -m soma_pl.cli reproduce docs` from `results/*/result.json`; do not edit by hand. "
             "Each experiment is run by `python -m soma_pl.cli reproduce <experiment>` (`--help` lists them and "
             "their cost). A verdict holds when the 95% intervals over seeds (three or more) and over test documents "
             "both lie on the claim's side of zero and, after Holm's adjustment over the experiment's claims, its "
             "p-value stays below 0.05 (`soma_pl/reproduce/verdicts.py`); documents are the test split's, or the "
             "validation split's for claims read off validation curves. A measurement is decided by its interval "
             "over independent draws (of directions, at fixed weights, or of timing rounds). A row without a Holm "
             "p-value is undecided, judged by its own rule (an equivalence margin, a prediction's margin, an exact "
             "count), or was saved before the rule, when its "
             "intervals alone decided (the seeds' alone where it had no document interval).", "",
             *table_head(["Experiment", "Paper claim", "Basis", "Ours", "Verdict", "p (Holm)"])]
    for result in saved:
        for check in result["checks"]:
            ours = evidence_text(check)
            lines.append(table_row([f"{result['experiment']} ({result['scale']})", check["claim"], check["basis"], ours,
                               f"**{check['verdict']}**", holm_text(check)]))
    for result, path in zip(saved, found, strict=True):
        if not (path.parent / "table.md").is_file():
            raise ConfigError(f"reproduce docs: {path.parent / 'table.md'} is missing; run the experiment again")
        body = (path.parent / "table.md").read_text()
        lines += ["", *("#" + line if line.startswith("#") else line for line in body.strip().splitlines())]
        if (path.parent / "figure.png").is_file():
            image = Path(os.path.relpath(path.parent.resolve() / "figure.png", page.parent.resolve())).as_posix()
            lines += ["", f"![{result['experiment']}]({image})"]
    return "\n".join(lines) + "\n"


def write_docs(results: str = "results", out: str = "docs/reproduction.md") -> None:
    """Write docs/reproduction.md from every saved experiment result.

    Args:
        results: the folder holding each experiment's folder (`<experiment>/result.json`).
        out: the page to write.
    """
    check_apart(out, "--out", [results])
    target = Path(out)
    text = reproduction_page(Path(results), target)
    target.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(text.encode(), target)
    print(f"wrote {target}")
