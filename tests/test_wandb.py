"""W&B: a `fit` and a `test` log offline runs, grouped and named by `--wandb.*`, with the whole
config, per-expert metrics, compute accounting and final losses; read back from the `.wandb` files."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from soma_pl.lightning_cli import make_cli
from tests.lit.conftest import corpus_dir  # noqa: F401
from tests.lit.test_soma import sharded, soma_args  # noqa: F401

BLOCK, HEADER = 32768, 7  # the LevelDB log layout of W&B's transaction log
FULL, LAST = 1, 4


def read_records(path: Path):
    """Every protobuf `Record` of a `.wandb` transaction log (after its 7-byte `:W&B` file header,
    LevelDB log records: 4-byte checksum, 2-byte length, 1-byte type; none crosses a 32 KiB block)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    position, parts = HEADER, []
    while position + HEADER <= len(data):
        if BLOCK - position % BLOCK < HEADER:  # block trailer padding
            position += BLOCK - position % BLOCK
            continue
        length, kind = struct.unpack("<HB", data[position + 4: position + HEADER])
        parts.append(data[position + HEADER: position + HEADER + length])
        position += HEADER + length
        if kind in (FULL, LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(parts))
            parts = []
            yield record


def _key(item) -> str:
    return item.key or ".".join(item.nested_key)


class OfflineRun:
    """The run record, merged config, every history row's keys and the final summary of one run."""

    def __init__(self, folder: Path):
        self.config, self.summary, self.history_keys = {}, {}, set()
        for record in read_records(next(folder.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                self.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                self.history_keys |= {_key(i) for i in record.history.item}
            elif kind == "summary":
                self.summary.update({_key(i): json.loads(i.value_json) for i in record.summary.update})


def _offline_runs(root: Path) -> dict[str, OfflineRun]:
    runs = [OfflineRun(folder) for folder in sorted((root / "wandb").glob("offline-run-*"))]
    return {run.run.job_type: run for run in runs}


def test_fit_and_test_log_grouped_offline_runs(sharded, corpus_dir, monkeypatch):  # noqa: F811
    monkeypatch.setenv("WANDB_MODE", "offline")
    root, _, experts = sharded
    wandb_args = ["--trainer.logger=true", "--wandb.group=study-a", "--wandb.name=trial-7"]
    run_dir = root / "wandb_run"
    make_cli(["fit", *soma_args(corpus_dir, root, experts, "wandb_run"), *wandb_args,
              "--compute.reference_seconds=[0.168]", "--trainer.max_steps=4"])
    make_cli(["test", *soma_args(corpus_dir, root, experts, "wandb_run"), *wandb_args,
              f"--ckpt_path={run_dir / 'checkpoints' / 'last.ckpt'}"])
    runs = _offline_runs(run_dir)
    assert set(runs) == {"fit", "test"}, "each command should finish its own W&B run"
    fit, test = runs["fit"], runs["test"]
    for run in (fit, test):
        assert (run.run.run_group, run.run.display_name, run.run.project) == ("study-a", "trial-7", "soma_pl")
        assert run.config["model"]["init_args"]["num_experts"] == 2 and run.config["wandb"]["group"] == "study-a"
    assert fit.config["compute"]["reference_seconds"] == [0.168]
    assert {f"expert/{e}/{m}" for e in (0, 1) for m in ("train_loss", "val_loss", "lr", "mean_update_seconds")} \
        <= fit.history_keys
    assert {"compute/aggregate_device_hours", "compute/fixed_0.168s_device_hours", "val/loss"} <= fit.history_keys
    summary = json.loads(next(run_dir.rglob("summary.json")).read_text())
    compute = summary["compute"]
    assert fit.summary["compute/aggregate_device_hours"] == pytest.approx(compute["aggregate_device_hours"])
    assert fit.summary["compute/updates"] == compute["updates"] == 4
    assert fit.summary["compute_accounting"]["expert_mean_update_seconds"] == compute["expert_mean_update_seconds"]
    assert fit.summary["val/loss"] == pytest.approx(summary["metrics"]["val/loss"])
    scores = json.loads(next(run_dir.rglob("test_scores.json")).read_text())
    assert test.summary["test/loss"] == pytest.approx(scores["loss"], rel=1e-5)


SECTIONS = {"model", "data", "trainer", "seed_everything", "checkpoint", "compute", "budget", "summary", "wandb"}


@pytest.mark.parametrize("logger", ["default", "WandbLogger"])
def test_each_logger_path_logs_the_whole_config_once(logger, corpus_dir, tmp_path, monkeypatch, capfd):  # noqa: F811
    """Both the default W&B logger and `--trainer.logger WandbLogger` get every resolved section,
    nothing flat beside them, and the `--wandb.*` settings."""
    from tests.lit.conftest import fit_args

    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    args = [a for a in fit_args(corpus_dir, tmp_path / "data", run_dir) if a != "--trainer.logger=false"]
    args += ["--trainer.max_steps=4", "--wandb.group=study-b", "--wandb.name=trial-3", "--wandb.tags=[x]"]
    args += ["--trainer.logger=WandbLogger"] if logger == "WandbLogger" else []
    make_cli(args)
    folders = list((run_dir / "wandb").glob("offline-run-*"))
    assert len(folders) == 1, f"one W&B run under the run folder, found {folders}"
    run = OfflineRun(folders[0])
    assert (run.run.run_group, run.run.display_name, run.run.project, run.run.job_type) == \
        ("study-b", "trial-3", "soma_pl", "fit")
    assert list(run.run.tags) == ["x"]
    logged = set(run.config) - {"_wandb"}
    assert SECTIONS <= logged, f"missing sections: {SECTIONS - logged}"
    init_args = run.config["model"]["init_args"]
    assert not logged & set(init_args), f"flat module arguments beside the nested config: {logged & set(init_args)}"
    assert init_args["optimizer"]["class_path"] == "torch.optim.SGD"
    assert init_args["optimizer"]["init_args"]["lr"] == 0.1 and init_args["shape"]["width"] == 8
    assert run.config["seed_everything"] == 0 and run.config["trainer"]["max_steps"] == 4
    assert run.config["data"]["init_args"]["batch_size"] == 4
    assert run.config["wandb"]["group"] == "study-b"
    err = capfd.readouterr().err
    assert "anonymous setting" not in err and "contains the key(s) ['monitor']" not in err
