"""Sweep files: every file under sweeps/ loads; grids, overrides and bad input."""

from __future__ import annotations

from pathlib import Path

import pytest

from soma_pl.cli import main
from soma_pl.config_files import cli_value, config_args, override_args, read_layers
from soma_pl.errors import ConfigError
from soma_pl.sweeps.space import load_sweep, trial_overrides

from .conftest import write_sweep

ROOT = Path(__file__).resolve().parents[2]
SWEEPS = sorted((ROOT / "sweeps").rglob("*.yaml"))
# sweeps/{table6_lr_eps,fig7_experts,fig7_npert,fig7_batch,table11_alloc,table4,table5,fig4}, their demo/
# twins (TWINS), demo/table7_pair, demo/fig9, demo/fig13, demo/fig14, demo/main_job
EXPECTED = 20

TWINS = {"table6_lr_eps.yaml": "demo/table6_lr_eps.yaml", "table4.yaml": "demo/table4.yaml",
         "fig7_experts.yaml": "demo/fig7.yaml", "fig7_npert.yaml": "demo/fig7_settings.yaml",
         "fig7_batch.yaml": "demo/fig7_settings.yaml", "table11_alloc.yaml": "demo/table11.yaml",
         "table5.yaml": "demo/table5.yaml", "fig4.yaml": "demo/fig4.yaml"}
"""Each paper-scale sweep → the demo sweep of the same experiment (`reproduce`'s CPU scale): Fig. 7's
n_pert and B panels share one demo sweep."""
DEMO_ONLY = {"demo/table7_pair.yaml", "demo/fig9.yaml", "demo/fig13.yaml", "demo/fig14.yaml", "demo/main_job.yaml"}
"""The demo's Table 6 -> 7 comparison (at paper scale that is table6_lr_eps.yaml), Fig. 9's
ablations (the paper's captions give neither the model nor the steps of its runs), Fig. 13's curves
(the paper's are separate runs it does not configure), Figs. 14-15's fixed-size runs (the paper's
N = 256 runs reach 41.9k GPU-hours) and the main job (at paper scale that is
Table 7's comparison, table6_lr_eps.yaml)."""


def test_found_every_sweep_and_its_demo_twin():
    names = [str(p.relative_to(ROOT / "sweeps")) for p in SWEEPS]
    assert len(SWEEPS) == EXPECTED, names
    assert {n for n in names if not n.startswith("demo/")} == set(TWINS)
    assert {n for n in names if n.startswith("demo/")} == set(TWINS.values()) | DEMO_ONLY


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: str(p.relative_to(ROOT)))
def test_sweep_loads(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # base configs are named relative to the repository
    spec = load_sweep(path)
    assert spec.is_grid and spec.grid_points()
    for point in spec.grid_points()[:3]:
        config, overrides = trial_overrides(spec, point)
        assert all((ROOT / layer).is_file() for layer in config) and "config" not in overrides
        layers = read_layers(config_args(config))
        assert [Path(layer).parent.name for layer, _ in layers[:2]] == ["trainer", "datamodule"]


def test_table6_grids_match_the_paper(monkeypatch):
    monkeypatch.chdir(ROOT)
    paper, demo = load_sweep("sweeps/table6_lr_eps.yaml"), load_sweep("sweeps/demo/table6_lr_eps.yaml")
    labels = {f.name: list(f.choices) for f in paper.factors}
    assert labels == {"N": [1, 2], "lr": [0.00125, 0.0025, 0.005], "eps": [0.00125, 0.0025, 0.005]}
    # App. I.2: every lr at eps = 0.0025, then the two other eps at each side's and seed's selected lr
    assert paper.first == {"eps": 0.0025} and paper.later_labels() == [{"eps": 0.00125}, {"eps": 0.005}]
    assert len(paper.seeds) == 3 and len(paper.grid_points()) == 18 and paper.planned_trials() == 30
    assert paper.budget == {"device_hours": 1.65}
    assert len(demo.grid_points()) >= 16 and len(demo.seeds) >= 2


def test_values_survive_the_command_line():
    assert cli_value(1e-05) == "1.0e-05" and cli_value(0.00125) == "0.00125" and cli_value(True) == "true"
    assert override_args({"a.b": [1, 2], "c": "data/x"}) == ["--a.b=[1, 2]", "--c=data/x"]


@pytest.mark.parametrize(("fields", "message"), [
    ({"grid": {"lr": {"values": [1]}}}, "needs `key`"),
    ({"grid": {"seed": {"key": "k", "values": [1]}}}, "grid.seed sets the seed"),
    ({"seeds": []}, "seeds must be"),
    ({"ranges": {"eps": {"key": "k", "low": 1, "high": 0.5}}, "trials": 3}, "must be below"),
    ({"ranges": {"eps": {"key": "k", "low": 0.1, "high": 0.5}}}, "needs `trials`"),
    ({"report": {"columns": "Q"}}, "not a grid factor"),
    ({"config": "configs/none.yaml"}, "does not exist"),
    ({"lr": 3}, "unknown key"),
])
def test_bad_sweep_files_are_one_clear_error(tmp_path, fields, message):
    with pytest.raises(ConfigError, match=message):
        load_sweep(write_sweep(tmp_path, **fields))


def test_cli_reports_a_bad_sweep_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--sweep", str(tmp_path / "none.yaml")])
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == \
        f"soma_pl: error: sweep file {tmp_path / 'none.yaml'} does not exist"
