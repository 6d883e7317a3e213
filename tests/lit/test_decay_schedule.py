"""The learning-rate decay is part of the selected schedule (`plateau.every`), not of how often a
run validates: a run that validates at every update for its curves, with `plateau.every=2`, trains
bit for bit as the run that validates every 2 updates did (the demo's main job against its Table 6
selection trial)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.lightning_cli import make_cli
from soma_pl.lit.plateau import PlateauConfig
from tests.lit.test_protocol import MODULES, TINY_SOMA, _decayed, datasets  # noqa: F401 (a fixture)


def _fit(root: Path, corpus: Path, name: str, run: str, schedule: list[str]) -> tuple[dict, list[int]]:
    config, extra = MODULES[name]
    experts = [f"--data.init_args.experts_dir={root / 'experts'}"] if config == TINY_SOMA else []
    run_dir = root / run
    make_cli(["fit", "--config", str(config), f"--data.init_args.dataset.corpus.paths=[{corpus}]",
              f"--data.init_args.dataset.output_dir={root / 'data'}", *experts,
              f"--trainer.default_root_dir={run_dir}", f"--checkpoint.dirpath={run_dir / 'checkpoints'}",
              "--checkpoint.save_top_k=-1", "--trainer.logger=false", *extra,
              "--model.init_args.plateau.patience=0", "--trainer.max_steps=16", *schedule])
    checkpoint = torch.load(run_dir / "checkpoints" / "last.ckpt", map_location="cpu", weights_only=False)
    steps = sorted(int(p.stem.split("step=")[1]) for p in (run_dir / "checkpoints").glob("*step=*.ckpt"))
    return checkpoint, steps


@pytest.mark.parametrize("name", ["spsa", "soma_n2", "bptt"])
def test_validating_more_often_leaves_the_decay_and_the_weights_unchanged(datasets, corpus_dir, name):  # noqa: F811
    selected, selected_steps = _fit(datasets, corpus_dir, name, f"{name}-every2",
                                    ["--trainer.val_check_interval=2"])
    curves, curve_steps = _fit(datasets, corpus_dir, name, f"{name}-every1",
                               ["--trainer.val_check_interval=1", "--model.init_args.plateau.every=2"])
    assert curve_steps == list(range(1, 17)) and selected_steps == list(range(2, 17, 2))
    assert _decayed(selected), "the tiny run's learning rate decayed: the schedule was exercised"
    for key, value in selected["state_dict"].items():
        assert torch.equal(value, curves["state_dict"][key]), key


def test_validating_more_often_without_every_decays_sooner(datasets, corpus_dir):  # noqa: F811
    """The control: without `plateau.every` the cadence does change training (what the main job did)."""
    selected, _ = _fit(datasets, corpus_dir, "spsa", "spsa-control2", ["--trainer.val_check_interval=2"])
    curves, _ = _fit(datasets, corpus_dir, "spsa", "spsa-control1", ["--trainer.val_check_interval=1"])
    assert any(not torch.equal(value, curves["state_dict"][key]) for key, value in selected["state_dict"].items())


def test_every_is_checked_where_it_is_defined():
    assert PlateauConfig(every=200).checks_at(400) and not PlateauConfig(every=200).checks_at(250)
    assert PlateauConfig().checks_at(7)
    with pytest.raises(ConfigError, match="plateau.every=0"):
        PlateauConfig(every=0)
