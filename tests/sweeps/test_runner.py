"""The shared study: every grid point once, resume without repeats, failures kept, stale and
interrupted trials re-run, duplicates claimed once, TPE ranges, and the real trial command line."""

from __future__ import annotations

import json
import threading
import time

import pytest
from optuna.trial import TrialState

from soma_pl.errors import ConfigError
from soma_pl.sweeps import runner
from soma_pl.sweeps.space import load_sweep, point_key
from soma_pl.sweeps.study import HEARTBEAT, claim_waiting, open_storage, open_study, selections, sync_queue, trial_id

from .conftest import TINY, fake_val_loss, ran, spec_of, write_sweep

STORAGES = {"sqlite": lambda d: f"sqlite:///{d / 'optuna.db'}", "journal": lambda d: str(d / "journal.log")}


def _study(spec, storage):
    return open_study(spec, open_storage(storage), create=False)


def _by_state(study) -> dict[str, int]:
    counts: dict[str, int] = {}
    for trial in study.get_trials(deepcopy=False):
        counts[trial.state.name] = counts.get(trial.state.name, 0) + 1
    return counts


@pytest.mark.parametrize(("kind", "seeds"), [("sqlite", [0]), ("journal", [0, 1])])
def test_grid_runs_every_point_once_and_resumes_without_repeats(kind, seeds, tmp_path, fake_trials):
    storage = STORAGES[kind](tmp_path)
    spec = spec_of(write_sweep(tmp_path, seeds=seeds))
    points = len(spec.grid_points())
    assert points == 4 * len(seeds)  # N (2) x lr (2) x seeds
    assert runner.work(spec, storage, n_trials=3) == {"COMPLETE": 3}
    assert runner.work(spec, storage) == {"COMPLETE": points - 3}
    assert runner.work(spec, storage) == {}  # a finished study: nothing runs again
    assert sorted(map(point_key, ran(fake_trials))) == sorted(map(point_key, spec.grid_points()))
    study = _study(spec, storage)
    assert _by_state(study) == {"COMPLETE": points}
    for trial in study.trials:
        point = json.loads(trial.user_attrs["point"])
        assert trial.params == {k: v for k, v in point.items() if k != "seed"}  # the seed is no parameter
        assert trial.user_attrs["seed"] == point["seed"]
        assert trial.value == pytest.approx(fake_val_loss(point, point["seed"]))
        assert trial.user_attrs["test_loss"] == pytest.approx(trial.value + 0.05)


def test_failed_trial_is_kept_with_its_error_and_rerun_only_on_request(tmp_path, fake_trials):
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, seeds=[0], grid={
        "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.01, 0.5]}}, report={}))
    assert runner.work(spec, storage) == {"COMPLETE": 1, "FAIL": 1}
    failed = _study(spec, storage).get_trials(states=(TrialState.FAIL,))
    assert len(failed) == 1 and failed[0].params == {"lr": 0.5}
    assert failed[0].user_attrs["failure"] == "error"
    assert failed[0].user_attrs["error"] == "FloatingPointError: loss diverged at step 3 (lr 0.5)"
    assert failed[0].user_attrs["log"].endswith("fit.log")
    assert runner.work(spec, storage) == {}
    assert runner.work(spec, storage, retry_failed=True) == {"FAIL": 1}
    assert _by_state(_study(spec, storage)) == {"COMPLETE": 1, "FAIL": 2}


def test_stale_running_trial_is_failed_and_its_point_rerun(tmp_path, fake_trials):
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, stale_seconds=5, seeds=[0]))
    opened = open_storage(storage)
    study = open_study(spec, opened)
    sync_queue(study, opened, spec)
    orphan = claim_waiting(study, opened)  # claimed by a worker that is then SIGKILLed: no more heartbeats
    opened.set_trial_system_attr(trial_id(opened, study, orphan.number), HEARTBEAT, time.time() - 60)
    assert runner.work(spec, storage) == {"COMPLETE": 4}
    study = _study(spec, storage)
    stale = study.trials[orphan.number]
    assert stale.state == TrialState.FAIL and stale.user_attrs["failure"] == "stale"
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.user_attrs["point"] for t in complete) == sorted(map(point_key, spec.grid_points()))


def test_database_storage_uses_optunas_heartbeat_and_retry(tmp_path, fake_trials):
    """On SQLite Optuna records the heartbeats, fails a trial whose worker went silent and enqueues
    its retry (a copy naming the failed trial); the sweep's own heartbeat attribute is not used."""
    storage = STORAGES["sqlite"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, stale_seconds=1, seeds=[0]))
    opened = open_storage(storage, spec=spec)
    assert opened.get_heartbeat_interval() == 1  # heartbeat_seconds 0.2, rounded up to whole seconds
    study = open_study(spec, opened)
    sync_queue(study, opened, spec)
    orphan = claim_waiting(study, opened)  # its worker is then SIGKILLed: no more heartbeats
    assert HEARTBEAT not in study.trials[orphan.number].system_attrs
    time.sleep(2.5)  # past the 1 s grace period, by the database's clock
    assert runner.work(spec, storage) == {"COMPLETE": 4}
    study = _study(spec, storage)
    stale = study.trials[orphan.number]
    assert stale.state == TrialState.FAIL and "failure" not in stale.user_attrs  # failed by Optuna
    retries = [t for t in study.trials if t.system_attrs.get("failed_trial") == orphan.number]
    assert len(retries) == 1 and retries[0].state == TrialState.COMPLETE
    assert retries[0].user_attrs["point"] == stale.user_attrs["point"]
    complete = study.get_trials(states=(TrialState.COMPLETE,))
    assert sorted(t.user_attrs["point"] for t in complete) == sorted(map(point_key, spec.grid_points()))
    assert sorted(map(point_key, ran(fake_trials))) == sorted(map(point_key, spec.grid_points()))


def test_interrupted_worker_fails_its_trial_and_a_restart_finishes(tmp_path, fake_trials, monkeypatch):
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, seeds=[0]))
    real_run_fit, calls = runner.run_fit, []

    def interrupted_on_third(command, run_dir):
        calls.append(run_dir)
        if len(calls) == 3:
            raise runner.Interrupted("SIGINT")
        return real_run_fit(command, run_dir)

    monkeypatch.setattr(runner, "run_fit", interrupted_on_third)
    with pytest.raises(SystemExit) as stopped:
        runner.work(spec, storage)
    assert stopped.value.code == 130
    study = _study(spec, storage)
    assert _by_state(study) == {"COMPLETE": 2, "FAIL": 1, "WAITING": 1}
    assert study.get_trials(states=(TrialState.FAIL,))[0].user_attrs["failure"] == "interrupted"
    monkeypatch.setattr(runner, "run_fit", real_run_fit)
    assert runner.work(spec, storage) == {"COMPLETE": 2}
    assert sorted(map(point_key, ran(fake_trials))) == sorted(map(point_key, spec.grid_points()))


def test_a_point_enqueued_twice_is_claimed_once(tmp_path):
    spec = spec_of(write_sweep(tmp_path, seeds=[0], grid={"lr": {"key": "k", "values": [0.01]}}, report={}))
    opened = open_storage(STORAGES["journal"](tmp_path))
    study = open_study(spec, opened)
    sync_queue(study, opened, spec)
    point = spec.grid_points()[0]
    study.enqueue_trial(point, user_attrs={"point": point_key(point)})  # a second worker's enqueue
    first, second = claim_waiting(study, opened), claim_waiting(study, opened)
    assert first is not None and second is None
    duplicate = study.get_trials(states=(TrialState.FAIL,))
    assert len(duplicate) == 1 and duplicate[0].user_attrs["failure"] == "duplicate"
    assert sync_queue(study, opened, spec) == 0  # the point is RUNNING: nothing to enqueue


def test_range_sweep_asks_tpe_for_trials_over_every_seed(tmp_path, fake_trials):
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, grid={}, report={}, trials=3,
                               ranges={"eps": {"key": "model.init_args.spsa.eps", "low": 0.001, "high": 0.01,
                                               "log": True}}))
    assert runner.work(spec, storage) == {"COMPLETE": 3}
    assert runner.work(spec, storage) == {}
    for trial in _study(spec, storage).trials:
        runs = trial.user_attrs["runs"]
        assert [r["seed"] for r in runs] == [0, 1]
        eps = trial.params["eps"]
        assert 0.001 <= eps <= 0.01
        expected = [fake_val_loss({"eps": eps}, seed) for seed in (0, 1)]
        assert trial.value == pytest.approx(sum(expected) / 2)


def test_trial_command_parses_through_the_real_fit_cli(tmp_path, monkeypatch):
    from soma_pl.lightning_cli import make_cli
    from soma_pl.sweeps.trial import TrialReporter

    spec = spec_of(write_sweep(tmp_path, budget={"token_forwards": 1000}, wandb=True,
                               pruner={"kind": "median", "n_warmup_steps": 4}))
    storage = STORAGES["journal"](tmp_path)
    opened = open_storage(storage)
    study = open_study(spec, opened)
    sync_queue(study, opened, spec)
    trial = claim_waiting(study, opened)
    params, seed = runner.suggest(spec, trial), trial.user_attrs["seed"]
    command = runner.fit_command(spec, trial, params, seed, tmp_path / "trial", storage, report=True)
    assert command[3].endswith("trial_result.json") and command[4:6] == ["--config", str(TINY)]
    monkeypatch.setenv("WANDB_MODE", "disabled")
    cli = make_cli(command[4:], run=False)
    assert cli.model.seed == seed and cli.config["seed_everything"] == seed
    assert cli.model.model.num_experts == params["N"]
    assert cli.config["budget"]["token_forwards"] == 1000
    assert cli.config["wandb"]["group"] == "unit" and cli.config["wandb"]["name"] == f"trial-{trial.number}"
    assert cli.trainer.default_root_dir == str(tmp_path / "trial")
    reporters = [c for c in cli.trainer.callbacks if isinstance(c, TrialReporter)]
    assert len(reporters) == 1 and reporters[0].trial_number == trial.number
    assert reporters[0].pruner.n_warmup_steps == 4 and reporters[0].storage == storage


def test_two_workers_starting_together_share_the_study(tmp_path, fake_trials):
    storage = STORAGES["sqlite"](tmp_path)  # a fresh database: both workers race to create it
    spec = spec_of(write_sweep(tmp_path, seeds=[0]))
    results, errors = [], []

    def worker():
        try:
            results.append(runner.work(spec, storage))
        except Exception as error:  # noqa: BLE001 - reported by the assertion below
            errors.append(error)

    threads = [threading.Thread(target=worker) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    assert sum(r.get("COMPLETE", 0) for r in results) == 4
    assert sorted(map(point_key, ran(fake_trials))) == sorted(map(point_key, spec.grid_points()))
    assert _by_state(_study(spec, storage)) == {"COMPLETE": 4}


def test_progress_bar_counts_trials_and_shows_the_best_value(tmp_path, fake_trials, capsys):
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, seeds=[0]))
    assert runner.work(spec, storage, progress=True) == {"COMPLETE": 4}
    err = capsys.readouterr().err
    best = min(fake_val_loss(p, p["seed"]) for p in spec.grid_points())
    assert "sweep unit" in err and "4/4" in err and f"best={best:.4f}" in err
    assert "running=trial 3" in err


@pytest.mark.parametrize("second", ["other_storage", "recreated_storage", "other_study"])
def test_a_second_study_never_writes_the_first_ones_trial_folders(second, tmp_path, fake_trials, capsys):
    """A journal sweep and a SQLite sweep of one file (or a study created anew after its database was
    deleted, or another study name with the same output_dir) would number trials from 0 into the same
    `trial-NNNN` folders: the second is refused with one line and the first one's files stay."""
    from tests.robustness.cli import cli, one_error

    sweep = write_sweep(tmp_path, seeds=[0])
    spec = spec_of(sweep)
    first = STORAGES["journal"](tmp_path)
    assert runner.work(spec, first, n_trials=1) == {"COMPLETE": 1}
    result = spec.output_dir / "trial-0000" / "trial_result.json"
    kept = result.read_bytes()
    if second == "other_storage":
        args = ["--storage", STORAGES["sqlite"](tmp_path)]
    elif second == "recreated_storage":
        (tmp_path / "journal.log").unlink()
        args = ["--storage", first]
    else:
        sweep = write_sweep(tmp_path, seeds=[0], study="other")
        args = ["--storage", STORAGES["sqlite"](tmp_path)]
    line = one_error(cli(capsys, "sweep", "--sweep", str(sweep), *args, "--progress", "false"),
                     str(spec.output_dir), "trial folders", "own output_dir")
    assert "'unit'" in line and "journal.log" in line
    assert result.read_bytes() == kept
    assert sorted(p.name for p in spec.output_dir.glob("trial-*")) == ["trial-0000"]
    if second != "recreated_storage":  # the first study's own workers go on as before
        assert runner.work(spec_of(write_sweep(tmp_path, seeds=[0])), first, n_trials=1) == {"COMPLETE": 1}
        assert sorted(p.name for p in spec.output_dir.glob("trial-*")) == ["trial-0000", "trial-0001"]


def test_a_study_with_trials_but_no_record_of_its_sweep_is_refused_with_one_line(tmp_path, capsys):
    """A study whose trials no `sweep` of this version ran (made by hand, or by an earlier soma_pl whose
    grid searched the seed as a parameter and recorded no fit settings) cannot be checked against
    the sweep file: one line, not a KeyError or trials of unknown settings."""
    import optuna

    from tests.robustness.cli import cli, one_error

    sweep = write_sweep(tmp_path, seeds=[0])
    storage = STORAGES["journal"](tmp_path)
    old = optuna.create_study(study_name="unit", storage=open_storage(storage))
    old.enqueue_trial({"N": 1, "lr": 0.01, "seed": 0}, user_attrs={"point": "{}"})
    old.ask({"N": optuna.distributions.CategoricalDistribution([1, 2]),
             "seed": optuna.distributions.CategoricalDistribution([0])})
    trials = len(old.get_trials())
    one_error(cli(capsys, "sweep", "--sweep", str(sweep), "--storage", storage, "--progress", "false"), "'unit'")
    assert len(old.get_trials()) == trials, "no trial was added"


def test_a_process_that_loses_the_race_to_create_a_new_database_opens_it_again(tmp_path, monkeypatch):
    """Workers and `reproduce` open one new SQLite file at once: the loser of the race to create its
    tables gets "table studies already exists" from SQLAlchemy, and opens the database again."""
    from sqlalchemy.exc import OperationalError

    from soma_pl.sweeps import study

    calls, real = [], study.RDBStorage

    def racing(url, **kwargs):
        calls.append(url)
        if len(calls) == 1:
            real(url)  # another process makes the tables first ...
            raise OperationalError("CREATE TABLE studies", {}, Exception("table studies already exists"))
        return real(url, **kwargs)  # ... and this one finds them

    monkeypatch.setattr(study, "RDBStorage", racing)
    url = f"sqlite:///{tmp_path / 'new.db'}"
    storage = open_storage(url)
    assert len(calls) == 2 and storage.get_all_studies() == []

    def locked(url, **kwargs):
        calls.append(url)
        raise OperationalError("SELECT 1", {}, Exception("database is locked"))

    monkeypatch.setattr(study, "RDBStorage", locked)
    with pytest.raises(OperationalError, match="database is locked"):  # any other error is not retried
        open_storage(url)
    assert len(calls) == 3


def test_numeric_grid_factors_are_numeric_axes_in_optuna_with_the_grids_exact_values(tmp_path, fake_trials):
    """Optuna's dashboard and importance analysis see a number axis (log where the gaps widen) for
    each numeric grid factor, a categorical one for names; every trial still runs a grid value."""
    from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

    grid = {"N": {"choices": {1: {}, 2: {"model.init_args.num_experts": 2}}},
            "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.0125, 0.025, 0.05]},
            "n_pert": {"key": "model.init_args.spsa.n_pert", "values": [2, 4, 6]},
            "direction": {"key": "model.init_args.spsa.direction", "values": ["sparse"]}}
    storage = STORAGES["journal"](tmp_path)
    spec = spec_of(write_sweep(tmp_path, seeds=[0], grid=grid))
    assert runner.work(spec, storage) == {"COMPLETE": 18}
    trials = _study(spec, storage).trials
    assert trials[0].distributions == {
        "N": IntDistribution(1, 2, log=True), "lr": FloatDistribution(0.0125, 0.05, log=True),
        "n_pert": IntDistribution(2, 6), "direction": CategoricalDistribution(["sparse"])}
    assert sorted(json.dumps(t.params, sort_keys=True) for t in trials) == \
        sorted(json.dumps({k: v for k, v in p.items() if k != "seed"}, sort_keys=True) for p in spec.grid_points())
    assert {type(t.params["N"]) for t in trials} == {int} and {t.params["lr"] for t in trials} == {0.0125, 0.025, 0.05}


def test_a_study_holding_a_factor_as_categories_is_refused_naming_it(tmp_path):
    """A study whose trials held lr as categories (its sweep file gave lr names before) cannot take
    numeric lr trials."""
    import optuna

    from soma_pl.errors import ConfigError
    from soma_pl.sweeps.study import SWEEP_ATTR

    spec = spec_of(write_sweep(tmp_path, seeds=[0]))
    storage = open_storage(STORAGES["journal"](tmp_path))
    old = optuna.create_study(study_name="unit", storage=storage)
    old.set_user_attr(SWEEP_ATTR, spec.describe())
    old.ask({"lr": optuna.distributions.CategoricalDistribution([0.01, 0.02])})
    with pytest.raises(ConfigError, match="'lr'"):
        open_study(spec, storage)


def test_a_study_started_at_another_budget_is_refused_naming_the_setting(tmp_path):
    """A sweep file whose budget changed cannot add trials to the study its old budget began: its
    trials would stop at another budget than the finished ones, which no parameter shows."""
    import optuna

    from soma_pl.errors import ConfigError
    from soma_pl.sweeps.study import SWEEP_ATTR

    storage = open_storage(STORAGES["journal"](tmp_path))
    old = optuna.create_study(study_name="unit", storage=storage)
    old.set_user_attr(SWEEP_ATTR, spec_of(write_sweep(tmp_path, seeds=[0], budget={"device_hours": 0.01})).describe())
    open_study(spec_of(write_sweep(tmp_path, seeds=[0], budget={"device_hours": 0.01})), storage)
    with pytest.raises(ConfigError, match="budget"):
        open_study(spec_of(write_sweep(tmp_path, seeds=[0], budget={"device_hours": 0.02})), storage)


REAL_FIT_COMMAND = runner.fit_command  # before `fake_trials` replaces it


@pytest.mark.parametrize("given", [["--overrides", "{trainer.max_steps: 3, model.init_args.spsa.eps: 0.02}"],
                                   ["--overrides.trainer.max_steps=3", "--overrides.model.init_args.spsa.eps=0.02"]])
def test_command_line_overrides_reach_every_trial(given, tmp_path, fake_trials, monkeypatch, capsys):
    """`sweep --overrides` (a mapping, or one `--overrides.<key>` per setting) sets each trial's fit
    settings after its config and the sweep file's own overrides."""
    from tests.robustness.cli import cli

    commands, fake = [], runner.fit_command

    def recorded(*args, **kwargs):
        commands.append(REAL_FIT_COMMAND(*args, **kwargs))
        return fake(*args, **kwargs)

    monkeypatch.setattr(runner, "fit_command", recorded)
    sweep = write_sweep(tmp_path, seeds=[0], overrides={"trainer.max_steps": 5, "trainer.val_check_interval": 1})
    assert cli(capsys, "sweep", "--sweep", str(sweep), *given, "--progress", "false")[0] == 0
    assert len(commands) == 4
    for command in commands:
        settings = [arg for arg in command if arg.startswith(("--trainer.", "--model.init_args.spsa."))]
        assert {"--trainer.max_steps=3", "--model.init_args.spsa.eps=0.02", "--trainer.val_check_interval=1"} \
            <= set(settings)
        assert "--trainer.max_steps=5" not in settings


@pytest.mark.parametrize(("overrides", "setting"), [
    ({"model.init_args.optimizer.init_args.lr": 0.1}, "model.init_args.optimizer.init_args.lr"),
    ({"model": {"init_args": {"num_experts": 4}}}, "model.init_args.num_experts"),
    ({"trainer.log_every_n_steps": 3}, "trainer.log_every_n_steps")])
def test_an_override_of_a_searched_or_unworkable_setting_is_refused_naming_it(overrides, setting, tmp_path):
    from soma_pl.errors import ConfigError

    with pytest.raises(ConfigError, match=setting.replace(".", r"\.")):
        runner.main(str(write_sweep(tmp_path, seeds=[0])), overrides=overrides, progress=False)
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("trial-*"))


def test_a_worker_joining_a_study_with_other_fit_settings_is_refused_naming_them(tmp_path):
    """The study records the settings every trial ran with (the sweep file's overrides and `--overrides`):
    a worker with another `trainer.max_steps` would add trials that differ in a setting no parameter shows."""
    from soma_pl.errors import ConfigError

    path = write_sweep(tmp_path, seeds=[0], overrides={"trainer.max_steps": 3})
    storage = open_storage(STORAGES["journal"](tmp_path))
    study = open_study(load_sweep(path, {"model.init_args.spsa.eps": 0.02}), storage)
    assert study.user_attrs["soma_pl:sweep"]["overrides"] == {"trainer.max_steps": 3, "model.init_args.spsa.eps": 0.02}
    open_study(load_sweep(path, {"model.init_args.spsa.eps": 0.02}), storage)  # the same settings join
    for other in ({}, {"model.init_args.spsa.eps": 0.05}, {"model.init_args.spsa.eps": 0.02, "trainer.max_steps": 4}):
        with pytest.raises(ConfigError, match="overrides") as refused:
            open_study(load_sweep(path, other), storage)
        assert "model.init_args.spsa.eps" in str(refused.value) or "trainer.max_steps" in str(refused.value)


def test_a_grid_extended_in_its_file_runs_only_the_added_points_and_reports_them_all(tmp_path, fake_trials):
    """A selection at the edge of a grid is answered by adding a value: the study keeps its finished
    trials, runs the added points only, and its report reads every value."""
    from soma_pl.sweeps.report import build_report

    grid = {"N": {"choices": {1: {}, 2: {"model.init_args.num_experts": 2}}},
            "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.01, 0.02]}}
    storage = STORAGES["journal"](tmp_path)
    assert runner.work(spec_of(write_sweep(tmp_path, seeds=[0], grid=grid)), storage) == {"COMPLETE": 4}
    grid["lr"]["values"] = [0.01, 0.02, 0.04]
    wider = spec_of(write_sweep(tmp_path, seeds=[0], grid=grid))
    assert runner.work(wider, storage) == {"COMPLETE": 2}
    study = _study(wider, storage)
    assert sorted(t.params["lr"] for t in study.trials) == [0.01, 0.01, 0.02, 0.02, 0.04, 0.04]
    report = build_report(study, storage)
    assert report["sweep"]["labels"]["lr"] == [0.01, 0.02, 0.04]
    assert sorted(row["setting"]["lr"] for row in report["table6"]["rows"]) == [0.01, 0.02, 0.04]


def test_a_staged_grid_runs_its_second_stage_at_each_groups_selection(tmp_path, fake_trials, monkeypatch):
    """Table 6's protocol (App. I.2): every lr at eps = 0.002, then the other eps at the lr each
    column (N) and seed selected. The best lr differs by seed (0.02 for seed 0, 0.04 for seed 1)."""
    best = {0: 0.02, 1: 0.04}
    monkeypatch.setattr("tests.sweeps.conftest.fake_val_loss",
                        lambda point, seed: 2.0 + 100 * (point["lr"] - best[seed]) ** 2 + point["eps"])
    grid = {"N": {"choices": {1: {}, 2: {"model.init_args.num_experts": 2}}},
            "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.01, 0.02, 0.04]},
            "eps": {"key": "model.init_args.spsa.eps", "values": [0.001, 0.002, 0.004]}}
    spec = spec_of(write_sweep(tmp_path, grid=grid, first={"eps": 0.002}))
    assert len(spec.grid_points()) == 12 and spec.planned_trials() == 12 + 2 * 2 * 2
    storage = STORAGES["sqlite"](tmp_path)
    assert runner.work(spec, storage) == {"COMPLETE": 20}
    points = ran(fake_trials)
    second = [p for p in points if p["eps"] != 0.002]
    assert sorted((p["N"], p["seed"], p["lr"], p["eps"]) for p in second) == sorted(
        (n, seed, best[seed], eps) for n in (1, 2) for seed in (0, 1) for eps in (0.001, 0.004))
    for point in second:  # after every first-stage point of its group
        group = [i for i, p in enumerate(points) if p["eps"] == 0.002 and (p["N"], p["seed"]) == (point["N"],
                                                                                                 point["seed"])]
        assert len(group) == 3 and max(group) < points.index(point)
    study = _study(spec, storage)
    assert {group: p["lr"] for group, p in selections(spec, study).items()} == {
        (n, seed): best[seed] for n in (1, 2) for seed in (0, 1)}
    assert runner.work(spec, storage) == {}  # nothing runs again


def test_a_staged_grid_holds_a_grid_factor_at_one_of_its_labels(tmp_path):
    for first in ({"eps": 0.003}, {"N": 1}, {"width": 8}):
        with pytest.raises(ConfigError) as refused:
            spec_of(write_sweep(tmp_path, grid={"N": {"choices": {1: {}, 2: {}}},
                                                "eps": {"key": "model.init_args.spsa.eps", "values": [0.001, 0.002]}},
                                first=first))
        assert f"first.{next(iter(first))}" in str(refused.value)


def test_a_staged_grid_holding_two_factors_gives_each_its_own_labels(tmp_path):
    grid = {"lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.005, 0.01]},
            "eps": {"key": "model.init_args.spsa.eps", "values": [0.1, 0.2]}}
    spec = spec_of(write_sweep(tmp_path, grid={"N": {"choices": {1: {}}}, **grid}, first={"eps": 0.2, "lr": 0.005}))
    assert spec.later_labels() == [{"lr": 0.005, "eps": 0.1}, {"lr": 0.01, "eps": 0.1}, {"lr": 0.01, "eps": 0.2}]
    assert [(p["lr"], p["eps"]) for p in spec.grid_points()] == [(0.005, 0.2)] * 2  # one per seed


def test_a_group_whose_first_stage_all_failed_has_no_second_stage_until_a_retry_is_over(tmp_path, fake_trials):
    grid = {"N": {"choices": {1: {}}}, "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.5]},
            "eps": {"key": "model.init_args.spsa.eps", "values": [0.001, 0.002]}}
    spec = spec_of(write_sweep(tmp_path, grid=grid, seeds=[0], first={"eps": 0.002}))
    storage = STORAGES["sqlite"](tmp_path)
    assert runner.work(spec, storage) == {"FAIL": 1}  # lr 0.5 diverges (the fake trial's own error)
    study = _study(spec, storage)
    assert selections(spec, study) == {(1, 0): None}
    sync_queue(study, open_storage(storage), spec, retry_failed=True)  # queued again: not over
    assert selections(spec, _study(spec, storage)) == {}
