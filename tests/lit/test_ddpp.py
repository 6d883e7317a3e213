"""DDPP: shares of one step's directions rebuild the one-process estimate; 2 gloo processes train
the weights one process trains, and exchange only a few floats per step."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from soma_pl.data.stream import rank_share
from soma_pl.errors import ConfigError
from soma_pl.estimators.spsa import SPSAConfig, assemble_estimate, spsa_differences, spsa_estimate
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import DDPPModule, SPSAModule
from soma_pl.models import StackedExperts

from .conftest import final_weights, fit_args
from .multiprocess import fit_on_processes, max_difference


@pytest.mark.parametrize("world,max_rows", [(1, None), (2, 4), (4, None)])
def test_shares_of_the_directions_rebuild_the_one_process_estimate_bit_for_bit(world, max_rows):
    torch.manual_seed(0)
    model = StackedExperts(num_experts=1, width=8, embed_dim=8, num_layers=1, time_chunk=8)
    params = dict(model.expert_parameters())
    batch = torch.randint(0, 256, (1, 6, 17), dtype=torch.uint8)
    config = SPSAConfig(eps=1e-2, n_pert=3, micro_batch=2, max_rows=max_rows)  # 9 directions, 3 micro-batches
    reference = spsa_estimate(model.loss_per_group, params, batch, config, step=5, seed=1)
    shares = [spsa_differences(model.loss_per_group, params, batch, config, 5, 1, rank_share(9, rank, world))
              for rank in range(world)]
    deltas, losses = torch.cat([d for d, _ in shares], 1), torch.cat([l for _, l in shares], 1)
    gradient = assemble_estimate(params, deltas, config, step=5, seed=1)
    assert torch.equal(deltas, reference.projected)
    assert torch.equal(losses.mean(1), reference.loss)
    for name in params:
        assert torch.equal(gradient[name], reference.gradient[name]), name


def test_plain_spsa_refuses_to_fit_on_several_processes(monkeypatch):
    trainer = SimpleNamespace(world_size=2, global_rank=0, ckpt_path=None)
    monkeypatch.setattr(SPSAModule, "trainer", property(lambda self: trainer))
    with pytest.raises(ConfigError, match="2 diverging replicas.*soma_pl.lit.DDPPModule"):
        SPSAModule(width=8, num_layers=1, embed_dim=8).setup("fit")
    DDPPModule(width=8, num_layers=1, embed_dim=8).check_world_size(2)  # DDPP accepts any number


def test_ddpp_on_two_processes_trains_the_weights_of_one_process(corpus_dir, tmp_path):
    # B = 6 windows in micro-batches of 2, n_pert = 3: 9 directions, shared 4 + 5, the split
    # running through the middle micro-batch.
    settings = ["--data.init_args.batch_size=6", "--model.init_args.n_pert=3", "--trainer.max_steps=6",
                "--trainer.val_check_interval=3"]
    data = tmp_path / "data"
    reference = make_cli(fit_args(corpus_dir, data, tmp_path / "one", *settings))
    ddpp = fit_args(corpus_dir, data, tmp_path / "two", *settings, "--model=soma_pl.lit.DDPPModule")[1:]
    ranks = fit_on_processes(ddpp, processes=2, dump=tmp_path / "ranks")

    assert max_difference(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert max_difference(one, two) <= 1e-6  # 0.0 on CPU: the same arithmetic in the same order
    # Each rank evaluated its own share of the forwards; they add up to the one process's.
    assert [r["token_forwards"] for r in ranks] == [2 * 4 * 2 * 24, 2 * 5 * 2 * 24]
    assert sum(r["token_forwards"] for r in ranks) == reference.model.last_update.token_forwards
    # Exchanged per step: δ and mean loss (2 float32) of 5 padded directions from each of 2 ranks.
    assert {r["exchange_bytes"] for r in ranks} == {2 * 5 * 2 * 4}
