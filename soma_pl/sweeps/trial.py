"""One sweep trial's process: `fit` through the suite's LightningCLI, then `test` on its last checkpoint.

    python -m soma_pl.sweeps.trial RESULT.json <fit arguments>

The runner starts this in a process of its own, so a crashing fit cannot take the study down. It
writes RESULT.json (atomically) with the ensemble-validation loss from the run's `summary.json`,
the test loss from `test_scores.json`, and whether the trial was pruned. The `TrialReporter`
callback, which the runner adds to sweep trials only, reports every validation loss to the Optuna
trial so the study's pruner can stop it.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import optuna
from lightning.pytorch.trainer.states import TrainerFn
from optuna.exceptions import UpdateFinishedTrialError

from soma_pl.errors import SomaError
from soma_pl.io import write_json_atomic
from soma_pl.sweeps.space import PrunerKind, PrunerSpec


class RunnerGone(SystemExit):
    """The sweep runner that owns this trial exited, or the trial was failed meanwhile: stop."""


class TrialReporter(L.Callback):
    """Reports `monitor` after each validation to Optuna trial `trial_number`; stops the fit
    (gracefully, so `summary.json` is still written) when the study's pruner says so.

    Optuna's own Lightning callback reports per epoch; suite runs are one stream-fed epoch that
    validates every `val_check_interval` steps, so this one reports at the global step.

    Args:
        storage: the study's storage (an Optuna RDB URL or a journal file path).
        study_name: the sweep's study.
        trial_number: the trial this fit belongs to.
        pruner: pruner kind and settings (the study's).
        report: report intermediate values (False for a multi-seed trial's later seeds).
        runner_pid: the runner's process id; the fit stops when the runner is gone.
        monitor: the metric reported.
    """

    def __init__(self, storage: str, study_name: str, trial_number: int, pruner: PrunerKind = PrunerKind.none,
                 n_startup_trials: int = 4, n_warmup_steps: int = 0, report: bool = True,
                 runner_pid: int | None = None, monitor: str = "val/loss"):
        self.storage, self.study_name, self.trial_number = storage, study_name, trial_number
        self.pruner = PrunerSpec(PrunerKind(pruner), n_startup_trials, n_warmup_steps)
        self.report, self.runner_pid, self.monitor = report, runner_pid, monitor
        self.pruned = False
        self._trial: optuna.Trial | None = None

    def _optuna_trial(self) -> optuna.Trial:
        if self._trial is None:
            from soma_pl.sweeps.study import make_pruner, open_storage, trial_id

            storage = open_storage(self.storage)
            study = optuna.load_study(study_name=self.study_name, storage=storage, pruner=make_pruner(self.pruner))
            self._trial = optuna.Trial(study, trial_id(storage, study, self.trial_number))
        return self._trial

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        # Only rank 0 is the runner's child; the other ranks of a multi-process trial (DDPP, expert-
        # parallel SOMA) are rank 0's, and its end breaks their collectives.
        if self.runner_pid is not None and trainer.global_rank == 0 and os.getppid() != self.runner_pid:
            raise RunnerGone(f"sweep runner {self.runner_pid} is gone: stopping trial {self.trial_number}")

    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not self.report or trainer.sanity_checking or trainer.state.fn != TrainerFn.FITTING:
            return
        value = trainer.callback_metrics.get(self.monitor)
        if value is None or not trainer.is_global_zero:
            return
        trial = self._optuna_trial()
        try:
            trial.report(float(value), step=trainer.global_step)
        except UpdateFinishedTrialError:
            raise RunnerGone(f"trial {self.trial_number} was finished by another process") from None
        if trial.should_prune():
            self.pruned = True
            trainer.should_stop = True


def _reporter(trainer: L.Trainer) -> TrialReporter | None:
    return next((c for c in trainer.callbacks if isinstance(c, TrialReporter)), None)


def run_trial(result_path: Path, fit_args: list[str]) -> dict:
    """Fit, test the last checkpoint unless pruned, and write the result JSON; returns it."""
    from soma_pl.lightning_cli import make_cli

    cli = make_cli(["fit", *fit_args])
    trainer = cli.trainer
    run_dir = Path(trainer.log_dir or trainer.default_root_dir)
    summary_path = run_dir / "summary.json"
    if not summary_path.is_file():
        raise SomaError(f"the fit wrote no {summary_path}")
    summary = json.loads(summary_path.read_text())
    reporter = _reporter(trainer)
    pruned = bool(reporter and reporter.pruned)
    result = {"run_dir": str(run_dir), "summary": str(summary_path), "global_step": summary["global_step"],
              "val_loss": summary["metrics"].get("val/loss"), "pruned": pruned, "test_loss": None}
    if result["val_loss"] is None:
        raise SomaError(f"{summary_path} has no val/loss: did the fit validate?")
    if not pruned:
        # `test` on the fit's last checkpoint, as its own CLI run (its own W&B run in the group).
        tester = make_cli(["test", *fit_args, f"--ckpt_path={summary['last_checkpoint']}"])
        scores_path = Path(tester.trainer.log_dir or tester.trainer.default_root_dir) / "test_scores.json"
        if not scores_path.is_file():
            raise SomaError(f"`test` wrote no {scores_path}")
        result["test_loss"] = json.loads(scores_path.read_text())["loss"]
        result["test_scores"] = str(scores_path)
    write_json_atomic(result_path, result)
    return result


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        raise SystemExit("usage: python -m soma_pl.sweeps.trial RESULT.json <fit arguments>")
    try:
        run_trial(Path(argv[0]), argv[1:])
    except SomaError as error:
        print(f"soma_pl: error: {error}", file=sys.stderr)
        raise SystemExit(2) from None


if __name__ == "__main__":
    main()
