"""Slow checks with the real CLI: every sweep choice parses as a fit command, and a tiny grid sweep
runs real fits and tests in trial processes and reports."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from soma_pl.cli import main
from soma_pl.lightning_cli import make_cli
from soma_pl.sweeps import runner
from soma_pl.sweeps.space import load_sweep
from tests.data.corpora import write_jsonl_corpus

from .conftest import write_sweep

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _choice_points(spec):
    """The first grid point with each factor set to each of its choices in turn."""
    first = spec.grid_points()[0]
    return [{**first, f.name: label} for f in spec.factors for label in f.choices]


@pytest.mark.parametrize("path", sorted((ROOT / "sweeps").rglob("*.yaml")), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_choice_parses_as_a_fit_command(path, monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(ROOT)
    spec = dataclasses.replace(load_sweep(path), calibrate=None)  # no calibration file here
    for point in _choice_points(spec):
        command = runner.fit_command(spec, SimpleNamespace(number=0), point, point["seed"], tmp_path / "t",
                                     "sqlite:///x.db", report=True)
        with pytest.raises(SystemExit) as exit_info:
            make_cli(["fit", *command[4:], "--print_config"])
        assert exit_info.value.code in (0, None), point
        printed = capsys.readouterr().out
        assert f"group: {spec.name}" in printed and f"default_root_dir: {tmp_path / 't'}" in printed


def test_tiny_sweep_runs_real_fits_and_reports(tmp_path, monkeypatch):
    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 30, "beta": 30}, min_words=150, max_words=500)
    path = write_sweep(tmp_path, seeds=[0, 1], report={}, wandb=False,
                       grid={"lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.05, 0.1]}},
                       overrides={"data.init_args.dataset.corpus.paths": [str(corpus)],
                                  "data.init_args.dataset.output_dir": str(tmp_path / "data"),
                                  "trainer.logger": False, "trainer.max_steps": 8})
    spec = load_sweep(path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert runner.work(spec, storage) == {"COMPLETE": 4}
    out = tmp_path / "report.json"
    main(["sweep", "report", "--sweep", str(path), "--storage", storage, "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["trials"] == {"COMPLETE": 4}
    rows = report["table6"]["rows"]
    assert sorted(row["setting"]["lr"] for row in rows) == [0.05, 0.1]
    for row in rows:
        val = row["cells"]["all"]["val"]
        assert val["n"] == 2 and 0 < val["mean"] < 6 and val["sd"] is not None
    for entry in report["table7"]["per_seed"]:
        trial_dir = spec.output_dir / f"trial-{entry['trial']['all']:04d}"
        result = json.loads((trial_dir / "trial_result.json").read_text())
        scores = json.loads(Path(result["test_scores"]).read_text())
        assert entry["test"]["all"] == pytest.approx(scores["loss"]) and result["global_step"] == 8


def test_final_test_scores_the_selected_runs_once_and_only_them(tmp_path, monkeypatch):
    """`sweep report --final_test`: each seed's selected run (and no other) is scored on the final
    test split, once; the second Table 7 holds those scores and their baseline − other differences."""
    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 30, "beta": 30}, min_words=150, max_words=500)
    path = write_sweep(tmp_path, seeds=[0, 1], wandb=False, report={"columns": "eps", "baseline": 0.01},
                       grid={"eps": {"key": "model.init_args.spsa.eps", "values": [0.01, 0.02]},
                             "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.05, 0.1]}},
                       overrides={"data.init_args.dataset.corpus.paths": [str(corpus)],
                                  "data.init_args.dataset.output_dir": str(tmp_path / "data"),
                                  "data.init_args.dataset.final_test_windows": 4,
                                  "trainer.max_steps": 4, "trainer.val_check_interval": 1})  # the curves
    spec = load_sweep(path)
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    assert runner.work(spec, storage) == {"COMPLETE": 8}
    out = tmp_path / "report.json"
    main(["sweep", "report", "--sweep", str(path), "--storage", storage, "--out", str(out), "--final_test=true"])
    t7 = json.loads(out.read_text())["table7"]
    final = t7["final_test"]
    selected = {(entry["seed"], label): trial for entry in t7["per_seed"] for label, trial in entry["trial"].items()}
    scored = sorted(spec.output_dir.glob("trial-*/**/final_test/**/test_scores.json"))
    assert len(scored) == len(selected) == 4  # two seeds x two eps columns; the four runs not selected untouched
    for entry, row in zip(t7["per_seed"], final["per_seed"], strict=True):
        assert row["seed"] == entry["seed"]
        for label, trial in entry["trial"].items():
            (scores,) = (spec.output_dir / f"trial-{trial:04d}").glob("**/final_test/**/test_scores.json")
            loss = json.loads(scores.read_text())["loss"]
            assert row["test"][label] == pytest.approx(loss) and loss != entry["test"][label]
        assert row["difference"]["0.02"] == pytest.approx(row["test"]["0.01"] - row["test"]["0.02"])
    assert final["difference"]["0.02"]["n"] == 2
    # Both compute bases: the same selections at equal measured update time, T the faster one's total.
    # With 4 updates T can fall before the slower run's first validation (the machine's load sets the
    # update times): then the report says so instead of comparing.
    timed = t7["equal_time"]
    if "unavailable" in timed:
        assert "falls before a selected run's first validation" in timed["unavailable"]
    for entry, row in zip(t7["per_seed"], timed.get("per_seed", []), strict="unavailable" not in timed):
        totals = {}
        for label, trial in entry["trial"].items():
            (summary,) = (spec.output_dir / f"trial-{trial:04d}").glob("**/summary.json")
            totals[label] = json.loads(summary.read_text())["compute"]["aggregate_device_hours"] * 3600
        assert row["total_seconds"] == pytest.approx(totals, rel=1e-6)
        assert row["budget_seconds"] == pytest.approx(min(totals.values()), rel=1e-6)
        fast = min(totals, key=totals.get)
        assert row["val"][fast] == pytest.approx(entry["val"][fast])  # its whole run: its final validation
    if "unavailable" not in timed:
        # each run's validations window by window at T: their paired mean is the seed-mean difference
        document = timed["document"]["0.02"]
        assert document["low"] <= document["mean"] <= document["high"]
        assert document["mean"] == pytest.approx(timed["difference"]["0.02"]["mean"], abs=1e-5)
    # A second report reads the scores back: no run is scored again.
    stamps = [p.stat().st_mtime_ns for p in scored]
    main(["sweep", "report", "--sweep", str(path), "--storage", storage, "--out", str(out), "--final_test=true"])
    assert [p.stat().st_mtime_ns for p in scored] == stamps
    assert json.loads(out.read_text())["table7"]["final_test"] == final
