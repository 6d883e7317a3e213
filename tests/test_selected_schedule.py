"""The main job runs at the setting its learning rates were selected at (issue 24, item 2): the same
resolved model and data settings as the selection's trial of each side, the same length, and the
same updates at which a decay is decided. Only the cadence of its curves (validation interval,
logging, kept checkpoints) and its output folders differ."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from soma_pl.main_job import SELECTION, DemoConfig, _side_args, fit_length, selected_updates
from soma_pl.sweeps.space import load_sweep, trial_overrides
from tests.sweeps.test_fair_starts import compose as resolve

ROOT = Path(__file__).resolve().parents[1]
CADENCE = {"trainer.val_check_interval", "trainer.log_every_n_steps", "trainer.enable_progress_bar",
           "trainer.enable_model_summary", "trainer.default_root_dir", "checkpoint", "wandb", "seed_everything",
           "model.init_args.seed"}
"""Keys that say how a run records itself, not what it trains."""


def _from_args(args: list[str]) -> tuple[list[str], dict]:
    layers = [args[i + 1] for i, arg in enumerate(args) if arg == "--config"]
    overrides = {}
    for arg in args:
        if arg.startswith("--") and "=" in arg:
            key, _, value = arg[2:].partition("=")
            overrides[key] = yaml.safe_load(value)
    return layers, overrides


def _flat(config: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat.update(_flat(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def decay_checks(config: dict) -> list[int]:
    """The updates at which a validation decides a learning-rate decay."""
    trainer, plateau = config["trainer"], config["model"]["init_args"].get("plateau", {})
    every = plateau.get("every")
    return [u for u in range(trainer["val_check_interval"], trainer["max_steps"] + 1, trainer["val_check_interval"])
            if every is None or u % every == 0]


@pytest.mark.parametrize("side", ["spsa", "soma"])
def test_the_main_job_trains_each_side_as_its_selection_trial_did(side):
    demo = DemoConfig()
    demo_side = getattr(demo, side)
    layers, overrides = _from_args([*_side_args(demo, demo_side), *fit_length(demo)])
    main_job = resolve(layers, overrides)
    spec = load_sweep(ROOT / SELECTION)
    label = {"spsa": 1, "soma": 2}[side]
    trial_layers, trial = trial_overrides(spec, {"N": label, "lr": demo_side.lr})
    selected = resolve(list(trial_layers), trial)

    def trains(config: dict) -> dict:
        return {key: value for key, value in _flat(config).items()
                if not any(key == c or key.startswith(f"{c}.") for c in CADENCE)}

    assert trains(main_job) == trains(selected)
    assert main_job["trainer"]["max_steps"] == selected_updates() == selected["trainer"]["max_steps"]
    assert decay_checks(main_job) == decay_checks(selected) != []
    assert main_job["trainer"]["val_check_interval"] < selected["trainer"]["val_check_interval"]  # curves


def test_both_sides_train_on_the_context_they_are_scored_on():
    """Issue 24, item 5: the demo pair trains on 1,024-byte contexts, as Table 1's scoring windows
    (route on 256 bytes, score the next 768) are 1,025 bytes."""
    from soma_pl import WINDOW_BYTES

    demo = DemoConfig()
    for side in (demo.spsa, demo.soma):
        config = resolve(*_from_args(_side_args(demo, side)))
        assert config["model"]["init_args"]["train_context"] == WINDOW_BYTES - 1
