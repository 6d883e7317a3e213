"""`validate` prints each metric once, with the value it logged."""

from __future__ import annotations

import json
import re

import pytest

from soma_pl.cli import main
from tests.lit.conftest import fit_args
from tests.robustness.cli import tiny_dataset

METRICS = ("expert/0/val_loss", "val/loss", "val/loss_ci_low", "val/loss_ci_high")
"""What `validate` of a one-expert run logs: the ensemble-validation loss and its interval (first
loader) and the expert-validation loss (second loader)."""


def test_validate_prints_each_metric_once(tmp_path, capsys):
    corpus, data = tiny_dataset(tmp_path / "tiny")
    run_dir = tmp_path / "run"
    args = fit_args(corpus, data, run_dir, "--trainer.max_steps=4")
    main(args)
    capsys.readouterr()
    main(["validate", *args[1:], "--ckpt_path=last"])
    out = capsys.readouterr().out
    shown = {}
    for name in METRICS:
        lines = [line for line in out.splitlines() if re.match(rf"\W*{re.escape(name)}\s", line)]
        assert len(lines) == 1, (name, out)
        values = [float(cell) for cell in re.findall(r"(?<![\w/.])-?\d+\.\d+(?:e-?\d+)?", lines[0])]
        assert len(values) == 1, f"{name} shown with {len(values)} values: {lines[0]}"
        shown[name] = values[0]
    interval = json.loads((run_dir / "val_scores.json").read_text())["bootstrap_95"]  # no logger: the root
    assert [shown["val/loss_ci_low"], shown["val/loss_ci_high"]] == pytest.approx(interval, rel=1e-6)
    assert shown["val/loss_ci_low"] < shown["val/loss"] < shown["val/loss_ci_high"]
