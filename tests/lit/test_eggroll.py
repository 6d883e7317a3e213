"""`EGGROLLModule` through the real CLI: a tiny fit, its accounting, exact resume, bad batch sizes."""

from __future__ import annotations

import pytest
import torch

from soma_pl.lightning_cli import make_cli

from .conftest import final_weights, fit_args, run_cli

# tiny_spsa.yaml's data hold 4 windows per batch: 4 groups of 6 members.
EGGROLL = ["--model=soma_pl.lit.EGGROLLModule", "--model.init_args.width=8", "--model.init_args.num_layers=1",
           "--model.init_args.embed_dim=8", "--model.init_args.train_context=24", "--model.init_args.sigma=0.05",
           "--model.init_args.rank=2", "--model.init_args.population=24", "--model.init_args.group_size=6",
           "--model.init_args.fitness=group", "--model.init_args.max_members=10", "--model.init_args.seed=3",
           "--model.init_args.optimizer=torch.optim.SGD", "--model.init_args.optimizer.lr=0.002"]


def test_fit_records_population_forwards_and_moves_the_weights(corpus_dir, tmp_path):
    args = fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", *EGGROLL, "--trainer.max_steps=4")
    initial = {name: value.clone() for name, value in make_cli(args[1:], run=False).model.state_dict().items()}
    cli = make_cli(args)
    module = cli.model
    record = module.last_update
    assert record.token_forwards == 24 * 24 and record.experts == 1 and record.seconds > 0
    metrics = cli.trainer.callback_metrics
    assert 0 < metrics["train/loss"].item() < 6 and metrics["train/sigma"].item() == pytest.approx(0.05)
    assert "population" in module.hparams and "n_pert" not in module.hparams
    trained = torch.load(tmp_path / "run" / "checkpoints" / "last.ckpt", weights_only=False)
    assert trained["global_step"] == 4
    for name in module.model.state_dict():  # matrices and norm gains alike
        assert not torch.equal(initial[f"model.{name}"], trained["state_dict"][f"model.{name}"]), name


def test_resume_after_a_crash_reaches_the_same_weights_bitwise(corpus_dir, tmp_path):
    data = tmp_path / "data"
    steps = "--trainer.max_steps=8"  # a checkpoint at step 4, a crash at step 6
    run_cli(fit_args(corpus_dir, data, tmp_path / "straight", *EGGROLL, steps))
    crashed = fit_args(corpus_dir, data, tmp_path / "crashed", *EGGROLL, steps,
                       "--trainer.callbacks+=tests.lit.crash.CrashAtStep", "--trainer.callbacks.step=6")
    with pytest.raises(RuntimeError, match="simulated crash at step 6"):
        run_cli(crashed)
    run_cli(fit_args(corpus_dir, data, tmp_path / "crashed", *EGGROLL, steps, "--ckpt_path=last"))
    straight, resumed = final_weights(tmp_path / "straight"), final_weights(tmp_path / "crashed")
    for name in straight:
        assert torch.equal(straight[name], resumed[name]), name


def test_batch_size_that_does_not_match_the_groups_is_one_clear_error(corpus_dir, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        run_cli(fit_args(corpus_dir, tmp_path / "data", tmp_path / "run", *EGGROLL, "--trainer.max_steps=1",
                         "--model.init_args.group_size=4"))
    assert exit_info.value.code == 2
    message = capsys.readouterr().err.strip().splitlines()[-1]
    assert "batch_size=6" in message and "4 windows" in message
