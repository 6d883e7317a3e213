"""The main job runs at the setting its learning rates were selected at (issue 24, item 2): each side's
trial composes to the selection's trial of that side at the main job's learning rate, its budget of
update time and the updates at which a decay is decided included; the selection's grid reaches
beyond it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from soma_pl.sweeps.calibration import calibration_points, reused
from soma_pl.sweeps.space import load_sweep, trial_overrides
from tests.sweeps.test_fair_starts import compose as resolve

ROOT = Path(__file__).resolve().parents[1]
MAIN_JOB = ROOT / "sweeps" / "demo" / "main_job.yaml"
SELECTION = ROOT / "sweeps" / "demo" / "table7_pair.yaml"
LR = "model.init_args.optimizer.init_args.lr"


def decay_checks(config: dict) -> list[int]:
    """The updates at which a validation decides a learning-rate decay."""
    trainer, plateau = config["trainer"], config["model"]["init_args"].get("plateau", {})
    every = plateau.get("every")
    return [u for u in range(trainer["val_check_interval"], trainer["max_steps"] + 1, trainer["val_check_interval"])
            if every is None or u % every == 0]


@pytest.mark.parametrize("label", [1, 2])
def test_the_main_job_trains_each_side_as_its_selection_trial_did(label, monkeypatch):
    monkeypatch.chdir(ROOT)
    main_job, selection = load_sweep(MAIN_JOB), load_sweep(SELECTION)
    layers, overrides = trial_overrides(main_job, {"N": label})
    lr = overrides[LR]
    selected = resolve(*trial_overrides(selection, {"N": label, "lr": lr}))
    assert resolve(layers, overrides) == selected
    assert main_job.budget == selection.budget
    assert main_job.calibrate == dataclasses.replace(selection.calibrate, reuse=SELECTION.relative_to(ROOT))
    monkeypatch.setattr("soma_pl.sweeps.calibration.read_calibration", lambda spec: {})
    assert reused(main_job, {"N": label}, selection) is None  # no selection has run: the main job times itself
    monkeypatch.setattr("soma_pl.sweeps.calibration.read_calibration", lambda spec: {
        key: {"params": params, "seconds_per_update": 0.5} for key, params in calibration_points(spec).items()})
    assert reused(main_job, {"N": label}, selection)["params"]["N"] == label  # the selection's time of this side
    assert decay_checks(selected) != []
    choices = next(f for f in selection.factors if f.name == "lr").choices
    assert min(choices) < lr < max(choices)  # a step either side of the selected rate was tried


def test_both_sides_train_on_the_context_they_are_scored_on(monkeypatch):
    """Issue 24, item 5: the demo pair trains on 1,024-byte contexts, as Table 1's scoring windows
    (route on 256 bytes, score the next 768) are 1,025 bytes."""
    from soma_pl import WINDOW_BYTES

    monkeypatch.chdir(ROOT)
    spec = load_sweep(MAIN_JOB)
    for label in (1, 2):
        config = resolve(*trial_overrides(spec, {"N": label}))
        assert config["model"]["init_args"]["train_context"] == WINDOW_BYTES - 1


def test_the_main_job_runs_at_the_rates_the_committed_table7_selected_for_seed_0(monkeypatch):
    """The main job's rates are the ones `reproduce table7` (results/table7) selected for seed 0, on the
    protocol the experiment describes today."""
    import json

    from soma_pl.reproduce.experiments import load_experiment

    monkeypatch.chdir(ROOT)
    result = json.loads((ROOT / "results" / "table7" / "result.json").read_text())
    assert result["sweep"] == str(SELECTION.relative_to(ROOT)) and result["basis"] == load_experiment("table7").basis
    selected = next(row["selected"] for row in result["rows"] if row["seed"] == 0)
    main_job = load_sweep(MAIN_JOB)
    for label in (1, 2):
        assert trial_overrides(main_job, {"N": label})[1][LR] == selected[str(label)]["lr"]
