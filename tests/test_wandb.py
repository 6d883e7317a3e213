"""W&B: a `fit` and a `test` log offline runs, grouped and named by `--wandb.*`, with the whole
config, per-expert metrics, compute accounting and final losses; a resumed `fit` continues its run;
`--wandb.log_model` logs checkpoints as artifacts; `WANDB_MODE=disabled` writes nothing of W&B.
Read back from the `.wandb` files."""

from __future__ import annotations

import base64
import hashlib
import json
import struct
from pathlib import Path

import pytest
from wandb.proto import wandb_internal_pb2

from soma_pl.contracts import UpdateClock
from soma_pl.lightning_cli import make_cli
from soma_pl.models.checkpoints import load_checkpoint
from tests.lit.conftest import corpus_dir, fit_args  # noqa: F401
from tests.lit.test_soma import sharded, soma_args  # noqa: F401
from tests.robustness.cli import tiny_dataset

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
    """The run record, merged config, every history row (and their keys and global steps), the
    metrics declared with `define_metric`, the final summary and the artifacts of one run."""

    def __init__(self, folder: Path):
        self.config, self.summary, self.history_keys, self.steps, self.artifacts = {}, {}, set(), set(), []
        self.rows, self.defined = [], {}
        for record in read_records(next(folder.glob("*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                self.run = record.run
                self.config.update({_key(i): json.loads(i.value_json) for i in record.run.config.update})
            elif kind == "config":
                self.config.update({_key(i): json.loads(i.value_json) for i in record.config.update})
            elif kind == "history":
                self.rows.append({_key(i): json.loads(i.value_json) for i in record.history.item})
                self.history_keys |= set(self.rows[-1])
                self.steps |= {json.loads(i.value_json) for i in record.history.item
                               if _key(i) == "trainer/global_step"}
            elif kind == "metric":
                self.defined[record.metric.name or record.metric.glob_name] = record.metric
            elif kind == "artifact":
                self.artifacts.append(record.artifact)
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


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> tuple[Path, Path]:
    return tiny_dataset(tmp_path_factory.mktemp("tiny"))


def _fit(tiny_data, run_dir: Path, *extra: str) -> None:
    corpus, data = tiny_data
    make_cli([*fit_args(corpus, data, run_dir), "--trainer.logger=true", *extra])


def test_every_row_of_losses_holds_the_compute_axes_a_chart_can_take_as_x(tiny_data, tmp_path, monkeypatch):
    """W&B plots one metric against another within a row only: each training and validation row
    holds the token-forwards, multiply-adds and device-hours spent by its update (the row's step is
    its update count minus one), and the run declares them with `define_metric`."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setattr(UpdateClock, "seconds", lambda self: 0.25)
    run_dir = tmp_path / "run"
    _fit(tiny_data, run_dir, "--trainer.max_steps=8", "--trainer.log_every_n_steps=2")
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    run = OfflineRun(folder)
    assert {"compute/token_forwards", "compute/multiply_adds", "compute/aggregate_device_hours"} <= set(run.defined)
    per_expert = json.loads((run_dir / "version_0" / "summary.json").read_text())["parameters"]  # one expert
    forwards = 2 * 4 * 1 * 4 * 24  # tiny_spsa.yaml: 2 · n_pert · experts · windows · predicted bytes
    losses = [row for row in run.rows if "train/loss" in row or "val/loss" in row]
    assert sorted(row["trainer/global_step"] for row in losses) == [1, 3, 3, 5, 7, 7]  # validations after 4, 8
    for row in losses:
        updates = row["trainer/global_step"] + 1
        assert row["compute/token_forwards"] == updates * forwards
        assert row["compute/multiply_adds"] == updates * forwards * per_expert
        assert row["compute/aggregate_device_hours"] == pytest.approx(updates * 0.25 / 3600)


@pytest.mark.parametrize("logger", ["default", "WandbLogger"])
def test_a_resumed_fit_continues_its_wandb_run(logger, tiny_data, tmp_path, monkeypatch):
    """Each session of a fit resumed from its own checkpoint (`--ckpt_path last`, or a path) is an
    offline run with the first session's id, logging from the checkpoint's step on."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    run_dir = tmp_path / "run"
    extra = ["--trainer.logger=WandbLogger"] if logger == "WandbLogger" else []
    _fit(tiny_data, run_dir, "--trainer.max_steps=4", *extra)
    resume = "last" if logger == "WandbLogger" else str(run_dir / "checkpoints" / "last.ckpt")
    _fit(tiny_data, run_dir, "--trainer.max_steps=8", f"--ckpt_path={resume}", *extra)
    folders = sorted((run_dir / "wandb").glob("offline-run-*"), key=lambda folder: folder.name)
    assert len(folders) == 2, folders
    first, second = (OfflineRun(folder) for folder in folders)
    assert first.run.run_id and second.run.run_id == first.run.run_id
    assert folders[1].name.endswith(f"-{first.run.run_id}")
    # Rows are logged at the update count before each update, and at the end: 0..4, then 4..8.
    assert first.steps == set(range(5)) and second.steps == set(range(4, 9))
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["run_identity"]["wandb_id"] == first.run.run_id
    assert not first.artifacts and not second.artifacts, "no checkpoint artifacts unless --wandb.log_model"


def test_wandb_disabled_writes_nothing_of_wandb(tiny_data, tmp_path, monkeypatch):
    """`WANDB_MODE=disabled`: no `wandb` folder anywhere (run folder or working directory), the CSV
    log and summary are written as ever, and the checkpoint names no W&B run."""
    monkeypatch.setenv("WANDB_MODE", "disabled")
    monkeypatch.chdir(tmp_path)
    run_dir = tmp_path / "run"
    _fit(tiny_data, run_dir, "--trainer.max_steps=4")
    assert not [path for path in tmp_path.rglob("*") if "wandb" in path.name], "W&B wrote files"
    rows = (run_dir / "version_0" / "metrics.csv").read_text().splitlines()
    assert "val/loss" in rows[0].split(",") and len(rows) > 4
    assert json.loads((run_dir / "version_0" / "summary.json").read_text())["global_step"] == 4
    assert load_checkpoint(run_dir / "checkpoints" / "last.ckpt")["run_identity"] == \
        {"csv_version": 0, "wandb_id": None}


def _md5(path: Path) -> str:
    """W&B's manifest digest of a file: its MD5, base64."""
    return base64.b64encode(hashlib.md5(path.read_bytes()).digest()).decode()


def test_log_model_puts_the_checkpoints_in_the_offline_run(tiny_data, tmp_path, monkeypatch):
    """`--wandb.log_model true`: when the fit ends, its last and best checkpoints are `model`
    artifacts of the offline run, each holding that file's bytes (W&B's MD5 digest of the file)."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb-data"))  # W&B stages artifact copies here
    run_dir = tmp_path / "run"
    _fit(tiny_data, run_dir, "--trainer.max_steps=4", "--wandb.log_model=true")
    (folder,) = (run_dir / "wandb").glob("offline-run-*")
    run = OfflineRun(folder)
    logged = {json.loads(artifact.metadata)["original_filename"]: artifact for artifact in run.artifacts}
    checkpoints = run_dir / "checkpoints"
    assert set(logged) == {path.name for path in checkpoints.glob("*.ckpt")} == {"last.ckpt", "epoch=0-step=4.ckpt"}
    for name, artifact in logged.items():
        assert (artifact.type, artifact.name, artifact.run_id) == ("model", f"model-{run.run.run_id}", run.run.run_id)
        (entry,) = artifact.manifest.contents
        assert entry.path == "model.ckpt" and entry.digest == _md5(checkpoints / name)
        assert entry.size == (checkpoints / name).stat().st_size
