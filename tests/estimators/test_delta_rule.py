"""The decoder-path delta rule (Eq. 7) against autograd of the mean cross entropy through the decoder alone."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from soma_pl.estimators import decoder_gradient

EXPERTS, WINDOWS, POSITIONS, WIDTH = 3, 2, 5, 4


def _autograd(features: torch.Tensor, head: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """∂/∂head of Σ_e (mean cross entropy of expert e), the features held fixed: per expert `[E, 256, d_E]`
    for per-expert heads, `[256, d_E]` (the sum of the experts' terms) for a shared one."""
    head = head.detach().clone().requires_grad_()
    heads = head.expand(EXPERTS, *head.shape) if head.dim() == 2 else head
    logits = torch.einsum("ebtd,evd->ebtv", features.detach(), heads)
    losses = [F.cross_entropy(logits[e].reshape(-1, 256), targets[e].reshape(-1).long()) for e in range(EXPERTS)]
    (gradient,) = torch.autograd.grad(torch.stack(losses).sum(), head)
    return gradient


@pytest.mark.parametrize("shared", [False, True])
def test_decoder_gradient_is_autograd_of_the_mean_cross_entropy_through_the_decoder(shared):
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(EXPERTS, WINDOWS, POSITIONS, WIDTH, generator=generator, dtype=torch.float64)
    head = torch.randn(*(() if shared else (EXPERTS,)), 256, WIDTH, generator=generator, dtype=torch.float64)
    targets = torch.randint(0, 256, (EXPERTS, WINDOWS, POSITIONS), generator=generator, dtype=torch.uint8)
    gradient = decoder_gradient(features, head, targets)
    assert gradient.shape == (EXPERTS, 256, WIDTH)
    expected = _autograd(features, head, targets)
    torch.testing.assert_close(gradient.sum(0) if shared else gradient, expected, rtol=1e-12, atol=1e-14)
    # each expert's term is its own: another expert's targets leave it unchanged
    moved = targets.clone()
    moved[1:] = (moved[1:].long() + 1).to(torch.uint8)
    torch.testing.assert_close(decoder_gradient(features, head, moved)[0], gradient[0], rtol=0, atol=0)
    assert not torch.allclose(decoder_gradient(features, head, moved)[1], gradient[1])
