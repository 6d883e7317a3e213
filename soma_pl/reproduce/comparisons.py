"""The claims an experiment declares as comparisons of its sweep's columns.

A claim with `worse` and `better` (its file's `claims`) compares each seed's selected run of one
column with the same seed's selected run of another, both scored on the claim's split: the verdict
reads the per-seed differences `worse − better` and the document interval over the windows both
scored. `worse: others` compares `better` with every other column, one check each. Where the
experiment scores its selected runs on the final test split (`final_test`), every such claim is
checked there again, after all of them on their own split.

An experiment whose claims are all such comparisons needs no module of its own: `selected_result`,
`selected_markdown` and `selected_figure` lay out each column's selected runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from soma_pl.errors import ConfigError
from soma_pl.eval.bootstrap import paired_document_interval
from soma_pl.io import write_json_atomic
from soma_pl.reproduce.experiments import Experiment
from soma_pl.reproduce.tables import (
    grid_edge_note,
    interval_text,
    number,
    rows_figure,
    selected_text,
    table_head,
    table_row,
)
from soma_pl.reproduce.verdicts import mean_sd
from soma_pl.sweeps.final_test import score_run
from soma_pl.sweeps.space import SweepSpec

EXTERNAL_TEXT = "data/external/moby_dick"
"""The external text of Table 9 at CPU scale (`python -m soma_pl.cli external-text`)."""
SPLITS = {"test": "test split", "final": "final test split (used once)", "external": "external text"}


def run_test_scores(run_dir: str, recorded: str | None) -> dict:
    """A run's per-window test scores: its trial's own test record, else scored (once)."""
    if recorded and Path(recorded).is_file():
        return json.loads(Path(recorded).read_text())
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


def sweep_columns(spec: SweepSpec) -> list[str]:
    """The labels of the sweep's report columns (its `report.columns` factor), as strings; none
    without one."""
    return next(([str(label) for label in factor.choices] for factor in spec.factors
                 if factor.name == spec.report.columns), [])


def check_columns(experiment: Experiment, columns: list[str]) -> None:
    """Refuse a comparison of a column the sweep has not (`reproduce` asks before any trial runs)."""
    for key, claim in experiment.claims.items():
        if claim.better is not None and (missing := sorted({claim.better, *claim.sides(columns)} - set(columns))):
            raise ConfigError(f"{experiment.path}: claims.{key} compares column '{missing[0]}', which the sweep has "
                              f"not; its columns: {', '.join(columns)}")


def comparison_checks(experiment: Experiment, scores: dict[str, dict[str, list[dict]]], **fields) -> list[dict]:
    """Every declared comparison on its split's `scores` (split → column → per-seed scores), then,
    with `final_test`, each again on the final split; `fields` fill the claims' text beside the
    column's `label` and `name` (the experiment's `names`)."""
    check_columns(experiment, list(next(iter(scores.values()), {})))
    checks = []
    for final in (False, True):
        for claim in experiment.claims.values():
            if claim.better is None or final and (not experiment.final_test or claim.split == "final"):
                continue
            columns = scores["final" if final else claim.split]
            for worse in claim.sides(list(columns)):
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


def selected_result(report: dict, folders: dict[int, dict[int, str]], experiment: Experiment) -> dict:
    """The result of an experiment without a module of its own: each column's selected setting per
    seed and its selected runs' scores on every split the comparisons read, the comparisons checked."""
    table = report["table7"]
    per_seed, edges = table["per_seed"], table.get("at_grid_edge") or {}
    scores, checks = compare_selected(report, folders, experiment)
    first = next(iter(scores))
    rows = [{"row": label, "name": experiment.names.get(label, label),
             "selected": [(entry.get("selected") or {}).get(label) for entry in per_seed],
             "at_grid_edge": edges.get(label) or [],
             "per_seed": {str(e["seed"]): s["loss"] for e, s in zip(per_seed, scores[first][label], strict=True)},
             "documents_95": [s.get("bootstrap_95") for s in scores[first][label]],
             **{split: mean_sd([s["loss"] for s in by_column[label]]) for split, by_column in scores.items()}}
            for label in scores[first]]
    return {"rows": rows, "splits": list(scores), "checks": checks, "seeds": [e["seed"] for e in per_seed]}


def selected_markdown(result: dict) -> str:
    """One row per column: its name, selected settings, each split's loss and the first split's
    document intervals per seed."""
    splits = result["splits"]
    lines = [f"Each column's selected run per seed (seeds {', '.join(map(str, result['seeds']))}), scored on "
             f"{', '.join(SPLITS.get(s, s) for s in splits)}: loss in nats/byte, mean ± sd over seeds, and each "
             f"seed's 95% document interval on the {SPLITS.get(splits[0], splits[0])}.", "",
             *table_head(["Column", "Name", "Selected, per seed", *(SPLITS.get(s, s) for s in splits),
                          "95% documents, per seed"])]
    for row in result["rows"]:
        lines.append(table_row([row["row"] + ("†" if row["at_grid_edge"] else ""), row["name"],
                                selected_text(row["selected"]),
                                *(f"{number(row[s]['mean'])} ± {number(row[s]['sd'])}" for s in splits),
                                " ".join(interval_text(i, False) for i in row["documents_95"])]))
    return "\n".join([*lines, *grid_edge_note({row["row"]: row["at_grid_edge"] for row in result["rows"]})]) + "\n"


def selected_figure(result: dict, path: Path) -> Path:
    """Each column's loss on the first split per seed, and its mean ± sd."""
    split = result["splits"][0]
    return rows_figure(result, path, split, f"{SPLITS.get(split, split)} loss (nats/byte)",
                       f"{result['experiment']} at {result['scale']} scale")
