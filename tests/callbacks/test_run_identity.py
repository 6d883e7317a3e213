"""A resumed `fit` logs into its run's `version_N` folder: `metrics.csv` keeps every session's rows
and reads as the log of an uninterrupted run; `summary.json` there holds the whole run's figures."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from soma_pl.callbacks.run_identity import ContinuedCSVLogger
from soma_pl.cli import main
from soma_pl.models.checkpoints import load_checkpoint
from tests.lit.conftest import fit_args
from tests.robustness.cli import tiny_dataset


def _rows(path: Path) -> list[dict[str, str]]:
    with path.open(newline="") as rows:
        return list(csv.DictReader(rows))


def _write_rows(path: Path, header: list[str], rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as file:
        csv.writer(file).writerows([header, *rows])


@pytest.mark.parametrize("left_aside", [False, True])
def test_continued_csv_logger_keeps_the_earlier_rows(left_aside, tmp_path):
    """Rows already in `version_0/metrics.csv` stay, new rows follow them, and a metric the earlier
    session did not log widens the header. A file left aside by a session killed while starting
    (`.metrics.csv.resumed`) is moved back the same way."""
    folder = tmp_path / "version_0"
    _write_rows(folder / (".metrics.csv.resumed" if left_aside else "metrics.csv"), ["a", "step"], [["1.5", "0"]])
    logger = ContinuedCSVLogger(tmp_path, version=0)
    logger.log_metrics({"a": 2.5}, step=1)
    logger.save()
    logger.log_metrics({"b": 3.0}, step=2)
    logger.save()
    assert logger.log_dir == str(folder)
    assert _rows(folder / "metrics.csv") == [{"a": "1.5", "b": "", "step": "0"}, {"a": "2.5", "b": "", "step": "1"},
                                             {"a": "", "b": "3.0", "step": "2"}]
    assert sorted(path.name for path in folder.iterdir()) == ["metrics.csv"]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_dataset(tmp_path_factory.mktemp("tiny"))


def _by_step(rows: list[dict[str, str]], metric: str) -> dict[int, float]:
    """`{step: value}` of `metric`'s rows, each step logged once."""
    steps = [int(row["step"]) for row in rows if row.get(metric)]
    assert len(steps) == len(set(steps)), f"{metric} logged twice at a step: {sorted(steps)}"
    return {int(row["step"]): float(row[metric]) for row in rows if row.get(metric)}


def test_resumed_fit_logs_into_its_version_folder(tiny_data, tmp_path, monkeypatch):
    """`fit` (4 updates), `validate`, `fit --ckpt_path last` (to 8), and `fit --ckpt_path last` again
    (nothing left to train): one fit folder, `version_0`, whose metrics equal an uninterrupted 8-update
    run's, step by step; `validate` has its own `version_1`; `summary.json` counts all 8 updates."""
    monkeypatch.setenv("WANDB_MODE", "disabled")  # the default loggers: CSV only
    corpus, data = tiny_data
    run_dir, reference = tmp_path / "run", tmp_path / "reference"
    main([*fit_args(corpus, data, reference), "--trainer.logger=true", "--trainer.max_steps=8"])
    args = [*fit_args(corpus, data, run_dir), "--trainer.logger=true"]
    main([*args, "--trainer.max_steps=4"])
    main(["validate", *args[1:], "--ckpt_path=last"])
    main([*args, "--trainer.max_steps=8", "--ckpt_path=last"])
    main([*args, "--trainer.max_steps=8", "--ckpt_path=last"])

    assert sorted(path.name for path in run_dir.iterdir()) == ["checkpoints", "version_0", "version_1"]
    assert sorted(path.name for path in (run_dir / "version_1").iterdir()) == \
        ["config.yaml", "hparams.yaml", "metrics.csv", "val_scores.json"]
    rows, expected = _rows(run_dir / "version_0" / "metrics.csv"), _rows(reference / "version_0" / "metrics.csv")
    for metric in ("train/loss", "val/loss", "expert/0/val_loss"):
        assert _by_step(rows, metric) == pytest.approx(_by_step(expected, metric), rel=1e-6), metric
    assert sorted(_by_step(rows, "train/loss")) == list(range(8))
    summary = json.loads((run_dir / "version_0" / "summary.json").read_text())
    assert summary["global_step"] == 8 and summary["compute"]["updates"] == 8
    assert summary["metrics"]["val/loss"] == pytest.approx(_by_step(expected, "val/loss")[7], rel=1e-6)
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["run_identity"]["csv_version"] == 0
