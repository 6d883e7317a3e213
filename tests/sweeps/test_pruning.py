"""`TrialReporter`: validation losses reach the Optuna trial at the global step; the study's pruner
stops the fit gracefully; a trial process whose runner is gone stops."""

from __future__ import annotations

import os
from types import SimpleNamespace

import optuna
import pytest
import torch
from lightning.pytorch.trainer.states import TrainerFn
from optuna.trial import create_trial

from soma_pl.sweeps.study import open_storage
from soma_pl.sweeps.trial import RunnerGone, TrialReporter


def _trainer(step: int, loss: float) -> SimpleNamespace:
    return SimpleNamespace(sanity_checking=False, state=SimpleNamespace(fn=TrainerFn.FITTING), is_global_zero=True,
                           global_rank=0, callback_metrics={"val/loss": torch.tensor(loss)}, global_step=step,
                           should_stop=False)


@pytest.fixture()
def storage(tmp_path) -> str:
    url = str(tmp_path / "journal.log")
    study = optuna.create_study(study_name="prune", storage=open_storage(url))
    for loss in (2.0, 3.0):  # two finished trials: the median at step 20 is 2.5
        study.add_trial(create_trial(value=loss, intermediate_values={20: loss}))
    return url


@pytest.mark.parametrize(("loss", "pruned"), [(2.6, True), (2.4, False)])
def test_reports_at_the_global_step_and_prunes_above_the_median(storage, loss, pruned):
    trial = optuna.load_study(study_name="prune", storage=open_storage(storage)).ask()
    reporter = TrialReporter(storage, "prune", trial.number, pruner="median", n_startup_trials=2)
    trainer = _trainer(step=20, loss=loss)
    reporter.on_validation_end(trainer, None)
    frozen = optuna.load_study(study_name="prune", storage=open_storage(storage)).trials[trial.number]
    assert frozen.intermediate_values == {20: pytest.approx(loss)}
    assert reporter.pruned is pruned and trainer.should_stop is pruned


def test_without_a_pruner_it_only_reports(storage):
    trial = optuna.load_study(study_name="prune", storage=open_storage(storage)).ask()
    reporter = TrialReporter(storage, "prune", trial.number)
    trainer = _trainer(step=20, loss=9.0)
    reporter.on_validation_end(trainer, None)
    assert not reporter.pruned and not trainer.should_stop


def test_a_trial_process_stops_when_its_runner_is_gone(storage):
    reporter = TrialReporter(storage, "prune", 0, runner_pid=os.getppid())
    reporter.on_train_batch_end(_trainer(1, 1.0))
    orphaned = TrialReporter(storage, "prune", 0, runner_pid=os.getppid() + 100000)
    with pytest.raises(RunnerGone, match="is gone"):
        orphaned.on_train_batch_end(_trainer(1, 1.0))


def test_the_other_ranks_of_a_multi_process_trial_are_not_the_runners_children(storage):
    """Rank 1 of a DDPP trial is rank 0's child: its parent is not the runner, and it goes on."""
    orphaned = TrialReporter(storage, "prune", 0, runner_pid=os.getppid() + 100000)
    other_rank = _trainer(1, 1.0)
    other_rank.global_rank = 1
    orphaned.on_train_batch_end(other_rank)  # no RunnerGone
    with pytest.raises(RunnerGone, match="is gone"):
        orphaned.on_train_batch_end(_trainer(1, 1.0))


def test_the_runner_names_the_trial_reporter_it_adds_to_each_trial():
    """The runner names the class rather than importing it (that would import Lightning)."""
    from soma_pl.sweeps import runner

    assert runner.TRIAL_REPORTER == f"{TrialReporter.__module__}.{TrialReporter.__name__}"
