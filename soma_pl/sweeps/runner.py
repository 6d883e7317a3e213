"""`python -m soma_pl.cli sweep --sweep sweeps/<name>.yaml [--storage URL] [--n_trials K]`: one worker.

A worker claims trials of the sweep's shared Optuna study one at a time and runs each as a `fit`
(then `test`) in a process of its own (`soma_pl.sweeps.trial`), under the sweep's compute budget,
and tells the study the ensemble-validation loss. The test loss is stored as the user attribute
`test_loss` and never used for selection (Table 7's protocol). Start several workers on one storage
to share the work; stop and restart them at any moment: completed trials are never run again.
A progress bar on stderr counts the study's finished trials (every worker's) and shows the trial
running here and the best ensemble-validation loss so far; the JSON summary goes to stdout.

`--overrides '{trainer.max_steps: 20}'` sets fit settings of every trial, over the sweep file's own
`overrides` (fit's dotted keys); a setting that a grid factor or a range searches is refused.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import optuna
from optuna.exceptions import UpdateFinishedTrialError
from optuna.storages import BaseStorage
from optuna.trial import TrialState
from tqdm import tqdm

from soma_pl.config_files import config_args, flatten, override_args, read_layers
from soma_pl.errors import ConfigError, SomaError
from soma_pl.sweeps.calibration import calibrated_seconds, check_calibrated
from soma_pl.sweeps.space import SEED, SweepSpec, load_sweep, trial_overrides
from soma_pl.sweeps.study import (
    FailureKind,
    Heartbeat,
    best_value,
    check_storage,
    claim_waiting,
    connect,
    default_storage,
    open_storage,
    open_study,
    running_trials,
    state_counts,
    suggest,
    sync_queue,
    trial_id,
)


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the runner."""


@dataclass
class FitOutcome:
    returncode: int
    result: dict | None
    log: Path

    @property
    def error(self) -> str:
        lines = [line for line in self.log.read_text(errors="replace").splitlines() if line.strip()] \
            if self.log.is_file() else []
        return lines[-1] if lines else f"exit status {self.returncode}"


def trial_settings(config: tuple[str, ...], overrides: dict) -> dict:
    """A trial's settings as dotted keys: its config layers in the parser's order (a later one
    wins), then its overrides."""
    settings = {}
    for _, layer in read_layers(config_args(config)):
        settings.update(flatten(layer))
    return {**settings, **overrides}


def takes_seed(config: tuple[str, ...], overrides: dict) -> bool:
    """Whether the trial's module has a `seed` argument (the zero-order modules: their directions'
    seed). BPTT has none: its repetition seed is `seed_everything`'s (a random initialisation) and
    the training stream's (`data.init_args.seed`), without which three warm-started repetitions would
    be one run three times. The module is the trial's `model.class_path` (True when none names one)."""
    class_path = trial_settings(config, overrides).get("model.class_path")
    if not isinstance(class_path, str) or "." not in class_path:
        return True
    module, name = class_path.rsplit(".", 1)
    try:
        cls = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        return True  # the fit itself names the bad class path in one line
    return "seed" in inspect.signature(cls.__init__).parameters


TRIAL_REPORTER = "soma_pl.sweeps.trial.TrialReporter"
"""The trial process's callback, named, not imported: importing it imports Lightning (4 s), which the
runner itself never needs."""
LIGHTNING_LOG_EVERY = 50
"""Lightning's default `trainer.log_every_n_steps`."""


def check_logging_interval(spec: SweepSpec) -> None:
    """Refuse, before any trial runs, a sweep whose fits would validate at updates where no update
    time is logged: the report's comparisons at equal time (`soma_pl.analysis.time_basis`)
    need `trainer.log_every_n_steps` to divide `trainer.val_check_interval` (an update count)."""
    names = [factor.name for factor in spec.factors]
    for labels in itertools.product(*(factor.choices for factor in spec.factors)):
        params = {**dict(zip(names, labels, strict=True)), **{r.name: None for r in spec.ranges}}
        settings = trial_settings(*trial_overrides(spec, params))
        interval = settings.get("trainer.val_check_interval")
        every = settings.get("trainer.log_every_n_steps", LIGHTNING_LOG_EVERY)
        counts = all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (interval, every))
        if counts and settings.get("trainer.logger") is not False and interval % every:
            point = f" (trial {', '.join(f'{n}={label}' for n, label in zip(names, labels, strict=True))})" \
                if names else ""
            raise ConfigError(f"{spec.path}: trainer.log_every_n_steps={every} does not divide "
                              f"trainer.val_check_interval={interval}{point}: every validation needs the update "
                              "time logged at its update; set log_every_n_steps to a divisor of the interval")


def fit_command(spec: SweepSpec, trial: optuna.Trial, params: dict, seed: int, run_dir: Path,
                storage: str, report: bool) -> list[str]:
    """The trial process's command line: base config, overrides, seed, budget, logging, reporter."""
    config, overrides = trial_overrides(spec, params)
    overrides.update({"seed_everything": seed, "trainer.default_root_dir": str(run_dir)})  # checkpoints: below it
    if takes_seed(config, overrides):
        overrides["model.init_args.seed"] = seed
    else:  # BPTT: a warm start draws nothing from `seed_everything`, so its repetitions differ by their data
        overrides.setdefault("data.init_args.seed", seed)
    overrides.update({f"budget.{key}": value for key, value in spec.budget.items()})
    calibrated = calibrated_seconds(spec, params)
    if calibrated is not None:
        overrides["budget.seconds_per_update"] = calibrated
    if spec.wandb:
        overrides.update({"wandb.group": spec.name, "wandb.name": f"trial-{trial.number}"})
    reporter = {"class_path": TRIAL_REPORTER, "init_args": {
        "storage": storage, "study_name": spec.name, "trial_number": trial.number,
        "pruner": spec.pruner.kind.value, "n_startup_trials": spec.pruner.n_startup_trials,
        "n_warmup_steps": spec.pruner.n_warmup_steps, "report": report, "runner_pid": os.getpid()}}
    return [sys.executable, "-m", "soma_pl.sweeps.trial", str(run_dir / "trial_result.json"),
            *config_args(config), *override_args(overrides),
            f"--trainer.callbacks+={json.dumps(reporter)}"]


def run_fit(command: list[str], run_dir: Path) -> FitOutcome:
    """Run one trial process; on SIGINT/SIGTERM stop it before passing the interruption on."""
    run_dir.mkdir(parents=True, exist_ok=True)
    log = run_dir / "fit.log"
    with log.open("w") as output:
        process = subprocess.Popen(command, stdout=output, stderr=subprocess.STDOUT)
        try:
            returncode = process.wait()
        except Interrupted:
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            raise
    result_path = run_dir / "trial_result.json"
    result = json.loads(result_path.read_text()) if returncode == 0 and result_path.is_file() else None
    return FitOutcome(returncode, result, log)


def _fail(study: optuna.Study, trial: optuna.Trial, kind: FailureKind, error: str) -> None:
    trial.set_user_attr("failure", kind.value)
    trial.set_user_attr("error", error)
    study.tell(trial, state=TrialState.FAIL, skip_if_finished=True)


def execute(spec: SweepSpec, study: optuna.Study, trial: optuna.Trial, storage: str) -> TrialState:
    """Run a claimed trial's fit(s) and tell the study; a grid trial is one seed, a range trial
    every seed (its value is their mean; only the first seed's fit reports for pruning)."""
    params = suggest(spec, trial)
    seeds = [trial.user_attrs[SEED]] if spec.is_grid else list(spec.seeds)
    trial_dir = spec.output_dir / f"trial-{trial.number:04d}"
    trial.set_user_attr("trial_dir", str(trial_dir))
    runs = []
    for index, seed in enumerate(seeds):
        run_dir = trial_dir if spec.is_grid else trial_dir / f"seed-{seed}"
        outcome = run_fit(fit_command(spec, trial, params, seed, run_dir, storage, report=index == 0), run_dir)
        if outcome.result is None:
            trial.set_user_attr("log", str(outcome.log))
            _fail(study, trial, FailureKind.error, outcome.error)
            return TrialState.FAIL
        runs.append({"seed": seed, **{k: outcome.result.get(k) for k in ("val_loss", "test_loss", "global_step",
                                                                          "run_dir", "test_scores")}})
        trial.set_user_attr("runs", runs)
        if outcome.result["pruned"]:
            study.tell(trial, state=TrialState.PRUNED, skip_if_finished=True)
            return TrialState.PRUNED
    tests = [r["test_loss"] for r in runs if r["test_loss"] is not None]
    trial.set_user_attr("test_loss", sum(tests) / len(tests) if len(tests) == len(runs) else None)
    study.tell(trial, sum(r["val_loss"] for r in runs) / len(runs), skip_if_finished=True)
    return TrialState.COMPLETE


def _next_trial(spec: SweepSpec, study: optuna.Study, storage: BaseStorage) -> optuna.Trial | None:
    """A waiting trial, or for range sweeps a new TPE trial while fewer than `trials` are live or done."""
    trial = claim_waiting(study, storage)
    if trial is not None or spec.is_grid:
        return trial
    states = (TrialState.COMPLETE, TrialState.PRUNED, TrialState.RUNNING)
    if len(study.get_trials(deepcopy=False, states=states)) >= spec.trials:
        return None
    with warnings.catch_warnings():
        # Optuna suggests `optimize` with its heartbeat; this worker sends the trial's heartbeats itself.
        warnings.filterwarnings("ignore", message="Heartbeat of storage is supposed to be used with Study.optimize")
        return study.ask()


class SweepProgress:
    """A tqdm bar over the study's points (grid) or trials (ranges): finished trials of every
    worker, the trial running here, and the best value so far."""

    def __init__(self, spec: SweepSpec, enabled: bool = True):
        total = spec.planned_trials() if spec.is_grid else spec.trials
        self.bar = tqdm(total=total, desc=f"sweep {spec.name}", unit="trial", disable=not enabled, file=sys.stderr)

    def update(self, study: optuna.Study, running: optuna.Trial | None = None) -> None:
        done = len(study.get_trials(deepcopy=False, states=(TrialState.COMPLETE, TrialState.PRUNED)))
        best = best_value(study)
        postfix = {"best": "—" if best is None else f"{best:.4f}"}
        if running is not None:
            point = json.loads(running.user_attrs.get("point", "{}")) or "TPE"
            postfix["running"] = f"trial {running.number} {point}"
        self.bar.n = min(done, self.bar.total)
        self.bar.set_postfix(postfix, refresh=True)

    def close(self) -> None:
        self.bar.close()


def _raise_interrupted(signum, frame) -> None:
    raise Interrupted(signal.Signals(signum).name)


def work(spec: SweepSpec, storage_url: str, n_trials: int | None = None, retry_failed: bool = False,
         setting: str = "storage", progress: bool = False) -> dict:
    """Claim and run trials until the study is done (waiting for other workers' running trials,
    which a vanished worker leaves stale) or `n_trials` ran. Returns counts by final state.
    `setting` names where the storage URL came from in errors."""
    study, storage = connect(spec, storage_url, setting=setting)
    sync_queue(study, storage, spec, retry_failed)
    bar = SweepProgress(spec, progress)
    bar.update(study)
    ran: dict[str, int] = {}
    trial = None
    try:
        while n_trials is None or sum(ran.values()) < n_trials:
            trial = _next_trial(spec, study, storage)
            if trial is None:
                if not running_trials(study):
                    break
                # Other workers' trials are running: wait, failing those that went stale.
                time.sleep(spec.heartbeat_seconds)
                sync_queue(study, storage, spec)
                bar.update(study)
                continue
            bar.update(study, trial)
            try:
                with Heartbeat(storage, trial_id(storage, study, trial.number), spec.heartbeat_seconds):
                    state = execute(spec, study, trial, storage_url)
            except UpdateFinishedTrialError:
                # Its heartbeat went stale (a stalled machine) and another worker failed it and
                # enqueued its point again: that worker's record stands.
                state = TrialState.FAIL
            ran[state.name] = ran.get(state.name, 0) + 1
            trial = None
            sync_queue(study, storage, spec)  # re-enqueue the points of trials whose workers vanished meanwhile
            bar.update(study)
    except Interrupted as signal_name:
        if trial is not None:
            _fail(study, trial, FailureKind.interrupted, f"worker stopped by {signal_name}")
        bar.close()
        print(f"interrupted by {signal_name}: trial {getattr(trial, 'number', None)} will re-run on restart",
              file=sys.stderr)
        raise SystemExit(130) from None
    bar.close()
    return ran


def main(sweep: str, storage: str | None = None, n_trials: int | None = None, retry_failed: bool = False,
         progress: bool = True, overrides: dict[str, Any] | None = None) -> None:
    """Run (or join) a sweep's Optuna study, one trial at a time.

    Args:
        sweep: a sweep file, e.g. sweeps/demo/table6_lr_eps.yaml.
        storage: Optuna RDB URL or journal file path; None: the sweep's, else sqlite:///<output_dir>/optuna.db.
        n_trials: most trials this worker runs; None: until the study is done.
        retry_failed: re-run grid points whose trials failed by their own error.
        progress: show a progress bar on stderr.
        overrides: fit settings for every trial, over the sweep file's `overrides`, as fit's dotted keys:
            '{trainer.max_steps: 20, model.init_args.spsa.eps: 0.01}'; a searched setting is refused.
    """
    if n_trials is not None and n_trials < 1:
        raise ConfigError(f"--n_trials={n_trials}: give how many trials this worker may run (1 or more), or leave it "
                          "unset to run until the study is done")
    spec = load_sweep(sweep, overrides)
    check_logging_interval(spec)
    check_calibrated(spec)
    url = storage or spec.storage or default_storage(spec)
    setting = "--storage" if storage else f"{sweep}: storage" if spec.storage else "the default storage"
    if storage or spec.storage:  # the default's folder, the sweep's output_dir, is made by `connect`
        check_storage(url, setting, create_folder=True)
    previous = {sig: signal.signal(sig, _raise_interrupted) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        ran = work(spec, url, n_trials, retry_failed, setting, progress=progress)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    study = open_study(spec, open_storage(url), create=False)
    counts = state_counts(study)
    print(json.dumps({"study": spec.name, "storage": url, "this_worker": ran, "study_trials": counts,
                      "points": spec.planned_trials() if spec.is_grid else spec.trials}, indent=2))
    check_some_finished(spec, ran, counts)


def check_some_finished(spec: SweepSpec, ran: dict[str, int], counts: dict[str, int]) -> None:
    """End with one line and a non-zero status when every trial this worker ran failed, or, when it
    ran none, every trial of the study did: a sweep with nothing to report is no success."""
    finished = (TrialState.COMPLETE.name, TrialState.PRUNED.name)
    failed = ran.get(TrialState.FAIL.name, 0) if ran else counts.get(TrialState.FAIL.name, 0)
    if not failed or any((ran or counts).get(state) for state in finished):
        return
    logs = spec.output_dir / ("trial-NNNN/fit.log" if spec.is_grid else "trial-NNNN/seed-S/fit.log")
    whose = "this worker ran" if ran else "the study holds"
    raise SomaError(f"sweep {spec.name}: all {failed} trial(s) {whose} failed; their logs are {logs}")
