"""Sweep files and a fake trial process for testing the study logic without real fits.

The fake trial writes the `trial_result.json` a real one would (validation loss from a closed form of
the point), appends the point it ran to `runs.jsonl` (an independent record of what actually ran),
and fails like a diverging fit for `lr: 0.5`.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from soma_pl.sweeps import runner
from soma_pl.sweeps.space import load_sweep

TINY = Path(__file__).resolve().parents[1] / "lit" / "tiny_spsa.yaml"
FAKE_TRIAL = """
import json, sys
result_path, payload, ledger = sys.argv[1:4]
payload = json.loads(payload)
with open(ledger, "a") as f:
    f.write(json.dumps(payload["point"]) + "\\n")
if payload["point"].get("lr") == 0.5:
    print("Traceback (most recent call last):", file=sys.stderr)
    print("FloatingPointError: loss diverged at step 3 (lr 0.5)", file=sys.stderr)
    sys.exit(1)
json.dump(payload["result"], open(result_path, "w"))
"""


def fake_val_loss(point: dict, seed: int) -> float:
    """A closed form the tests can recompute: lower lr and eps are better, seeds add a little."""
    return 2.0 + point.get("lr", 0.0) + 10 * point.get("eps", 0.0) + 0.01 * seed - 0.1 * (point.get("N", 1) - 1)


def write_sweep(folder: Path, storage: str | None = None, **fields) -> Path:
    """A grid sweep (N x lr, seeds 0 and 1) over the tiny test config, written as YAML."""
    content = {"study": "unit", "config": str(TINY), "output_dir": str(folder / "out"), "seeds": [0, 1],
               "grid": {"N": {"choices": {1: {}, 2: {"model.init_args.num_experts": 2}}},
                        "lr": {"key": "model.init_args.optimizer.init_args.lr", "values": [0.01, 0.02]}},
               "report": {"columns": "N", "baseline": 1}, "heartbeat_seconds": 0.2, "stale_seconds": 30,
               "wandb": False, **({"storage": storage} if storage else {}), **fields}
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump(content))
    return path


@pytest.fixture()
def fake_trials(monkeypatch, tmp_path):
    """Replace the trial process by FAKE_TRIAL; returns the ledger of points that ran."""
    ledger = tmp_path / "runs.jsonl"
    ledger.touch()

    def command(spec, trial, params, seed, run_dir, storage, report):
        point = {**{k: v for k, v in params.items() if k != "seed"}, "seed": seed}
        val = fake_val_loss(point, seed)
        result = {"val_loss": val, "test_loss": val + 0.05, "pruned": False, "global_step": 7,
                  "run_dir": str(run_dir)}
        return [sys.executable, "-c", FAKE_TRIAL, str(run_dir / "trial_result.json"),
                json.dumps({"point": point, "result": result}), str(ledger)]

    monkeypatch.setattr(runner, "fit_command", command)
    return ledger


def ran(ledger: Path) -> list[dict]:
    return [json.loads(line) for line in ledger.read_text().splitlines()]


def spec_of(path: Path):
    return load_sweep(path)
