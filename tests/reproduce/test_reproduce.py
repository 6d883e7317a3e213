"""`reproduce`: the experiment listing and dry run, a result drawn from a hand-made report, the
docs page, and (slow) a tiny experiment run end to end by real sweep workers."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import numpy as np
import pytest

from soma_pl.analysis.time_basis import accountings
from soma_pl.cli import COMMANDS, main
from soma_pl.distributed import Accounting
from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.reproduce import command, comparisons
from soma_pl.reproduce.experiments import all_experiments, load_experiment
from soma_pl.reproduce.tables import reproduction_page, run_footer
from soma_pl.reproduce.verdicts import Verdict
from soma_pl.sweeps.report import stats
from soma_pl.sweeps.space import load_sweep, trial_overrides

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_experiment_with_its_cost(capsys):
    with pytest.raises(SystemExit):
        main(["reproduce", "--help"])
    shown = " ".join(capsys.readouterr().out.split())
    shown = re.sub(r"(\w)- (\w)", r"\1-\2", shown)  # a word the help wrapped at its hyphen
    for experiment in all_experiments().values():
        assert f"`{experiment.name}`" in shown and " ".join(experiment.cost["cpu"].split()) in shown


def test_a_dry_run_lists_the_trials_and_the_paper_scale_budget(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    for scale, trials in (("cpu", 36), ("paper", 30)):  # cpu: 6 lr x 2 N x 3 seeds
        spec = dataclasses.replace(load_sweep(load_experiment("table7").sweeps[scale]), output_dir=tmp_path / scale)
        listed = command.list_trials(load_experiment("table7"), scale, spec, f"sqlite:///{tmp_path / scale / 'x.db'}")
        assert (listed["trials"], listed["done"]) == (trials, 0)
    printed = capsys.readouterr().out
    # Table 6 (App. I.2): 3 lr at eps 0.0025, then 2 more eps at the selected lr, x 2 N x 3 seeds
    assert printed.count(": to run") == 36 + 18 and printed.count(": after the first stage") == 12
    assert "30 trials of 1.65 aggregate device-hours: 49.5 device-hours" in printed
    assert not (tmp_path / "cpu").exists(), "a dry run writes nothing"


@pytest.mark.parametrize(("experiment", "trials", "cost"), [
    ("table5", 6, "6 trials of 100 aggregate device-hours: 600 device-hours"),
    # Fig. 7's cutoff: 183.6 elapsed hours, N = 1 + 2 + 8 + 32 + 256 experts at most as slow as the slowest
    ("fig7", 5, "at most 54,896.4 aggregate device-hours"),
    ("table11", 6, "6 of 6 trials"),  # 3 allocations x 2 paired seeds, 512 updates each
    ("fig4", 6, "6 of 6 trials"),  # 2 arms x 3 paired seeds, 1,000 updates each (App. J)
])
def test_each_paper_scale_plan_has_the_papers_trials_and_gpu_hours(experiment, trials, cost, tmp_path, monkeypatch,
                                                                  capsys):
    monkeypatch.chdir(ROOT)
    spec = dataclasses.replace(load_sweep(load_experiment(experiment).sweeps["paper"]), output_dir=tmp_path)
    listed = command.list_trials(load_experiment(experiment), "paper", spec, f"sqlite:///{tmp_path / 'x.db'}")
    assert (listed["trials"], listed["done"]) == (trials, 0) and cost in listed["cost"]
    firsts = [line for line in capsys.readouterr().out.splitlines() if line.startswith("  first: ")]
    assert len(firsts) == len(load_experiment(experiment).data.get("paper", []))


def test_a_dry_run_works_from_any_folder_and_goes_back_to_it(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    main(["reproduce", "table7", "--dry_run", "true"])
    printed = capsys.readouterr().out
    assert len(re.findall(r"^  N=\d, lr=[\d.]+, seed \d: \w+", printed, re.MULTILINE)) == 36
    assert Path.cwd() == tmp_path and list(tmp_path.iterdir()) == []


def test_fig9_lists_its_conditions_and_refuses_a_paper_scale_it_has_not(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    spec = dataclasses.replace(load_sweep(load_experiment("fig9").sweeps["cpu"]), output_dir=tmp_path)
    listed = command.list_trials(load_experiment("fig9"), "cpu", spec, f"sqlite:///{tmp_path / 'x.db'}")
    assert (listed["trials"], listed["done"]) == (72, 0)  # 6 conditions x 4 learning rates x 3 seeds
    printed = capsys.readouterr().out
    for condition in ("reference", "random_shards", "global_iid", "cold", "decoder_only_head", "frozen_random_head"):
        assert printed.count(f"condition={condition}, lr=") == 12
    with pytest.raises(SystemExit) as stop:
        main(["reproduce", "fig9", "--scale", "paper", "--dry_run", "true"])
    assert stop.value.code == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert len(error) == 1 and "--scale paper" in error[0] and "run --scale cpu" in error[0]


def test_table4_lists_the_papers_five_rows_and_their_gpu_hours(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(ROOT)
    spec = dataclasses.replace(load_sweep(load_experiment("table4").sweeps["paper"]), output_dir=tmp_path)
    listed = command.list_trials(load_experiment("table4"), "paper", spec, f"sqlite:///{tmp_path / 'x.db'}")
    assert (listed["trials"], listed["done"]) == (5, 0)
    printed = capsys.readouterr().out
    for row in ("soma_n2", "spsa_64", "spsa_256", "spsa_1024", "eggroll"):
        assert printed.count(f"row={row}, seed 1: to run") == 1
    # Table 4: about 150 aggregate GPU-hours per run
    assert "5 trials of 150 aggregate device-hours: 750 device-hours" in printed
    n_pert = {point["row"]: trial_overrides(spec, point)[1].get("model.init_args.spsa.n_pert")
              for point in spec.grid_points() if point["row"].startswith("spsa")}
    assert n_pert == {"spsa_64": None, "spsa_256": 256, "spsa_1024": 1024}  # configs/ddpp.yaml holds 64


def _window_scores(losses: list[float], seed: int) -> dict:
    documents = ["a", "a", "b", "c", "d"][: len(losses)]
    return {"loss": float(np.mean(losses)), "bootstrap_95": [0.0, 9.0], "window_index": list(range(len(losses))),
            "window_losses": losses, "doc_ids": documents, "seed": seed}


def _pair_report(monkeypatch, root: Path = Path()) -> tuple[dict, dict]:
    """Three seeds where SOMA wins on every window of the test split, loses on the final one: the
    sweep report and the run folders (under `root`) of a Table 7 comparison."""
    per_seed, folders, scores = [], {}, {}
    for seed in range(3):
        spsa, soma = 10 * seed + 1, 10 * seed + 2  # trial numbers
        folders[spsa], folders[soma] = {seed: str(root / f"spsa{seed}")}, {seed: str(root / f"soma{seed}")}
        base = [3.0 + 0.01 * seed, 3.1, 2.9, 3.2]
        spsa_run, soma_run = folders[spsa][seed], folders[soma][seed]
        scores[(spsa_run, "test")] = _window_scores(base, seed)
        scores[(soma_run, "test")] = _window_scores([x - 0.04 - 0.001 * seed for x in base], seed)
        scores[(spsa_run, "final")] = _window_scores(base, seed)
        scores[(soma_run, "final")] = _window_scores([x + 0.02 for x in base], seed)
        per_seed.append({"seed": seed, "trial": {"1": spsa, "2": soma},
                         "test": {"1": scores[(spsa_run, "test")]["loss"], "2": scores[(soma_run, "test")]["loss"]},
                         "difference": {"2": 0.04 + 0.001 * seed}, "selected": {"1": {"lr": 0.025}, "2": {"lr": 0.05}},
                         "at_grid_edge": {"1": [], "2": ["lr"]}})
    monkeypatch.setattr(comparisons, "score_run", lambda run, split: scores[(str(run), split)])
    table6 = {"row_factors": ["lr"], "columns": "N", "column_labels": [1, 2], "rows": [
        {"setting": {"lr": 0.025}, "cells": {"1": {"val": stats([3.0, 3.1, 3.2])}, "2": {"val": stats([2.9, 3.0])}}}]}
    report = {"table7": {"baseline": 1, "column_labels": [1, 2], "per_seed": per_seed,
                         "final_test": {}, "at_grid_edge": {"1": [], "2": ["lr"]}}, "table6": table6,
              "trials": {"COMPLETE": 18}, "failed": []}
    return report, folders


RUN = {"experiment": "table7", "scale": "cpu", "title": "t", "basis": "b", "wall_seconds": 1.0, "workers": 2,
       "load_average": [0.1, 0.2], "trial_minutes": 3.0}


def test_a_result_puts_the_paper_beside_ours_and_checks_each_split(monkeypatch):
    report, folders = _pair_report(monkeypatch)
    result = load_experiment("table7").result(report, folders)
    assert [row["paper"]["difference"] for row in result["rows"]] == [0.0368, 0.0462, 0.0358]  # Table 7
    assert result["summary"]["difference"]["mean"] == pytest.approx(0.041)
    verdicts = {check["split"]: check for check in result["checks"]}
    assert verdicts["test"]["verdict"] == Verdict.holds.value
    assert verdicts["test"]["basis"].startswith("equal update time")  # the paper's basis (Table 3)
    # every window gains 0.04 + 0.001·seed: the seed-mean paired gain is 0.041 on every document
    assert verdicts["test"]["document_interval"] == pytest.approx([0.041, 0.041])
    assert verdicts["final"]["verdict"] == Verdict.does_not_hold.value
    assert [c["split"] for c in result["checks"]] == ["test", "final"]  # one budget: no claim on another basis
    text = load_experiment("table7").table({**result, **RUN})
    assert "| 0 | 3.0500 | 3.0100† | 0.0400 | 2.2641 | 2.2273 | 0.0368 |" in text
    assert "| lr | N=1 | N=2 |" in text and "| 0.025 | 3.1000 ± 0.1000 | 2.9500 ± 0.0707 |" in text
    assert "| Mean | " in text and "0.0396" in text and "**does not hold**" in text and "SOMA: lr" in text


def test_the_main_job_is_table7_at_one_rate_per_side_with_its_curves(monkeypatch, tmp_path):
    """`demo` runs `reproduce main_job`: Table 7's verdicts on its runs, and each run's validation curve
    on the calibrated time basis (updates × the update time calibrated alone) for its figure."""
    report, folders = _pair_report(monkeypatch, tmp_path)
    for runs in folders.values():
        for run in map(Path, runs.values()):
            run.mkdir()
            rows = ["step,val/loss,compute/aggregate_device_hours", "99,3.5,", "100,,0.1", "199,3.25,", "200,,0.2"]
            (run / "metrics.csv").write_text("\n".join(rows) + "\n")
            (run / "compute.json").write_text(json.dumps({"budget": {"seconds_per_update": 2.0 if "spsa" in run.name
                                                                     else 3.0}}))
    experiment = load_experiment("main_job")
    assert experiment.sweeps == {"cpu": "sweeps/demo/main_job.yaml"} and COMMANDS["demo"].function == "demo"
    result = experiment.result(report, folders)
    # the same runs as Table 7's test: SOMA below on the test split, above on the final split
    assert [(c["split"], c["verdict"], round(c["mean"], 4)) for c in result["checks"]] == [
        ("test", Verdict.holds.value, 0.041), ("final", Verdict.does_not_hold.value, -0.02)]
    assert result["checks"][0]["claim"].startswith("SOMA (N = 2) reaches a lower test loss than monolithic SPSA")
    assert result["curves"]["spsa"][0] == [[100, 3.5, 200.0], [200, 3.25, 400.0]]
    assert result["curves"]["soma"][2] == [[100, 3.5, 300.0], [200, 3.25, 600.0]]
    text = experiment.table({**result, **RUN, "experiment": "main_job"})
    assert "the learning rate seed 0 of the demo's Table 6 selection chose" in text and "## Table 6" not in text
    assert experiment.figure({**result, **RUN}, tmp_path / "figure.png").read_bytes().startswith(b"\x89PNG")


def test_a_result_says_which_compute_accounting_its_runs_used(tmp_path):
    folders = {}
    for trial, seed, kind in [(0, 0, "batched"), (0, 1, "batched"), (1, 0, "device_per_expert")]:
        run = tmp_path / f"trial{trial}_seed{seed}"
        run.mkdir()
        (run / "compute.json").write_text(json.dumps({"accounting": kind}))
        folders.setdefault(trial, {})[seed] = str(run)
    counts = accountings(folders)
    assert counts == {"batched": 2, "device_per_expert": 1}
    footer = run_footer({"wall_seconds": 1.0, "load_average": [0.1, 0.2], "accounting": counts})
    assert f"2 with {Accounting.batched.meaning}" in footer
    assert f"1 with {Accounting.device_per_expert.meaning}" in footer
    assert "load average 0.10 before, 0.20 after" in footer


def test_the_docs_page_has_a_row_per_claim_and_each_table(tmp_path):
    folder = tmp_path / "results" / "table7"
    folder.mkdir(parents=True)
    check = {"claim": "SOMA below SPSA", "basis": "equal multiply-adds", "verdict": "holds", "mean": 0.04,
             "seeds": 3, "seed_interval": [0.03, 0.05], "document_interval": [0.02, 0.06], "split": "test",
             "p": 0.001, "holm_p": 0.002}
    (folder / "result.json").write_text(json.dumps({"experiment": "table7", "scale": "cpu", "checks": [check]}))
    (folder / "table.md").write_text("# table7\n\n| a |\n")
    (folder / "figure.png").write_bytes(b"png")
    page = reproduction_page(tmp_path / "results", tmp_path / "docs" / "reproduction.md")
    assert "| table7 (cpu) | SOMA below SPSA | equal multiply-adds | +0.0400 [+0.0300, +0.0500] over 3 seeds, " \
           "[+0.0200, +0.0600] over documents | **holds** | 0.002 |" in page
    assert "## table7" in page and "![table7](../results/table7/figure.png)" in page


@pytest.mark.slow
def test_a_tiny_experiment_runs_scores_checks_and_reuses_its_trials(tmp_path, monkeypatch):
    from tests.data.corpora import write_jsonl_corpus
    from tests.sweeps.conftest import write_sweep

    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 30, "beta": 30}, min_words=150, max_words=500)
    path = write_sweep(tmp_path, seeds=[0, 1], wandb=False, report={"columns": "eps", "baseline": 0.01},
                       grid={"eps": {"key": "model.init_args.spsa.eps", "values": [0.01, 0.02]}},
                       overrides={"data.init_args.dataset.corpus.paths": [str(corpus)],
                                  "data.init_args.dataset.output_dir": str(tmp_path / "data"),
                                  "data.init_args.dataset.final_test_windows": 4,
                                  "trainer.max_steps": 4, "trainer.val_check_interval": 1})
    spec = load_sweep(path)
    table7 = load_experiment("table7")
    claim = dataclasses.replace(table7.claims["test"], worse="0.01", better="0.02")  # this sweep's columns
    tiny = dataclasses.replace(table7, sweeps={"cpu": str(path)}, data={}, claims={"test": claim})
    storage = f"sqlite:///{tmp_path / 'optuna.db'}"
    result = command.run(tiny, "cpu", spec, storage, workers=2, results=tmp_path / "results")
    folder = tmp_path / "results" / "table7"
    assert json.loads((folder / "result.json").read_text()) == json.loads(json.dumps(result))
    assert (folder / "table.md").read_text().startswith("# table7 (cpu scale)")
    assert (folder / "figure.png").stat().st_size > 0
    assert result["trials"] == {"COMPLETE": 4}, result["failed"]
    # Each selected run's trial test record gives its test loss and the per-window losses of its check.
    for row, entry in zip(result["rows"], result["blocks"]["test"]["per_seed"], strict=True):
        assert entry["spsa"] == pytest.approx(row["ours"]["spsa"], abs=1e-6)
        assert entry["soma"] == pytest.approx(row["ours"]["soma"], abs=1e-6)
    assert not list(spec.output_dir.glob("trial-*/**/test_windows"))  # no run scored on the test split again
    # The document interval is the bootstrap of the saved per-window paired differences.
    check = next(c for c in result["checks"] if c["split"] == "test")
    records = {int(p.relative_to(spec.output_dir).parts[0].split("-")[1]): p
               for p in spec.output_dir.glob("trial-*/**/test_scores.json") if "final_test" not in p.parts}
    assert len(records) == 4  # each seed's run of each column (each column has one setting), tested once
    by_trial = {trial: json.loads(path.read_text()) for trial, path in records.items()}
    spsa, soma = ([by_trial[trial] for trial in _selected(spec, result, label)] for label in ("0.01", "0.02"))
    differences = np.mean([np.subtract(a["window_losses"], b["window_losses"])
                           for a, b in zip(spsa, soma, strict=True)], axis=0)
    expected = document_bootstrap(differences, np.asarray(spsa[0]["doc_ids"]))
    assert check["document_interval"] == pytest.approx([expected.low, expected.high])
    assert [c["split"] for c in result["checks"]] == ["test", "final"]
    assert all(c["verdict"] in {v.value for v in Verdict} for c in result["checks"])
    # A second run reuses every trial and every score.
    stamps = {p: p.stat().st_mtime_ns for p in spec.output_dir.glob("trial-*/version_0/*/**/test_scores.json")}
    again = command.run(tiny, "cpu", spec, storage, workers=2, results=tmp_path / "results")
    assert again["trials"] == {"COMPLETE": 4} and again["checks"] == result["checks"]
    assert again["sweep_wall_seconds"] == result["sweep_wall_seconds"] > 0  # the sweep's, not the rerun's
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
    main(["reproduce", "docs", "--results", str(tmp_path / "results"), "--out", str(tmp_path / "reproduction.md")])
    assert check["claim"] in (tmp_path / "reproduction.md").read_text()


def test_the_sweeps_wall_time_is_the_union_of_its_trials_intervals():
    from datetime import datetime, timedelta
    from types import SimpleNamespace

    start = datetime(2026, 1, 1)

    def trial(begin: float, end: float | None) -> SimpleNamespace:
        return SimpleNamespace(datetime_start=start + timedelta(seconds=begin),
                               datetime_complete=None if end is None else start + timedelta(seconds=end))

    # two workers overlap on [0, 100] and [50, 120]; a session later [1000, 1030] inside which [1010, 1020];
    # a running trial (no end) counts nothing
    trials = [trial(50, 120), trial(0, 100), trial(1000, 1030), trial(1010, 1020), trial(2000, None)]
    assert command.busy_seconds(trials) == 120 + 30
    assert command.busy_seconds([]) == 0


def _selected(spec, result: dict, label: str) -> list[int]:
    """Each seed's COMPLETE trial of column `label` (the only setting of the column: the selected one)."""
    import optuna

    study = optuna.load_study(study_name=spec.name, storage=f"sqlite:///{spec.output_dir.parent / 'optuna.db'}")
    trials = study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))
    return [next(t.number for t in trials if t.user_attrs.get("seed") == row["seed"] and str(t.params["eps"]) == label)
            for row in result["rows"]]


def test_the_committed_docs_page_is_the_one_the_committed_results_make():
    assert (ROOT / "docs" / "reproduction.md").read_text() == \
        reproduction_page(ROOT / "results", ROOT / "docs" / "reproduction.md"), \
        "run `python -m soma_pl.cli reproduce docs` after changing results/"
