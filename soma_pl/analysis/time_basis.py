"""Equal update time (Table 3's basis): loss curves against a run's update time, read from its
CSV logs, and a run's standing at a time budget.

A fit logs `compute/aggregate_device_hours` (`U · Σₑ t̄ₑ` so far) every `log_every_n_steps` updates;
at each validation whose update count that interval divides, the curve has the loss and the
measured time. A run given a calibrated update time (`budget.seconds_per_update`, measured alone by
`sweep calibrate`, as the paper estimates its hours from recorded mean step times) is placed at
updates × that time instead (`update_curve`), so its place does not depend on what else the machine
was doing; the measured time stays in its log. Comparisons at equal time interpolate those curves at
the budget `T`.
"""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from soma_pl import VAL_WINDOWS
from soma_pl.errors import ConfigError, SomaError


def versions(folder: Path, name: str) -> list[Path]:
    """`folder/version_N/name` files or folders, oldest first (`folder/name` itself when `folder` is a version)."""
    if (folder / name).exists():
        return [folder / name]
    return sorted(folder.glob(f"version_*/{name}"), key=lambda p: int(p.parent.name.split("_")[1]))


def logged(metrics: Path) -> tuple[dict[int, float], dict[int, float]]:
    """One CSV log's ensemble-validation losses by update count (a validation row's `step` is its
    update count minus one) and its cumulative measured update seconds by update."""
    losses, seconds = {}, {}
    with metrics.open() as rows:
        for row in csv.DictReader(rows):
            if row.get("val/loss"):
                losses[int(row["step"]) + 1] = float(row["val/loss"])
            if row.get("compute/aggregate_device_hours"):
                seconds[int(row["step"])] = float(row["compute/aggregate_device_hours"]) * 3600
    return losses, seconds


def measured_curve(fit_root: Path) -> list[tuple[int, float, float]]:
    """`(updates, ensemble-validation loss, update seconds so far)` at every validation of a fit
    (resumed sessions included). The seconds are the measured `compute/aggregate_device_hours`
    logged at that update (the fit logs it every `log_every_n_steps`, a divisor of the validation
    interval); the logged `step` of a validation row is its update count minus one."""
    losses: dict[int, float] = {}
    seconds: dict[int, float] = {}
    for path in versions(fit_root, "metrics.csv"):
        logged_losses, logged_seconds = logged(path)
        losses.update(logged_losses)
        seconds.update(logged_seconds)
    missing = sorted(set(losses) - set(seconds))
    if missing:
        raise SomaError(f"{fit_root}: no update time logged at validation update(s) {missing[:5]}: "
                        "log_every_n_steps must divide the validation interval")
    return [(step, losses[step], seconds[step]) for step in sorted(losses)]


@dataclass(frozen=True)
class CalibrationRun:
    """How a configuration's update time is measured alone: a short `fit` of it, no validation,
    its update time logged at every update, `warmup` updates and then `updates` timed ones."""

    warmup: int = 3
    """Updates run before the clock starts (allocations, first-call costs)."""
    updates: int = 10
    """Updates timed."""

    def __post_init__(self):
        for name, least in (("warmup", 0), ("updates", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ConfigError(f"{name}={value!r}: give an integer of at least {least}")

    def overrides(self, root: Path) -> dict[str, Any]:
        """A fit's settings that cut it to the calibration, into `root` (budgets are dropped by the
        caller: a calibration runs its updates whatever the run's budget)."""
        return {"trainer.default_root_dir": str(root), "trainer.max_steps": self.warmup + self.updates,
                "trainer.limit_val_batches": 0, "trainer.log_every_n_steps": 1, "trainer.enable_progress_bar": False,
                "trainer.logger": {"class_path": "lightning.pytorch.loggers.CSVLogger",
                                   "init_args": {"save_dir": str(root), "name": ""}}}

    def seconds_per_update(self, root: Path) -> float:
        """The aggregate update seconds per update between update `warmup` and `warmup + updates`,
        from the cumulative `compute/aggregate_device_hours` the calibration's CSV log (under `root`)
        holds at every update."""
        found = versions(root, "metrics.csv")
        if not found:
            raise SomaError(f"{root}: no metrics.csv; the calibration's fit logged nothing")
        _, seconds = logged(found[-1])
        end = self.warmup + self.updates
        if end not in seconds or (self.warmup and self.warmup not in seconds):
            raise SomaError(f"{found[-1]}: no update time logged at update {self.warmup} and {end}")
        return (seconds[end] - seconds.get(self.warmup, 0.0)) / self.updates


def calibration(fit_root: Path) -> float | None:
    """The fit's calibrated seconds per update (`budget.seconds_per_update` in its `compute.json`),
    None where it ran without one."""
    found = versions(fit_root, "compute.json")
    budget = (json.loads(found[-1].read_text()).get("budget") or {}) if found else {}
    return budget.get("seconds_per_update")


def update_curve(fit_root: Path) -> list[tuple[int, float, float]]:
    """`measured_curve` on the fit's time basis: the seconds are updates × its calibrated update time
    where it has one (`calibration`), else the measured."""
    points = measured_curve(fit_root)
    rate = calibration(fit_root)
    return points if rate is None else [(step, loss, step * rate) for step, loss, _ in points]


def validation_windows(fit_root: Path) -> dict[int, dict]:
    """Each validation of a fit window by window (`soma_pl.VAL_WINDOWS`), by update count (a resumed
    session's record of an update replaces the earlier one); empty where the fit kept none."""
    records = {}
    for folder in versions(fit_root, VAL_WINDOWS):
        for path in folder.glob("*.json"):
            record = json.loads(path.read_text())
            records[int(record["updates"])] = record
    return records


def window_curve(fit_root: Path, points: list[tuple[int, float, float]] | None = None
                 ) -> tuple[list, list, list[np.ndarray]] | None:
    """The windows of every validation on the fit's curve (`points`: its `update_curve`, read
    when not given), in its order: their indices, their documents and each validation's per-window
    losses; None where a validation kept no record or they scored different windows (a session
    resumed on another validation split)."""
    records = validation_windows(fit_root)
    steps = [step for step, _, _ in (update_curve(fit_root) if points is None else points)]
    if not steps or any(step not in records for step in steps):
        return None
    first = records[steps[0]]
    if any(records[step]["window_index"] != first["window_index"] or records[step]["doc_ids"] != first["doc_ids"]
           for step in steps):
        return None
    return first["window_index"], first["doc_ids"], [np.asarray(records[step]["window_losses"]) for step in steps]


def windows_at_seconds(fit_root: Path, budgets: Sequence[float]) -> list[dict | None]:
    """The fit's validation windows at each of `budgets` seconds of update time (`update_curve`), each
    window interpolated linearly as the curve's loss is (their mean is it), as scores records
    (`window_index`, `window_losses`, `doc_ids`) for `soma_pl.eval.bootstrap.paired_document_interval`;
    None outside the curve, and for every budget where `window_curve` is None. The fit's files are
    read once."""
    points = update_curve(fit_root)
    saved = window_curve(fit_root, points)
    if saved is None:
        return [None] * len(budgets)
    index, documents, losses = saved
    curve = [(point[2], window_losses) for point, window_losses in zip(points, losses, strict=True)]
    return [{"window_index": index, "window_losses": interpolate(curve, budget), "doc_ids": documents}
            if curve[0][0] <= budget <= curve[-1][0] * (1 + 1e-9) else None for budget in budgets]


def interpolate(points: list[tuple[float, float]], at: float) -> float:
    """The piecewise-linear value of `(x, y)` points at `x = at` (within their range; an end point's
    value within a relative 1e-9 of it, as a budget read back from that point's own log is)."""
    for x, y in (points[0], points[-1]):
        if abs(at - x) <= 1e-9 * max(abs(x), 1.0):
            return y
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x0 <= at <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (at - x0) / (x1 - x0)
    raise SomaError(f"{at:g} lies outside the curve's range [{points[0][0]:g}, {points[-1][0]:g}]")


def accountings(folders: dict[int, dict[int, str]]) -> dict[str, int]:
    """How many of a study's runs (`folders`: trial → seed → run folder) used each `Accounting`,
    from their `compute.json`."""
    counts = Counter(json.loads((Path(run) / "compute.json").read_text())["accounting"]
                     for runs in folders.values() for run in runs.values() if (Path(run) / "compute.json").is_file())
    return dict(sorted(counts.items()))


def measured_over_calibrated(folders: dict[int, dict[int, str]]) -> dict | None:
    """Each calibrated run's measured aggregate update time over its calibrated one (updates × its
    calibrated time, `compute.json`): above 1 where the machine's other work (or the run's own
    warm-up) slowed its updates. `runs`, `min`, `mean`, `max`; None without calibrated runs."""
    ratios = []
    for runs in folders.values():
        for run in runs.values():
            rate = calibration(Path(run))
            if rate is not None:
                report = json.loads(versions(Path(run), "compute.json")[-1].read_text())
                ratios.append(report["aggregate_device_hours"] * 3600 / (report["updates"] * rate))
    return {"runs": len(ratios), "min": min(ratios), "mean": float(np.mean(ratios)), "max": max(ratios)} \
        if ratios else None
