"""`fit` through the real CLI: exact resume, summaries, loggers, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from soma_pl.analysis.time_basis import measured_curve, validation_windows
from soma_pl.lightning_cli import make_cli

from .conftest import final_weights, fit_args, run_cli

LEARNING_RATE = "--model.init_args.optimizer.init_args.lr=0.05"
"""tiny_spsa.yaml's lr of 0.1 (momentum 0.9) raises the validation loss over 4 updates; 0.05 lowers it
(by 0.028 nats/byte on validation, 0.019 on test, measured)."""
LEARNED = 0.01
"""Nats/byte a trained run's loss must lie below its untrained model's."""


def untrained_loss(corpus, data, run_dir, stage: str = "validate") -> float:
    """`val/loss` (`test/loss` for stage `test`) of tiny_spsa.yaml's model as it starts (the same seed)."""
    cli = make_cli([stage, *fit_args(corpus, data, run_dir)[1:]])
    return cli.trainer.callback_metrics["val/loss" if stage == "validate" else "test/loss"].item()


@pytest.mark.parametrize("optimizer", [(), ("--model.init_args.optimizer=soma_pl.lit.optim.ZOAdam",
                                              "--model.init_args.optimizer.init_args.lr=0.01")],
                         ids=["sgd_momentum", "zo_adam"])
def test_resume_after_a_crash_reaches_the_same_weights_bitwise(corpus_dir, tmp_path, optimizer):
    data = tmp_path / "data"
    run_cli(fit_args(corpus_dir, data, tmp_path / "straight", *optimizer))
    crashed = fit_args(corpus_dir, data, tmp_path / "crashed", *optimizer,
                       "--trainer.callbacks+=tests.lit.crash.CrashAtStep", "--trainer.callbacks.step=10")
    with pytest.raises(RuntimeError, match="simulated crash at step 10"):
        run_cli(crashed)
    checkpoint = torch.load(tmp_path / "crashed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 8
    run_cli(fit_args(corpus_dir, data, tmp_path / "crashed", *optimizer, "--ckpt_path=last"))
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "crashed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert not torch.equal(straight["model.w_hh"], checkpoint["state_dict"]["model.w_hh"])


def test_a_continued_run_keeps_the_optimizer_state_and_steps_at_its_own_learning_rate(corpus_dir, tmp_path):
    """Table 6's settings each continue one checkpoint with its optimizer state (App. I.2): Adam's
    moments and step count come from the checkpoint, the learning rate from the continuation's config."""
    adam = ("--model.init_args.optimizer=soma_pl.lit.optim.ZOAdam", "--model.init_args.optimizer.init_args.lr=0.01")
    data, first = tmp_path / "data", tmp_path / "first" / "checkpoints" / "last.ckpt"
    run_cli(fit_args(corpus_dir, data, tmp_path / "first", *adam, "--trainer.max_steps=2"))
    start = torch.load(first, weights_only=False)["optimizer_states"][0]
    run_cli(fit_args(corpus_dir, data, tmp_path / "continued", *adam, "--model.init_args.optimizer.init_args.lr=0.002",
                     "--trainer.max_steps=3", f"--ckpt_path={first}"))
    end = torch.load(tmp_path / "continued" / "checkpoints" / "last.ckpt", weights_only=False)["optimizer_states"][0]
    assert [g["lr"] for g in start["param_groups"]] == [0.01] and [g["lr"] for g in end["param_groups"]] == [0.002]
    assert {float(s["step"]) for s in start["state"].values()} == {2.0}
    assert {float(s["step"]) for s in end["state"].values()} == {3.0}  # the moments went on, not restarted


def test_summary_json_and_offline_loggers(corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    args = [a for a in fit_args(corpus_dir, tmp_path / "data", tmp_path / "run") if a != "--trainer.logger=false"]
    run_cli(args + ["--trainer.max_steps=4", LEARNING_RATE])
    summaries = list((tmp_path / "run").rglob("summary.json"))
    assert [s.parent for s in summaries] == [tmp_path / "run" / "version_0"]
    summary = json.loads(summaries[0].read_text())
    assert summary["global_step"] == 4
    untrained = untrained_loss(corpus_dir, tmp_path / "data", tmp_path / "untrained")
    assert summary["metrics"]["val/loss"] < untrained - LEARNED
    assert summary["last_checkpoint"].endswith("last.ckpt")
    metrics = list((tmp_path / "run").rglob("metrics.csv"))
    assert metrics and "train/token_forwards_per_s" in metrics[0].read_text().splitlines()[0]
    offline_runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert offline_runs and list(offline_runs[0].glob("*.wandb")), "W&B should have written an offline run"
    assert f"run directory: {tmp_path / 'run' / 'version_0'}" in capsys.readouterr().err


def test_unknown_config_key_is_one_clear_error(corpus_dir, tmp_path):
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", *fit_args(corpus_dir, tmp_path / "d", tmp_path / "r"),
                             "--model.init_args.bogus_key=1"], capture_output=True, text=True)
    assert result.returncode != 0
    assert "bogus_key" in result.stderr.strip().splitlines()[-1]


def test_checkpoint_of_another_shape_names_both_shapes(corpus_dir, tmp_path, capsys):
    data = tmp_path / "data"
    run_cli(fit_args(corpus_dir, data, tmp_path / "small", "--trainer.max_steps=4"))
    ckpt = tmp_path / "small" / "checkpoints" / "last.ckpt"
    with pytest.raises(SystemExit) as exit_info:
        run_cli(fit_args(corpus_dir, data, tmp_path / "wide", "--model.init_args.shape.width=12",
                         f"--ckpt_path={ckpt}"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "[1, 3, 8]" in message and "[1, 3, 12]" in message and "model.norm_gains" in message


@pytest.mark.network
def test_quickstart_fast_dev_run_on_the_demo_corpus(tmp_path):
    run_cli(["fit", "--config", "configs/quickstart.yaml", "--trainer.fast_dev_run=2",
             f"--data.prepared={tmp_path / 'demo'}", f"--trainer.default_root_dir={tmp_path}"])
    manifest = json.loads((tmp_path / "demo" / "manifest.json").read_text())
    assert set(manifest["train"]["sources"]) == {"wikipedia", "sotu", "python_docs"}


def test_bptt_trains_through_the_cli(corpus_dir, tmp_path):
    run_cli(fit_args(corpus_dir, tmp_path / "data", tmp_path / "bptt", "--model=soma_pl.lit.BPTTModule",
                     "--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
                     "--model.init_args.shape.embed_dim=8",
                     "--model.init_args.train_context=24", "--model.init_args.optimizer=torch.optim.Adam",
                     "--model.init_args.optimizer.lr=0.01", "--trainer.max_steps=8"))
    checkpoint = torch.load(tmp_path / "bptt" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 8
    assert checkpoint["optimizer_states"][0]["state"], "Adam should hold moment estimates after 8 steps"


def test_validate_test_and_predict_from_a_checkpoint(corpus_dir, tmp_path):
    data = tmp_path / "data"
    run_cli(fit_args(corpus_dir, data, tmp_path / "run", "--trainer.max_steps=4", LEARNING_RATE))
    ckpt = f"--ckpt_path={tmp_path / 'run' / 'checkpoints' / 'last.ckpt'}"
    common = [a for a in fit_args(corpus_dir, data, tmp_path / "eval")[1:] if not a.startswith("--checkpoint")]
    runs = {}
    for command in ("validate", "test", "predict"):
        runs[command] = make_cli([command, *common, ckpt])
    val_loss = runs["validate"].trainer.callback_metrics["val/loss"].item()
    test_loss = runs["test"].trainer.callback_metrics["test/loss"].item()
    assert val_loss < untrained_loss(corpus_dir, data, tmp_path / "untrained") - LEARNED
    assert test_loss < untrained_loss(corpus_dir, data, tmp_path / "untrained", "test") - LEARNED
    predictions = runs["predict"].trainer.predict_loop.predictions
    indices = torch.cat([p["index"] for p in predictions])
    losses = torch.cat([p["loss"] for p in predictions], dim=1)
    assert indices.tolist() == list(range(4)) and losses.shape == (1, 4)
    assert losses.mean().item() == pytest.approx(test_loss, rel=1e-5)  # equal windows: mean of means
    report = json.loads(next((tmp_path / "eval").rglob("test_scores.json")).read_text())
    low, high = report["bootstrap_95"]
    assert low <= test_loss <= high and report["windows"] == 4 and report["documents"] == 4
    assert report["loss"] == pytest.approx(test_loss, rel=1e-5)
    # Per window, in the split's order: the predictions' losses, and the documents they came from.
    assert report["window_index"] == list(range(4)) and len(set(report["doc_ids"])) == 4
    assert report["window_losses"] == pytest.approx(losses[0].tolist(), rel=1e-5)


def test_a_fit_keeps_each_validation_window_by_window(corpus_dir, tmp_path):
    """`val_windows/<updates>.json` at every validation of a fit: its windows' mean is the logged
    `val/loss` at that update, its update counts the validation curve's, every window and document of
    the validation split; what reproduce's document intervals on validation curves are made of."""
    args = [a for a in fit_args(corpus_dir, tmp_path / "data", tmp_path / "run") if a != "--trainer.logger=false"]
    run_cli(args + ["--trainer.max_steps=8", "--trainer.logger=lightning.pytorch.loggers.CSVLogger",
                    f"--trainer.logger.init_args.save_dir={tmp_path / 'run'}", "--trainer.logger.init_args.name=fit"])
    fit_root = tmp_path / "run" / "fit"
    records, curve = validation_windows(fit_root), measured_curve(fit_root)
    assert sorted(records) == [updates for updates, _, _ in curve] == [4, 8]
    for updates, loss, _ in curve:
        record = records[updates]
        assert record["window_index"] == list(range(len(record["window_losses"])))
        assert len(record["doc_ids"]) == len(record["window_losses"]) > 1
        assert sum(record["window_losses"]) / len(record["window_losses"]) == pytest.approx(loss, rel=1e-6)
