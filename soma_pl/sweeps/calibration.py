"""`python -m soma_pl.cli sweep calibrate --sweep sweeps/<name>.yaml`: each configuration's update
time, measured alone.

The paper's hours are estimated from recorded mean step times (Table 3), so they do not depend on
what else a machine was doing while a run trained. A sweep with `calibrate:` does the same: before
its trials, each configuration whose arithmetic differs (one per combination of the `by` factors'
labels) runs a short `fit` by itself, one thread per process, `warmup` updates and then `updates`
timed ones, and its seconds per update (U·Σₑ t̄ₑ per update: every expert and rank counted) go into
`<output_dir>/calibration.json`. Every trial then runs with `--budget.seconds_per_update`: a
device-hour budget counts updates × that time, and so does the time axis of its validation curve
(`soma_pl.analysis.time_basis.update_curve`); the measured times stay beside it in its
`compute.json`. A configuration already in the file is not timed again; delete the file to time
them anew. Run it with nothing else on the machine: the load average before and after each
measurement is kept with it. With `reuse: <sweep file>` a configuration that sweep has timed (the
same layers and settings, but for those its factors outside `by` set, timed the same way) takes its
time instead of a new measurement, which can differ by tens of percent between moments.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tqdm import tqdm

from soma_pl.config_files import config_args, override_args
from soma_pl.errors import ConfigError, SomaError
from soma_pl.io import write_json_atomic
from soma_pl.sweeps.space import Label, SweepSpec, load_sweep, trial_overrides

CALIBRATION = "calibration.json"
THREADS = 1
"""Intra-op threads of each calibration process, as `reproduce` gives its sweep workers."""


def calibration_key(spec: SweepSpec, params: dict[str, Any]) -> str:
    """The calibration a trial's `params` share: its labels of the `by` factors (canonical JSON)."""
    return json.dumps({name: params[name] for name in spec.calibrate.by}, sort_keys=True)


def calibration_points(spec: SweepSpec) -> dict[str, dict[str, Any]]:
    """Key → the parameters one calibration runs: each combination of the `by` factors' labels, the
    other factors at their first-stage (else first) label and ranges at their low end, which change
    no arithmetic."""
    by = [f for f in spec.factors if f.name in spec.calibrate.by]
    points: dict[str, dict[str, Any]] = {}
    for labels in itertools.product(*(list(f.choices) for f in by)):
        params = {f.name: spec.first.get(f.name, next(iter(f.choices))) for f in spec.factors}
        params.update({**dict(zip([f.name for f in by], labels, strict=True)), **{r.name: r.low for r in spec.ranges}})
        points[calibration_key(spec, params)] = params
    return points


def timed_settings(spec: SweepSpec, params: dict[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """A trial's config layers and settings without its budget: what its update time depends on
    (two labels that differ only in their budget, as Fig. 14's N = 8 at two budgets, share one
    calibration)."""
    config, overrides = trial_overrides(spec, params)
    return config, {key: value for key, value in overrides.items() if not key.startswith("budget.")}


def calibration_command(spec: SweepSpec, params: dict[str, Label | float], root: Path) -> list[str]:
    """A trial's `fit` cut to the calibration (`CalibrationRun.overrides`), without its budget."""
    config, overrides = timed_settings(spec, params)
    overrides.update({"seed_everything": 0, **spec.calibrate.run.overrides(root)})
    return [sys.executable, "-m", "soma_pl.cli", "fit", *config_args(config), *override_args(overrides)]


def measure(spec: SweepSpec, params: dict[str, Any]) -> dict:
    """One configuration's calibration, run alone in a folder removed afterwards (kept on failure)."""
    folder = spec.output_dir / "calibration"
    folder.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp(prefix="run-", dir=folder))
    environment = {**os.environ, "OMP_NUM_THREADS": str(THREADS), "MKL_NUM_THREADS": str(THREADS),
                   "WANDB_MODE": "disabled"}
    load_before = os.getloadavg()[0]
    with (root / "fit.log").open("w") as log:
        code = subprocess.call(calibration_command(spec, params, root), stdout=log, stderr=subprocess.STDOUT,
                               env=environment)
    if code != 0:
        tail = " | ".join((root / "fit.log").read_text(errors="replace").strip().splitlines()[-2:])
        raise SomaError(f"calibration of {spec.name} {params} exited with status {code} ({root / 'fit.log'}): {tail}")
    seconds = spec.calibrate.run.seconds_per_update(root)
    shutil.rmtree(root)
    return {"params": params, "seconds_per_update": seconds, "threads": THREADS, "warmup": spec.calibrate.run.warmup,
            "updates": spec.calibrate.run.updates, "load_average": [load_before, os.getloadavg()[0]],
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def read_calibration(spec: SweepSpec) -> dict[str, dict]:
    """The sweep's calibrations so far, by key (empty before any)."""
    path = spec.output_dir / CALIBRATION
    return json.loads(path.read_text())["points"] if path.is_file() else {}


def reused(spec: SweepSpec, params: dict[str, Any], source: SweepSpec) -> dict | None:
    """`source`'s calibration of the arithmetic `params` runs: the same layers and settings but for
    those `source` declares free of arithmetic (set by its factors outside `by`), timed the same way;
    None where it has none."""
    if source.calibrate is None or source.calibrate.run != spec.calibrate.run:
        return None
    free = {key for factor in source.factors if factor.name not in source.calibrate.by
            for choice in factor.choices.values() for key in choice}

    def timing(sweep: SweepSpec, point: dict[str, Any]) -> tuple:
        layers, settings = timed_settings(sweep, point)
        return layers, {key: value for key, value in settings.items() if key not in free}

    wanted = timing(spec, params)
    return next((entry for entry in read_calibration(source).values() if timing(source, entry["params"]) == wanted),
                None)


def calibrate(spec: SweepSpec, progress: bool = True) -> dict[str, dict]:
    """Time every configuration of the sweep not yet in its calibration file, one at a time; the file
    is rewritten after each, so an interrupted calibration resumes."""
    if spec.calibrate is None:
        raise ConfigError(f"{spec.path}: no `calibrate:` section; the sweep's trials use measured update time")
    saved = read_calibration(spec)
    todo = {key: params for key, params in calibration_points(spec).items() if key not in saved}
    source = spec.calibrate.reuse and load_sweep(spec.calibrate.reuse)
    for key, params in tqdm(todo.items(), desc=f"calibrate {spec.name}", unit="config", disable=not progress):
        settings = timed_settings(spec, params)
        same = next((entry for entry in saved.values() if timed_settings(spec, entry["params"]) == settings), None)
        if same is None and source and (other := reused(spec, params, source)) is not None:
            same = {**other, "reused_from": str(source.path)}
        saved[key] = measure(spec, params) if same is None else {**same, "params": params, "timed_as": same["params"]}
        write_json_atomic(spec.output_dir / CALIBRATION, {"sweep": str(spec.path), "points": saved})
    return saved


def check_calibrated(spec: SweepSpec) -> None:
    """Refuse, before a worker claims a trial, a calibrating sweep some configuration of which has
    not been timed."""
    if spec.calibrate is None:
        return
    saved = read_calibration(spec)
    missing = [params for key, params in calibration_points(spec).items() if key not in saved]
    if missing:
        raise ConfigError(f"{spec.path}: {len(missing)} configuration(s) ({missing[0]}, ...) have no calibration in "
                          f"{spec.output_dir / CALIBRATION}; run `python -m soma_pl.cli sweep calibrate --sweep "
                          f"{spec.path}` first (reproduce does)")


def check_runs_calibrated(spec: SweepSpec, rates: list[float | None]) -> None:
    """Refuse a calibrating sweep's result when a finished run was timed otherwise (`rates`: each
    run's `budget.seconds_per_update`): made before the sweep calibrated, or by a calibration since
    replaced. Its time would sit on another basis than the rest."""
    if spec.calibrate is None:
        return
    timed = {entry["seconds_per_update"] for entry in read_calibration(spec).values()}
    stray = [rate for rate in rates if rate not in timed]
    if stray:
        raise ConfigError(f"{spec.path}: {len(stray)} finished run(s) of {spec.output_dir} ran with an update time not "
                          f"in {spec.output_dir / CALIBRATION} (first: {stray[0]}); they would compare on another "
                          f"time basis: delete {spec.output_dir} and run the sweep again")


def calibrated_seconds(spec: SweepSpec, params: dict[str, Any]) -> float | None:
    """A trial's calibrated seconds per update (None for a sweep without `calibrate:`)."""
    if spec.calibrate is None:
        return None
    entry = read_calibration(spec).get(calibration_key(spec, params))
    if entry is None:
        raise ConfigError(f"{spec.path}: trial {params} has no calibration in {spec.output_dir / CALIBRATION}; run "
                          f"`python -m soma_pl.cli sweep calibrate --sweep {spec.path}` first (reproduce does)")
    return entry["seconds_per_update"]


def main(sweep: str, progress: bool = True) -> None:
    """Time each configuration of a sweep alone, before its trials.

    The sweep's `calibrate:` section says which grid factors change an update's arithmetic and how
    many updates are timed; the times go into `<output_dir>/calibration.json`.

    Args:
        sweep: the sweep file.
        progress: show a progress bar on stderr.
    """
    spec = load_sweep(sweep)
    saved = calibrate(spec, progress)
    print(json.dumps({"calibration": str(spec.output_dir / CALIBRATION),
                      "seconds_per_update": {key: entry["seconds_per_update"] for key, entry in saved.items()}},
                     indent=2))
