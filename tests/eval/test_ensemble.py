"""Ensemble scoring against direct computation from full logits; bootstrap intervals."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.eval.ensemble import ensemble_probabilities, score_windows
from soma_pl.models.stacked import StackedExperts

SCORE_FROM = 20


@pytest.fixture
def setup():
    torch.manual_seed(0)
    model = StackedExperts(num_experts=3, width=8, embed_dim=8, num_layers=1, time_chunk=7)
    with torch.no_grad():
        model.head.mul_(40)  # distinct, confident experts so that averaging matters
    windows = torch.randint(0, 256, (5, 41), dtype=torch.uint8)
    ranking = torch.stack([torch.randperm(3) for _ in range(5)])
    return model, windows, ranking


def test_averaged_probabilities_sum_to_one(setup):
    model, windows, ranking = setup
    probs = ensemble_probabilities(model, ranking, windows, k=2)
    assert probs.shape == (5, 41, 256)
    torch.testing.assert_close(probs.sum(-1), torch.ones(5, 41))


def test_scores_match_full_logits_and_skip_unscored_targets(setup):
    model, windows, ranking = setup
    scores = score_windows(model, ranking, windows, max_k=3, score_from=SCORE_FROM)
    targets = windows[:, 1:].long()
    for k in (1, 2, 3):
        probs = ensemble_probabilities(model, ranking, windows[:, :-1], k)  # predicts bytes 1..40
        picked = probs.gather(-1, targets[..., None]).squeeze(-1)  # [b, 40]
        expected = -picked[:, SCORE_FROM:].log().mean(1)
        torch.testing.assert_close(scores.loss_by_k[:, k - 1], expected.double(), rtol=1e-4, atol=1e-5)
    tokens = windows.unsqueeze(0).expand(3, -1, -1)
    logp = torch.log_softmax(model(tokens[..., :-1]), -1).gather(-1, targets.expand(3, -1, -1)[..., None]).squeeze(-1)
    torch.testing.assert_close(scores.expert_losses, -logp[..., SCORE_FROM:].double().mean(2), rtol=1e-4, atol=1e-5)
    assert scores.loss_by_k.dtype == scores.expert_losses.dtype == torch.float64  # the mixture in float64 (App. L.1)
    assert not torch.allclose(scores.expert_losses, -logp.double().mean(2), rtol=1e-3), "early targets must not count"


def test_top1_is_the_best_ranked_expert_and_k_max_is_capped(setup):
    model, windows, ranking = setup
    scores = score_windows(model, ranking, windows, max_k=10, score_from=SCORE_FROM)
    assert scores.loss_by_k.shape == (5, 3)
    best = scores.expert_losses.T.gather(1, ranking[:, :1]).squeeze(1)
    torch.testing.assert_close(scores.loss_by_k[:, 0], best)


def test_document_bootstrap_resamples_documents():
    doc_ids = np.repeat(np.arange(50), 4)
    constant = document_bootstrap(np.full(200, 2.5), doc_ids)
    assert constant.low == pytest.approx(2.5) and constant.high == pytest.approx(2.5)
    rng = np.random.default_rng(1)
    per_doc = rng.normal(2.0, 0.3, 50)
    losses = np.repeat(per_doc, 4)  # windows of a document are perfectly correlated
    interval = document_bootstrap(losses, doc_ids, resamples=4000)
    assert (interval.documents, interval.windows) == (50, 200)
    assert interval.low < interval.mean < interval.high
    # Resampling documents: the width matches the standard error of 50 documents, not 200 windows.
    expected_half_width = 1.96 * per_doc.std(ddof=1) / np.sqrt(50)
    assert (interval.high - interval.low) / 2 == pytest.approx(expected_half_width, rel=0.15)
