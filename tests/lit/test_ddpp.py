"""DDPP: shares of one step's directions rebuild the one-process estimate; 2 gloo processes train
the weights one process trains, exchanging a few floats per step (`scalars`) or each rank's partial
estimate (`estimates`, Fig. 12)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch

from soma_pl.distributed import rank_share
from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, assemble_estimate, spsa_differences, spsa_estimate
from soma_pl.lightning_cli import make_cli
from soma_pl.lit import ModelShape, SPSAArgs, ZOModule, ddpp
from soma_pl.lit.ddpp import Exchange, partial_estimate, step_exchange_bytes, unflatten
from soma_pl.models import StackedExperts

from .conftest import final_weights, fit_args
from .multiprocess import fit_on_processes, max_difference

SHAPE = ModelShape(width=8, num_layers=1, embed_dim=8)


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
    deltas, losses = torch.cat([d for d, _ in shares], 1), torch.cat([loss for _, loss in shares], 1)
    gradient = assemble_estimate(params, deltas, config, step=5, seed=1)
    assert torch.equal(deltas, reference.projected)
    assert torch.equal(losses.mean(1), reference.loss)
    for name in params:
        assert torch.equal(gradient[name], reference.gradient[name]), name


def test_plain_spsa_refuses_to_fit_on_several_processes(monkeypatch):
    trainer = SimpleNamespace(world_size=2, global_rank=0, ckpt_path=None, precision="32-true")
    monkeypatch.setattr(ZOModule, "trainer", property(lambda self: trainer))
    with pytest.raises(ConfigError, match="spsa.exchange"):
        ZOModule(shape=SHAPE).setup("fit")
    ZOModule(shape=SHAPE, spsa={"exchange": "scalars"}).check_world_size(2)  # DDPP accepts any number


def test_ddpp_on_two_processes_trains_the_weights_of_one_process(corpus_dir, tmp_path):
    # B = 6 windows in micro-batches of 2, n_pert = 3: 9 directions, shared 4 + 5, the split
    # running through the middle micro-batch.
    settings = ["--data.init_args.batch_size=6", "--model.init_args.spsa.n_pert=3", "--trainer.max_steps=6",
                "--trainer.val_check_interval=3"]
    data = tmp_path / "data"
    reference = make_cli(fit_args(corpus_dir, data, tmp_path / "one", *settings))
    ddpp = fit_args(corpus_dir, data, tmp_path / "two", *settings, "--model.init_args.spsa.exchange=scalars")[1:]
    ranks = fit_on_processes(ddpp, processes=2, dump=tmp_path / "ranks")

    assert max_difference(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    one, two = final_weights(tmp_path / "one"), final_weights(tmp_path / "two")
    assert max_difference(one, two) <= 1e-6  # 0.0 on CPU: the same arithmetic in the same order
    # Each rank evaluated its own share of the forwards; they add up to the one process's.
    assert [r["token_forwards"] for r in ranks] == [2 * 4 * 2 * 24, 2 * 5 * 2 * 24]
    assert sum(r["token_forwards"] for r in ranks) == reference.model.last_update.token_forwards
    # Exchanged per step: δ and mean loss (2 float32) of 5 padded directions from each of 2 ranks.
    assert {r["exchange_bytes"] for r in ranks} == {2 * 5 * 2 * 4}
    # Each device is charged the whole step (App. K): one model on 2 devices, against one expert on one.
    accounting = {run: json.loads(next((tmp_path / run).rglob("compute.json")).read_text())["accounting"]
                  for run in ("one", "two")}
    assert accounting == {"one": "device_per_expert", "two": "every_device"}


PAPER_PARAMETERS = 8_333_905  # configs/ddpp.yaml: the d_t = 509 body (8,325,713) and its head (8,192)


@pytest.mark.parametrize("exchange,world,expected", [
    (Exchange.scalars, 1, 0),
    (Exchange.scalars, 2, 2 * 5 * 2 * 4),  # 9 directions padded to 5 per rank, δ and loss in float32
    (Exchange.scalars, 8, 8 * 8 * 2 * 4),  # configs/ddpp.yaml: 64 directions over 8 ranks
    (Exchange.estimates, 1, 0),
    (Exchange.estimates, 2, 2 * (PAPER_PARAMETERS + 1) * 4),  # estimate and mean loss, up and back
    (Exchange.estimates, 8, 2 * (PAPER_PARAMETERS + 1) * 4),  # per rank: independent of W
])
def test_exchange_bytes_per_step_have_the_closed_form(exchange, world, expected):
    directions = 9 if world == 2 and exchange is Exchange.scalars else 64
    assert step_exchange_bytes(exchange, directions, PAPER_PARAMETERS, 1, torch.float32, world) == expected
    assert step_exchange_bytes(exchange.value, directions, PAPER_PARAMETERS, 1, torch.float64, world) == 2 * expected


@pytest.mark.parametrize("world,max_rows,kind", [(3, None, DirectionKind.rademacher), (9, 4, DirectionKind.sparse),
                                                 (3, None, DirectionKind.gaussian), (2, None, DirectionKind.sparse),
                                                 (4, 4, DirectionKind.rademacher)])
def test_partial_estimates_of_the_shares_add_up_to_the_one_process_estimate(world, max_rows, kind):
    """9 directions in chunks of 3 (one micro-batch's n_pert) or of 1 (max_rows = 4): on 3 and 9 ranks each
    share is one whole chunk and the shares' sums, added in rank order, are the one-process estimate's
    bits; on 2 and 4 ranks the shares cut chunks, and the sums agree to float rounding."""
    torch.manual_seed(0)
    model = StackedExperts(num_experts=1, width=8, embed_dim=8, num_layers=1, time_chunk=8)
    params = dict(model.expert_parameters())
    batch = torch.randint(0, 256, (1, 6, 17), dtype=torch.uint8)
    config = SPSAConfig(eps=1e-2, n_pert=3, micro_batch=2, max_rows=max_rows, direction=kind)  # 9 directions
    reference = spsa_estimate(model.loss_per_group, params, batch, config, step=5, seed=1)
    total = None
    for rank in range(world):
        share = rank_share(9, rank, world)
        delta, _ = spsa_differences(model.loss_per_group, params, batch, config, 5, 1, share)
        partial = partial_estimate(params, delta, config, 5, 1, share)
        total = partial.clone() if total is None else total.add_(partial)
    exact = world in (3, 9)
    for name, gradient in unflatten(total / 9, params).items():
        if exact:
            assert torch.equal(gradient, reference.gradient[name]), name
        else:
            torch.testing.assert_close(gradient, reference.gradient[name], rtol=1e-6, atol=1e-7 * gradient.abs().max())


def _tiny_ddpp(exchange: str = "scalars") -> ZOModule:
    torch.manual_seed(0)
    return ZOModule(shape=SHAPE, spsa=SPSAArgs(eps=1e-2, n_pert=3, micro_batch=2, exchange=exchange), seed=1)


def _estimate_on(module: ZOModule, monkeypatch, rank: int, world: int):
    trainer = SimpleNamespace(world_size=world, global_rank=rank)
    monkeypatch.setattr(ZOModule, "trainer", property(lambda self: trainer))
    return module.estimator.estimate(module, torch.randint(0, 256, (1, 6, 17), dtype=torch.uint8,
                                                           generator=torch.Generator().manual_seed(2)), 1e-2)


def test_estimates_exchange_makes_the_scalars_update_with_d_floats_per_rank(monkeypatch):
    scalars, estimates = _tiny_ddpp(), _tiny_ddpp(exchange="estimates")
    assert scalars.exchange is Exchange.scalars and estimates.exchange is Exchange.estimates
    assert estimates.hparams.spsa["exchange"] == "estimates"
    reference = _estimate_on(scalars, monkeypatch, 0, 1)
    one = _estimate_on(estimates, monkeypatch, 0, 1)  # one process: ZOModule's estimate exactly
    for name, gradient in reference.gradient.items():
        assert torch.equal(one.gradient[name], gradient), name
    assert one.logs["exchange_bytes"] == 0

    # Two ranks without processes: record each rank's payload, then hand every rank their sum.
    payloads = []
    monkeypatch.setattr(ddpp, "sum_at_coordinator", lambda module, local: payloads.append(local) or local)
    for rank in range(2):
        _estimate_on(estimates, monkeypatch, rank, 2)
    monkeypatch.setattr(ddpp, "sum_at_coordinator", lambda module, local: payloads[0] + payloads[1])
    combined = [_estimate_on(estimates, monkeypatch, rank, 2) for rank in range(2)]
    for name, gradient in reference.gradient.items():
        assert torch.equal(combined[0].gradient[name], combined[1].gradient[name])
        torch.testing.assert_close(combined[0].gradient[name], gradient, rtol=1e-6, atol=1e-7 * gradient.abs().max())
    torch.testing.assert_close(combined[0].loss, reference.loss, rtol=1e-6, atol=0.0)
    assert "head" not in estimates.perturbed_parameters()  # the delta rule steps it (the default)
    parameters = sum(p.numel() for p in estimates.perturbed_parameters().values())
    assert [p.shape for p in payloads] == [torch.Size([1, parameters + 1])] * 2
    assert [update.logs["exchange_bytes"] for update in combined] == [2 * (parameters + 1) * 4] * 2
    assert [update.forwards // (2 * 2 * 16) for update in combined] == [4, 5]  # 9 directions: 4 + 5, 2 windows of 16


@pytest.mark.slow
def test_both_exchanges_on_two_processes_train_the_weights_of_one_process_bit_for_bit(corpus_dir, tmp_path):
    # B = 4 windows in micro-batches of 2, n_pert = 3: 6 directions, one micro-batch's chunk of 3 per rank.
    # `estimates` adds each rank's chunk at the coordinator in rank order, as one process adds its chunks.
    settings = ["--data.init_args.batch_size=4", "--model.init_args.spsa.n_pert=3", "--trainer.max_steps=6",
                "--trainer.val_check_interval=3"]
    data = tmp_path / "data"
    make_cli(fit_args(corpus_dir, data, tmp_path / "one", *settings))
    runs = {}
    for exchange in Exchange:
        args = fit_args(corpus_dir, data, tmp_path / exchange.value, *settings,
                        f"--model.init_args.spsa.exchange={exchange.value}")[1:]
        runs[exchange] = fit_on_processes(args, processes=2, dump=tmp_path / f"ranks_{exchange.value}")

    ranks = runs[Exchange.estimates]
    assert max_difference(ranks[0]["weights"], ranks[1]["weights"]) == 0.0  # the sum is broadcast from rank 0
    one = final_weights(tmp_path / "one")
    for exchange in Exchange:
        assert max_difference(one, final_weights(tmp_path / exchange.value)) == 0.0, exchange
    # Per rank and step, in float32: the estimate and summed loss up and back; 3 directions' δ and loss.
    parameters = sum(w.numel() for w in ranks[0]["weights"].values())
    assert [r["exchange_bytes"] for r in ranks] == [2 * (parameters + 1) * 4] * 2
    assert [r["exchange_bytes"] for r in runs[Exchange.scalars]] == [2 * 3 * 2 * 4] * 2
