"""The zero-order update is the paper's Adam (Eq. 8, App. E): three `training_step`s of SOMA N = 2
move each expert's weights exactly as `torch.optim.Adam` with coupled weight decay moves them when
fed the same SPSA estimates, each expert stepped by its own optimizer at its own decayed learning rate.

The reference runs apart from the module: the estimator (`spsa_estimate`) on its own copy of the
weights at each step's tokens, seed, update index and each expert's ε, and one `torch.optim.Adam`
per expert over that expert's slice of every weight, so a wrong moment, bias correction, decay,
per-expert state or learning-rate multiplier moves θ elsewhere.
"""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch

from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.lit import EpsSchedule, HeadTraining, Init, ModelShape, SPSAArgs, ZOModule
from soma_pl.lit.optim import ZOAdam
from tests.pinned.data import PinnedData, pinned_router

LR, EPS, SEED, CONTEXT, STEPS = 0.01, 0.01, 5, 48, 3
SPSA = SPSAArgs(eps=EPS, n_pert=6, micro_batch=2, direction=DirectionKind.rademacher,
                eps_schedule=EpsSchedule.proportional)
MULTIPLIERS = torch.tensor([1.0, 0.25])
"""Each expert's learning-rate (and ε) multiplier: expert 1 has decayed twice."""


def _module(tmp_path) -> ZOModule:
    torch.manual_seed(0)
    module = ZOModule(num_experts=2, init=Init.random, head_training=HeadTraining.trainable,
                      router_path=pinned_router(tmp_path), top_k=1, seed=SEED, train_context=CONTEXT,
                      shape=ModelShape(width=12, num_layers=1, embed_dim=8, time_chunk=16), spsa=SPSA,
                      optimizer=lambda params: ZOAdam(params, lr=LR))
    module.plateau.scale.copy_(MULTIPLIERS)
    return module


def _reference(start, data: PinnedData, weight_decay: float = 1e-4) -> dict[str, torch.Tensor]:
    """The weights after `STEPS` updates of per-expert `torch.optim.Adam` on the estimates."""
    model = copy.deepcopy(start)
    params = dict(model.expert_parameters())
    slices = [{name: param.detach()[e].clone().requires_grad_() for name, param in params.items()}
              for e in range(model.num_experts)]
    adams = [torch.optim.Adam(own.values(), lr=LR * float(scale), betas=(0.9, 0.999), eps=1e-8,
                                 weight_decay=weight_decay)
             for own, scale in zip(slices, MULTIPLIERS, strict=True)]
    config = SPSAConfig(eps=EPS, n_pert=SPSA.n_pert, micro_batch=SPSA.micro_batch, direction=SPSA.direction)
    for step in range(STEPS):
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(torch.stack([own[name].detach() for own in slices]))
            estimate = spsa_estimate(model.loss_per_group, params, data.train[step][..., : CONTEXT + 1], config,
                                     step=step, seed=SEED, expert_ids=torch.arange(2), expert_eps=EPS * MULTIPLIERS)
        for e, (own, adam) in enumerate(zip(slices, adams, strict=True)):
            for name, weight in own.items():
                weight.grad = estimate.gradient[name][e].clone()
            adam.step()
    return {name: torch.stack([own[name].detach() for own in slices]) for name in params}


def test_three_soma_steps_are_per_expert_adam_with_coupled_decay_on_the_estimates(tmp_path):
    module = _module(tmp_path)
    start = copy.deepcopy(module.model).double()
    data = PinnedData(experts=2, batch_size=4, steps=STEPS)
    L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=STEPS, limit_val_batches=0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    trained = {name: param.detach() for name, param in module.model.expert_parameters().items()}
    for name, weight in trained.items():
        moved = (weight - start.get_parameter(name).detach()).abs().amax(dim=tuple(range(1, weight.dim())))
        assert moved.min() > 1e-3, name  # every expert moved: the comparison is not of unchanged weights
    _assert_equal(trained, _reference(start, data))
    with pytest.raises(AssertionError):  # the coupled decay is in the step: Adam without it ends elsewhere
        _assert_equal(trained, _reference(start, data, weight_decay=0.0))


def _assert_equal(trained: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    """Equal to float64 rounding, amplified (the module scales an expert's step by interpolating, the reference by
    its lr; a loss difference's rounding, divided by ε, moves Adam's normalised step), far below the
    steps (≥ 1e-3) or what λθ adds to them. Measured: at most 1.06e-8 (one head coordinate of 8,960;
    the next largest 5.3e-9), against at least 7.5e-6 in every tensor without the decay."""
    for name, weight in trained.items():
        torch.testing.assert_close(weight, expected[name], rtol=0, atol=1e-7, msg=name)


def test_zo_adam_is_the_papers_adam_with_coupled_decay():
    weight = torch.nn.Parameter(torch.zeros(3))
    defaults = ZOAdam([weight]).defaults
    assert (defaults["lr"], defaults["betas"], defaults["eps"], defaults["weight_decay"]) == (1e-3, (0.9, 0.999),
                                                                                              1e-8, 1e-4)
    assert not defaults["decoupled_weight_decay"] and not defaults["amsgrad"]
    assert isinstance(ZOModule().optimizer_factory([weight]), ZOAdam)
