"""A sweep with nothing to report is no success: `sweep` exits non-zero when every trial failed,
`sweep report` refuses a study with no finished trial, a logging interval the report cannot use is
refused before the first trial, and a worker makes the folder of its storage file."""

from __future__ import annotations

import json

import pytest

from soma_pl.cli import main

from .conftest import ran, spec_of, write_sweep

LR = "model.init_args.optimizer.init_args.lr"


def _run(capsys, argv: list[str]) -> tuple[int, str, list[str]]:
    """The CLI's exit status, stdout, and stderr's non-empty lines."""
    capsys.readouterr()
    try:
        main(argv)
        code = 0
    except SystemExit as stop:
        code = stop.code
    captured = capsys.readouterr()
    return code, captured.out, [line for line in captured.err.splitlines() if line.strip()]


def test_a_sweep_whose_every_trial_failed_exits_2_naming_its_logs(tmp_path, fake_trials, capsys):
    sweep = write_sweep(tmp_path, seeds=[0, 1], grid={"lr": {"key": LR, "values": [0.5]}}, report={})
    code, out, err = _run(capsys, ["sweep", "--sweep", str(sweep), "--progress", "false"])
    assert code == 2 and len(err) == 1 and err[0].startswith("soma_pl: error:"), err
    assert str(spec_of(sweep).output_dir / "trial-NNNN" / "fit.log") in err[0]
    assert json.loads(out)["this_worker"] == {"FAIL": 2}  # the summary is still printed
    assert len(ran(fake_trials)) == 2
    # Started again it runs nothing (failures are kept), and the study still has nothing finished.
    code, _, err = _run(capsys, ["sweep", "--sweep", str(sweep), "--progress", "false"])
    assert code == 2 and len(err) == 1 and len(ran(fake_trials)) == 2


def test_a_sweep_with_one_trial_finished_exits_0(tmp_path, fake_trials, capsys):
    sweep = write_sweep(tmp_path, seeds=[0], grid={"lr": {"key": LR, "values": [0.01, 0.5]}}, report={})
    code, out, err = _run(capsys, ["sweep", "--sweep", str(sweep), "--progress", "false"])
    assert code == 0 and json.loads(out)["this_worker"] == {"COMPLETE": 1, "FAIL": 1}


def test_sweep_report_of_a_study_with_no_finished_trial_is_one_line(tmp_path, fake_trials, capsys):
    sweep = write_sweep(tmp_path, seeds=[0], grid={"lr": {"key": LR, "values": [0.5]}}, report={})
    _run(capsys, ["sweep", "--sweep", str(sweep), "--progress", "false"])
    out = tmp_path / "report.json"
    code, _, err = _run(capsys, ["sweep", "report", "--sweep", str(sweep), "--out", str(out)])
    assert code == 2 and len(err) == 1 and err[0].startswith("soma_pl: error:"), err
    assert str(spec_of(sweep).output_dir / "trial-0000" / "fit.log") in err[0]
    assert not out.exists()


@pytest.mark.parametrize("where", ["overrides", "grid"])
def test_a_log_interval_that_does_not_divide_the_validation_interval_is_refused_before_any_trial(
        where, tmp_path, fake_trials, capsys):
    bad = {"trainer.val_check_interval": 10, "trainer.log_every_n_steps": 4}
    fields = {"overrides": bad} if where == "overrides" else {"grid": {
        "lr": {"key": LR, "values": [0.01]},
        "schedule": {"choices": {"fine": {"trainer.val_check_interval": 8, "trainer.log_every_n_steps": 4},
                                 "coarse": bad}}}}
    sweep = write_sweep(tmp_path, **fields, report={})
    code, _, err = _run(capsys, ["sweep", "--sweep", str(sweep), "--progress", "false"])
    assert code == 2 and len(err) == 1 and str(sweep) in err[0], err
    assert "trainer.log_every_n_steps=4" in err[0] and "trainer.val_check_interval=10" in err[0]
    assert ran(fake_trials) == [] and not (tmp_path / "out").exists()


@pytest.mark.parametrize("kind", ["sqlite", "journal"])
def test_a_worker_makes_the_folder_of_its_storage_file(kind, tmp_path, fake_trials, capsys):
    folder = tmp_path / "not" / "yet"
    url = f"sqlite:///{folder / 'optuna.db'}" if kind == "sqlite" else str(folder / "journal.log")
    sweep = write_sweep(tmp_path, seeds=[0])
    code, out, err = _run(capsys, ["sweep", "--sweep", str(sweep), "--storage", url, "--progress", "false"])
    assert code == 0, err
    assert json.loads(out)["study_trials"] == {"COMPLETE": 4} and folder.is_dir()
