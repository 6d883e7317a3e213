"""`sweep report` flags a selected setting at an edge of its grid (lowest or highest value of a numeric factor)."""

from __future__ import annotations

import itertools
import json
import re
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution
from optuna.trial import create_trial

from soma_pl.sweeps.report import build_report, grid_edges, markdown
from soma_pl.sweeps.space import load_sweep
from soma_pl.sweeps.study import SWEEP_ATTR

ROOT = Path(__file__).resolve().parents[2]

LABELS = {"N": [1, 2], "lr": [0.0125, 0.025, 0.05], "eps": [0.0025, 0.005, 0.01]}
WINNERS = {(1, 0): (0.025, 0.005), (1, 1): (0.05, 0.005), (2, 0): (0.0125, 0.01), (2, 1): (0.025, 0.005)}
"""(N, seed) → the (lr, eps) with the lowest validation loss: N = 1 inside the grid in seed 0 and at the
highest lr in seed 1; N = 2 at the lowest lr and the highest eps in seed 0, inside in seed 1."""


def _description(labels: dict) -> dict:
    return {"factors": list(labels), "ranges": [], "seeds": [0, 1], "columns": "N", "baseline": 1,
            "labels": labels, "sweep_file": "x.yaml"}


def make_study(winners: dict[tuple[int, int], tuple[float, float]]) -> optuna.Study:
    """A finished grid study whose lowest validation loss for (N, seed) is at `winners[N, seed]`."""
    study = optuna.create_study(study_name="edges")
    study.set_user_attr(SWEEP_ATTR, _description(LABELS))
    distributions = {name: CategoricalDistribution(values) for name, values in LABELS.items()}
    for n, lr, eps, seed in itertools.product(LABELS["N"], LABELS["lr"], LABELS["eps"], (0, 1)):
        val = 2.0 if winners[n, seed] == (lr, eps) else 2.5 + lr + eps
        runs = [{"seed": seed, "val_loss": val, "test_loss": val + 0.1, "global_step": 10, "run_dir": "x"}]
        study.add_trial(create_trial(params={"N": n, "lr": lr, "eps": eps}, distributions=distributions, value=val,
                                     user_attrs={"runs": runs, "seed": seed}))
    return study


@pytest.fixture()
def study():
    return make_study(WINNERS)


def test_the_json_names_the_factors_at_an_edge_for_each_selection(study):
    t7 = build_report(study, "memory")["table7"]
    by_seed = {entry["seed"]: entry for entry in t7["per_seed"]}
    assert by_seed[0]["selected"] == {"1": {"lr": 0.025, "eps": 0.005}, "2": {"lr": 0.0125, "eps": 0.01}}
    assert by_seed[0]["at_grid_edge"] == {"1": [], "2": ["lr", "eps"]}
    assert by_seed[1]["at_grid_edge"] == {"1": ["lr"], "2": []}
    assert t7["at_grid_edge"] == {"1": ["lr"], "2": ["eps", "lr"]}


def test_the_table_marks_each_edge_selection_and_explains_it_in_a_footnote(study):
    text = markdown(build_report(study, "memory"))
    assert "| 0 | 2.1000 | 2.1000† | 0.0000 |" in text
    assert "| 1 | 2.1000† | 2.1000 | 0.0000 |" in text
    footnote = text[text.index("† Selected at an edge"):].splitlines()
    assert footnote[1:4] == ["- N=2, seed 0: lr = 0.0125, the lowest of 0.0125, 0.025, 0.05",
                             "- N=2, seed 0: eps = 0.01, the highest of 0.0025, 0.005, 0.01",
                             "- N=1, seed 1: lr = 0.05, the highest of 0.0125, 0.025, 0.05"]


def test_a_selection_inside_every_axis_has_no_mark_and_no_footnote():
    report = build_report(make_study(dict.fromkeys(WINNERS, (0.025, 0.005))), "memory")
    assert report["table7"]["at_grid_edge"] == {"1": [], "2": []}
    assert all(entry["at_grid_edge"] == {"1": [], "2": []} for entry in report["table7"]["per_seed"])
    assert "†" not in markdown(report)


@pytest.mark.parametrize(("labels", "setting", "edges"), [
    ({"lr": [0.025, 0.05]}, {"lr": 0.025}, ["lr"]),           # a two-value axis: every choice is an edge
    ({"lr": [0.05, 0.0125, 0.025]}, {"lr": 0.0125}, ["lr"]),  # lowest by value, not by position
    ({"lr": [0.05, 0.0125, 0.025]}, {"lr": 0.05}, ["lr"]),
    ({"lr": [0.05, 0.0125, 0.025]}, {"lr": 0.025}, []),
    ({"lr": [0.025]}, {"lr": 0.025}, []),                     # one value: not searched
    ({"alloc": ["64x1024", "256x256"]}, {"alloc": "64x1024"}, []),  # labels, not an axis
    ({"flag": [False, True]}, {"flag": True}, []),
    ({"B": [16, 64, 256]}, {"B": 256}, ["B"]),                # integers too
])
def test_only_numeric_grid_axes_have_edges(labels, setting, edges):
    assert grid_edges(setting, _description(labels)) == edges


def test_the_written_report_carries_the_flags(study, tmp_path, monkeypatch, capsys):
    from soma_pl.cli import main
    from soma_pl.sweeps import report

    monkeypatch.setattr(report.optuna, "load_study", lambda study_name, storage: study)
    monkeypatch.setattr(report, "open_storage", lambda url: url)
    main(["sweep", "report", "--study", "edges", "--storage", "sqlite:///unused.db",
          "--out", str(tmp_path / "report.json")])
    written = json.loads((tmp_path / "report.json").read_text())
    assert written["table7"]["at_grid_edge"] == {"1": ["lr"], "2": ["eps", "lr"]}
    assert "- N=1, seed 1: lr = 0.05, the highest of 0.0125, 0.025, 0.05" in capsys.readouterr().out


def test_the_demo_table6_has_an_eps_axis_of_three_values(monkeypatch):
    """As Table 6's cross has (its trials start from random weights, so its lr axis need not hold the
    main job's, whose sides start from seeds; `tests/test_selected_schedule.py` checks those)."""
    monkeypatch.chdir(ROOT)
    table6 = {f.name: list(f.choices) for f in load_sweep("sweeps/demo/table6_lr_eps.yaml").factors}
    assert table6["eps"] == [0.00125, 0.0025, 0.005]


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_a_sweep_header_counts_its_trials_right(path, monkeypatch):
    monkeypatch.chdir(ROOT)
    stated = re.findall(r"= (\d+) trials", " ".join(path.read_text().replace("#", " ").split()))
    assert [int(n) for n in stated] in ([], [len(load_sweep(path).grid_points())])
