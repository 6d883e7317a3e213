"""Table 7's selections compared at equal update time (Table 3's basis).

A sweep stopped by updates or multiply-adds (not by a budget of update time, which `sweep report`
does not compare again) reports its selections at equal update time too, labelled as such.
Per seed, the selected runs' ensemble-validation curves (`soma_pl.analysis.time_basis.update_curve`:
updates × each configuration's update time calibrated alone where the sweep calibrates, else the
time measured beside whatever shared the machine) are interpolated at `T`, the smaller of their
total update times, and compared there.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

from soma_pl.analysis.time_basis import interpolate, update_curve, windows_at_seconds
from soma_pl.eval.bootstrap import paired_document_interval


def equal_time_table(per_seed: list[dict], run_dirs: dict[int, dict[int, str]], baseline: str | None,
                     stats) -> dict | None:
    """Per seed: `budget_seconds` (T), each selected run's `total_seconds` and `val` at T, and
    baseline − other differences; then their statistics (`stats`) and, per other label, the
    document bootstrap of the seed-mean difference from the runs' validations window by window at
    T (`document`: the `Interval`'s fields, or None where a run kept no windows). None when a
    selected run kept no CSV log (`trainer.logger: false`) to read its curve from;
    `{"unavailable": why}` when `T` falls before a run's first validation (its curve has no point there)."""
    rows, windows = [], []
    for entry in per_seed:
        curves = {label: update_curve(Path(run_dirs[trial][entry["seed"]]))
                  for label, trial in entry["trial"].items()}
        if not all(curves.values()):
            return None
        totals = {label: curve[-1][2] for label, curve in curves.items()}
        budget = min(totals.values())
        if any(budget < curve[0][2] * (1 - 1e-9) for curve in curves.values()):
            return {"unavailable": f"seed {entry['seed']}: T = {budget:.1f} s falls before a selected run's first "
                                   "validation; validate more often to compare at equal time"}
        val = {label: interpolate([(seconds, loss) for _, loss, seconds in curve], budget)
               for label, curve in curves.items()}
        windows.append({label: windows_at_seconds(Path(run_dirs[trial][entry["seed"]]), [budget])[0]
                        for label, trial in entry["trial"].items()})
        rows.append({"seed": entry["seed"], "budget_seconds": budget, "total_seconds": totals, "val": val,
                     "difference": {label: val[str(baseline)] - loss for label, loss in val.items()
                                    if label != str(baseline)}})
    labels = list(rows[0]["val"]) if rows else []
    others = [label for label in labels if label != str(baseline)]
    document = {}
    for label in others:
        sides = [[seed[side] for seed in windows] for side in (str(baseline), label)]
        whole = all(record is not None for side in sides for record in side)
        interval = paired_document_interval(*sides) if whole else None
        document[label] = None if interval is None else asdict(interval)
    return {"per_seed": rows, "val": {label: stats([r["val"][label] for r in rows]) for label in labels},
            "difference": {label: stats([r["difference"][label] for r in rows]) for label in others},
            "document": document}
