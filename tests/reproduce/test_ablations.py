"""Fig. 9's result drawn from a hand-made report: the curves' means and standard errors, each
condition's difference from the reference, the verdicts, the table and the figure."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from soma_pl.reproduce import comparisons
from soma_pl.reproduce.ablations import REFERENCE, fig9_figure
from soma_pl.reproduce.experiments import load_experiment
from soma_pl.reproduce.verdicts import Verdict

CONDITIONS = [REFERENCE, "random_shards", "global_iid", "cold", "decoder_only_head", "frozen_random_head"]
SHIFT = {REFERENCE: 0.0, "random_shards": 0.02, "global_iid": 0.01, "cold": -0.05, "decoder_only_head": 0.03,
         "frozen_random_head": 1.5}
"""Each condition's test loss above the reference's, on every window (cold: below it)."""
STEPS = (50, 100)


def _curve(folder: Path, losses: list[float]) -> None:
    """A fit's metrics.csv: a validation at each of STEPS (logged at step − 1) and its update time."""
    folder.mkdir(parents=True)
    rows = ["step,val/loss,compute/aggregate_device_hours"]
    for step, loss in zip(STEPS, losses, strict=True):
        rows += [f"{step - 1},{loss},", f"{step},,{step / 3600}"]
    (folder / "metrics.csv").write_text("\n".join(rows) + "\n")


def _scores(path: Path, losses: list[float]) -> str:
    path.write_text(json.dumps({"loss": statistics.fmean(losses), "bootstrap_95": [0.0, 9.0],
                                "window_index": list(range(len(losses))), "window_losses": losses,
                                "doc_ids": ["a", "a", "b", "c"][: len(losses)]}))
    return str(path)


def _report(tmp_path: Path) -> tuple[dict, dict, dict]:
    """Three seeds; condition c's trial is 10·seed + its index; `val[c][seed]` its two validations."""
    per_seed, folders, recorded, val = [], {}, {}, {}
    for seed in range(3):
        trials = {}
        base = [3.0 + 0.01 * seed, 3.1, 2.9, 3.2]
        for index, condition in enumerate(CONDITIONS):
            trial = 10 * seed + index
            trials[condition] = trial
            run = tmp_path / f"trial-{trial}" / "version_0"
            losses = [3.5 + SHIFT[condition] + 0.1 * seed, 3.2 + SHIFT[condition] + 0.05 * seed]
            val.setdefault(condition, {})[seed] = losses
            _curve(run, losses)
            folders[trial] = {seed: str(run)}
            windows = [x + SHIFT[condition] + (0.001 * seed if condition != REFERENCE else 0.0) for x in base]
            recorded[trial] = {seed: _scores(run.parent / "test_scores.json", windows)}
            (run / "final_test" / "version_0").mkdir(parents=True)  # the final split: the same gaps, doubled
            _scores(run / "final_test" / "version_0" / "test_scores.json",
                    [x + SHIFT[condition] for x in windows])
        per_seed.append({"seed": seed, "trial": trials, "val": {c: val[c][seed][-1] for c in CONDITIONS},
                         "selected": {c: {"lr": 0.01 if c == "cold" else 0.001} for c in CONDITIONS}})
    report = {"table7": {"baseline": REFERENCE, "column_labels": CONDITIONS, "per_seed": per_seed,
                         "at_grid_edge": {"cold": ["lr"]}},
              "test_score_files": recorded, "trials": {"COMPLETE": 15}, "failed": []}
    return report, folders, val


def _seed_model(tmp_path: Path, folders: dict, report: dict) -> None:
    """The reference runs' config names a seed checkpoint whose fit summary recorded its validation."""
    seed_root = tmp_path / "seed"
    (seed_root / "version_0").mkdir(parents=True)
    checkpoint = seed_root / "checkpoints" / "last.ckpt"
    (seed_root / "version_0" / "summary.json").write_text(json.dumps(
        {"global_step": 150, "method": "spsa", "last_checkpoint": str(checkpoint), "metrics": {"val/loss": 2.2867}}))
    entry = report["table7"]["per_seed"][0]
    run = Path(folders[entry["trial"][REFERENCE]][entry["seed"]])
    (run / "config.yaml").write_text(f"model:\n  init_args:\n    init: seed\n    seed_checkpoint: {checkpoint}\n")


def test_fig9_draws_the_curves_and_checks_each_claim_on_the_paired_test_windows(tmp_path, monkeypatch):
    report, folders, val = _report(tmp_path)
    _seed_model(tmp_path, folders, report)
    scored = comparisons.score_run
    monkeypatch.setattr(comparisons, "score_run", lambda run, split: pytest.fail("the trials' own test scores are "
                                                                               "used") if split == "test" else
                        scored(run, split))
    result = load_experiment("fig9").result(report, folders)
    for condition in CONDITIONS:
        curve = result["curves"][condition]
        assert curve["steps"] == list(STEPS)
        for position in range(len(STEPS)):
            values = [val[condition][seed][position] for seed in range(3)]
            assert curve["mean"][position] == pytest.approx(statistics.fmean(values))
            assert curve["se"][position] == pytest.approx(statistics.stdev(values) / 3 ** 0.5)
    rows = {row["condition"]: row for row in result["rows"]}
    # every window of condition c is SHIFT[c] + 0.001·seed above the reference's: mean SHIFT[c] + 0.001
    for condition in CONDITIONS[1:]:
        assert rows[condition]["difference"]["mean"] == pytest.approx(SHIFT[condition] + 0.001)
        assert rows[condition]["difference"]["se"] == pytest.approx(0.001 / 3 ** 0.5)
    assert rows["decoder_only_head"]["paper_difference"] == 0.029 and "difference" not in rows[REFERENCE]
    finals = [check for check in result["checks"] if check["split"] == "final"]
    assert [c["claim"].endswith("(final test split, used once)") for c in finals] == [True] * 5
    assert finals[0]["mean"] == pytest.approx(2 * SHIFT["random_shards"] + 0.001)
    assert rows["cold"]["final"]["mean"] == pytest.approx(3.0525 + 0.001 + 2 * SHIFT["cold"])  # base 3.05 + 0.0025·seed
    checks = {check["claim"]: check for check in result["checks"] if check["split"] == "test"}
    claims = {condition: claim.claim for condition, claim in load_experiment("fig9").claims.items()}
    assert set(checks) == set(claims.values()) and set(claims) == set(CONDITIONS[1:])
    for condition in ("random_shards", "global_iid", "decoder_only_head", "frozen_random_head"):
        check = checks[claims[condition]]
        assert check["verdict"] == Verdict.holds.value and check["split"] == "test"
        assert check["document_interval"] == pytest.approx([SHIFT[condition] + 0.001] * 2)
    assert checks[claims["cold"]]["verdict"] == Verdict.does_not_hold.value
    text = load_experiment("fig9").table({**result, "experiment": "fig9", "scale": "cpu", "title": "t", "basis": "b",
                          "wall_seconds": 1.0, "workers": 2, "load_average": [0.1, 0.2], "trial_minutes": 3.0})
    assert "| cold† | lr=0.01; lr=0.01; lr=0.01 |" in text and "(cold: lr)" in text
    assert "| decoder_only_head | lr=0.001; lr=0.001; lr=0.001 | 3.2800 ± 0.0289 | 3.0835 ± 0.0020 | " \
           "+0.0310 ± 0.0006 | 3.1135 ± 0.0020 | +0.029 |" in text
    assert "| update 50 | update 100 |" in text and "**does not hold**" in text
    assert result["seed_model"]["val_loss"] == 2.2867
    assert "150 updates of spsa), whose ensemble-validation loss is 2.2867" in text
    assert fig9_figure({**result, "experiment": "fig9", "scale": "cpu"}, tmp_path / "f.png").stat().st_size > 0


def test_a_selected_run_without_its_trials_test_record_is_scored_on_the_test_split(tmp_path, monkeypatch):
    report, folders, _ = _report(tmp_path)
    Path(report["test_score_files"][0][0]).unlink()
    rescored = json.loads(Path(report["test_score_files"][1][0]).read_text())
    calls = []
    scored = comparisons.score_run
    monkeypatch.setattr(comparisons, "score_run", lambda run, split: calls.append((run, split)) or rescored
                        if split == "test" else scored(run, split))
    result = load_experiment("fig9").result(report, folders)
    assert result["seed_model"] is None  # no run config names a seed
    assert calls == [(Path(folders[0][0]), "test")]
    assert result["rows"][0]["per_seed"]["0"] == pytest.approx(rescored["loss"])
