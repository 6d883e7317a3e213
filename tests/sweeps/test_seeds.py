"""Seeds are repetitions, not hyperparameters: every configuration runs once per seed, the seed is a
trial user attribute (never `trial.params`, so importance analysis never sees it), the report
averages over seeds, and a sweep file that searches or fixes the seed is refused with one line."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from types import SimpleNamespace

import optuna
import pytest
from optuna.trial import TrialState

from soma_pl.sweeps import runner
from soma_pl.sweeps.report import build_report
from soma_pl.sweeps.space import load_sweep
from soma_pl.sweeps.study import open_storage, open_study
from tests.robustness.cli import cli, one_error

from .conftest import fake_val_loss, ran, spec_of, write_sweep

SEEDS = [0, 1, 2]
LRS = [0.01, 0.02]


def _finished_grid(tmp_path, storage: str):
    spec = spec_of(write_sweep(tmp_path, seeds=SEEDS))
    assert runner.work(spec, storage) == {"COMPLETE": 2 * len(LRS) * len(SEEDS)}
    return spec, open_study(spec, open_storage(storage), create=False)


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_grid_trials_hold_the_seed_as_a_user_attribute_not_a_parameter(kind, tmp_path, fake_trials):
    storage = f"sqlite:///{tmp_path / 'optuna.db'}" if kind == "sqlite" else str(tmp_path / "journal.log")
    _, study = _finished_grid(tmp_path, storage)
    seen = []
    for trial in study.trials:
        assert set(trial.params) == {"N", "lr"} and set(trial.distributions) == {"N", "lr"}
        seed = trial.user_attrs["seed"]
        assert [run["seed"] for run in trial.user_attrs["runs"]] == [seed]
        seen.append((trial.params["N"], trial.params["lr"], seed))
    # Every configuration ran once per seed, as the fake trial process itself recorded.
    expected = sorted((n, lr, s) for n in (1, 2) for lr in LRS for s in SEEDS)
    assert sorted(seen) == expected
    assert sorted((p["N"], p["lr"], p["seed"]) for p in ran(fake_trials)) == expected


def test_importance_analysis_of_a_finished_study_lists_no_seed(tmp_path, fake_trials):
    _, study = _finished_grid(tmp_path, str(tmp_path / "journal.log"))
    # fANOVA, Optuna's default and optuna-dashboard's view.
    importances = optuna.importance.get_param_importances(study)
    assert set(importances) == {"N", "lr"} and sum(importances.values()) == pytest.approx(1.0)
    # N moves the loss by 0.1 and lr by 0.01 (fake_val_loss): a forest's impurity decrease ranks N first.
    impurity = optuna.importance.get_param_importances(
        study, evaluator=optuna.importance.MeanDecreaseImpurityImportanceEvaluator(seed=0))
    assert set(impurity) == {"N", "lr"} and impurity["N"] > impurity["lr"]


def test_range_trials_run_every_seed_and_suggest_no_seed(tmp_path, fake_trials):
    spec = spec_of(write_sweep(tmp_path, grid={}, report={}, trials=2, seeds=SEEDS,
                               ranges={"eps": {"key": "model.init_args.spsa.eps", "low": 0.001, "high": 0.01}}))
    storage = str(tmp_path / "journal.log")
    assert runner.work(spec, storage) == {"COMPLETE": 2}
    for trial in open_study(spec, open_storage(storage), create=False).trials:
        assert set(trial.params) == {"eps"}
        assert [run["seed"] for run in trial.user_attrs["runs"]] == SEEDS
        assert trial.value == pytest.approx(statistics.fmean(fake_val_loss(trial.params, s) for s in SEEDS))


def test_report_averages_each_configuration_over_its_seeds(tmp_path, fake_trials):
    _, study = _finished_grid(tmp_path, str(tmp_path / "journal.log"))
    t6 = build_report(study, "journal")["table6"]
    assert t6["row_factors"] == ["lr"] and t6["column_labels"] == [1, 2]
    cells = 0
    for row in t6["rows"]:
        for label, cell in row["cells"].items():
            params = {"N": int(label), "lr": row["setting"]["lr"]}
            values = [t.value for t in study.get_trials(states=(TrialState.COMPLETE,)) if t.params == params]
            assert len(values) == len(SEEDS) and cell["val"]["n"] == len(SEEDS)
            assert sorted(cell["seeds"]) == SEEDS
            assert cell["val"]["mean"] == pytest.approx(statistics.fmean(values))
            assert cell["val"]["sd"] == pytest.approx(statistics.stdev(values))
            # Closed form: the seeds add 0.01 * seed, so the mean is the seed-free loss + 0.01 * mean seed.
            assert cell["val"]["mean"] == pytest.approx(fake_val_loss(params, 0) + 0.01 * statistics.fmean(SEEDS))
            cells += 1
    assert cells == 2 * len(LRS)


@pytest.mark.parametrize(("fields", "where"), [
    ({"grid": {"seed": {"key": "k", "values": [1, 2]}}}, "grid.seed"),
    ({"grid": {"s": {"key": "seed_everything", "values": [1, 2]}}}, "grid.s"),
    ({"grid": {"init": {"choices": {"a": {"model.init_args.seed": 1}, "b": {}}}}}, "grid.init"),
    ({"ranges": {"s": {"key": "model.init_args.seed", "low": 0, "high": 9, "int": True}}, "trials": 3}, "ranges.s"),
    ({"overrides": {"seed_everything": 3}}, "overrides.seed_everything"),
])
def test_a_sweep_file_that_searches_or_fixes_the_seed_is_refused_in_one_line(fields, where, tmp_path, capsys):
    sweep = write_sweep(tmp_path, **fields)
    one_error(cli(capsys, "sweep", "--sweep", str(sweep), "--progress", "false"),
              f"{sweep}: {where} sets the seed", "`seeds:`")
    assert not (tmp_path / "out").exists()  # refused before any study or trial folder


def test_the_module_seed_goes_only_to_modules_that_take_one(tmp_path, monkeypatch):
    """A zero-order module's directions take `model.init_args.seed`; BPTT has no such argument, so
    its trials' repetition seed is `seed_everything`'s and its training stream's (a warm-started BPTT
    run draws nothing else at random); a grid mixing both, as Table 5's does, runs both."""
    monkeypatch.chdir(Path(__file__).resolve().parents[2])
    spec = dataclasses.replace(load_sweep("sweeps/demo/table5.yaml"), calibrate=None)  # no calibration file here
    seen = {}
    for point in spec.grid_points()[::2]:
        command = runner.fit_command(spec, SimpleNamespace(number=0), {"run": point["run"]}, 3, tmp_path / "t",
                                     "sqlite:///x.db", report=False)
        seen[point["run"]] = ("--model.init_args.seed=3" in command, "--seed_everything=3" in command,
                              "--data.init_args.seed=3" in command)
    assert seen == {"soma_n1": (True, True, False), "soma_n2": (True, True, False), "soma_n4": (True, True, False),
                    "bptt_n1": (False, True, True), "bptt_n2": (False, True, True), "bptt_n4": (False, True, True)}
    class_paths = {"soma_pl.lit.ZOModule": True, "soma_pl.lit.BPTTModule": False}
    for class_path, takes in class_paths.items():
        assert runner.takes_seed((), {"model.class_path": class_path}) is takes
