"""`python -m soma_pl.cli reproduce <experiment> [...] [--scale cpu|paper] [--dry_run true]`.

For each experiment (a file of `experiments/`, `soma_pl.reproduce.experiments`): prepare and shard
its data (a no-op when up to date), time each of its sweep's configurations alone where the sweep
calibrates (`soma_pl.sweeps.calibration`: the update time its budgets and time axes use), run its
sweep's trials with `workers` sweep workers of one thread each on the sweep's Optuna storage (a bar
shows the trials done and the best ensemble-validation loss; finished trials are reused and an
interrupted run resumes), then score the selected runs (the final test split once), check the
paper's claims and write `results/<experiment>/` (`result.json`, `table.md` in the paper's layout
with the paper's numbers beside ours, `figure.png`), printing the table. `--dry_run true` lists the
trials, which are done, and the compute the rest will cost. An experiment of measurements at fixed
weights (`commands`) runs its commands in order instead of a sweep and reports what they wrote.

`reproduce docs` writes `docs/reproduction.md` from every `results/*/result.json`.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import optuna
from optuna.trial import TrialState
from tqdm import tqdm

from soma_pl.analysis.time_basis import accountings, calibration, measured_over_calibrated
from soma_pl.errors import ConfigError, SomaError
from soma_pl.io import write_atomic, write_json_atomic
from soma_pl.locks import die_with_parent
from soma_pl.reproduce.comparisons import check_columns, sweep_columns
from soma_pl.reproduce.experiments import REPOSITORY, Experiment, all_experiments, load_experiment
from soma_pl.reproduce.verdicts import family
from soma_pl.sweeps.calibration import (
    CALIBRATION,
    calibrate,
    calibration_points,
    check_runs_calibrated,
    read_calibration,
)
from soma_pl.sweeps.report import build_report, run_folders
from soma_pl.sweeps.runner import SweepProgress
from soma_pl.sweeps.space import SEED, SweepSpec, load_sweep, point_experts, point_key
from soma_pl.sweeps.study import default_storage, open_storage, open_study, selections

POLL_SECONDS = 5.0


def listing() -> str:
    """The experiments with what each compares and costs (`reproduce --help`)."""
    return "Experiments: " + " ".join(f"`{e.name}`: {e.title} (cpu: {e.cost['cpu']}; paper: {e.cost['paper']})."
                                      for e in all_experiments().values())


@contextlib.contextmanager
def in_repository() -> Iterator[None]:
    """Run in the repository root (the experiments' paths are relative to it), then go back."""
    if not (REPOSITORY / "sweeps").is_dir():
        raise ConfigError(f"reproduce runs the sweeps of a soma_pl checkout, and {REPOSITORY / 'sweeps'} does not "
                          "exist: install soma_pl from a clone (pip install -e .)")
    started = Path.cwd()
    os.chdir(REPOSITORY)
    try:
        yield
    finally:
        os.chdir(started)


def _absolute_storage(url: str) -> str:
    """A storage URL whose file (a journal, a SQLite database) is named from the current folder."""
    if "://" not in url:
        return str(Path(url).expanduser().absolute())
    database = url.removeprefix("sqlite:///")
    return f"sqlite:///{Path(database).expanduser().absolute()}" if database != url and database else url


def _existing_study(spec: SweepSpec, storage: str) -> optuna.Study | None:
    """The sweep's study when a worker has made it (a dry run creates nothing)."""
    if storage.startswith("sqlite:///") and not Path(storage.removeprefix("sqlite:///")).is_file():
        return None
    try:
        return optuna.load_study(study_name=spec.name, storage=open_storage(storage, spec=spec))
    except KeyError:
        return None


def _trials(spec: SweepSpec, study: optuna.Study | None) -> dict[str, str]:
    """Each point's state in the study (absent before any worker ran it)."""
    states: dict[str, str] = {}
    for trial in study.get_trials(deepcopy=False) if study else []:
        key = trial.user_attrs.get("point")
        if key and states.get(key) not in ("COMPLETE", "PRUNED"):
            states[key] = trial.state.name
    return states


def _measured_minutes(study: optuna.Study | None) -> float | None:
    """The mean wall minutes of the study's COMPLETE trials (one thread each), None before any."""
    took = [(t.datetime_complete - t.datetime_start).total_seconds() / 60
            for t in (study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)) if study else [])]
    return sum(took) / len(took) if took else None


def list_trials(experiment: Experiment, scale: str, spec: SweepSpec, storage: str) -> dict:
    """The trials, their states and the cost of the rest, printed; nothing runs."""
    study = _existing_study(spec, storage)
    selected, states = selections(spec, study), _trials(spec, study)
    points = spec.grid_points(selected)
    firsts: dict[tuple, dict] = {}  # a staged grid's groups still in their first stage: the second stage to come
    for point in spec.grid_points():
        firsts.setdefault(spec.stage_group(point), point)
    waiting = [{**point, **later} for group, point in firsts.items() if group not in selected
               for later in spec.later_labels()]
    done = sum(states.get(point_key(p)) in ("COMPLETE", "PRUNED") for p in points)
    print(f"{experiment.name} ({scale}): {experiment.title}")
    _print_commands(experiment.data.get(scale, []), "first: ")  # each reused when its output is there
    print(f"sweep {spec.path}: {len(points) + len(waiting)} trials, {done} done; storage {storage}")
    for point in points:
        shown = ", ".join(f"{k}={v}" for k, v in point.items() if k != SEED)
        print(f"  {shown}, seed {point[SEED]}: {states.get(point_key(point), 'to run').lower()}")
    for point in waiting:
        shown = ", ".join(f"{k}={v if k in spec.first or k == spec.report.columns else '(first stage)'}"
                          for k, v in point.items() if k != SEED)
        print(f"  {shown}, seed {point[SEED]}: after the first stage")
    for group in (group for group, best in selected.items() if best is None):
        column = f"{spec.report.columns}={group[0]}, " if spec.report.columns else ""
        print(f"  {column}seed {group[1]}: no second stage (no first-stage trial completed)")
    budget, elapsed = spec.budget.get("device_hours"), spec.budget.get("elapsed_hours")
    left = [p for p in points if states.get(point_key(p)) not in ("COMPLETE", "PRUNED")] + waiting
    remaining = len(left)
    if budget:
        cost = f"{remaining} trials of {budget:g} aggregate device-hours: {remaining * budget:,.4g} device-hours"
    elif elapsed:  # N experts on N devices spend up to N times the slowest one's time
        most = sum(point_experts(spec, p) for p in left) * elapsed
        cost = (f"{remaining} trials to {elapsed:g} estimated elapsed hours each (the slowest expert's update "
                f"time): at most {most:,.1f} aggregate device-hours, every expert as slow as the slowest")
    else:
        cost = f"{remaining} of {len(points) + len(waiting)} trials"
    cost += f"; all of them: {experiment.cost[scale]}"
    measured = _measured_minutes(study) if remaining and not (budget or elapsed) else None
    if measured:
        cost += f"; the study's finished trials took {measured:.1f} min each: about {remaining * measured:.0f} " \
                "core-minutes to go"
    print(f"to run: {cost}")
    if spec.calibrate is not None:
        timed, configurations = read_calibration(spec), calibration_points(spec)
        print(f"calibration: {sum(key in timed for key in configurations)} of {len(configurations)} configurations "
              "timed alone "
              f"({spec.output_dir / CALIBRATION}), the rest first")
    print(f"equal compute: {experiment.basis}")
    return {"trials": len(points) + len(waiting), "done": done, "cost": cost}


def result_folder(results: Path, experiment: Experiment, scale: str) -> Path:
    """Where an experiment's result goes: `<results>/<name>` at CPU scale, `<name>_<scale>` otherwise."""
    return results / (experiment.name if scale == "cpu" else f"{experiment.name}_{scale}")


def _print_commands(commands: list[list[str]], label: str = "") -> None:
    for arguments in commands:
        print(f"  {label}python -m soma_pl.cli " + " ".join(arguments))


def list_commands(experiment: Experiment, scale: str, results: Path) -> None:
    """The commands an experiment runs at `scale` and what they cost, printed; nothing runs."""
    print(f"{experiment.name} ({scale}): {experiment.title}")
    folder = result_folder(results, experiment, scale)
    _print_commands([*experiment.data.get(scale, []), *_commands(experiment, scale, folder)])
    print(f"to run: {experiment.cost[scale]}")
    print(f"equal compute: {experiment.basis}")


def _run_workers(spec: SweepSpec, storage: str, workers: int, logs: Path, progress: bool = True) -> None:
    """`workers` sweep workers (one thread each) until the study is done, with one progress bar
    (unless not `progress`)."""
    logs.mkdir(parents=True, exist_ok=True)
    open_storage(storage)  # a new database's tables made here, before the workers race to make them
    environment = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "soma_pl.cli", "sweep", "--sweep", str(spec.path), f"--storage={storage}",
               "--progress=false"]
    handles = [(logs / f"worker{i}.log").open("w") for i in range(workers)]
    # the workers (and their trials, which watch their worker) die with this process, however it ends
    processes = [subprocess.Popen(command, stdout=h, stderr=subprocess.STDOUT, env=environment,
                                  preexec_fn=die_with_parent(os.getpid())) for h in handles]
    bar, study = SweepProgress(spec, progress), None
    try:
        while any(p.poll() is None for p in processes):
            time.sleep(POLL_SECONDS)
            try:
                # Opened once: each opening of a database storage sets up its heartbeat (and warns).
                study = study or open_study(spec, open_storage(storage, spec=spec), create=False)
            except (KeyError, optuna.exceptions.StorageInternalError):
                continue  # the first worker has not made the study yet
            bar.update(study)
    except KeyboardInterrupt:
        # Ctrl-C reached the workers too (one process group); each marks its trial interrupted, to
        # re-run on restart. A worker started otherwise is sent SIGTERM, which it handles the same way.
        deadline = time.time() + 10
        for process in processes:
            try:
                process.wait(max(0.0, deadline - time.time()))
            except subprocess.TimeoutExpired:
                process.send_signal(signal.SIGTERM)
                process.wait()
        raise
    finally:
        bar.close()
        for handle in handles:
            handle.close()
    failed = [(i, p.returncode) for i, p in enumerate(processes) if p.returncode != 0]
    if failed:
        index, code = failed[0]
        tail = " | ".join((logs / f"worker{index}.log").read_text(errors="replace").strip().splitlines()[-2:])
        raise SomaError(f"sweep worker {index} of {spec.name} exited with status {code} "
                        f"({logs / f'worker{index}.log'}): {tail}")


def _prepare_data(experiment: Experiment, scale: str, logs: Path) -> None:
    """The experiment's data commands (`prepare`, `shard`: no-ops when their output is up to date)."""
    for index, arguments in enumerate(experiment.data.get(scale, [])):
        quiet = ["--progress=false"] if arguments[0] in ("prepare", "shard") else []
        _call([*arguments, *quiet], logs / f"data{index}-{arguments[0]}.log")


def _call(arguments: list[str], log: Path) -> None:
    """One CLI command, its output into `log`; a failure raised with the log's last line."""
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as output:
        code = subprocess.call([sys.executable, "-m", "soma_pl.cli", *arguments], stdout=output,
                               stderr=subprocess.STDOUT, preexec_fn=die_with_parent(os.getpid()))
    if code != 0:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-1:])
        raise SomaError(f"{' '.join(arguments)} failed ({log}): {tail}")


def busy_seconds(trials: list) -> float:
    """The wall time during which at least one of `trials` ran (the union of their start-to-complete
    intervals): the sweep's own wall time, the same when a later run reuses every trial, and free of
    the gaps between sessions of a study resumed over several."""
    total, end = 0.0, None
    for start, stop in sorted((t.datetime_start, t.datetime_complete) for t in trials
                              if t.datetime_start and t.datetime_complete):
        if end is None or start > end:
            total, end = total + (stop - start).total_seconds(), stop
        elif stop > end:
            total, end = total + (stop - end).total_seconds(), stop
    return total


def run(experiment: Experiment, scale: str, spec: SweepSpec, storage: str, workers: int, results: Path,
        progress: bool = True) -> dict:
    """Run the experiment's sweep to the end, then write and print its result."""
    folder = result_folder(results, experiment, scale)
    started = time.time()
    load_before = os.getloadavg()[0]
    _prepare_data(experiment, scale, folder / "logs")
    spec.output_dir.mkdir(parents=True, exist_ok=True)  # the trials' folder, which holds the default storage
    timed = calibrate(spec, progress) if spec.calibrate is not None else None  # alone, before any trial
    _run_workers(spec, storage, workers, folder / "logs", progress)
    study = optuna.load_study(study_name=spec.name, storage=open_storage(storage, spec=spec))
    if not study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,)):
        raise SomaError(f"{experiment.name}: no trial of {spec.name} completed; see {folder / 'logs'}")
    check_runs_calibrated(spec, [calibration(Path(run)) for runs in run_folders(study).values()
                                 for run in runs.values()])
    report = build_report(study, storage, final_test=experiment.final_test)
    measured = experiment.result(report, run_folders(study))  # scores the selected runs: part of the wall time
    measured["checks"] = family(measured.get("checks", []))
    finished = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    trial_minutes = sum((t.datetime_complete - t.datetime_start).total_seconds() for t in finished) / 60
    result = {"experiment": experiment.name, "scale": scale, "title": experiment.title, "basis": experiment.basis,
              "sweep": str(spec.path), "study": spec.name, "unit": "nats/byte", "workers": workers,
              "wall_seconds": round(time.time() - started, 1), "load_average": [load_before, os.getloadavg()[0]],
              "sweep_wall_seconds": round(busy_seconds(study.get_trials(deepcopy=False)), 1),
              "trial_minutes": round(trial_minutes, 1), "accounting": accountings(run_folders(study)),
              "calibration": timed, "measured_over_calibrated": measured_over_calibrated(run_folders(study)),
              **measured}
    return _write(experiment, folder, result)


def _write(experiment: Experiment, folder: Path, result: dict) -> dict:
    """`result.json`, `table.md` and the figure (where the experiment has one) into `folder`; the
    table printed."""
    text = experiment.table(result)
    folder.mkdir(parents=True, exist_ok=True)
    write_json_atomic(folder / "result.json", result)
    write_atomic(text.encode(), folder / "table.md")
    figure = experiment.figure(result, folder / "figure.png")
    print(text)
    print(f"wrote {folder / 'result.json'}, {folder / 'table.md'}{f', {figure}' if figure else ''}", file=sys.stderr)
    return result


def _commands(experiment: Experiment, scale: str, folder: Path) -> list[list[str]]:
    """The experiment's commands at `scale` with `{folder}` filled in."""
    return [[argument.replace("{folder}", str(folder)) for argument in arguments]
            for arguments in experiment.commands[scale]]


def run_commands(experiment: Experiment, scale: str, results: Path, progress: bool = True) -> dict:
    """Run the experiment's commands in order (each logged to `<folder>/logs`), then write and print
    its result from what they wrote into its folder. A command that finished before with the same
    arguments (its stamp `logs/run<i>.done`) is reused, as a sweep's finished trials are: delete the
    stamp to run it again."""
    folder = result_folder(results, experiment, scale)
    started, load_before = time.time(), os.getloadavg()[0]
    _prepare_data(experiment, scale, folder / "logs")
    commands, seconds = _commands(experiment, scale, folder), []
    for index, arguments in enumerate(tqdm(commands, desc=experiment.name, unit="command", disable=not progress)):
        stamp = folder / "logs" / f"run{index}.done"
        done = json.loads(stamp.read_text()) if stamp.is_file() else {}
        if done.get("arguments") != experiment.commands[scale][index]:
            begun = time.time()
            _call(arguments, folder / "logs" / f"run{index}-{arguments[0]}.log")
            done = {"arguments": experiment.commands[scale][index], "seconds": round(time.time() - begun, 1)}
            write_json_atomic(stamp, done)
        seconds.append(done["seconds"])
    try:
        measured = experiment.result(folder)
    except (KeyError, IndexError, TypeError) as error:  # a command's output without what the result reads
        raise SomaError(f"{experiment.name}: the output in {folder} lacks what its result reads "
                        f"({type(error).__name__}: {error})") from error
    measured["checks"] = family(measured.get("checks", []))
    result = {"experiment": experiment.name, "scale": scale, "title": experiment.title, "basis": experiment.basis,
              "commands": [" ".join(["python -m soma_pl.cli", *arguments])
                           for arguments in _commands(experiment, scale, Path(os.path.relpath(folder)))],
              "unit": experiment.paper.get("unit", "nats/byte"), "wall_seconds": round(time.time() - started, 1),
              "command_seconds": seconds, "load_average": [load_before, os.getloadavg()[0]], **measured}
    return _write(experiment, folder, result)


def main(experiments: list[str], scale: Literal["cpu", "paper"] = "cpu", dry_run: bool = False,
         workers: int | None = None, storage: str | None = None, results: str = "results",
         progress: bool = True) -> None:
    """Run one or more of the paper's experiments and report each beside the paper.

    The experiments' sweep files, configs, data and trial folders are the repository's, named from
    its root: the command runs there wherever it is started; `results` and a storage file path are
    taken from where it was started.

    Args:
        experiments: experiment names (listed below).
        scale: `cpu` (the demo corpus, minutes to an hour on 2 cores) or `paper` (the paper's sizes, for GPUs).
        dry_run: list the trials, which are done, and what the rest costs; run nothing.
        workers: sweep workers, one thread each; None: one per core.
        storage: Optuna storage URL; None: the sweep's own (sqlite in its output folder).
        results: where each experiment's folder of results goes.
        progress: show a progress bar on stderr.
    """
    if workers is not None and workers < 1:
        raise ConfigError(f"--workers={workers}: give 1 or more sweep workers")
    chosen = [load_experiment(name) for name in experiments]
    results, storage = Path(results).absolute(), storage and _absolute_storage(storage)
    with in_repository():
        _reproduce(chosen, scale, dry_run, workers, storage, results, progress)


def demo(dry_run: bool = False, workers: int | None = None, results: str = "results", progress: bool = True) -> None:
    """The main job: monolithic SPSA against SOMA at equal compute, a table and a figure.

    `reproduce main_job` (`experiments/main_job.yaml`): both sides from their seeds at the learning rates
    seed 0 of the demo's Table 6 selection chose, three seeds, each at the selection's budget of update time (each
    side's calibrated alone), tested; the result goes to `results/main_job/`.

    Args:
        dry_run: list the trials, which are done, and what the rest costs; run nothing.
        workers: sweep workers, one thread each; None: one per core.
        results: where the result's folder goes.
        progress: show a progress bar on stderr.
    """
    main(["main_job"], dry_run=dry_run, workers=workers, results=results, progress=progress)


def _reproduce(chosen: list[Experiment], scale: str, dry_run: bool, workers: int | None, storage: str | None,
               results: Path, progress: bool) -> None:
    """`main` in the repository root."""
    for experiment in chosen:  # a wrong module, function or compared column is refused before anything runs
        for kind in ("result", "markdown"):
            experiment.function(kind)
        if scale in experiment.sweeps:
            check_columns(experiment, sweep_columns(load_sweep(experiment.sweeps[scale])))
    for experiment in chosen:
        if scale not in experiment.scales:
            why = experiment.cost.get(scale)
            raise ConfigError(f"reproduce {experiment.name}: nothing to run at --scale {scale}"
                              f"{f' ({why})' if why else ''}; run --scale {' or '.join(experiment.scales)}")
        if experiment.commands:
            if dry_run:
                list_commands(experiment, scale, results)
            else:
                run_commands(experiment, scale, results, progress)
            continue
        spec = load_sweep(experiment.sweeps[scale])
        url = storage or spec.storage or default_storage(spec)
        if dry_run:
            list_trials(experiment, scale, spec, url)
            continue
        count = workers or os.cpu_count() or 1
        run(experiment, scale, spec, url, min(count, spec.planned_trials()), results, progress)
