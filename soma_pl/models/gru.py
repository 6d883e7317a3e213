"""EGGROLL's GRU byte language model (App. I.1), the recipe the paper's EGGROLL rows reproduce, in FP32.

The EGGROLL authors' recipe (nano-egg's ``run.py``, there in int8) is a byte embedding, L = 6 layers
of ``x + GRU(norm(x))`` then ``x + MLP(norm(x))`` (ReLU, hidden 4·d, no biases), a final norm and
an *untied* output head. Its recurrent cell has one gate f, which both gates the past before the
candidate's recurrent matrix and mixes the candidate in (a minimal gated unit, not ``torch.nn.GRU``'s
reset and update gates)::

    f  = σ(W_f x + U_f h + b_f)
    h̃  = tanh(W_h x + U_h (f ⊙ h) + b_h)
    h' = h + f ⊙ (h̃ − h)

Its norm scales by the mean absolute value, ``g ⊙ x / mean|x|`` (no centring). In int8 the saturating
adds stand in for σ and tanh; here they are the functions themselves. Weights are kept in the
reference's units: unit-variance entries, every matrix product divided by √fan_in (the embedding is a
lookup, unscaled), so EGGROLL's noise ``2^-sigma_shift · A·Bᵀ`` and its fixed step size mean what they
mean there. Per layer the model holds 12·d² + 4·d numbers; in all ``72·d² + 537·d`` at L = 6
(8,456,355 at the paper's widest d = 339: its "≈ 8.44M").

One forward (:meth:`GRUStack.features`) serves evaluation and EGGROLL's members, as the LSTM
experts' does (:mod:`soma_pl.models.stacked`): weights with a leading group dimension, ``[G, R, T]``
bytes, and with ``noise`` the R rows of a group are M members, member m running every matrix as
``W + A_m·B_mᵀ`` (never formed: ``x·Wᵀ + (x·B)·Aᵀ``) and every vector as ``v + δ_m``. Input
products and the MLP run over a whole time chunk; the recurrence steps through it. A given state is
carried: EGGROLL's streams continue each window from the previous update's state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from soma_pl import VOCAB_SIZE
from soma_pl.models.stacked import MLP_RATIO, ExpertStack, Factors, LowRank, linear

LAYERS = 6
"""The reference's depth."""
NORMS_PER_LAYER = 2
"""One norm before the GRU, one before the MLP."""
GATE, CANDIDATE = 0, 1
"""Index of f's and h̃'s matrices and bias in the stacked ``w_ih``, ``w_hh`` and ``bias``."""
MATRICES = ("embed", "w_ih", "w_hh", "mlp_in", "mlp_out", "head")
"""Parameters whose last two dims are ``(out, in)`` matrices (EGGROLL's rank-r perturbations)."""
VECTORS = ("bias", "norm_gains")
"""Parameters EGGROLL perturbs with full noise."""
NORM_EPS = 1e-5
"""Floor of the mean absolute value a norm divides by."""


def gru_parameter_count(width: int, layers: int = LAYERS) -> int:
    """Numbers in one model: embedding and head ``2·256·d``, per layer ``12·d² + 4·d``, final norm ``d``."""
    return 2 * VOCAB_SIZE * width + layers * (12 * width * width + 4 * width) + width


def abs_mean_norm(x: Tensor, gain: Tensor) -> Tensor:
    """``g ⊙ x / mean|x|`` over the last dim. x: ``[G, R, n, d]``; gain: ``[G, M, d]`` (member m's on its rows)."""
    groups, members, width = gain.shape
    normed = x / x.abs().mean(-1, keepdim=True).clamp_min(NORM_EPS)
    return (normed.view(groups, members, -1, width) * gain[:, :, None]).view(x.shape)


def _by_member(vector: Tensor, x: Tensor) -> Tensor:
    """Add a member vector ``[G, M, d]`` to the rows of ``x [G, R, n, d]`` each member owns."""
    groups, members, width = vector.shape
    return (x.view(groups, members, -1, width) + vector[:, :, None]).view(x.shape)


class GRUPass:
    """One pass's prepared weights: each matrix transposed and divided by √fan_in (its member factors'
    A too), each vector with its members' offsets.

    Args:
        params: name → ``[G, ...]`` complete weights (:meth:`GRUStack.group_parameters`).
        noise: EGGROLL's members, or None (one member per group).
    """

    def __init__(self, params: Mapping[str, Tensor], noise: LowRank | None = None) -> None:
        if noise is not None:
            noise.check(MATRICES, VECTORS)
        self.members = 1 if noise is None else noise.members
        self.params, self.factors = params, {} if noise is None else dict(noise.factors)
        offsets = {} if noise is None else noise.offsets
        self.vectors = {name: (params[name][:, None] + offsets[name] if name in offsets else params[name][:, None]
                               ).expand(-1, self.members, *params[name].shape[1:]) for name in VECTORS}

    def matrix(self, name: str, *index: int) -> tuple[Tensor, Factors | None]:
        """Matrix ``name`` (stack ``index``) as ``(Wᵀ/√in [G, in, out], (A/√in, B) per member or None)``."""
        weight = self.params[name][(slice(None), *index)]
        scale = 1.0 / math.sqrt(weight.shape[-1])
        factors = self.factors.get(name)
        if factors is not None:
            a, b = (f[(slice(None), slice(None), *index)].flatten(0, 1) for f in factors)
            factors = (a * scale, b)
        return (weight * scale).transpose(-1, -2).contiguous(), factors

    def vector(self, name: str, *index: int) -> Tensor:
        """Vector ``name`` (stack ``index``) of every member, ``[G, M, d]``."""
        return self.vectors[name][(slice(None), slice(None), *index)]

    def embed(self, tokens: Tensor) -> Tensor:
        """Embedding rows of ``tokens [G, R, n]`` → ``[G, R, n, d]``, plus each member's ``A[y]·Bᵀ``."""
        table = self.params["embed"]
        index = tokens.long()
        offsets = torch.arange(0, table.shape[0] * VOCAB_SIZE, VOCAB_SIZE, device=table.device)
        rows = F.embedding(index + offsets[:, None, None], table.reshape(-1, table.shape[-1]))
        factors = self.factors.get("embed")
        if factors is None:
            return rows
        a, b = (f.flatten(0, 1) for f in factors)  # [G·M, 256, r], [G·M, d, r]
        flat = index.reshape(a.shape[0], -1, 1).expand(-1, -1, a.shape[-1])
        return rows + torch.bmm(torch.gather(a, 1, flat), b.transpose(1, 2)).view(rows.shape)

    def gru(self, layer: int, x: Tensor, h: Tensor) -> tuple[Tensor, Tensor]:
        """Layer ``layer``'s cell over a chunk: x ``[G, R, Tc, d]`` normalised input, h ``[G, R, d]``
        → outputs ``[G, R, Tc, d]`` and the last h."""
        gate_in = _by_member(self.vector("bias", layer, GATE), linear(x, *self.matrix("w_ih", layer, GATE)))
        cand_in = _by_member(self.vector("bias", layer, CANDIDATE),
                             linear(x, *self.matrix("w_ih", layer, CANDIDATE)))
        u_gate, u_cand = self.matrix("w_hh", layer, GATE), self.matrix("w_hh", layer, CANDIDATE)
        outputs = []
        for t in range(x.shape[2]):
            f = torch.sigmoid(gate_in[:, :, t] + linear(h[:, :, None], *u_gate)[:, :, 0])
            candidate = torch.tanh(cand_in[:, :, t] + linear((f * h)[:, :, None], *u_cand)[:, :, 0])
            h = torch.addcmul(h, f, candidate - h)
            outputs.append(h)
        return torch.stack(outputs, dim=2), h

    def mlp(self, layer: int, x: Tensor) -> Tensor:
        """``W_out·ReLU(W_in·x)`` over a chunk."""
        return linear(torch.relu(linear(x, *self.matrix("mlp_in", layer))), *self.matrix("mlp_out", layer))

    def norm(self, index: int, x: Tensor) -> Tensor:
        return abs_mean_norm(x, self.vector("norm_gains", index))

    def logits(self, features: Tensor) -> Tensor:
        return linear(features, *self.matrix("head"))

    def cross_entropy(self, features: Tensor, targets: Tensor) -> Tensor:
        """Next-byte cross entropy ``[G, R, Tc]`` of features ``[G, R, Tc, d]``."""
        logits = self.logits(features)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.long().reshape(-1),
                               reduction="none").view(targets.shape)


class GRUStack(ExpertStack):
    """E of EGGROLL's GRU language models, every weight with a leading expert dimension.

    Parameters (per expert, after ``E``):
        embed: ``[256, d]`` byte embedding; head: ``[256, d]`` output head (untied);
        w_ih, w_hh: ``[L, 2, d, d]`` the cell's input and recurrent matrices, f's then h̃'s;
        bias: ``[L, 2, d]`` b_f and b_h;
        norm_gains: ``[2L + 1, d]`` each layer's GRU norm and MLP norm, then the final norm;
        mlp_in: ``[L, 4d, d]``, mlp_out: ``[L, d, 4d]``.

    Args:
        num_experts: E (EGGROLL: 1).
        width: d (the paper's reproduction: 20, 29, 58, 118, 339).
        num_layers: L (the reference: 6).
        time_chunk: time steps whose activations are held at once.
    """

    def __init__(self, num_experts: int, width: int, num_layers: int = LAYERS, time_chunk: int = 128,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        if min(num_experts, width, num_layers, time_chunk) < 1:
            raise ValueError("num_experts, width, num_layers, time_chunk must be >= 1")
        self.num_experts, self.width, self.num_layers, self.time_chunk = num_experts, width, num_layers, time_chunk
        make = {"device": device, "dtype": dtype}
        self.embed = nn.Parameter(torch.empty(num_experts, VOCAB_SIZE, width, **make))
        self.w_ih = nn.Parameter(torch.empty(num_experts, num_layers, 2, width, width, **make))
        self.w_hh = nn.Parameter(torch.empty(num_experts, num_layers, 2, width, width, **make))
        self.bias = nn.Parameter(torch.empty(num_experts, num_layers, 2, width, **make))
        self.norm_gains = nn.Parameter(torch.empty(num_experts, NORMS_PER_LAYER * num_layers + 1, width, **make))
        self.mlp_in = nn.Parameter(torch.empty(num_experts, num_layers, MLP_RATIO * width, width, **make))
        self.mlp_out = nn.Parameter(torch.empty(num_experts, num_layers, width, MLP_RATIO * width, **make))
        self.head = nn.Parameter(torch.empty(num_experts, VOCAB_SIZE, width, **make))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """The reference's: every matrix and the embedding standard normal, biases zero, gains one."""
        for weight in (self.embed, self.w_ih, self.w_hh, self.mlp_in, self.mlp_out, self.head):
            nn.init.normal_(weight)
        nn.init.zeros_(self.bias)
        nn.init.ones_(self.norm_gains)

    def head_parameter_names(self) -> tuple[str, ...]:
        return ("embed", "head")

    def zero_state(self, params: Mapping[str, Tensor], rows: int) -> list[Tensor]:
        """Each layer's h before the first byte: zeros ``[G, R, d]``, a tensor of its own per layer (a
        stream writes each layer's back in place)."""
        return [params["w_hh"].new_zeros(params["w_hh"].shape[0], rows, self.width) for _ in range(self.num_layers)]

    def features(self, params: Mapping[str, Tensor], tokens: Tensor, noise: LowRank | None = None,
                 state: list[Tensor] | None = None, plan: GRUPass | None = None) -> Iterator[Tensor]:
        """The model's one forward: the final norm's output per time chunk.

        Args:
            params: name → ``[G, ...]`` complete weights.
            tokens: ``[G, R, T]`` bytes (with ``noise``: M members of R / M windows per group).
            noise: EGGROLL's members, or None.
            state: where each layer's h starts (zeros when None); a given list is updated in place
                to the state after the last byte, so a stream carries it to its next segment.
            plan: the pass's prepared weights (made here when None).

        Yields:
            ``[G, R, Tc, d]``.
        """
        plan = plan or GRUPass(params, noise)
        states = self.zero_state(params, tokens.shape[1]) if state is None else state
        for start in range(0, tokens.shape[2], self.time_chunk):
            x = plan.embed(tokens[:, :, start : start + self.time_chunk])
            for layer in range(self.num_layers):
                out, states[layer] = plan.gru(layer, plan.norm(NORMS_PER_LAYER * layer, x), states[layer])
                x = x + out
                x = x + plan.mlp(layer, plan.norm(NORMS_PER_LAYER * layer + 1, x))
            yield plan.norm(NORMS_PER_LAYER * self.num_layers, x)

    def make_pass(self, params: Mapping[str, Tensor], noise: LowRank | None = None) -> GRUPass:
        return GRUPass(params, noise)

    def decoder(self, experts: Tensor, batch: int = 1) -> GRUDecoder:
        return GRUDecoder(self, experts, batch)


class GRUDecoder:
    """Incremental decoding of some of the models: each call gives the next-byte logits after its
    bytes, every layer's h carried from the previous call (``tokens [k, b, T]`` → ``[k, b, 256]``)."""

    def __init__(self, model: GRUStack, experts: Tensor, batch: int = 1) -> None:
        self.model = model
        self.params = {name: param[experts] for name, param in model.named_parameters()}
        self.plan = GRUPass(self.params)
        self.state = model.zero_state(self.params, batch)

    def __call__(self, tokens: Tensor) -> Tensor:
        *_, last = self.model.features(self.params, tokens, state=self.state, plan=self.plan)
        return self.plan.logits(last[:, :, -1:])[:, :, 0]
