"""Summed-loss training (§6, App. J: Fig. 4's control arm): with `spsa.loss_grouping` K, one
`training_step` moves each expert by −lr·ĝₑ, ĝₑ = mean_k δ_k zₑₖ, where δ_k is ONE central
difference of the group's summed loss along the joint direction (z₀ₖ, z₁ₖ): computed here by
perturbing both experts together and adding their losses, apart from the estimator's grouping code.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind, direction_keys, parameter_directions
from soma_pl.lit import EpsSchedule, HeadTraining, Init, ModelShape, SPSAArgs, ZOModule
from tests.pinned.data import PinnedData, pinned_router
from tests.pinned.runs import sgd

LR, EPS, SEED, CONTEXT, N_PERT = 0.05, 0.01, 7, 48, 6


def _module(tmp_path, experts: int = 2, grouping: int = 2) -> ZOModule:
    torch.manual_seed(0)
    spsa = SPSAArgs(eps=EPS, n_pert=N_PERT, micro_batch=4, direction=DirectionKind.sparse, loss_grouping=grouping,
                    eps_schedule=EpsSchedule.constant)
    return ZOModule(num_experts=experts, init=Init.random, head_training=HeadTraining.frozen_shared,
                    router_path=pinned_router(tmp_path), top_k=1, seed=SEED, train_context=CONTEXT,
                    shape=ModelShape(width=12, num_layers=1, embed_dim=8, time_chunk=16), spsa=spsa,
                    optimizer=sgd(LR, momentum=0.0))


def _summed_loss_step(start, tokens: torch.Tensor) -> dict[str, torch.Tensor]:
    """−lr·ĝ of both experts from differences of L₀ + L₁ along each joint direction."""
    params = {name: param.detach() for name, param in start.expert_parameters().items()}
    keys = direction_keys(SEED, 0, torch.arange(2), torch.arange(N_PERT))
    z = parameter_directions(DirectionKind.sparse, keys, {n: p.shape[1:] for n, p in params.items()})
    estimate = {name: torch.zeros_like(param, dtype=torch.float64) for name, param in params.items()}
    for k in range(N_PERT):
        summed = [start.loss_per_group({n: p + sign * EPS * z[n][:, k] for n, p in params.items()}, tokens).double()
                  .sum() for sign in (1, -1)]
        delta = (summed[0] - summed[1]) / (2 * EPS)
        for name in params:
            estimate[name] += delta * z[name][:, k].double() / N_PERT
    return {name: -LR * gradient for name, gradient in estimate.items()}


def test_a_summed_loss_step_is_one_difference_of_the_groups_summed_loss(tmp_path):
    module = _module(tmp_path)
    start = copy.deepcopy(module.model)
    data = PinnedData(experts=2, batch_size=4, steps=1)
    L.Trainer(accelerator="cpu", devices=1, precision="32-true", max_steps=1, limit_val_batches=0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    expected = _summed_loss_step(start, data.train[0][..., : CONTEXT + 1])
    for name, param in module.model.expert_parameters().items():
        if not param.requires_grad:
            continue
        moved = param.detach().double() - start.get_parameter(name).detach().double()
        assert moved.abs().amax(dim=tuple(range(1, moved.dim()))).min() > 1e-5, name
        torch.testing.assert_close(moved, expected[name], rtol=1e-3, atol=1e-6, msg=name)


def test_a_grouping_that_does_not_divide_the_experts_is_refused_naming_it(tmp_path):
    with pytest.raises(ConfigError, match="loss_grouping"):
        _module(tmp_path, experts=3, grouping=2)
