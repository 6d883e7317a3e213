"""Fig. 4 drawn from hand-made continuations: the two arms paired by seed, the start checkpoint's
test loss beside them, and the claim decided on `summed − independent`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soma_pl.errors import SomaError
from soma_pl.reproduce.experiments import load_experiment
from soma_pl.reproduce.mechanism import fig4_figure
from soma_pl.reproduce.verdicts import Verdict


def _continuation(folder: Path, loss: float) -> None:
    """A continuation of `folder.parent / start` (test loss 2.5 there) whose four test windows of two
    documents score `loss` ± 0.05."""
    start = folder.parent / "start"
    folder.mkdir(parents=True)
    (folder / "config.yaml").write_text(f"ckpt_path: {start / 'checkpoints' / 'last.ckpt'}\n")
    if not (start / "start_test").is_dir():
        (start / "start_test" / "version_0").mkdir(parents=True)
        (start / "start_test" / "version_0" / "test_scores.json").write_text(json.dumps({"loss": 2.5}))
    losses = [loss - 0.05, loss + 0.05, loss - 0.05, loss + 0.05]
    (folder / "test_windows" / "version_0").mkdir(parents=True)
    (folder / "test_windows" / "version_0" / "test_scores.json").write_text(json.dumps({
        "loss": loss, "window_losses": losses, "window_index": [0, 1, 2, 3], "doc_ids": ["a", "a", "b", "b"]}))


def _report(root: Path, gap: dict[int, float]) -> tuple[dict, dict]:
    """Three seeds; independent at 2.0 + 0.01·seed, summed `gap[seed]` above it."""
    per_seed, folders = [], {}
    for seed in (0, 1, 2):
        trials = {"independent": 10 * seed, "summed": 10 * seed + 1}
        for arm, trial in trials.items():
            folders[trial] = {seed: str(root / f"t{trial}")}
            _continuation(root / f"t{trial}", 2.0 + 0.01 * seed + (gap[seed] if arm == "summed" else 0.0))
        per_seed.append({"seed": seed, "trial": trials})
    return ({"table7": {"column_labels": ["independent", "summed"], "per_seed": per_seed}, "trials": {"COMPLETE": 6},
             "failed": []}, folders)


def test_fig4_holds_when_every_seed_and_document_favours_the_independent_losses(tmp_path):
    report, folders = _report(tmp_path, {0: 0.03, 1: 0.04, 2: 0.035})
    result = load_experiment("fig4").result(report, folders)
    (check,) = result["checks"]
    assert result["differences"] == pytest.approx([0.03, 0.04, 0.035])
    assert check["verdict"] == Verdict.holds.value and check["split"] == "test" and "200 further" in check["claim"]
    assert check["document_interval"][0] > 0 and result["start"]["test"] == 2.5
    shown = {**result, "experiment": "fig4", "scale": "cpu", "title": "t", "basis": "b", "wall_seconds": 1.0,
             "workers": 2, "load_average": [0.1, 0.2]}
    assert "| 1 | 2.0100 | 2.0500 | +0.0400 |" in load_experiment("fig4").table(shown)
    assert fig4_figure(shown, tmp_path / "f.png").stat().st_size > 0


def test_fig4_does_not_hold_when_the_summed_loss_ends_lower(tmp_path):
    report, folders = _report(tmp_path, {0: -0.03, 1: -0.04, 2: -0.035})
    assert load_experiment("fig4").result(report, folders)["checks"][0]["verdict"] == Verdict.does_not_hold.value


def test_fig4_refuses_arms_that_resumed_different_checkpoints(tmp_path):
    report, folders = _report(tmp_path, {0: 0.03, 1: 0.04, 2: 0.035})
    (Path(folders[1][0]) / "config.yaml").write_text("ckpt_path: elsewhere/checkpoints/last.ckpt\n")  # summed, seed 0
    with pytest.raises(SomaError) as refused:
        load_experiment("fig4").result(report, folders)
    assert "elsewhere/checkpoints/last.ckpt" in str(refused.value)
