"""Settings that must take effect or be refused, never silently changed: precision, the CLI's
optimizer, and the optimizer a checkpoint restores."""

from __future__ import annotations

import pytest
import torch

from soma_pl.cli import main
from soma_pl.lit import ZOModule

from .conftest import fit_args, run_cli

BPTT = ["--model=soma_pl.lit.BPTTModule", "--model.init_args.shape.width=8", "--model.init_args.shape.num_layers=1",
        "--model.init_args.shape.embed_dim=8", "--model.init_args.train_context=24",
        "--model.init_args.optimizer=torch.optim.Adam", "--model.init_args.optimizer.lr=0.01"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-mixed", "16-true"])
def test_zero_order_modules_refuse_reduced_precision_in_one_line(corpus_dir, tmp_path, capsys, precision):
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", f"--trainer.precision={precision}"))
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    # on a CPU Lightning runs 16-mixed as bf16-mixed, and the message names what it runs
    assert err[-1].startswith("soma_pl: error: trainer.precision=") and "ZOModule" in err[-1]
    assert "32-true, 64-true" in err[-1]


def test_bptt_trains_in_bf16_mixed_precision(corpus_dir, tmp_path):
    run_cli(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", *BPTT, "--trainer.precision=bf16-mixed",
                     "--trainer.max_steps=4"))
    checkpoint = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert checkpoint["global_step"] == 4 and checkpoint["optimizer_states"][0]["state"]
    assert all(torch.isfinite(v).all() for v in checkpoint["state_dict"].values() if v.is_floating_point())


def test_lightning_cli_optimizer_flag_is_not_offered(corpus_dir, tmp_path, capsys):
    """`--optimizer` would replace the module's optimizer and its decay; the optimizer is
    `--model.init_args.optimizer`."""
    with pytest.raises(SystemExit) as exit_info:
        main(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", "--optimizer=Adam", "--optimizer.lr=1e-3"))
    assert exit_info.value.code == 2
    assert "--optimizer" in capsys.readouterr().err


def test_load_from_checkpoint_restores_the_configured_optimizer(corpus_dir, tmp_path):
    run_cli(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", "--trainer.max_steps=2"))
    module = ZOModule.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "last.ckpt")
    optimizer = module.optimizer_factory(module.trainable_parameters().values())
    assert isinstance(optimizer, torch.optim.SGD)
    group = optimizer.param_groups[0]
    assert (group["lr"], group["momentum"]) == (0.1, 0.9)  # tiny_spsa.yaml's, not SGD's or the signature's
