"""The final test split of a sweep's selected runs: `sweep report --final_test=true`.

The prepared dataset's `test_final` split (`dataset.final_test_windows`) is used once: only the
runs that Table 7 selected on ensemble validation are scored on it, after the selection, each by a
`test --data.init_args.test_split=final` of its last checkpoint under the run's own saved config.
A run's score is kept in `<run_dir>/final_test/` and read back by every later report, so the split
is evaluated once per selected run however often the report is drawn.

`score_run(run_dir, "test")` scores a run on the ordinary test split the same way (into
`<run_dir>/test_windows/`): `reproduce` uses it for a selected run whose trial kept no test
record of its own (the paired document bootstrap needs its per-window losses).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from soma_pl.errors import SomaError

FOLDERS = {"final": "final_test", "test": "test_windows"}
"""Where each split's scores of a run go, under its run folder."""


def scored(run_dir: Path, split: str = "final") -> dict | None:
    """The run's scores on `split` (`final` or `test`), when it has been scored."""
    return _scores_in(run_dir / FOLDERS[split])


def _scores_in(folder: Path) -> dict | None:
    found = sorted(folder.glob("**/test_scores.json"))
    return json.loads(found[-1].read_text()) if found else None


def score_run(run_dir: Path, split: str = "final") -> dict:
    """Score one selected run's last checkpoint on `split` (once; later calls read it)."""
    done = scored(run_dir, split)
    if done is not None:
        return done
    config, summary = run_dir / "config.yaml", run_dir / "summary.json"
    for path in (config, summary):
        if not path.is_file():
            raise SomaError(f"selected run {run_dir} has no {path.name}: cannot score it on the {split} test split")
    checkpoint = json.loads(summary.read_text()).get("last_checkpoint")
    if not checkpoint or not Path(checkpoint).is_file():
        raise SomaError(f"selected run {run_dir}: its last checkpoint {checkpoint} is gone")
    return score_checkpoint(config, checkpoint, run_dir / FOLDERS[split], split)


def score_checkpoint(config: Path, checkpoint: str, folder: Path, split: str = "test") -> dict:
    """`test` of `checkpoint` under the run config `config` on `split`, as its own process, its
    scores kept in `folder` (once; later calls read them)."""
    done = _scores_in(folder)
    if done is not None:
        return done
    log = folder.with_suffix(".log")
    log.parent.mkdir(parents=True, exist_ok=True)
    command = [sys.executable, "-m", "soma_pl.cli", "test", "--config", str(config), f"--ckpt_path={checkpoint}",
               f"--data.init_args.test_split={split}", f"--trainer.default_root_dir={folder}",
               "--trainer.callbacks=[]", "--trainer.enable_progress_bar=false"]  # no trial reporter
    with log.open("w") as output:
        code = subprocess.call(command, stdout=output, stderr=subprocess.STDOUT, env={**os.environ})
    done = _scores_in(folder)
    if code != 0 or done is None:
        tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-2:])
        raise SomaError(f"{split}-split test of {checkpoint} failed ({log}): {tail}")
    return done


def final_table(per_seed: list[dict], run_dirs: dict[int, dict[int, str]], baseline: str | None,
                stats) -> dict:
    """Table 7 on the final split: each seed's selected runs (`per_seed[i]["trial"][label]`) scored,
    baseline − other differences, then their statistics (`stats`)."""
    rows = []
    for entry in per_seed:
        losses = {label: score_run(Path(run_dirs[trial][entry["seed"]]))["loss"]
                  for label, trial in entry["trial"].items()}
        rows.append({"seed": entry["seed"], "test": losses,
                     "difference": {label: losses[str(baseline)] - loss for label, loss in losses.items()
                                    if label != str(baseline)}})
    labels = list(rows[0]["test"]) if rows else []
    return {"per_seed": rows, "test": {label: stats([r["test"][label] for r in rows]) for label in labels},
            "difference": {label: stats([r["difference"][label] for r in rows])
                           for label in labels if label != str(baseline)}}
