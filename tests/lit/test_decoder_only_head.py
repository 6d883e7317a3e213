"""`head_training: decoder_only`: the head is never perturbed and learns by the decoder-path delta rule
(Eq. 7, App. E), stepped by the body's optimizer with each expert's own learning-rate multiplier.

The reference runs apart from the module: the body's SPSA estimate (`spsa_estimate`) over the body's
weights alone, the head's gradient by autograd of the mean cross entropy through the decoder with the
features held fixed, and plain SGD steps `θ − lr·sₑ·g` for each expert e.
"""

from __future__ import annotations

import copy
import functools

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.lit import (
    BPTTModule,
    EGGROLLArgs,
    EpsSchedule,
    Exchange,
    HeadTraining,
    Init,
    ModelShape,
    SPSAArgs,
    ZOModule,
)
from soma_pl.models import StackedExperts
from tests.pinned.data import PinnedData, pinned_router

LR, EPS, SEED, CONTEXT, BATCH = 0.05, 0.01, 5, 40, 4
CONFIG = SPSAConfig(eps=EPS, n_pert=4, micro_batch=2, direction=DirectionKind.rademacher)
SHAPE = ModelShape(width=12, num_layers=1, embed_dim=8, time_chunk=16)
"""d_t ≠ d_E (the features come out of out_proj); 40 positions run as spans of 16, 16 and 8."""


def _module(tmp_path, experts: int) -> ZOModule:
    torch.manual_seed(0)
    spsa = SPSAArgs(eps=EPS, n_pert=CONFIG.n_pert, micro_batch=CONFIG.micro_batch, direction=CONFIG.direction,
                    eps_schedule=EpsSchedule.proportional, exchange=None if experts > 1 else Exchange.scalars)
    return ZOModule(num_experts=experts, init=Init.random,  # head_training: decoder_only, the default
                    router_path=pinned_router(tmp_path) if experts > 1 else None, top_k=1, seed=SEED,
                    train_context=CONTEXT, shape=SHAPE, spsa=spsa, optimizer=functools.partial(torch.optim.SGD, lr=LR))


def _head_gradient(model: StackedExperts, tokens: torch.Tensor) -> torch.Tensor:
    """Autograd of Σₑ mean cross entropy w.r.t. the head through the decoder only: the features come
    from a forward without gradients (the input embedding is not differentiated)."""
    with torch.no_grad():
        features = torch.cat(list(model.features(dict(model.named_parameters()), tokens[..., :-1])), dim=2)
    head = model.head.detach().clone().requires_grad_()
    logits = torch.einsum("ebtd,evd->ebtv", features, head)
    losses = F.cross_entropy(logits.flatten(0, 2), tokens[..., 1:].flatten().long(), reduction="none")
    (gradient,) = torch.autograd.grad(losses.view(tokens.shape[0], -1).mean(1).sum(), head)
    return gradient


@pytest.mark.parametrize("experts", [2, 1], ids=["soma_n2", "ddpp_one_process"])
def test_a_decoder_only_step_is_sgd_on_the_delta_rule_head_and_the_body_only_estimate(tmp_path, experts):
    module = _module(tmp_path, experts)
    multipliers = torch.tensor([1.0, 0.25][:experts], dtype=torch.float64)
    if experts > 1:
        module.plateau.scale.copy_(multipliers)  # expert 1 has decayed twice: its head steps at lr / 4
    assert "head" in module.trainable_parameters() and "head" not in module.perturbed_parameters()
    start = copy.deepcopy(module.model).double()
    data = PinnedData(experts=experts, batch_size=BATCH, steps=1)
    L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=1, limit_val_batches=0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    tokens = data.train[0][..., : CONTEXT + 1]
    body = {name: param for name, param in start.expert_parameters().items() if name != "head"}
    ids = torch.arange(experts)
    estimate = spsa_estimate(start.loss_per_group, body, tokens, CONFIG, step=0, seed=SEED, expert_ids=ids,
                             expert_eps=EPS * multipliers).gradient
    estimate["head"] = _head_gradient(start, tokens)
    for name, param in module.model.expert_parameters().items():
        scale = LR * multipliers.view(-1, *[1] * (param.dim() - 1))
        expected = start.get_parameter(name).detach() - scale * estimate[name]
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-12, msg=name)
    # A head in the estimator's directions would change every body coordinate's direction.
    with_head = spsa_estimate(start.loss_per_group, dict(start.expert_parameters()), tokens, CONFIG, step=0, seed=SEED,
                              expert_ids=ids, expert_eps=EPS * multipliers).gradient
    assert not torch.allclose(with_head["w_hh"], estimate["w_hh"])
    windows, positions = BATCH * experts, CONTEXT  # the delta rule's forward counted with the ± pairs'
    assert module.last_update.token_forwards == (2 * CONFIG.n_pert + 1) * windows * positions


@pytest.mark.parametrize("given", [{"head_training": HeadTraining.decoder_only}, {}], ids=["given", "default"])
def test_decoder_only_is_refused_with_eggroll_naming_head_training(given):
    with pytest.raises(ConfigError, match="head_training"):
        ZOModule(num_experts=1, shape=SHAPE, eggroll=EGGROLLArgs(sigma=0.02, rank=1, population=8, group_size=2),
                 **given)


def _bptt(tmp_path, head_training: HeadTraining) -> BPTTModule:
    torch.manual_seed(0)
    return BPTTModule(num_experts=2, init=Init.random, head_training=head_training, router_path=pinned_router(tmp_path),
                      top_k=1, train_context=CONTEXT, shape=SHAPE, optimizer=functools.partial(torch.optim.SGD, lr=LR))


def _one_step(module, experts: int = 2) -> torch.Tensor:
    data = PinnedData(experts=experts, batch_size=BATCH, steps=1)
    L.Trainer(accelerator="cpu", devices=1, precision="64-true", max_steps=1, limit_val_batches=0, logger=False,
              enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False).fit(module, data)
    return data.train[0][..., : CONTEXT + 1]


def test_a_bptt_decoder_only_step_takes_the_heads_gradient_through_the_decoder_alone(tmp_path):
    """Fig. 9's BPTT control (App. D.1): the body by backprop, the tied head by Eq. 7 only, none of
    its gradient through the input embedding."""
    module = _bptt(tmp_path, HeadTraining.decoder_only)
    start = copy.deepcopy(module.model).double()
    tokens = _one_step(module)
    full = copy.deepcopy(start)
    full.loss_per_group({}, tokens).sum().backward()  # plain autograd of the experts' own losses
    decoder = _head_gradient(start, tokens)
    for name, param in module.model.expert_parameters().items():
        gradient = decoder if name == "head" else full.get_parameter(name).grad
        expected = start.get_parameter(name).detach() - LR * gradient
        torch.testing.assert_close(param.detach(), expected, rtol=0, atol=1e-12, msg=name)
    assert not torch.allclose(full.head.grad, decoder)  # the embedding's share, left out
    assert module.last_update.token_forwards == 2 * BATCH * 2 * CONTEXT  # the tape's forward and the rule's


def test_a_bptt_frozen_random_head_is_one_shared_head_that_never_moves(tmp_path):
    module = _bptt(tmp_path, HeadTraining.frozen_random)
    head = module.model.head.detach().clone()
    assert head.shape == (256, SHAPE.embed_dim) and "head" not in module.trainable_parameters()
    before = module.model.w_hh.detach().clone()
    _one_step(module)
    assert torch.equal(module.model.head.double(), head.double()) and not torch.equal(module.model.w_hh, before)
