"""`python -m soma_pl.cli sweep report --sweep sweeps/<name>.yaml [--storage URL] [--out FILE.json]`.

Reads a sweep's study and prints, as markdown, and writes, as JSON:

- **Table 6** (ensemble validation loss): one row per setting of the non-column factors, one column
  per label of `report.columns` (e.g. N), each cell mean ± sample standard deviation over seeds.
- **Table 7** (test loss after selection): for each seed and column, the setting with the lowest
  unrounded ensemble-validation loss of that seed is selected and its test loss reported; the
  differences are baseline minus each other column, per seed, then their mean and sample standard
  deviation. Test losses never take part in the selection. A selected setting at an edge of its grid
  (the lowest or highest value of a numeric grid factor) is flagged (`at_grid_edge`, a † in the
  table and a footnote): the best setting may lie outside the grid.

All losses are nats/byte. Only COMPLETE trials enter the tables; pruned and failed ones are counted,
and failed ones listed with their error (a trial Optuna failed for a stale heartbeat is `stale`).

With `--final_test=true` the runs Table 7 selected (and only those) are also scored on the prepared
dataset's final test split, the one no development result has touched (`soma_pl.sweeps.final_test`):
a second Table 7 on it, reported by a reproduction's final runs only.

With `--figures DIR` it also saves Optuna's own views of the study as PNG (matplotlib):
`<study>_parallel_coordinate.png` (every COMPLETE trial as a line across its parameters to its
value) and `<study>_optimization_history.png` (value by trial, best so far).
"""

from __future__ import annotations

import os
import statistics
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import optuna
from optuna.exceptions import StorageInternalError
from optuna.trial import TrialState
from sqlalchemy.exc import SQLAlchemyError

from soma_pl.errors import ConfigError, SomaError
from soma_pl.io import check_apart, markdown_cell, write_json_atomic
from soma_pl.sweeps.equal_time import equal_time_table
from soma_pl.sweeps.final_test import final_table
from soma_pl.sweeps.space import Label, load_sweep
from soma_pl.sweeps.study import (
    RETRYABLE,
    SWEEP_ATTR,
    FailureKind,
    database_error,
    default_storage,
    open_storage,
    shown_storage,
    state_counts,
)

ALL = "all"
"""The one column of a sweep without `report.columns`."""


@dataclass(frozen=True)
class Record:
    """One finished fit: its setting (factor -> label or sampled value), seed and losses."""

    setting: tuple[tuple[str, Label], ...]
    seed: int
    val_loss: float
    test_loss: float | None
    trial: int


def collect_records(study: optuna.Study, description: dict) -> list[Record]:
    """Every COMPLETE trial's fits; a setting seen twice for one seed keeps the earliest trial."""
    names = [*description["factors"], *description["ranges"]]
    records: dict[tuple, Record] = {}
    for trial in sorted(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)), key=lambda t: t.number):
        setting = tuple((name, trial.params[name]) for name in names)
        for run in trial.user_attrs.get("runs", []):
            record = Record(setting, int(run["seed"]), float(run["val_loss"]),
                            None if run.get("test_loss") is None else float(run["test_loss"]), trial.number)
            records.setdefault((setting, record.seed), record)
    return list(records.values())


def stats(values: list[float]) -> dict:
    """Mean and sample standard deviation (n − 1 denominator; None below two values)."""
    return {"mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) > 1 else None, "n": len(values), "values": values}


def _split(setting: tuple, columns: str | None) -> tuple[tuple, Label]:
    row = tuple((name, label) for name, label in setting if name != columns)
    column = dict(setting).get(columns) if columns else ALL
    return row, column


def _column_labels(records: list[Record], description: dict) -> list[Label]:
    columns = description.get("columns")
    if not columns:
        return [ALL]
    seen = {_split(r.setting, columns)[1] for r in records}
    return [label for label in description["labels"][columns] if label in seen]


def table6(records: list[Record], description: dict) -> dict:
    """Rows of non-column settings; cells: val (and test) loss statistics over seeds."""
    columns = description.get("columns")
    labels = _column_labels(records, description)
    rows: dict[tuple, dict] = {}
    for record in sorted(records, key=lambda r: (r.setting, r.seed)):
        row, column = _split(record.setting, columns)
        cell = rows.setdefault(row, {}).setdefault(column, {"val": [], "test": [], "seeds": []})
        cell["val"].append(record.val_loss)
        cell["seeds"].append(record.seed)
        if record.test_loss is not None:
            cell["test"].append(record.test_loss)
    return {"row_factors": [n for n in [*description["factors"], *description["ranges"]] if n != columns],
            "columns": columns, "column_labels": labels,
            "rows": [{"setting": dict(row), "cells": {str(label): {"val": stats(cell["val"]),
                                                                   "test": stats(cell["test"]),
                                                                   "seeds": cell["seeds"]}
                                                      for label, cell in cells.items()}}
                     for row, cells in rows.items()]}


def _numeric(label: Label) -> bool:
    return isinstance(label, int | float) and not isinstance(label, bool)


def grid_edges(setting: dict[str, Label], description: dict) -> list[str]:
    """The numeric grid factors (two or more values) whose label in `setting` is their grid's lowest
    or highest value; ranges and the column factor are not grid axes of a selection."""
    edges = []
    for name, label in setting.items():
        labels = description["labels"].get(name) or []
        if len(labels) > 1 and all(map(_numeric, labels)) and label in (min(labels), max(labels)):
            edges.append(name)
    return edges


def table7(records: list[Record], description: dict) -> dict:
    """Per seed and column: the lowest-validation setting's test loss; baseline − other differences."""
    columns = description.get("columns")
    labels = _column_labels(records, description)
    baseline = description.get("baseline")
    baseline = baseline if baseline in labels else labels[0] if labels else None
    per_seed = []
    for seed in sorted({r.seed for r in records}):
        chosen = {}
        for label in labels:
            candidates = [r for r in records if r.seed == seed and _split(r.setting, columns)[1] == label]
            if candidates:
                chosen[label] = min(candidates, key=lambda r: (r.val_loss, r.trial))
        if len(chosen) == len(labels) and all(r.test_loss is not None for r in chosen.values()):
            per_seed.append({"seed": seed, "test": {str(k): r.test_loss for k, r in chosen.items()},
                             "val": {str(k): r.val_loss for k, r in chosen.items()},
                             "selected": {str(k): dict(_split(r.setting, columns)[0]) for k, r in chosen.items()},
                             "at_grid_edge": {str(k): grid_edges(dict(_split(r.setting, columns)[0]), description)
                                              for k, r in chosen.items()},
                             "trial": {str(k): r.trial for k, r in chosen.items()},
                             "difference": {str(k): chosen[baseline].test_loss - r.test_loss
                                            for k, r in chosen.items() if k != baseline}})
    others = [str(label) for label in labels if label != baseline]
    edges = {str(label): sorted({name for s in per_seed for name in s["at_grid_edge"][str(label)]})
             for label in labels}
    return {"columns": columns, "column_labels": labels, "baseline": baseline, "per_seed": per_seed,
            "at_grid_edge": edges,
            "test": {str(label): stats([s["test"][str(label)] for s in per_seed]) for label in labels},
            "difference": {label: stats([s["difference"][label] for s in per_seed]) for label in others}}


def failures(study: optuna.Study) -> list[dict]:
    """FAIL trials with why; `rerun`: its point runs again (a retry exists or will be enqueued)."""
    trials = study.get_trials(deepcopy=False)
    # Optuna's stale-trial retry (database storages) names the failed trials in the copy it enqueues.
    retried = {number: t.number for t in trials for number in t.system_attrs.get("retry_history", [])}
    rows = []
    for t in trials:
        if t.state != TrialState.FAIL:
            continue
        failure, error = t.user_attrs.get("failure"), t.user_attrs.get("error")
        if failure is None and t.number in retried:
            failure, error = FailureKind.stale.value, f"no heartbeat: Optuna retried it as trial {retried[t.number]}"
        rows.append({"trial": t.number, "params": t.params, "failure": failure, "error": error,
                     "log": t.user_attrs.get("log"), "rerun": failure in RETRYABLE})
    return rows


def run_folders(study: optuna.Study) -> dict[int, dict[int, str]]:
    """Trial number → seed → the run folder of each COMPLETE trial's fits."""
    return {t.number: {int(run["seed"]): run["run_dir"] for run in t.user_attrs.get("runs", []) if run.get("run_dir")}
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}


def own_test_scores(study: optuna.Study) -> dict[int, dict[int, str]]:
    """Trial number → seed → the `test_scores.json` of each COMPLETE trial's own test (per-window
    losses; absent for trials run before the runner recorded it)."""
    return {t.number: {int(run["seed"]): run["test_scores"] for run in t.user_attrs.get("runs", [])
                       if run.get("test_scores")}
            for t in study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))}


def build_report(study: optuna.Study, storage: str, final_test: bool = False) -> dict:
    description = study.user_attrs.get(SWEEP_ATTR)
    if description is None:
        raise ConfigError(f"study '{study.study_name}' was not made by `sweep` (no {SWEEP_ATTR} attribute)")
    records = collect_records(study, description)
    t7 = table7(records, description)
    folders = run_folders(study)
    # A budget of update time stops every run at the same U·Σₑ t̄ₑ: Table 7's layout is already at equal time.
    timed_budget = "device_hours" in description.get("budget", {})
    if t7["per_seed"] and not timed_budget and all(t7["columns"] and folders.get(trial) for s in t7["per_seed"]
                              for trial in s["trial"].values()):
        timed = equal_time_table(t7["per_seed"], folders, t7["baseline"], stats)
        if timed is not None:
            t7["equal_time"] = timed
    if final_test:
        t7["final_test"] = final_table(t7["per_seed"], folders, t7["baseline"], stats)
    return {"study": study.study_name, "storage": storage, "unit": "nats/byte", "sweep": description,
            "trials": state_counts(study), "table6": table6(records, description),
            "table7": t7, "failed": failures(study), "test_score_files": own_test_scores(study)}


def _fmt(value: float | None, digits: int = 4) -> str:
    return "—" if value is None else f"{value:.{digits}f}"


def _cell(stat: dict | None) -> str:
    if not stat or stat["mean"] is None:
        return "—"
    return _fmt(stat["mean"]) + (f" ± {_fmt(stat['sd'])}" if stat["sd"] is not None else f" (n={stat['n']})")


def _row(cells: list[str]) -> str:
    """A markdown table row; a `|` or a line break inside a cell (a factor's name or label) is escaped."""
    return "| " + " | ".join(map(markdown_cell, cells)) + " |"


def _head(cells: list[str]) -> list[str]:
    return [_row(cells), "|" + "---|" * len(cells)]


def _column_name(columns: str | None, label) -> str:
    return "loss" if columns is None else f"{columns}={label}"


def table6_lines(t6: dict) -> list[str]:
    """Table 6's layout: one row per setting, one column per report column, the ensemble-validation
    loss's mean ± sample standard deviation over seeds."""
    names = [_column_name(t6["columns"], label) for label in t6["column_labels"]]
    lines = _head([*t6["row_factors"], *names])
    for row in t6["rows"]:
        cells = [_cell(row["cells"].get(str(label), {}).get("val")) for label in t6["column_labels"]]
        lines.append(_row([*(str(row["setting"][f]) for f in t6["row_factors"]), *cells]))
    return lines


def markdown(report: dict) -> str:
    t6, t7 = report["table6"], report["table7"]
    lines = [f"## {report['study']}: ensemble validation loss (Table 6 layout)", "",
             "Mean ± sample standard deviation over seeds, nats/byte.", "", *table6_lines(t6)]
    others = [label for label in t7["column_labels"] if label != t7["baseline"]]
    base_name = _column_name(t7["columns"], t7["baseline"])
    differences = [f"Difference ({base_name} − {_column_name(t7['columns'], o)})" for o in others]
    lines += ["", f"## {report['study']}: test loss after selection on ensemble validation (Table 7 layout)", "",
              *_head(["Optimization seed", *(_column_name(t7["columns"], c) for c in t7["column_labels"]),
                      *differences])]
    for entry in t7["per_seed"]:
        tests = [_fmt(entry["test"][str(c)]) + ("†" if entry["at_grid_edge"][str(c)] else "")
                 for c in t7["column_labels"]]
        differences = [_fmt(entry["difference"][str(o)]) for o in others]
        lines.append(_row([str(entry["seed"]), *tests, *differences]))
    for name, key in (("Mean", "mean"), ("Sample standard deviation", "sd")):
        values = ([t7["test"][str(c)][key] for c in t7["column_labels"]]
                  + [t7["difference"][str(o)][key] for o in others])
        lines.append(_row([name, *map(_fmt, values)]))
    lines += _edge_footnote(t7, report["sweep"]["labels"])
    if "equal_time" in t7:
        lines += _equal_time_section(report, others)
    if "final_test" in t7:
        lines += _final_section(report, others)
    lines += ["", "Trials: " + ", ".join(f"{k} {v}" for k, v in sorted(report["trials"].items()))]
    lines += [f"- trial {f['trial']} {f['failure']}{' (its point is re-run)' if f['rerun'] else ''}: {f['error']}"
              for f in report["failed"]]
    return "\n".join(lines) + "\n"


def _equal_time_section(report: dict, others: list) -> list[str]:
    t7 = report["table7"]
    timed = t7["equal_time"]
    if "unavailable" in timed:
        return ["", f"At equal update time (Table 3's basis): not compared ({timed['unavailable']})."]
    names = [_column_name(t7["columns"], c) for c in t7["column_labels"]]
    base_name = _column_name(t7["columns"], t7["baseline"])
    lines = ["", f"## {report['study']}: the same selections at equal update time (Table 3's basis)", "",
             "Ensemble-validation loss interpolated at T, the smaller of the selected runs' update times "
             "U·Σₑ t̄ₑ (updates × the update time calibrated alone where the sweep calibrates, else measured "
             "beside whatever else ran on the machine); the Table 7 layout above is at equal updates.", "",
             *_head(["Optimization seed", "T (s)", *(f"{n} (its U·Σₑ t̄ₑ)" for n in names),
                     *(f"Difference ({base_name} − {_column_name(t7['columns'], o)})" for o in others)])]
    for entry in timed["per_seed"]:
        cells = [f"{_fmt(entry['val'][str(c)])} ({entry['total_seconds'][str(c)]:.0f} s)" for c in t7["column_labels"]]
        lines.append(_row([str(entry["seed"]), f"{entry['budget_seconds']:.0f}", *cells,
                           *(_fmt(entry["difference"][str(o)]) for o in others)]))
    for name, key in (("Mean", "mean"), ("Sample standard deviation", "sd")):
        values = [timed["val"][str(c)][key] for c in t7["column_labels"]] + \
                 [timed["difference"][str(o)][key] for o in others]
        lines.append(_row([name, "", *map(_fmt, values)]))
    return lines


def _final_section(report: dict, others: list) -> list[str]:
    t7 = report["table7"]
    final = t7["final_test"]
    base_name = _column_name(t7["columns"], t7["baseline"])
    differences = [f"Difference ({base_name} − {_column_name(t7['columns'], o)})" for o in others]
    lines = ["", f"## {report['study']}: the same selections on the final test split (used once)", "",
             *_head(["Optimization seed", *(_column_name(t7["columns"], c) for c in t7["column_labels"]),
                     *differences])]
    for entry in final["per_seed"]:
        cells = [_fmt(entry["test"][str(c)]) for c in t7["column_labels"]]
        lines.append(_row([str(entry["seed"]), *cells, *(_fmt(entry["difference"][str(o)]) for o in others)]))
    for name, key in (("Mean", "mean"), ("Sample standard deviation", "sd")):
        values = [final["test"][str(c)][key] for c in t7["column_labels"]] + \
                 [final["difference"][str(o)][key] for o in others]
        lines.append(_row([name, *map(_fmt, values)]))
    return lines


def _edge_footnote(t7: dict, labels: dict[str, list[Label]]) -> list[str]:
    """The † footnote: each selection at a grid edge, by column, factor and value, with its seeds."""
    seeds: dict[tuple[str, str, Label], list[int]] = {}
    for entry in t7["per_seed"]:
        for column, names in entry["at_grid_edge"].items():
            for name in names:
                seeds.setdefault((column, name, entry["selected"][column][name]), []).append(entry["seed"])
    if not seeds:
        return []
    lines = ["", "† Selected at an edge of its grid (the lowest or highest value tried): the best setting may "
                 "lie outside the grid; extend it."]
    for (column, name, value), which in seeds.items():
        where = f"{_column_name(t7['columns'], column)}, " if t7["columns"] else ""
        side = "lowest" if value == min(labels[name]) else "highest"
        lines.append(f"- {where}seed{'s' if len(which) > 1 else ''} {', '.join(map(str, which))}: {name} = {value}, "
                     f"the {side} of {', '.join(map(str, labels[name]))}")
    return lines


def save_figures(study: optuna.Study, folder: Path) -> list[Path]:
    """Optuna's parallel-coordinate and optimization-history plots of the COMPLETE trials as PNG."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only, whatever display the shell has
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("sweep report --figures needs matplotlib: pip install -e '.[notebooks]'") from None
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise ConfigError(f"sweep report --figures: study '{study.study_name}' has no COMPLETE trial to draw")
    from optuna.visualization import matplotlib as views

    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, view in (("parallel_coordinate", views.plot_parallel_coordinate),
                       ("optimization_history", views.plot_optimization_history)):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
            axes = view(study, target_name="ensemble validation loss (nats/byte)")
        figure = axes.figure
        figure.set_size_inches(9, 4.5)
        figure.tight_layout()
        path = folder / f"{study.study_name}_{name}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        paths.append(path)
    return paths


def check_finished(study: optuna.Study, storage: str) -> None:
    """Refuse with one line a study with no COMPLETE trial: its tables would be empty."""
    if study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        return
    counts = ", ".join(f"{state} {count}" for state, count in sorted(state_counts(study).items())) or "no trials"
    logs = [f["log"] for f in failures(study) if f["log"]]
    hint = (f"see the failed trials' logs ({logs[0]}" + (f" and {len(logs) - 1} more)" if len(logs) > 1 else ")")
            if logs else "run `sweep` on it first")
    raise SomaError(f"study '{study.study_name}' in {shown_storage(storage)} has no finished trial to report "
                    f"({counts}): {hint}")


def _report(study: optuna.Study, storage: str, final_test: bool = False) -> tuple[dict, str]:
    """The report and its markdown text (`main` has a `markdown` option, which hides the function)."""
    report = build_report(study, storage, final_test)
    return report, markdown(report)


def main(sweep: str | None = None, study: str | None = None, storage: str | None = None,
         out: str = "results/sweep_report.json", markdown: str | None = None, figures: str | None = None,
         final_test: bool = False) -> None:
    """Table 6 / Table 7 style tables of a sweep's study (nats/byte).

    Args:
        sweep: the sweep file (it names the study and the storage).
        study: the study's name (instead of `sweep`).
        storage: Optuna RDB URL or journal file path.
        out: where to write the JSON report.
        markdown: also write the markdown table here.
        figures: also save Optuna's parallel-coordinate and history plots as PNG into this folder.
        final_test: also score the selected runs (only those) on the final test split, once each.
    """
    if not sweep and not study:
        raise ConfigError("sweep report needs --sweep FILE or --study NAME (with --storage)")
    spec = load_sweep(sweep) if sweep else None
    storage = storage or (spec and (spec.storage or default_storage(spec)))
    if not storage:
        raise ConfigError("sweep report --study needs --storage")
    database = storage.removeprefix("sqlite:///")  # a journal or SQLite file is an input; a server is not
    for path, setting in ((out, "--out"), (markdown, "--markdown")):
        if path:
            check_apart(path, setting, [sweep, None if "://" in database else database])
    name = study or spec.name
    try:
        loaded = optuna.load_study(study_name=name, storage=open_storage(storage))
    except KeyError:
        raise ConfigError(f"no study '{name}' in {storage}") from None
    except (SQLAlchemyError, StorageInternalError) as error:
        raise database_error(storage, "--storage", error) from None
    check_finished(loaded, storage)
    report, text = _report(loaded, storage, final_test)
    print(text)
    if markdown:
        path = Path(markdown)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        temporary.write_text(text)
        os.replace(temporary, path)
    print(f"wrote {write_json_atomic(Path(out), report)}", file=sys.stderr)
    if figures:
        for path in save_figures(loaded, Path(figures)):
            print(f"wrote {path}", file=sys.stderr)
