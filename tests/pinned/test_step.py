"""One `training_step` of SPSA and of SOMA moves each expert's weights θₑ by exactly −lr·sₑ·ĝₑ.

ĝₑ is computed here, apart from the module, by the estimator (`spsa_estimate`) on a copy of the
starting weights, the step's tokens, seed and update index and each expert's own ε; sₑ is the
expert's learning-rate multiplier (`ExpertPlateau.scale`, which also scales its ε under
`eps_schedule: proportional`; 1 for the monolithic SPSA module). The optimizer is plain SGD without
momentum, so an update is that step and nothing else: a wrong lr, multiplier, ε, seed, update index,
token slice or expert order moves θ elsewhere.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.lit import EpsSchedule, HeadTraining, Init, ModelShape, PlateauConfig, SPSAArgs, ZOModule
from tests.pinned.data import PinnedData, pinned_router
from tests.pinned.runs import sgd

LR, EPS, SEED, CONTEXT = 0.2, 0.01, 5, 48
SPSA = SPSAArgs(eps=EPS, n_pert=6, micro_batch=2, direction=DirectionKind.rademacher, loss_grouping=1,
                max_rows=None, eps_schedule=EpsSchedule.proportional)
SETTINGS = {"shape": ModelShape(width=12, num_layers=1, embed_dim=8, time_chunk=16), "spsa": SPSA,
            "optimizer": sgd(LR, momentum=0.0),
            "seed": SEED, "train_context": CONTEXT, "score_from": 256,
            "plateau": PlateauConfig(factor=0.25, patience_updates=1, min_lr=0.0)}


def _one_step(module: L.LightningModule, data: PinnedData) -> None:
    L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=1, limit_val_batches=0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)


def _expected_step(start, tokens: torch.Tensor, scale: torch.Tensor) -> dict[str, torch.Tensor]:
    """−lr·sₑ·ĝₑ for every expert parameter, ĝₑ estimated at εₑ = ε·sₑ on `start`'s weights."""
    params = dict(start.expert_parameters())
    config = SPSAConfig(eps=EPS, n_pert=SPSA.n_pert, micro_batch=SPSA.micro_batch, direction=SPSA.direction)
    experts = torch.arange(start.num_experts)
    estimate = spsa_estimate(start.loss_per_group, params, tokens, config, step=0, seed=SEED, expert_ids=experts,
                             expert_eps=EPS * scale)
    shaped = {name: scale.double().view(-1, *[1] * (param.dim() - 1)) for name, param in params.items()}
    return {name: -LR * shaped[name] * gradient.double() for name, gradient in estimate.gradient.items()}


def _check(module: L.LightningModule, start, data: PinnedData, scale: torch.Tensor) -> None:
    expected = _expected_step(start, data.train[0][..., : CONTEXT + 1], scale)
    moved = {name: param.detach().double() - start.get_parameter(name).detach().double()
             for name, param in module.model.expert_parameters().items()}
    assert moved.keys() == expected.keys() == {"head", "in_proj", "out_proj", "norm_gains", "w_ih", "w_hh", "mlp_in",
                                               "mlp_out"}
    for name, step in expected.items():
        assert step.abs().amax(dim=tuple(range(1, step.dim()))).min() > 1e-5, name  # every expert moves
        # Float32 rounding of θ − lr·ĝ and of the multiplier's interpolation: a few ulp of |θ|.
        largest = max(start.get_parameter(name).detach().abs().max().item(),
                      module.model.get_parameter(name).detach().abs().max().item())
        ulp = torch.finfo(torch.float32).eps * largest
        torch.testing.assert_close(moved[name], step, rtol=0, atol=4 * ulp, msg=name)


def test_one_spsa_step_moves_theta_by_minus_lr_times_the_estimate():
    torch.manual_seed(0)
    module = ZOModule(num_experts=1, head_training=HeadTraining.trainable, seed_checkpoint=None, **SETTINGS)
    start = copy.deepcopy(module.model)
    data = PinnedData(experts=1, batch_size=4, steps=1)
    _one_step(module, data)
    _check(module, start, data, torch.ones(1))


def test_one_soma_step_moves_each_expert_by_minus_lr_times_its_multiplier_times_its_estimate(tmp_path):
    torch.manual_seed(0)
    module = ZOModule(num_experts=2, init=Init.random, seed_checkpoint=None, head_training=HeadTraining.trainable,
                        router_path=pinned_router(tmp_path), top_k=1, **SETTINGS)
    module.plateau.step(torch.tensor([1.0, 1.0]), 0)
    module.plateau.step(torch.tensor([0.5, 2.0]), 1)  # expert 1 stalls: its multiplier decays by 0.25
    scale = module.plateau.scale.clone()
    assert scale.tolist() == [1.0, 0.25]
    start = copy.deepcopy(module.model)
    data = PinnedData(experts=2, batch_size=4, steps=1)
    _one_step(module, data)
    _check(module, start, data, scale)
    with pytest.raises(AssertionError):  # the multiplier matters: the step of s = 1 is not this one
        _check(module, start, data, torch.ones(2))
