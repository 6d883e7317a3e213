"""Ensemble evaluation (Table 1, Fig. 16): route on 256 bytes, average top-k experts' probabilities.

Every expert scores every window once; the router's ranking orders the experts per window, and a
cumulative log-sum-exp over that order gives the log-probability of each target under the average
of the top-k experts' distributions for every k at once, so the whole top-k curve comes from one
pass. The average of k distributions is itself a distribution: only target probabilities are
needed, never the averaged 256-way distribution (`ensemble_probabilities` builds it for checks).

`score_top_k` is the inference path for one k: only each window's k routed experts run (N = 256
would otherwise run all 256 experts on every window for 4 of them).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from soma_pl.models.stacked import StackedExperts


@dataclass
class EnsembleScores:
    """Per-window results of one evaluation pass.

    Attributes:
        loss_by_k: ``[b, K]`` mean scored nats/byte of the top-k average, k = 1..K.
        expert_losses: ``[E, b]`` each expert's own mean scored nats/byte.
        ranking: ``[b, E]`` the router's expert order for each window, best first.
    """

    loss_by_k: Tensor
    expert_losses: Tensor
    ranking: Tensor


@torch.no_grad()
def score_windows(model: StackedExperts, ranking: Tensor, windows: Tensor, max_k: int,
                  score_from: int) -> EnsembleScores:
    """Score `windows: [b, T] uint8` with every expert and every top-k ensemble up to `max_k`.

    Args:
        model: E stacked experts.
        ranking: ``[b, E]`` expert indices per window, best first (the router's order).
        windows: ``[b, T]`` bytes; targets from position ``score_from`` on are scored.
        max_k: largest ensemble size scored (capped at E).
        score_from: first scored target (256 in the paper's protocol).
    """
    experts = model.num_experts
    max_k = min(max_k, experts)
    tokens = windows.unsqueeze(0).expand(experts, *windows.shape)
    top = ranking[:, :max_k]
    log_k = torch.log(torch.arange(1, max_k + 1, device=windows.device, dtype=torch.float64))
    ensemble_nats, expert_nats = 0.0, 0.0
    for chunk in model.target_log_probs({}, tokens, score_from):  # [E, b, Tc]
        chunk = chunk.double()  # the mixture and the loss reduction in float64 (App. L.1)
        expert_nats = expert_nats - chunk.sum(2)
        ranked = chunk.permute(1, 0, 2).gather(1, top[:, :, None].expand(-1, -1, chunk.shape[2]))  # [b, k, Tc]
        mixture = torch.logcumsumexp(ranked, dim=1) - log_k[None, :, None]
        ensemble_nats = ensemble_nats - mixture.sum(2)
    targets = windows.shape[1] - 1 - score_from
    return EnsembleScores(ensemble_nats / targets, expert_nats / targets, ranking)


def mixture_log_probs(log_probs: Tensor, dim: int) -> Tensor:
    """Log-probabilities under the average of the distributions along ``dim`` (each selected
    expert's): the log of the mean of their probabilities, ``dim`` removed."""
    return torch.logsumexp(log_probs, dim=dim) - math.log(log_probs.shape[dim])


@torch.no_grad()
def ensemble_probabilities(model: StackedExperts, ranking: Tensor, windows: Tensor, k: int) -> Tensor:
    """The averaged next-byte distribution of each window's top-k experts: ``[b, T, 256]``."""
    experts = model.num_experts
    tokens = windows.unsqueeze(0).expand(experts, *windows.shape)
    probs = torch.softmax(model(tokens), dim=-1)  # [E, b, T, 256]
    top = ranking[:, :k]
    batch_index = torch.arange(windows.shape[0], device=windows.device)[:, None]
    return probs[top, batch_index].mean(1)



@dataclass
class TopKScores:
    """Per-window results of a routed top-k pass (only the selected experts run).

    Attributes:
        loss: ``[b]`` mean scored nats/byte of the average of each window's k experts.
        expert_losses: ``[b, k]`` each selected expert's own mean scored nats/byte, in routed order.
    """

    loss: Tensor
    expert_losses: Tensor


@dataclass(frozen=True)
class SlotLayout:
    """Where every (window, selected expert) pair runs: slots of ``rows`` rows, each one expert's.

    Attributes:
        slot: ``[b·k]`` the pair's slot (pairs in ``top.reshape(-1)`` order).
        row: ``[b·k]`` its row within the slot.
        expert: ``[S]`` the expert whose weights each slot runs, ascending.
        rows: rows per slot.
    """

    slot: Tensor
    row: Tensor
    expert: Tensor
    rows: int


def slot_layout(top: Tensor, experts: int) -> SlotLayout:
    """Each expert's pairs in slots of the mean load (``ceil(b·k / E)`` rows), as many slots as it
    needs: at most ``b·k + E·(rows − 1)`` rows in all, however uneven the routing, where padding
    every expert to the busiest one costs ``E ·`` its load (N = 256, k = 4 on random bytes: about
    6× the mean).

    Args:
        top: ``[b, k]`` selected experts of each window.
        experts: E.
    """
    expert = top.reshape(-1)
    rows = max(1, -(-expert.numel() // experts))
    order = torch.sort(expert, stable=True).indices
    counts = torch.bincount(expert, minlength=experts)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.empty_like(expert)
    rank[order] = torch.arange(expert.numel(), device=top.device) - starts[expert[order]]
    slots = -(-counts // rows)
    first_slot = torch.cumsum(slots, 0) - slots
    slot_expert = torch.repeat_interleave(torch.arange(experts, device=top.device), slots)
    return SlotLayout(first_slot[expert] + rank // rows, rank % rows, slot_expert, rows)


@torch.no_grad()
def score_top_k(model: StackedExperts, top: Tensor, windows: Tensor, score_from: int) -> TopKScores:
    """Score `windows: [b, T] uint8` with the average of each window's routed experts only.

    The (window, expert) pairs are laid out in slots of a few rows, each slot one expert's
    (:func:`slot_layout`), and evaluated as one batched forward: every expert runs only on the
    windows routed to it, its weights gathered once per slot, and the work is at most
    ``b·k + E·(rows − 1)`` windows, about ``2 b·k`` at worst, instead of ``E · b`` for
    :func:`score_windows`. The loss equals ``score_windows(...).loss_by_k[:, k - 1]`` for the same
    experts.

    Args:
        model: E stacked experts.
        top: ``[b, k]`` expert indices per window (the router's top-k, best first).
        windows: ``[b, T]`` bytes; targets from position ``score_from`` on are scored.
        score_from: first scored target (256 in the paper's protocol).
    """
    batch, k = top.shape
    layout = slot_layout(top, model.num_experts)
    slots = layout.expert.numel()
    tokens = windows.new_zeros(slots, layout.rows, windows.shape[1])
    tokens[layout.slot, layout.row] = windows.repeat_interleave(k, dim=0)
    one_slot_each = torch.equal(layout.expert, torch.arange(model.num_experts, device=top.device))
    params = {} if one_slot_each else {name: param.index_select(0, layout.expert)
                                       for name, param in model.expert_parameters().items()}
    ensemble_nats, expert_nats = 0.0, 0.0
    for chunk in model.target_log_probs(params, tokens, score_from):  # [S, rows, Tc]
        pairs = chunk[layout.slot, layout.row].view(batch, k, -1).double()  # float64 mixture (App. L.1)
        expert_nats = expert_nats - pairs.sum(2)
        mixture = mixture_log_probs(pairs, dim=1)
        ensemble_nats = ensemble_nats - mixture.sum(1)
    targets = windows.shape[1] - 1 - score_from
    return TopKScores(ensemble_nats / targets, expert_nats / targets)
