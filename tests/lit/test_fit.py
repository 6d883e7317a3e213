"""`fit` through the real CLI: exact resume, summaries, loggers, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from .conftest import final_weights, fit_args, run_cli


def test_resume_after_a_crash_reaches_the_same_weights_bitwise(corpus_dir, tmp_path):
    data = tmp_path / "data"
    run_cli(fit_args(corpus_dir, data, tmp_path / "straight"))
    crashed = fit_args(corpus_dir, data, tmp_path / "crashed",
                       "--trainer.callbacks+=tests.lit.crash.CrashAtStep", "--trainer.callbacks.step=10")
    with pytest.raises(RuntimeError, match="simulated crash at step 10"):
        run_cli(crashed)
    checkpoint = torch.load(tmp_path / "crashed" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 8
    run_cli(fit_args(corpus_dir, data, tmp_path / "crashed", "--ckpt_path=last"))
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "crashed")
    assert straight.keys() == resumed.keys()
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name
    assert not torch.equal(straight["model.w_hh"], checkpoint["state_dict"]["model.w_hh"])


def test_summary_json_and_offline_loggers(corpus_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    args = [a for a in fit_args(corpus_dir, tmp_path / "data", tmp_path / "run") if a != "--trainer.logger=false"]
    run_cli(args + ["--trainer.max_steps=4"])
    summaries = list((tmp_path / "runs").rglob("summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["global_step"] == 4 and 0 < summary["metrics"]["val/loss"] < 6
    assert summary["last_checkpoint"].endswith("last.ckpt")
    metrics = list((tmp_path / "runs").rglob("metrics.csv"))
    assert metrics and "train/token_forwards_per_s" in metrics[0].read_text().splitlines()[0]
    assert list((tmp_path / "runs").rglob("offline-run-*")), "W&B should have written an offline run"
    assert "run directory:" in capsys.readouterr().err


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
        run_cli(fit_args(corpus_dir, data, tmp_path / "wide", "--model.init_args.width=12", f"--ckpt_path={ckpt}"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "[1, 2, 8]" in message and "[1, 2, 12]" in message and "model.norm_gains" in message
