"""The decoder-path delta rule (§4, App. E, Eq. 7): the tied head's exact gradient through the decoder.

The tied head E (``[V, d_E]``, V = 256) embeds the input bytes and decodes the final features h into
logits ``E·h``. Holding every h fixed, the derivative of the mean cross entropy over B windows and T
target positions with respect to E, through the decoder only, is

    ∇_E L_dec = 1/(B·T) Σ_b Σ_t (p_{b,t} − onehot(y_{b,t+1})) · h_{b,t}ᵀ,   p_{b,t} = softmax(E·h_{b,t}).

It deliberately omits the indirect derivative through the input embedding and the recurrent body
("an exact decoder-path delta rule, not the full gradient of a tied embedding/decode matrix"): one
unperturbed forward and two products, no reverse-mode pass. E is never perturbed by SPSA, which keeps
its V·d_E coordinates out of each estimate (§4: "Keeping the head out of SPSA reduces the search
dimension").
"""

from __future__ import annotations

import torch
from torch import Tensor


@torch.no_grad()
def decoder_gradient(features: Tensor, head: Tensor, targets: Tensor) -> Tensor:
    """Eq. 7 for E experts at once: each expert's ∇_E L_dec on its own windows.

    Args:
        features: ``[E, b, T, d_E]`` the final features h (after ``out_proj`` when d_t ≠ d_E), from
            a forward at the unperturbed weights.
        head: ``[E, V, d_E]`` each expert's head, or one shared ``[V, d_E]``.
        targets: ``[E, b, T]`` the next bytes y_{b,t+1} (uint8 or long).

    Returns:
        ``[E, V, d_E]``: the mean over the b·T positions of (p − onehot(y))·hᵀ, per expert (with a
        shared head, each expert's own term).
    """
    experts, width = features.shape[0], features.shape[-1]
    h = features.reshape(experts, -1, width)  # [E, n, d_E], n = b·T
    heads = head.expand(experts, *head.shape) if head.dim() == 2 else head
    residual = torch.bmm(h, heads.transpose(1, 2)).softmax(-1)  # p: [E, n, V]
    index = targets.reshape(experts, -1, 1).long()
    residual.scatter_add_(2, index, residual.new_full(index.shape, -1.0))  # p − onehot(y)
    return torch.bmm(residual.transpose(1, 2), h) / h.shape[1]
