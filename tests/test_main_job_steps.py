"""The main job's fit bars: the demo reads a fit's progress file (`ProgressFile`'s JSON lines)."""

from __future__ import annotations

import importlib
import io
import json

from tqdm import tqdm

from soma_pl.callbacks.progress import ProgressFile
from soma_pl.main_job_steps import PROGRESS_CALLBACK, FitProgress, progress_arguments


def _bar(total: int | None = 10) -> tqdm:
    return tqdm(total=total, desc="spsa fit", file=io.StringIO(), mininterval=0)


def test_whole_lines_only_each_read_once(tmp_path):
    path = tmp_path / "fit.progress.jsonl"
    bar = _bar()
    progress = FitProgress(path, bar)
    progress.poll()  # no file yet: the fit has not started training
    assert bar.n == 0
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 2, "val_loss": 5.43216}\n{"step": 3')
    progress.poll()
    assert bar.n == 2 and bar.postfix == "val loss 5.4322"  # the half-written last line waits
    with path.open("a") as file:
        file.write('}\n{"step": 4, "val_loss": 4.9}\n')
    progress.poll()
    assert bar.n == 4 and bar.postfix == "val loss 4.9000"
    progress.poll()  # nothing new
    assert bar.n == 4
    bar.close()
    assert "4/10" in bar.fp.getvalue() and "val loss 4.9000" in bar.fp.getvalue()


def test_a_resumed_fit_starts_at_its_checkpoints_update(tmp_path):
    path = tmp_path / "fit.progress.jsonl"
    path.write_text('{"step": 6}\n{"step": 7}\n')
    bar = _bar()
    FitProgress(path, bar).poll()
    assert bar.n == 7


def test_the_fit_argument_names_the_callback(tmp_path):
    (argument,) = progress_arguments(tmp_path / "p.jsonl")
    option, _, value = argument.partition("=")
    assert option == "--trainer.callbacks+"
    callback = json.loads(value)
    module, _, name = callback["class_path"].rpartition(".")
    assert callback["class_path"] == PROGRESS_CALLBACK
    assert getattr(importlib.import_module(module), name) is ProgressFile
    assert callback["init_args"] == {"path": str(tmp_path / "p.jsonl")}
