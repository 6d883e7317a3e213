"""The claims an experiment declares as comparisons of its sweep's columns.

A claim with `worse` and `better` (its file's `claims`) compares each seed's selected run of one
column with the same seed's selected run of another, both scored on the claim's split: the verdict
reads the per-seed differences `worse − better` and the document interval over the windows both
scored. `worse: others` compares `better` with every other column, one check each. Where the
experiment scores its selected runs on the final test split (`final_test`), every such claim is
checked there again, after all of them on their own split.
"""

from __future__ import annotations

import json
from pathlib import Path

from soma_pl.errors import ConfigError
from soma_pl.eval.bootstrap import paired_document_interval
from soma_pl.io import write_json_atomic
from soma_pl.reproduce.experiments import FOLDER, Experiment
from soma_pl.sweeps.final_test import score_run

EXTERNAL_TEXT = "data/external/moby_dick"
"""The external text of Table 9 at CPU scale (`python -m soma_pl.cli external-text`)."""


def run_test_scores(run_dir: str, recorded: str | None) -> dict:
    """A run's per-window test scores: its trial's own test record, else scored again (once)."""
    if recorded and Path(recorded).is_file():
        scores = json.loads(Path(recorded).read_text())
        if "window_losses" in scores:
            return scores
    return score_run(Path(run_dir), "test")


def external_scores(run_dir: Path, text: str = EXTERNAL_TEXT) -> dict:
    """The run's last checkpoint evaluated, frozen, on `text` (once: kept in `<run_dir>/external/`)."""
    from soma_pl.evaluate_text import evaluate

    saved = run_dir / "external" / f"{Path(text).name}.json"
    if saved.is_file():
        return json.loads(saved.read_text())
    checkpoint = json.loads((run_dir / "summary.json").read_text())["last_checkpoint"]
    scores = evaluate(checkpoint, text)
    write_json_atomic(saved, scores)
    return scores


def selected_scores(report: dict, folders: dict[int, dict[int, str]], split: str,
                    text: str = EXTERNAL_TEXT) -> dict[str, list[dict]]:
    """Column → each seed's selected run scored on `split`: `test` (the trial's own test record),
    `final` (the final test split, scored once per run) or `external` (the frozen external text)."""
    table, recorded = report["table7"], report.get("test_score_files", {})
    scores = {}
    for label in map(str, table["column_labels"]):
        runs = [(folders[entry["trial"][label]][entry["seed"]], entry["trial"][label], entry["seed"])
                for entry in table["per_seed"]]
        if split == "test":
            scores[label] = [run_test_scores(run, recorded.get(trial, {}).get(seed)) for run, trial, seed in runs]
        elif split == "external":
            scores[label] = [external_scores(Path(run), text) for run, _, _ in runs]
        else:
            scores[label] = [score_run(Path(run), split) for run, _, _ in runs]
    return scores


def splits(experiment: Experiment) -> list[str]:
    """The splits the experiment's comparisons are checked on, in order: their own, then `final`."""
    own = [claim.split for claim in experiment.claims.values() if claim.better is not None]
    return list(dict.fromkeys(own + (["final"] if experiment.final_test and own else [])))


def comparison_checks(experiment: Experiment, scores: dict[str, dict[str, list[dict]]], **fields) -> list[dict]:
    """Every declared comparison on its split's `scores` (split → column → per-seed scores), then
    each again on `final` where it was scored; `fields` fill the claims' text beside the column's
    `label` and `name` (the experiment's `names`)."""
    checks = []
    for final in (False, True):
        for claim in experiment.claims.values():
            if claim.better is None or (final and "final" not in scores):
                continue
            columns = scores["final" if final else claim.split]
            if missing := sorted({claim.better, *claim.sides(list(columns))} - set(columns)):
                raise ConfigError(f"{FOLDER / experiment.name}.yaml: a claim compares column '{missing[0]}', "
                                  f"which the sweep has not; its columns: {', '.join(columns)}")
            for worse in claim.sides(columns):
                differences = [a["loss"] - b["loss"] for a, b in zip(columns[worse], columns[claim.better],
                                                                      strict=True)]
                checked = claim.on_final() if final else claim
                checks.append(checked.check(differences, paired_document_interval(columns[worse],
                                                                                  columns[claim.better]),
                                            label=worse, name=experiment.names.get(worse, worse), **fields))
    return checks


def compare_selected(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment,
                     text: str = EXTERNAL_TEXT, **fields) -> tuple[dict[str, dict[str, list[dict]]], list[dict]]:
    """(split → column → each seed's selected run scored there, the declared comparisons checked)."""
    scores = {split: selected_scores(report, folders, split, text) for split in splits(experiment)}
    return scores, comparison_checks(experiment, scores, **fields)
