"""`runs`: several real tiny fits side by side. The table holds each summary's numbers, the curve
each metrics log's validations; bad input is one error line; the figure is written."""

from __future__ import annotations

import csv
import json
import re
import shutil
from pathlib import Path

import pytest

from soma_pl.analysis.runs import RunRow, markdown_table
from soma_pl.cli import main
from tests.lit.conftest import fit_args
from tests.robustness.cli import cli, one_error, tiny_dataset

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
FORWARDS_PER_UPDATE = 2 * 4 * 1 * 4 * 24  # tiny_spsa.yaml: 2 · n_pert · E · B · T


def _args(command: str, corpus: Path, data: Path, run: Path, *extra: str) -> list[str]:
    """`command` on tests/lit/tiny_spsa.yaml with a CSV logger only (no W&B), its versions in the
    run's folder as the default loggers put them."""
    args = [arg for arg in fit_args(corpus, data, run, *extra)[1:] if arg != "--trainer.logger=false"]
    return [command, *args, "--trainer.logger=CSVLogger", f"--trainer.logger.save_dir={run}", "--trainer.logger.name="]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    """Two fits under one folder: `a` (12 updates, validated every 4, then tested in its own folder
    as a sweep trial is) and `b` (8 updates, validated every 2, not tested)."""
    root = tmp_path_factory.mktemp("runs")
    corpus, data = tiny_dataset(root / "dataset")
    a, b = root / "runs" / "a", root / "runs" / "b"
    main(_args("fit", corpus, data, a))
    main(_args("test", corpus, data, a, f"--ckpt_path={a / 'checkpoints' / 'last.ckpt'}"))
    main(_args("fit", corpus, data, b, "--trainer.max_steps=8", "--trainer.val_check_interval=2",
               "--model.init_args.optimizer.init_args.lr=0.05"))
    return root / "runs"


def _summary(run: Path) -> dict:
    return json.loads((run / "version_0" / "summary.json").read_text())


def _validations(run: Path) -> list[tuple[int, float]]:
    """(updates, val/loss) read straight from the CSV log: its `step` is the update count minus one."""
    with (run / "version_0" / "metrics.csv").open() as rows:
        return [(int(row["step"]) + 1, float(row["val/loss"])) for row in csv.DictReader(rows) if row["val/loss"]]


def test_the_table_holds_each_summarys_numbers_and_the_figure_is_written(runs, tmp_path, capsys):
    out, markdown, figure = tmp_path / "table.json", tmp_path / "table.md", tmp_path / "curves.png"
    code, errors = cli(capsys, "runs", str(runs), "--out", str(out), "--markdown", str(markdown),
                       "--figure", str(figure))
    assert (code, errors) == (0, [])
    rows = {Path(row["summary"]).parent.parent.name: row for row in json.loads(out.read_text())["runs"]}
    assert sorted(rows) == ["a", "b"]
    for name, updates, every in (("a", 12, 4), ("b", 8, 2)):
        row, summary, validations = rows[name], _summary(runs / name), _validations(runs / name)
        compute = summary["compute"]
        assert (row["method"], row["experts"], row["updates"]) == ("SPSA", 1, updates)
        assert row["token_forwards"] == compute["token_forwards"] == updates * FORWARDS_PER_UPDATE
        assert row["parameters"] == summary["parameters"]
        assert row["multiply_adds"] == updates * FORWARDS_PER_UPDATE * summary["parameters"]
        assert row["update_seconds"] == pytest.approx(compute["aggregate_device_hours"] * 3600)
        assert row["training_seconds"] == compute["elapsed_training_seconds"]
        assert row["final_val_loss"] == pytest.approx(summary["metrics"]["val/loss"])
        assert [p["updates"] for p in row["curve"]] == list(range(every, updates + 1, every))
        assert [p["val_loss"] for p in row["curve"]] == pytest.approx([loss for _, loss in validations])
        best_updates, best = min(validations, key=lambda v: v[1])
        assert (row["best_val_updates"], row["best_val_loss"]) == (best_updates, pytest.approx(best))
        last = row["curve"][-1]
        assert last["multiply_adds"] == row["multiply_adds"] and last["update_seconds"] == pytest.approx(
            row["update_seconds"])
    (scores,) = (runs / "a").glob("version_*/test_scores.json")
    assert rows["a"]["test_loss"] == pytest.approx(json.loads(scores.read_text())["loss"])
    assert rows["b"]["test_loss"] is None
    table = markdown.read_text()
    assert f"| {rows['a']['final_val_loss']:.4f} |" in table and "| – |" in table  # b has no test loss
    assert len(table.strip().splitlines()) == 2 + 2
    png = figure.read_bytes()
    assert png.startswith(PNG_SIGNATURE) and len(png) > 10_000


def test_runs_named_one_by_one_in_order_with_labels(runs, tmp_path, capsys):
    out = tmp_path / "table.json"
    code, _ = cli(capsys, "runs", str(runs / "b"), str(runs / "a" / "version_0" / "summary.json"),
                  "--labels", "[slow, fast]", "--out", str(out))
    assert code == 0
    rows = json.loads(out.read_text())["runs"]
    assert [(r["label"], r["updates"]) for r in rows] == [("slow", 8), ("fast", 12)]


def test_a_resumed_run_is_one_run_with_the_curve_of_every_session(runs, tmp_path, capsys):
    # A session resumed from update 12 to 16 writes version_2 beside the fit (version_0) and the
    # test (version_1); its summary, written after the test, leaves that test loss out.
    resumed = tmp_path / "resumed"
    shutil.copytree(runs / "a", resumed)
    summary = _summary(resumed)
    summary["global_step"], summary["metrics"]["val/loss"] = 16, 4.5
    summary["compute"].update(updates=16, token_forwards=16 * FORWARDS_PER_UPDATE)
    (resumed / "version_2").mkdir()
    (resumed / "version_2" / "metrics.csv").write_text("epoch,step,val/loss\n0,15,4.5\n")
    (resumed / "version_2" / "summary.json").write_text(json.dumps(summary))
    out = tmp_path / "table.json"
    assert cli(capsys, "runs", str(resumed), "--out", str(out)) == (0, [])
    (row,) = json.loads(out.read_text())["runs"]
    assert row["summary"].endswith("version_2/summary.json") and row["updates"] == 16
    assert [p["updates"] for p in row["curve"]] == [4, 8, 12, 16] and row["final_val_loss"] == 4.5
    assert row["best_val_loss"] == 4.5 and row["test_loss"] is None


@pytest.mark.parametrize("damage, fragment", [
    ("missing", "run not found: "),
    ("empty folder", "no summary.json in it or under it"),
    ("not JSON", "summary.json: unreadable run summary (JSONDecodeError"),
    ("a list", "summary.json: not a run summary (a JSON list, not an object)"),
    ("no compute updates", "summary.json: not a run summary written by `fit` (compute.'updates' is None)"),
    ("bad metrics log", "metrics.csv: unreadable metrics log (ValueError"),
])
def test_a_missing_or_corrupt_run_is_one_error_line(damage, fragment, runs, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(runs / "b", run)
    summary = run / "version_0" / "summary.json"
    if damage == "missing":
        shutil.rmtree(run)
    elif damage == "empty folder":
        shutil.rmtree(run)
        run.mkdir()
    elif damage == "not JSON":
        summary.write_text('{"module": "ZOModule", ')
    elif damage == "a list":
        summary.write_text("[]")
    elif damage == "no compute updates":
        payload = json.loads(summary.read_text())
        del payload["compute"]["updates"]
        summary.write_text(json.dumps(payload))
    else:
        (run / "version_0" / "metrics.csv").write_text("step,val/loss\nfour,5.0\n")
    one_error(cli(capsys, "runs", str(runs / "a"), str(run)), fragment, str(run))


def test_labels_must_name_each_run_once(runs, capsys):
    one_error(cli(capsys, "runs", str(runs), "--labels", "[only]"), "--labels has 1 names for 2 runs found")
    one_error(cli(capsys, "runs", str(runs), "--labels", "[same, same]"), "two runs are named 'same'")


@pytest.mark.parametrize("named", ["run folder", "summary"])
def test_an_output_over_a_runs_files_is_refused_and_the_run_kept(runs, named, capsys):
    run = runs / "a"
    before = {path: path.read_bytes() for path in run.rglob("*") if path.is_file()}
    summary, metrics = run / "version_0" / "summary.json", run / "version_0" / "metrics.csv"
    argument = str(run if named == "run folder" else summary)
    one_error(cli(capsys, "runs", argument, "--out", str(summary)), f"--out={summary}")
    one_error(cli(capsys, "runs", argument, "--markdown", str(metrics)), f"--markdown={metrics}")
    assert {path: path.read_bytes() for path in run.rglob("*") if path.is_file()} == before


@pytest.mark.parametrize("label", ["lr|0.05", "two\nlines", "a | b\r\nc"])
def test_a_label_with_a_pipe_or_a_line_break_stays_one_cell_of_its_row(label):
    row = RunRow(label=label, summary="s.json", method="SPSA", experts=1, parameters=10, updates=2,
                 final_val_loss=2.5, best_val_loss=2.4, best_val_updates=1, test_loss=None, test_scores=None,
                 token_forwards=None, multiply_adds=None, update_seconds=None, training_seconds=None)
    header, rule, *body = markdown_table([row]).split("\n")
    assert len(body) == 1
    cells = re.split(r"(?<!\\)\|", body[0])[1:-1]  # a markdown row's cells: split on unescaped pipes
    assert len(cells) == header.count("|") - 1 == rule.count("|") - 1
    assert cells[0].strip().replace("\\|", "|") == " ".join(label.splitlines())


def test_a_calibrated_run_is_placed_at_updates_times_its_calibrated_update_time(runs, tmp_path, capsys):
    copy = tmp_path / "b"
    shutil.copytree(runs / "b", copy)
    compute = copy / "version_0" / "compute.json"
    report = json.loads(compute.read_text())
    report["budget"] = {**(report.get("budget") or {}), "seconds_per_update": 2.5}
    compute.write_text(json.dumps(report))
    out = tmp_path / "table.json"
    assert cli(capsys, "runs", str(copy), "--out", str(out)) == (0, [])
    (row,) = json.loads(out.read_text())["runs"]
    assert row["update_seconds"] == pytest.approx(8 * 2.5)  # 8 updates, not the measured time
    assert [p["update_seconds"] for p in row["curve"]] == pytest.approx([2.5 * u for u in (2, 4, 6, 8)])
