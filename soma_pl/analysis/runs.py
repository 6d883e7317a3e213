"""`python -m soma_pl.cli runs`: several fits side by side, as a table and their validation curves.

A run is what one `fit` leaves in its run directory (`soma_pl.callbacks.summary.RunSummary`):
`summary.json` (final metrics, compute accounting, checkpoints) and, beside it, the CSV logger's
`metrics.csv`, whose `val/loss` rows are the curve (`read_curve`).
Each argument names a run directory, a `summary.json`, or a folder holding runs: every
`summary.json` under it (a sweep's output folder, as the demo's `runs/sweeps/demo_main_job`). A fit resumed in a
new session may write a new `version_N` beside the first: the versions in one folder are one run,
whose summary is the newest that accounts for training and whose curve joins every version's log.

Per run the table gives the method (the module), N experts, parameters, updates, the final and the
best ensemble-validation loss, the test loss when a `test` scored the run after its fit ended (in
the run's folder, as a sweep trial tests), forward multiply-adds (as the run's compute accounting
counted them) and measured time: Table 3's
update time `U · Σₑ t̄ₑ` and the elapsed training time. The figure draws validation loss against
updates, multiply-adds and update time (`soma_pl.analysis.curves`), one line per run.
"""

from __future__ import annotations

import csv
import json
import math
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from soma_pl.analysis.curves import draw_loss_curves
from soma_pl.analysis.time_basis import calibration
from soma_pl.errors import ConfigError, DataError
from soma_pl.io import check_apart, check_output_file, markdown_cell, write_atomic, write_json_atomic

SUMMARY = "summary.json"
METRICS = "metrics.csv"
TEST_SCORES = "test_scores.json"
VERSION = re.compile(r"version_(\d+)")
EXPERT_METRIC = re.compile(r"expert/(\d+)/(?:val_loss|train_loss)")
SUMMARY_FIELDS = {"module": str, "method": str, "global_step": int, "metrics": dict, "parameters": int}
COMPUTE_FIELDS = {"updates": int, "experts": int, "token_forwards": int, "aggregate_device_hours": (int, float),
                  "elapsed_training_seconds": (int, float)}


@dataclass
class CurvePoint:
    """One validation of a run."""

    updates: int
    val_loss: float
    multiply_adds: int | None
    """Forward multiply-adds spent so far (the run's `compute/multiply_adds` per update × updates); None without
    compute figures."""
    update_seconds: float | None
    """Update time spent so far, `updates · Σₑ t̄ₑ` on the run's time basis (calibrated where it has one);
    None without compute figures."""


@dataclass
class RunRow:
    """One run's row of the table, and its curve."""

    label: str
    summary: str
    """The `summary.json` read."""
    method: str
    """The method: SPSA, SOMA, EGGROLL, DDPP or BPTT."""
    experts: int
    """N: experts of the model (from its per-expert metrics, else the compute accounting's count)."""
    parameters: int
    updates: int
    final_val_loss: float | None
    """The last ensemble-validation loss the fit logged (`val/loss`)."""
    best_val_loss: float | None
    best_val_updates: int | None
    test_loss: float | None
    test_scores: str | None
    """The `test_scores.json` the test loss comes from."""
    token_forwards: int | None
    multiply_adds: int | None
    update_seconds: float | None
    """Table 3's `U · Σₑ t̄ₑ` in seconds on the run's time basis: updates × its update time calibrated
    alone where it ran with one (`budget.seconds_per_update`), else the measured aggregate device-hours
    × 3600."""
    training_seconds: float | None
    """Elapsed training wall time (validation and data loading included)."""
    curve: list[CurvePoint] = field(default_factory=list)


def _version(folder: Path) -> int | None:
    match = VERSION.fullmatch(folder.name)
    return int(match[1]) if match else None


def run_root(summary: Path) -> Path:
    """The folder a run's versions share: `root/version_N/summary.json` → `root`."""
    return summary.parent.parent if _version(summary.parent) is not None else summary.parent


def _read_json(path: Path, what: str) -> dict:
    try:
        payload = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise DataError(f"{path}: unreadable {what} ({type(error).__name__}: {str(error).splitlines()[0]})") from error
    if not isinstance(payload, dict):
        raise DataError(f"{path}: not a {what} (a JSON {type(payload).__name__}, not an object)")
    return payload


def _check_fields(path: Path, payload: dict, fields: dict, where: str) -> None:
    for key, kind in fields.items():
        value = payload.get(key)
        if isinstance(value, bool) or not isinstance(value, kind):
            raise DataError(f"{path}: not a run summary written by `fit` ({where}{key!r} is {value!r})")


def read_summary(path: Path) -> dict:
    """A `summary.json`, checked for the fields the table reads.

    Raises:
        DataError: unreadable, not JSON, or missing a field, naming the file.
    """
    summary = _read_json(path, "run summary")
    _check_fields(path, summary, SUMMARY_FIELDS, "")
    if summary.get("compute") is not None:
        if not isinstance(summary["compute"], dict):
            raise DataError(f"{path}: not a run summary written by `fit` ('compute' is {summary['compute']!r})")
        _check_fields(path, summary["compute"], COMPUTE_FIELDS, "compute.")
    return summary


def run_summaries(argument: str) -> list[Path]:
    """The summary of each run `argument` names: a `summary.json`, a run directory, or a folder
    holding runs. Of a run's versions, the newest summary that accounts for training is taken
    (a session resumed after the last update trains nothing and has no compute figures).

    Raises:
        DataError: the path does not exist, or holds no `summary.json`.
    """
    path = Path(argument).expanduser()
    if path.is_file():
        return [path]
    if not path.is_dir():
        raise DataError(f"run not found: {argument}")
    found = [path / SUMMARY] if (path / SUMMARY).is_file() else sorted(path.rglob(SUMMARY))
    if not found:
        raise DataError(f"{argument}: no {SUMMARY} in it or under it (every `fit` writes one into its run directory)")
    by_root: dict[Path, list[Path]] = {}
    for summary in found:
        by_root.setdefault(run_root(summary), []).append(summary)
    chosen = []
    for summaries in by_root.values():
        newest_first = sorted(summaries, key=lambda s: _version(s.parent) or 0, reverse=True)
        trained = [s for s in newest_first if read_summary(s).get("compute")]
        chosen.append((trained or newest_first)[0])
    return chosen


def read_curve(summary: Path, updates: int) -> dict[int, float]:
    """Updates → `val/loss` from the run's `metrics.csv` files, oldest version first (up to the
    summary's own): a later session's value at the same update wins.

    A validation during the fit logs `step` = its update count minus one; one after the fit ended
    on the same logger (`trainer.validate` in Python) logs the count itself. Both measure weights
    of at most `updates` updates, the run's total, so a count is capped there.

    Raises:
        DataError: a log that cannot be read, naming it.
    """
    root, last = run_root(summary), _version(summary.parent)
    logs = [root / METRICS] if last is None else sorted(
        (p for p in root.glob(f"version_*/{METRICS}") if (_version(p.parent) or 0) <= last),
        key=lambda p: _version(p.parent) or 0)
    points: dict[int, float] = {}
    for log in logs:
        if not log.is_file():
            continue
        try:
            with log.open(newline="") as rows:
                for row in csv.DictReader(rows):
                    if row.get("val/loss"):
                        points[min(int(row["step"]) + 1, updates)] = float(row["val/loss"])
        except (OSError, UnicodeDecodeError, ValueError, TypeError, KeyError, csv.Error) as error:
            raise DataError(f"{log}: unreadable metrics log ({type(error).__name__}: {error})") from error
    return dict(sorted(points.items()))


def find_test_scores(summary: Path) -> Path | None:
    """The newest `test_scores.json` written after `summary` in the run's folder (a sweep trial's
    `test` shares it)."""
    root = run_root(summary)
    candidates = [*root.glob(f"version_*/{TEST_SCORES}"), root / TEST_SCORES]
    ended = summary.stat().st_mtime
    fresh = [p for p in candidates if p.is_file() and p.stat().st_mtime >= ended]
    return max(fresh, key=lambda p: p.stat().st_mtime, default=None)


def _experts(summary: dict) -> int:
    indices = [int(m[1]) for key in summary["metrics"] if (m := EXPERT_METRIC.fullmatch(key))]
    if indices:
        return max(indices) + 1
    return (summary.get("compute") or {}).get("experts") or 1


def _finite(value) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def read_run(path: Path, label: str) -> RunRow:
    """The table row and curve of the run whose summary is `path`."""
    summary = read_summary(path)
    compute = summary.get("compute")
    experts = _experts(summary)
    updates = compute["updates"] if compute else summary["global_step"]
    final = _finite(summary["metrics"].get("val/loss"))
    points = read_curve(path, updates)
    if not points and final is not None:
        points = {updates: final}
    per_update = compute["multiply_adds"] / compute["updates"] if compute and compute["updates"] else None
    rate = calibration(path.parent)  # the run's time basis: its update time calibrated alone, where it has one
    step_seconds = rate if rate is not None else \
        compute["aggregate_device_hours"] * 3600 / compute["updates"] if per_update is not None else None
    curve = [CurvePoint(u, loss, None if per_update is None else round(u * per_update),
                        None if step_seconds is None else u * step_seconds) for u, loss in points.items()]
    finite = [p for p in curve if math.isfinite(p.val_loss)]
    best = min(finite, key=lambda p: p.val_loss, default=None)
    test = find_test_scores(path)
    test_loss = _finite(_read_json(test, "test scores").get("loss")) if test is not None else None
    return RunRow(label=label, summary=str(path), method=summary["method"].upper(), experts=experts,
                  parameters=summary["parameters"], updates=updates, final_val_loss=final,
                  best_val_loss=best.val_loss if best else None, best_val_updates=best.updates if best else None,
                  test_loss=test_loss, test_scores=str(test) if test_loss is not None else None,
                  token_forwards=compute["token_forwards"] if compute else None,
                  multiply_adds=compute["multiply_adds"] if compute else None,
                  update_seconds=(updates * rate if rate is not None else compute["aggregate_device_hours"] * 3600)
                  if compute else None,
                  training_seconds=compute["elapsed_training_seconds"] if compute else None, curve=curve)


def _label(summary: Path) -> str:
    root = run_root(summary).absolute()
    try:
        return str(root.relative_to(Path.cwd())) or "."
    except ValueError:
        return str(root)


def _cell(value, form: str) -> str:
    return "–" if value is None else format(value, form)


def markdown_table(rows: list[RunRow]) -> str:
    """One line per run; losses in nats/byte, `–` where a run has no such figure."""
    header = ["run", "method", "N", "parameters", "updates", "final val loss", "best val loss (update)",
              "test loss", "multiply-adds", "update time U·Σₑ t̄ₑ (s)", "training time (s)"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        best = "–" if r.best_val_loss is None else f"{r.best_val_loss:.4f} ({r.best_val_updates:,})"
        cells = [markdown_cell(r.label), r.method, str(r.experts), f"{r.parameters:,}", f"{r.updates:,}",
                 _cell(r.final_val_loss, ".4f"), best, _cell(r.test_loss, ".4f"), _cell(r.multiply_adds, ".3e"),
                 _cell(r.update_seconds, ".1f"), _cell(r.training_seconds, ".1f")]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(runs: list[str], labels: list[str] | None = None, out: str | None = None, markdown: str | None = None,
         figure: str | None = None) -> dict:
    """Several runs side by side: their summaries as one table, their validation curves as one figure.

    Prints the table (markdown) on stdout.

    Args:
        runs: run directories, `summary.json` files, or folders holding runs (every `summary.json`
            under them).
        labels: the runs' names in the table and the legend, one per run found, in order. None:
            each run's folder.
        out: write the table and the curves as JSON here (`runs`: one object per run).
        markdown: write the markdown table here.
        figure: draw validation loss against updates, multiply-adds and update time here (PNG).
    """
    for path, setting in ((markdown, "--markdown"), (figure, "--figure")):
        if path is not None:
            check_output_file(path, setting)
    summaries = list(dict.fromkeys(os.path.realpath(s) for argument in runs for s in run_summaries(argument)))
    if labels is not None and len(labels) != len(summaries):
        raise ConfigError(f"--labels has {len(labels)} names for {len(summaries)} runs found: give one per run "
                          f"({', '.join(_label(Path(s)) for s in summaries)})")
    names = labels or [_label(Path(s)) for s in summaries]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:  # the legend and the JSON would not tell them apart
        raise ConfigError(f"two runs are named {repeated[0]!r}: give --labels, one distinct name per run")
    rows = [read_run(Path(s), name) for s, name in zip(summaries, names, strict=True)]
    inputs = [*runs, *(run_root(Path(row.summary)) for row in rows), *(row.test_scores for row in rows)]
    for path, setting in ((out, "--out"), (markdown, "--markdown"), (figure, "--figure")):
        if path is not None:
            check_apart(path, setting, inputs)
    result = {"runs": [asdict(row) for row in rows]}
    text = markdown_table(rows)
    print(text)
    if out is not None:
        print(f"wrote {write_json_atomic(out, result)}", file=sys.stderr)
    if markdown is not None:
        Path(markdown).parent.mkdir(parents=True, exist_ok=True)
        write_atomic((text + "\n").encode(), Path(markdown))
        print(f"wrote {markdown}", file=sys.stderr)
    if figure is not None:
        curves = {row.label: [asdict(p) for p in row.curve] for row in rows}
        drawn = draw_loss_curves(curves, figure, f"Validation loss of {len(rows)} run(s) against compute")
        print(f"wrote {drawn}", file=sys.stderr)
    return result
