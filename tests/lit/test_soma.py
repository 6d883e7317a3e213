"""SOMA pieces: per-expert isolation on real data, per-expert ε, plateau decay, warm start."""

from __future__ import annotations

import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.estimators import SPSAConfig, spsa_estimate
from soma_pl.lit.soma import ExpertPlateau
from soma_pl.models import StackedExperts


def _model_and_batch(experts: int = 3):
    torch.manual_seed(0)
    model = StackedExperts(num_experts=experts, width=8, embed_dim=8, num_layers=1, time_chunk=8)
    batch = torch.randint(0, 256, (experts, 4, 17), dtype=torch.uint8)
    return model, batch


def test_expert_update_is_unchanged_when_other_experts_data_changes():
    model, batch = _model_and_batch()
    params = dict(model.expert_parameters())
    config = SPSAConfig(eps=1e-2, n_pert=6, micro_batch=2)
    reference = spsa_estimate(model.loss_per_group, params, batch, config, step=5, seed=1)
    changed = batch.clone()
    changed[1:] = torch.randint(0, 256, changed[1:].shape, dtype=torch.uint8)
    other = spsa_estimate(model.loss_per_group, params, changed, config, step=5, seed=1)
    for name in params:
        torch.testing.assert_close(other.gradient[name][0], reference.gradient[name][0], rtol=0, atol=0)
        assert not torch.equal(other.gradient[name][1], reference.gradient[name][1])


def test_per_expert_eps_equals_separate_runs():
    model, batch = _model_and_batch(2)
    params = dict(model.expert_parameters())
    config = SPSAConfig(eps=1e-2, n_pert=4, micro_batch=2)
    both = spsa_estimate(model.loss_per_group, params, batch, config, 0, 0, expert_eps=torch.tensor([1e-2, 3e-2]))
    small = spsa_estimate(model.loss_per_group, params, batch, config, 0, 0)
    large = spsa_estimate(model.loss_per_group, params, batch, SPSAConfig(eps=3e-2, n_pert=4, micro_batch=2), 0, 0)
    torch.testing.assert_close(both.projected[0], small.projected[0], rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(both.projected[1], large.projected[1], rtol=1e-4, atol=1e-6)
    assert not torch.allclose(small.projected[1], large.projected[1], rtol=1e-4)


def test_expert_plateau_decays_only_the_expert_that_stalls():
    plateau = ExpertPlateau(experts=3, factor=0.5, patience=1)
    for losses in ([3.0, 3.0, 3.0], [2.9, 3.0, 2.0], [2.8, 3.0, 1.9], [2.7, 3.1, 1.8]):
        plateau.step(torch.tensor(losses))
    assert plateau.scale.tolist() == [1.0, 0.5, 1.0]
    assert plateau.bad.tolist() == [0, 1, 0]
