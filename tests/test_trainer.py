"""`limit_*_batches: 1` is one batch: an integer in a config file, on the command line or in a sweep's
overrides stays an integer (Lightning reads 1.0 as every batch), and a fraction stays a fraction."""

from __future__ import annotations

import json

import pytest
import yaml

from soma_pl.config_files import override_args
from soma_pl.lightning_cli import make_cli
from soma_pl.sweeps.space import load_sweep
from tests.lit.conftest import TINY, corpus_dir, fit_args  # noqa: F401

ROOT = TINY.parents[2]


def _trainer(tmp_path, *args: str):
    return make_cli(["--config", str(TINY), f"--trainer.default_root_dir={tmp_path / 'run'}", "--trainer.logger=false",
                     *args], run=False).trainer


@pytest.mark.parametrize(("written", "expected"), [("1", 1), ("3", 3), ("1.0", 1.0), ("0.25", 0.25)])
def test_a_batch_limit_keeps_the_type_it_was_written_with(written, expected, tmp_path):
    layer = tmp_path / "limits.yaml"
    layer.write_text(f"trainer:\n  limit_val_batches: {written}\n  limit_test_batches: {written}\n")
    from_file = _trainer(tmp_path, "--config", str(layer))
    from_line = _trainer(tmp_path, f"--trainer.limit_val_batches={written}", "--trainer.limit_test_batches",
                         written, f"--trainer.limit_predict_batches={written}", f"--trainer.overfit_batches={written}")
    for trainer in (from_file, from_line):
        for value in (trainer.limit_val_batches, trainer.limit_test_batches):
            assert value == expected and type(value) is type(expected)
    assert type(from_line.limit_predict_batches) is type(from_line.overfit_batches) is type(expected)


@pytest.mark.parametrize("name", ["table6_lr_eps"])
def test_the_demo_sweeps_score_one_validation_batch(name, tmp_path):
    spec = load_sweep(ROOT / "sweeps" / "demo" / f"{name}.yaml")
    assert spec.overrides["trainer.limit_val_batches"] == 1
    limits = {key: value for key, value in spec.overrides.items() if key.startswith("trainer.limit_")}
    trainer = _trainer(tmp_path, *override_args(limits))
    assert trainer.limit_val_batches == 1 and isinstance(trainer.limit_val_batches, int)


def test_predict_with_one_batch_scores_one_batch_of_windows(corpus_dir, tmp_path):  # noqa: F811
    """The windows scored, counted in what `predict` writes: 2 of the 4 test windows at batch size 2."""
    data, run = tmp_path / "data", tmp_path / "run"
    make_cli(fit_args(corpus_dir, data, run, "--trainer.max_steps=2"))
    args = [a for a in fit_args(corpus_dir, data, tmp_path / "predict")[1:] if not a.startswith("--checkpoint")]
    for limit, windows in (("1", 2), ("1.0", 4)):
        make_cli(["predict", *args, f"--ckpt_path={run / 'checkpoints' / 'last.ckpt'}",
                  "--data.init_args.eval_batch_size=2", f"--trainer.limit_predict_batches={limit}",
                  f"--predictions.path=windows-{limit}.jsonl"])
        rows = (tmp_path / "predict" / f"windows-{limit}.jsonl").read_text().splitlines()
        assert len(rows) == windows, (limit, rows)
        assert [json.loads(row)["window"] for row in rows] == list(range(windows))
    assert yaml.safe_load(TINY.read_text())["data"]["init_args"]["dataset"]["test_windows"] == 4


def test_the_gpu_base_runs_float32_products_in_tf32_and_the_cpu_base_does_not(tmp_path):
    """Table 1: float32 weights with TF32 kernels on the GPU (audit row A12); the setting is the trainer
    base's, applied by the CLI before anything is built, and the CPU base keeps full float32."""
    import torch

    bases = {name: yaml.safe_load((ROOT / "configs" / "trainer" / f"{name}.yaml").read_text())
             for name in ("gpu", "cpu")}
    assert bases["gpu"]["float32_matmul_precision"] == "high" and "float32_matmul_precision" not in bases["cpu"]
    try:
        for written, expected in (("high", "high"), (None, "highest")):
            torch.set_float32_matmul_precision("medium")
            _trainer(tmp_path, *([f"--float32_matmul_precision={written}"] if written else []))
            assert torch.get_float32_matmul_precision() == expected
    finally:
        torch.set_float32_matmul_precision("highest")
