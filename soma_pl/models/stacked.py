"""E byte-level experts in one module, every weight carrying a leading expert dimension (App. C, Table 2).

Each expert is a tied byte embedding / output head E of 256×d_E (d_E = 32), bias-free projections
d_E→d_t→d_E when d_t ≠ d_E, and a body of D = 2 pre-norm residual blocks of width d_t: each block
adds a bias-free LSTM of its normalised input, then a bias-free MLP with GELU and hidden width 4·d_t
of its normalised input, every norm a gain-only LayerNorm, and a final gain-only LayerNorm ends the
body. The body holds 16·D·d_t² + (2D + 1)·d_t parameters: 32·d_t² + 5·d_t, 32,928 at d_t = 32.

One forward (:meth:`StackedExperts.features`) serves inference, SPSA's weight groups, EGGROLL's
members and BPTT. It takes weights with a leading *group* dimension ``G`` (E experts, or E experts ×
C perturbed copies, expert-major) and ``[G, R, T]`` bytes, and runs every group at once: a loop over
time chunks and, inside the recurrence, steps, never over experts or directions. With ``noise`` the
R rows of a group are M members of R / M windows each, member m running every matrix W as
``W + A_m·B_mᵀ`` and every gain g as ``g + δ_m`` (EGGROLL: the reference threads its noiser through
the model's one forward the same way); ``A·Bᵀ`` is never formed: a product is ``x·Wᵀ + (x·B)·Aᵀ``.
Which kernel runs the LSTM sublayers is decided once per pass (:class:`Pass`); the MLP runs over a
whole time chunk as batched matrix products. The same code runs under ``torch.no_grad()`` (zero
order) and under autograd (BPTT).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from soma_pl import VOCAB_SIZE
from soma_pl.models import recurrence
from soma_pl.models.recurrence import Kernel

NORM_EPS = 1e-5
"""Epsilon of every LayerNorm (PyTorch's default; the native kernel's fused norm uses it too)."""
MLP_RATIO = 4
"""The MLP's hidden width over d_t (App. C)."""
NORMS_PER_BLOCK = 2
"""One norm before the LSTM, one before the MLP."""
LOW_RANK_MATRICES = ("head", "in_proj", "out_proj", "w_ih", "w_hh", "mlp_in", "mlp_out")
"""Parameters whose last two dims are ``(out, in)`` matrices (the body's stack one per block)."""
NORM_GAINS = "norm_gains"
"""The only vector parameter, ``[2D + 1, d_t]``: EGGROLL perturbs it with full noise."""
_LSTM_GATES = 4
_EMBED_INIT_STD = 0.02
"""Small tied embeddings make the initial logits near-uniform (loss ≈ ln 256); the pre-norm
rescales the residual stream, so the body still sees unit-scale inputs."""

Factors = tuple[Tensor, Tensor]
"""``(A [G, M, *stack, out, r], B [G, M, *stack, in, r])``, signed and scaled."""


class HeadMode(str, Enum):
    """How the tied byte embedding / output head is held (member names are what configs write)."""

    per_expert = "per_expert"
    """Each expert owns a head: ``head`` is ``[E, 256, d_E]`` (Table 2, N ≤ 8)."""
    shared = "shared"
    """One head for all experts: ``head`` is ``[256, d_E]`` (N = 256; the trainer freezes it)."""


@dataclass(frozen=True)
class LowRank:
    """EGGROLL's perturbations of one pass: the rows of every group are ``members`` members."""

    members: int
    """M: members per group; each owns ``R / M`` consecutive rows (windows)."""
    factors: Mapping[str, Factors] = field(default_factory=dict)
    """Matrix name → ``(A [G, M, *stack, out, r], B [G, M, *stack, in, r])``; a missing name is unperturbed."""
    offsets: Mapping[str, Tensor] = field(default_factory=dict)
    """``{"norm_gains": [G, M, 2D + 1, d_t]}`` added to the gains, or empty."""

    def check(self, matrices: Collection[str], vectors: Collection[str]) -> None:
        """Refuse a perturbation the model has no path for (``KeyError`` naming it)."""
        unknown = (set(self.factors) - set(matrices)) | (set(self.offsets) - set(vectors))
        if unknown:
            raise KeyError(f"no low-rank path for {sorted(unknown)}")


def _transposed(weight: Tensor) -> Tensor:
    """``[G, out, in]`` → contiguous ``[G, in, out]`` (batched products read it ~1.7x faster than a
    transposed view on the CPU); one weight set (a shared ``[out, in]`` or ``G = 1``) → a transposed
    view, which a plain matrix product reads without a copy (:func:`linear`)."""
    transposed = weight.transpose(-1, -2)
    return transposed if weight.dim() == 2 or weight.shape[0] == 1 else transposed.contiguous()


def _member(factors: Factors | None, index: int | None = None) -> tuple[Tensor, Tensor] | None:
    """One stacked slice ``index`` (a block) of a matrix's factors, members flattened into groups:
    ``(A [G·M, out, r], B [G·M, in, r])``; None for an unperturbed matrix."""
    if factors is None:
        return None
    return tuple((f if index is None else f[:, :, index]).flatten(0, 1) for f in factors)


def linear(x: Tensor, weight_t: Tensor, factors: tuple[Tensor, Tensor] | None = None,
           out: Tensor | None = None) -> Tensor:
    """``x·Wᵀ`` per group, plus each member's ``(x·B)·Aᵀ``.

    Args:
        x: ``[G, R, n, in]`` (rows member-major: member m owns rows ``m·R/M .. (m+1)·R/M − 1``).
        weight_t: ``[G, in, out]``, or one shared ``[in, out]``.
        factors: ``(A [G·M, out, r], B [G·M, in, r])`` from :func:`_member`, or None.
        out: a contiguous ``[G, R, n, out]`` to write the product into (no autograd), or None.

    Returns:
        ``[G, R, n, out]``.
    """
    groups, width = x.shape[0], x.shape[-1]
    shape = (*x.shape[:-1], weight_t.shape[-1])
    if weight_t.dim() == 2 or groups == 1:
        # squeeze, not [0]: a view, whose backward writes no zero-filled copy of the weight
        weight = weight_t if weight_t.dim() == 2 else weight_t.squeeze(0)
        flat = x.reshape(-1, width)
        product = flat @ weight if out is None else torch.mm(flat, weight, out=out.view(flat.shape[0], -1))
    else:
        rows = x.reshape(groups, -1, width)
        product = (torch.bmm(rows, weight_t) if out is None
                   else torch.bmm(rows, weight_t, out=out.view(groups, rows.shape[1], -1)))
    out = product.view(shape)
    if factors is None:
        return out
    a, b = factors
    members = a.shape[0]
    add_low_rank(out.view(members, -1, out.shape[-1]), torch.bmm(x.reshape(members, -1, width), b), a)
    return out


def add_low_rank(out: Tensor, thin: Tensor, a: Tensor) -> None:
    """``out += thin·Aᵀ`` in place, per member: out ``[K, n, out]``, thin ``[K, n, r]``, a ``[K, out, r]``."""
    if a.shape[-1] == 1:  # rank 1: an outer product, added elementwise (3-7x baddbmm_'s speed on the CPU)
        out.addcmul_(thin, a.transpose(1, 2))
    else:
        out.baddbmm_(thin, a.transpose(1, 2))


def layer_norm(x: Tensor, gain: Tensor) -> Tensor:
    """Gain-only LayerNorm over the last dim. x: ``[G, R, n, d]``; gain: ``[G, M, d]`` (member m's on its rows)."""
    groups, members, width = gain.shape
    if groups * members == 1:
        return F.layer_norm(x, (width,), gain.view(width), eps=NORM_EPS)
    normed = F.layer_norm(x, (width,), eps=NORM_EPS)
    return (normed.view(groups, members, -1, width) * gain[:, :, None]).view(x.shape)


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step from its pre-activations. gates: ``[..., 4d]`` (input, forget, cell, output); c: ``[..., d]``."""
    width = c.shape[-1]
    sig = torch.sigmoid(gates)  # the cell block's sigmoid is unused: one kernel, not two
    cell = torch.tanh(gates[..., 2 * width : 3 * width])
    # New tensors each step (no in-place updates) so autograd can backpropagate through time.
    c = torch.addcmul(sig[..., width : 2 * width] * c, sig[..., :width], cell)
    return sig[..., 3 * width :] * torch.tanh(c), c


def _python_chunk(gates_in: Tensor, w_hh_t: Tensor, recurrent: tuple[Tensor, Tensor] | None,
                  state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """The LSTM recurrence over a chunk, all groups at once (the ``python`` kernel, the reference).

    Args:
        gates_in: ``[G, Tc, R, 4d]`` time-major input projections (a contiguous block per step).
        w_hh_t: ``[G, d, 4d]``; recurrent: each member's ``(A_hh [G·M, 4d, r], B_hh [G·M, d, r])`` or None.
        state: ``(h, c)``, each ``[G, R, d]``.

    Returns:
        out ``[G, R, Tc, d]``; the final ``(h, c)``.
    """
    h, c = state
    outputs = []
    for t in range(gates_in.shape[1]):
        gates = torch.baddbmm(gates_in[:, t], h, w_hh_t)
        if recurrent is not None:
            a, b = recurrent
            thin = torch.bmm(h.reshape(a.shape[0], -1, h.shape[-1]), b)
            by_member = gates.view(a.shape[0], -1, gates.shape[-1])
            gates = torch.baddbmm(by_member, thin, a.transpose(1, 2)).view(gates.shape)
        h, c = lstm_cell(gates, c)
        outputs.append(h)
    return torch.stack(outputs, dim=2), (h, c)


class Pass:
    """One forward pass's decisions and prepared weights: the LSTM kernel, chosen here once for the
    pass (:func:`soma_pl.models.recurrence.resolve_kernel`), each block's weights laid out for it and
    for the batched products, each member's gains and rank-r terms, and whether the fused native
    head scores the bytes.

    Args:
        model: the experts (shapes, kernel setting, time chunk).
        params: name → ``[G, ...]`` complete weights (:meth:`StackedExperts.group_parameters`).
        noise: EGGROLL's members, or None (one member per group).
        kernel: the kernel setting; None: the model's.
    """

    def __init__(self, model: StackedExperts, params: Mapping[str, Tensor], noise: LowRank | None = None,
                 kernel: Kernel | None = None) -> None:
        kernel = model.kernel if kernel is None else kernel
        if noise is not None:
            noise.check(LOW_RANK_MATRICES, (NORM_GAINS,))
        self.members = 1 if noise is None else noise.members
        self.factors = {} if noise is None else dict(noise.factors)
        self.kernel = recurrence.resolve_kernel(kernel, params, noise is not None)
        self.grad = recurrence.needs_grad(params)
        self.width = params["w_hh"].shape[-1]
        self.head = params["head"]
        if self.head.dim() == 2 and "head" in self.factors:
            raise ValueError("a shared head is not perturbed")
        self.head_t = _transposed(self.head)
        # the native fused head and GELU, whatever the LSTM's kernel (no autograd; any number of weight
        # sets, EGGROLL's members too)
        self.fused = not self.grad and recurrence.native_applies(kernel, self.head, *self._factor_tensors())
        self._scratch: dict[str, Tensor] = {}
        gains = params[NORM_GAINS][:, None]
        if noise is not None and NORM_GAINS in noise.offsets:
            gains = gains + noise.offsets[NORM_GAINS]
        self.gains = gains.expand(-1, self.members, -1, -1)  # [G, M, 2D + 1, d]
        self.proj_t = {name: _transposed(params[name]) for name in ("in_proj", "out_proj") if name in params}
        layers = range(params["w_ih"].shape[1])
        # unbind, not one index per block: under autograd its backward is one stack of the blocks'
        # gradients, where each index's would write a zero-filled copy of the whole stack
        self.mlp_in_t = [_transposed(weight) for weight in params["mlp_in"].unbind(1)]
        self.mlp_out_t = [_transposed(weight) for weight in params["mlp_out"].unbind(1)]
        w_ih, w_hh = params["w_ih"], params["w_hh"]
        if self.kernel is Kernel.library:
            self.library = recurrence.library_weights(w_ih, w_hh)
            return
        self.w_ih_t = [_transposed(weight) for weight in w_ih.unbind(1)]
        if self.kernel is Kernel.native:
            self.packed = [recurrence.pack_recurrent(w_hh[:, layer]) for layer in layers]
            self.native_terms = [self._native_terms(layer) for layer in layers]
        else:
            self.w_hh_t = [weight.transpose(-1, -2).contiguous() for weight in w_hh.unbind(1)]

    def _factor_tensors(self) -> list[Tensor]:
        return [tensor for pair in self.factors.values() for tensor in pair]

    def _native_terms(self, layer: int) -> tuple[Tensor, dict[str, Tensor]] | None:
        """A block's rank-r LSTM terms for the native kernel, once per pass: each member's ``B_ih``
        (for the chunk's ``x_t·B_ih``), and ``b_hh`` and the packed ``[A_ih, A_hh]`` (a matrix
        missing beside its twin as zeros); None without them."""
        f_ih, f_hh = _member(self.factors.get("w_ih"), layer), _member(self.factors.get("w_hh"), layer)
        if f_ih is None and f_hh is None:
            return None
        f_ih = f_ih or tuple(torch.zeros_like(f) for f in f_hh)
        f_hh = f_hh or tuple(torch.zeros_like(f) for f in f_ih)
        return f_ih[1], {"b_hh": f_hh[1].contiguous(),
                         "a_packed": recurrence.pack_recurrent(torch.cat((f_ih[0], f_hh[0]), dim=-1))}

    def span(self, chunk: int, rows: int, steps: int) -> int:
        """Time steps per chunk. The library kernel re-packs its weights on every call, so it takes
        :data:`~soma_pl.models.recurrence.LIBRARY_GATE_FLOATS` gate floats per call (the whole
        sequence under autograd, which keeps every step anyway); the others take ``chunk``."""
        if self.kernel is not Kernel.library:
            return chunk
        return steps if self.grad else max(chunk, recurrence.LIBRARY_GATE_FLOATS // (4 * self.width * rows))

    def gain(self, index: int) -> Tensor:
        """Norm ``index``'s gains, ``[G, M, d]``."""
        return self.gains[:, :, index]

    def lstm(self, layer: int, x: Tensor, normed: Tensor, state: tuple[Tensor, Tensor]
             ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """Block ``layer``'s LSTM sublayer on its normalised input over a chunk, the residual add and
        the MLP's norm after it.

        Args:
            x: ``[G, R, Tc, d]`` residual stream (updated in place on a fused pass).
            normed: the LSTM's normalised input, same shape.
            state: ``(h, c)``, ``[G, R, d]`` each.

        Returns:
            The residual stream, the MLP's normalised input and the final ``(h, c)``.
        """
        next_norm = NORMS_PER_BLOCK * layer + 1
        if self.kernel is Kernel.native:
            return self._native_lstm(layer, x, normed, state, self.gain(next_norm))
        if self.kernel is Kernel.library:
            out, state = recurrence.library_chunk(normed, self.library[layer], state)
        else:
            recurrent = _member(self.factors.get("w_hh"), layer)
            gates_in = linear(normed, self.w_ih_t[layer], _member(self.factors.get("w_ih"), layer))
            gates_in = gates_in.transpose(1, 2).contiguous()  # time-major: a contiguous block per step
            if self.kernel is Kernel.triton:
                from soma_pl.models.triton_lstm import triton_chunk

                out, state = triton_chunk(gates_in, self.w_hh_t[layer], state, low_rank=recurrent,
                                          windows=x.shape[1] // self.members)
            else:
                out, state = _python_chunk(gates_in, self.w_hh_t[layer], recurrent, state)
        return (*self.residual_norm(x, next_norm, out), state)

    def _native_lstm(self, layer: int, x: Tensor, normed: Tensor, state: tuple[Tensor, Tensor], next_gain: Tensor
                     ) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
        """:meth:`lstm` on the native kernel: each member a kernel group of its windows (the members
        of a group sharing its packed weights), the rank-r terms and the residual add and the MLP's
        norm inside each step (:func:`soma_pl.models.recurrence.native_residual_chunk`)."""
        groups, rows, steps, width = x.shape
        kernel_groups, windows = groups * self.members, rows // self.members
        gates_shape = (*x.shape[:-1], self.w_ih_t[layer].shape[-1])
        gates_in = linear(normed, self.w_ih_t[layer], out=self.scratch("gates_in", gates_shape))
        terms, step_terms = self.native_terms[layer], None
        if terms is not None:
            b_ih, kernel_terms = terms
            thin_in = recurrence.native_thin(normed.reshape(kernel_groups, -1, width), b_ih)
            step_terms = {"thin_in": thin_in.view(kernel_groups, windows, steps, -1), **kernel_terms}
        as_members = (kernel_groups, windows, width)
        mlp_in, (h, c) = recurrence.native_residual_chunk(
            gates_in.view(kernel_groups, windows, steps, -1), self.packed[layer],
            tuple(part.reshape(as_members) for part in state), x.view(kernel_groups, windows, steps, width),
            next_gain.reshape(kernel_groups, width), NORM_EPS, step_terms)
        return x, mlp_in.view(x.shape), (h.view(groups, rows, width), c.view(groups, rows, width))

    def mlp(self, layer: int, x: Tensor, normed: Tensor) -> tuple[Tensor, Tensor]:
        """Block ``layer``'s MLP sublayer, ``W_out·GELU(W_in·normed)``, over a whole chunk, the
        residual add and the next norm after it (the next block's LSTM's, or the final one).

        Natively the GELU runs in place with the members' rank-r terms of both matrices beside it
        (:func:`~soma_pl.models.recurrence.native_gelu`), and the second matrix's term is added in the
        residual add's pass: no pass of their own over the rows.

        Args:
            x: ``[G, R, Tc, d]`` residual stream (updated in place natively).
            normed: the MLP's normalised input, same shape.

        Returns:
            The residual stream and the next norm's output.
        """
        f_in, f_out = _member(self.factors.get("mlp_in"), layer), _member(self.factors.get("mlp_out"), layer)
        next_norm = NORMS_PER_BLOCK * (layer + 1)
        if not self.fuses(normed):
            hidden = linear(normed, self.mlp_in_t[layer], f_in)
            return self.residual_norm(x, next_norm, linear(F.gelu(hidden), self.mlp_out_t[layer], f_out))
        hidden_shape = (*x.shape[:-1], self.mlp_in_t[layer].shape[-1])
        hidden = linear(normed, self.mlp_in_t[layer], out=self.scratch("hidden", hidden_shape))
        groups = normed.shape[0] * self.members
        low_rank_in = None if f_in is None else (normed.reshape(groups, -1, normed.shape[-1]), *f_in)
        thin = recurrence.native_gelu(hidden.view(groups, -1, hidden.shape[-1]), low_rank_in,
                                      None if f_out is None else f_out[1])
        low_rank_out = None if f_out is None else (thin, f_out[0])
        out = linear(hidden, self.mlp_out_t[layer], out=self.scratch("mlp_out", x.shape))
        return self.residual_norm(x, next_norm, out, low_rank_out)

    def scratch(self, name: str, shape: tuple[int, ...]) -> Tensor:
        """A buffer of ``shape`` that every chunk and block of the pass reuses (fused passes only: no
        autograd keeps it). Writing fresh pages costs a page fault each: a 32 MB product took 38.1 ms
        into a new tensor against 25.0 ms into a reused one (one thread)."""
        numel = math.prod(shape)
        buffer = self._scratch.get(name)
        if buffer is None or buffer.numel() < numel:
            buffer = self._scratch[name] = self.head.new_empty(numel)
        return buffer[:numel].view(shape)

    def fuses(self, x: Tensor) -> bool:
        """Whether the native fused ops run on ``x`` (not under autocast, whose products are bf16)."""
        return self.fused and not torch.is_autocast_enabled(x.device.type)

    def residual_norm(self, x: Tensor, index: int, delta: Tensor | None = None,
                      low_rank: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``x + delta`` (x without delta) and its gain-only LayerNorm under norm ``index``'s gains;
        natively one pass over the rows, the sum written into x in place, with each member's
        ``thin·Aᵀ`` (``low_rank``: ``thin [G·M, n, r]``, ``A [G·M, d, r]``, with a delta)."""
        gain = self.gain(index)
        if not self.fuses(x):
            x = x if delta is None else x + delta
            if low_rank is not None:
                add_low_rank(x.view(low_rank[0].shape[0], -1, x.shape[-1]), *low_rank)
            return x, layer_norm(x, gain)
        groups = gain.shape[0] * gain.shape[1]
        rows = x.view(groups, -1, x.shape[-1])
        normed = recurrence.native_residual_norm(rows, gain.reshape(groups, -1), NORM_EPS,
                                                 None if delta is None else delta.reshape(rows.shape), low_rank)
        return x, normed.view(x.shape)

    def project(self, name: str, x: Tensor) -> Tensor:
        """The ``in_proj`` or ``out_proj`` product, or ``x`` itself where the width needs none."""
        return linear(x, self.proj_t[name], _member(self.factors.get(name))) if name in self.proj_t else x

    def embed(self, tokens: Tensor) -> Tensor:
        """Rows of the (member's) head for ``tokens [G, R, Tc]`` → ``[G, R, Tc, d_E]``: one row
        gather of the heads stacked as one ``[G·256, d_E]`` table, plus the member's ``A[y]·Bᵀ``."""
        index = tokens.long()
        if self.head.dim() == 2:
            return F.embedding(index, self.head)
        offsets = torch.arange(0, self.head.shape[0] * VOCAB_SIZE, VOCAB_SIZE, device=self.head.device)
        rows = F.embedding(index + offsets[:, None, None], self.head.reshape(-1, self.head.shape[-1]))
        factors = _member(self.factors.get("head"))
        if factors is None:
            return rows
        a, b = factors  # [G·M, 256, r], [G·M, d_E, r]
        flat = index.reshape(a.shape[0], -1, 1).expand(-1, -1, a.shape[-1])
        add_low_rank(rows.view(a.shape[0], -1, rows.shape[-1]), torch.gather(a, 1, flat), b)
        return rows

    def logits(self, features: Tensor) -> Tensor:
        """The tied head's logits of features ``[G, R, Tc, d_E]``."""
        return linear(features, self.head_t)

    def cross_entropy(self, features: Tensor, targets: Tensor) -> Tensor:
        """Next-byte cross entropy ``[G, R, Tc]`` of features ``[G, R, Tc, d_E]``: the native fused
        head where it applies (no logits written out; a member's rank-r part ``(x·B)·Aᵀ`` inside the
        same register sums, its group's head shared), else the logits and ``F.cross_entropy``."""
        factors = _member(self.factors.get("head"))
        if not self.fused:
            logits = linear(features, self.head_t, factors)
            nll = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.long().reshape(-1), reduction="none")
            return nll.view(targets.shape)
        groups = features.shape[0] * self.members
        flat = features.reshape(groups, 1, -1, features.shape[-1])
        low_rank = None
        if factors is not None:
            a, b = factors
            low_rank = (recurrence.native_thin(flat[:, 0], b), a.transpose(1, 2))
        nll = recurrence.native_head_nll(self.head_t, flat, targets.reshape(groups, 1, -1), low_rank)
        return nll.view(targets.shape)


class ExpertStack(nn.Module):
    """What every stacked model shares: parameters ``[E, ...]`` with a leading expert dimension (a
    shared one without it), their flat per-expert vectors, weight groups for batched perturbations,
    and the logits and losses read off a model's own ``features`` and pass (:meth:`make_pass`).
    ``num_experts`` is set by the model."""

    num_experts: int

    def head_parameter_names(self) -> tuple[str, ...]:
        """Names of the tied embedding / output head parameters."""
        return ("head",)

    def body_parameter_names(self) -> tuple[str, ...]:
        """Names of the body parameters (blocks, norm gains, projections)."""
        heads = self.head_parameter_names()
        return tuple(name for name, _ in self.named_parameters() if name not in heads)

    def is_shared(self, name: str) -> bool:
        """Whether parameter ``name`` has no expert dimension (one tensor shared by the experts)."""
        return False

    def expert_parameters(self) -> dict[str, nn.Parameter]:
        """The parameters with a leading expert dimension, ``[E, ...]``, in flat-vector order."""
        return {n: p for n, p in self.named_parameters() if not self.is_shared(n)}

    def expert_param_shapes(self) -> dict[str, torch.Size]:
        """Per-expert shape (without ``E``) of each expert parameter, in flat-vector order."""
        return {name: p.shape[1:] for name, p in self.expert_parameters().items()}

    def flatten_experts(self) -> Tensor:
        """Each expert's flat parameter vector. Returns ``[E, D]`` (a copy)."""
        params = self.expert_parameters().values()
        return torch.cat([p.detach().reshape(self.num_experts, -1) for p in params], dim=1)

    @torch.no_grad()
    def load_flat_experts(self, flat: Tensor) -> None:
        """Inverse of :meth:`flatten_experts`. flat: ``[E, D]``."""
        params = self.expert_parameters().values()
        expected = sum(param[0].numel() for param in params)
        if tuple(flat.shape) != (self.num_experts, expected):
            raise ValueError(f"flat shape {tuple(flat.shape)} != ({self.num_experts}, {expected})")
        start = 0
        for param in params:
            size = param[0].numel()
            param.copy_(flat[:, start : start + size].reshape(param.shape))
            start += size

    def group_parameters(self, params: Mapping[str, Tensor], groups: int) -> dict[str, Tensor]:
        """Complete ``params`` (``[G, ...]`` each) with this module's own weights: a missing expert
        parameter is repeated expert-major over the ``G = E·C`` groups (group ``g`` belongs to expert
        ``g // C``; with every expert parameter given, G is free); the shared head is used as it is."""
        own = dict(self.named_parameters())
        unknown = set(params) - set(own)
        if unknown:
            raise KeyError(f"unknown parameter names {sorted(unknown)}; expected {sorted(own)}")
        missing = [name for name in own if name not in params and not self.is_shared(name)]
        if missing and groups % self.num_experts:
            raise ValueError(f"{groups} groups is not a multiple of {self.num_experts} experts")
        copies = groups // self.num_experts
        return {name: params[name] if name in params else param if self.is_shared(name) or copies == 1
                else param.repeat_interleave(copies, dim=0) for name, param in own.items()}

    def make_pass(self, params: Mapping[str, Tensor], noise: LowRank | None = None):
        """One forward pass's prepared weights (``features``' ``plan``): its ``logits`` and
        ``cross_entropy`` of the final features."""
        raise NotImplementedError

    def forward_with(self, params: Mapping[str, Tensor], tokens: Tensor) -> Tensor:
        """Logits under the given weights. params: name → ``[G, ...]`` (missing ones filled by
        :meth:`group_parameters`); tokens: ``[G, b, T]`` bytes → logits ``[G, b, T, 256]``."""
        full = self.group_parameters(params, tokens.shape[0])
        plan = self.make_pass(full)
        chunks = [plan.logits(y) for y in self.features(full, tokens, plan=plan)]
        return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=2)

    def target_log_probs(self, params: Mapping[str, Tensor], tokens: Tensor, score_from: int = 0,
                         noise: LowRank | None = None, state: list | None = None) -> Iterator[Tensor]:
        """Log-probability of each scored next byte, one time chunk at a time (no full logits kept).

        Args:
            params: name → ``[G, ...]`` weights (missing ones filled by :meth:`group_parameters`).
            tokens: ``[G, R, T]`` bytes; inputs ``[..., :-1]``, targets ``[..., 1:]``.
            score_from: first target position scored (evaluation: 256 of a 1,025-byte window).
            noise: EGGROLL's members, or None.
            state: where the recurrence starts, carried on in place (the model's ``features``).

        Yields:
            ``[G, R, Tc]`` log p(target) for consecutive chunks of the scored positions.
        """
        groups, rows, steps = tokens.shape
        if not 0 <= score_from < steps - 1:
            raise ValueError(f"score_from={score_from} leaves no targets in {steps} bytes")
        full = self.group_parameters(params, groups)
        plan = self.make_pass(full, noise)
        start = 0
        for features in self.features(full, tokens[..., :-1], noise, state, plan):
            stop = start + features.shape[2]
            first = max(score_from, start)
            if first < stop:
                yield -plan.cross_entropy(features[:, :, first - start :].contiguous(),
                                          tokens[:, :, first + 1 : stop + 1])
            start = stop

    def window_losses(self, tokens: Tensor, score_from: int = 0, params: Mapping[str, Tensor] | None = None,
                      noise: LowRank | None = None, reduce_dtype: torch.dtype | None = None,
                      state: list | None = None) -> Tensor:
        """Mean scored next-byte cross entropy (nats/byte) of every window, per group.

        Args:
            tokens: ``[G, R, T]`` bytes.
            score_from: first target position scored.
            params: name → ``[G, ...]`` weights; None: this module's own (G = E).
            noise: EGGROLL's members, or None.
            reduce_dtype: the sum over positions in this dtype (evaluation: float64, App. L, so that
                a window's loss does not depend on how many other rows share the reduction); None:
                the features' own.
            state: as :meth:`target_log_probs`.

        Returns:
            loss: ``[G, R]``.
        """
        chunks = self.target_log_probs(params or {}, tokens, score_from, noise, state)
        total = sum(-chunk.sum(2, dtype=reduce_dtype) for chunk in chunks)
        return total / (tokens.shape[2] - 1 - score_from)

    def loss_per_group(self, params: Mapping[str, Tensor], tokens: Tensor, score_from: int = 0) -> Tensor:
        """Mean next-byte cross entropy (nats) per group. tokens: ``[G, b, T]`` → ``[G]``."""
        return self.window_losses(tokens, score_from, params).mean(1)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of each expert on its own bytes. tokens: ``[E, b, T]`` → ``[E, b, T, 256]``."""
        return self.forward_with({}, tokens)

    def decoder(self, experts: Tensor, batch: int = 1):
        """Incremental decoding of ``experts`` (``[k]``): a callable from the bytes after the previous
        call's, ``[k, b, T]``, to the next byte's logits ``[k, b, 256]``, the state carried."""
        raise NotImplementedError


class StackedExperts(ExpertStack):
    """E byte-level language models (the paper's expert, App. C) whose weights carry a leading expert dimension.

    Parameters (per expert shapes after the leading ``E``):
        head: ``[256, d_E]`` tied embedding / output head (no leading ``E`` when shared);
        in_proj: ``[d_t, d_E]`` and out_proj: ``[d_E, d_t]``, only when ``d_t ≠ d_E``;
        norm_gains: ``[2D + 1, d_t]`` (each block's LSTM norm and MLP norm, then the final norm);
        w_ih, w_hh: ``[D, 4·d_t, d_t]`` bias-free LSTM weights, gate rows (input, forget, cell, output),
            ``torch.nn.LSTM``'s order;
        mlp_in: ``[D, 4·d_t, d_t]`` and mlp_out: ``[D, d_t, 4·d_t]`` bias-free MLP weights.

    Args:
        num_experts: E (Table 2: N).
        width: body width d_t.
        embed_dim: head width d_E.
        num_layers: D, the number of blocks (one LSTM layer each; the paper: 2).
        head: per-expert or shared head.
        time_chunk: time steps whose activations are held at once; bounds activation memory at
            ``G·R·time_chunk·4·d_t`` floats (one weight set without gradients: at least 4,096
            window-steps per call, see :meth:`Pass.span`).
        kernel: which implementation runs the LSTM sublayers (:mod:`soma_pl.models.recurrence`);
            ``auto`` picks by the call's weight sets, grad mode and device. All agree to float rounding.
        device: where to allocate (``"meta"`` counts parameters without allocating).
        dtype: parameter dtype.
    """

    def __init__(
        self,
        num_experts: int,
        width: int,
        embed_dim: int = 32,
        num_layers: int = 2,
        head: HeadMode = HeadMode.per_expert,
        time_chunk: int = 64,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        kernel: Kernel | str = Kernel.auto,
    ) -> None:
        super().__init__()
        if min(num_experts, width, embed_dim, num_layers, time_chunk) < 1:
            raise ValueError("num_experts, width, embed_dim, num_layers, time_chunk must be >= 1")
        self.num_experts, self.width, self.embed_dim = num_experts, width, embed_dim
        self.num_layers, self.head_mode, self.time_chunk = num_layers, HeadMode(head), time_chunk
        self.kernel = Kernel(kernel)
        make = {"device": device, "dtype": dtype}
        experts = () if self.head_mode == HeadMode.shared else (num_experts,)
        self.head = nn.Parameter(torch.empty(*experts, VOCAB_SIZE, embed_dim, **make))
        self.has_projections = width != embed_dim
        if self.has_projections:
            self.in_proj = nn.Parameter(torch.empty(num_experts, width, embed_dim, **make))
            self.out_proj = nn.Parameter(torch.empty(num_experts, embed_dim, width, **make))
        self.norm_gains = nn.Parameter(torch.empty(num_experts, NORMS_PER_BLOCK * num_layers + 1, width, **make))
        gates, hidden = _LSTM_GATES * width, MLP_RATIO * width
        self.w_ih = nn.Parameter(torch.empty(num_experts, num_layers, gates, width, **make))
        self.w_hh = nn.Parameter(torch.empty(num_experts, num_layers, gates, width, **make))
        self.mlp_in = nn.Parameter(torch.empty(num_experts, num_layers, hidden, width, **make))
        self.mlp_out = nn.Parameter(torch.empty(num_experts, num_layers, width, hidden, **make))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's LSTM and Linear inits (uniform ±1/√fan_in), fan-in normal projections, unit gains."""
        nn.init.normal_(self.head, std=_EMBED_INIT_STD)
        for weight in (self.w_ih, self.w_hh, self.mlp_in, self.mlp_out):
            bound = 1.0 / math.sqrt(weight.shape[-1])
            nn.init.uniform_(weight, -bound, bound)
        nn.init.ones_(self.norm_gains)
        if self.has_projections:
            nn.init.normal_(self.in_proj, std=1.0 / math.sqrt(self.embed_dim))
            nn.init.normal_(self.out_proj, std=1.0 / math.sqrt(self.width))

    def is_shared(self, name: str) -> bool:
        """Whether parameter ``name`` has no expert dimension (the shared head)."""
        return name == "head" and self.head_mode == HeadMode.shared

    def zero_state(self, params: Mapping[str, Tensor], rows: int) -> list[tuple[Tensor, Tensor]]:
        """Each block's LSTM ``(h, c)`` before the first byte: zeros, ``[G, R, d_t]`` each."""
        zeros = params["w_hh"].new_zeros(params["w_hh"].shape[0], rows, self.width)
        return [(zeros, zeros)] * self.num_layers

    def features(self, params: Mapping[str, Tensor], tokens: Tensor, noise: LowRank | None = None,
                 state: list[tuple[Tensor, Tensor]] | None = None, plan: Pass | None = None) -> Iterator[Tensor]:
        """The model's one forward: final features per span of time steps (:meth:`Pass.span`).

        Args:
            params: name → ``[G, ...]`` complete weights (:meth:`group_parameters`).
            tokens: ``[G, R, T]`` bytes (with ``noise``: M members of R / M windows per group).
            noise: EGGROLL's members, or None.
            state: where the LSTMs start (:meth:`zero_state` when None); a given list is updated in
                place to their state after the last byte, so :class:`Decoder` carries it.
            plan: the pass's decisions and prepared weights (:class:`Pass`; made here when None).

        Yields:
            ``[G, R, Tc, d_E]``.
        """
        groups, rows, steps = tokens.shape
        states = self.zero_state(params, rows) if state is None else state
        plan = plan or Pass(self, params, noise)
        span = plan.span(self.time_chunk, rows, steps)
        for start in range(0, steps, span):
            x = plan.project("in_proj", plan.embed(tokens[:, :, start : start + span])).contiguous()
            x, normed = plan.residual_norm(x, 0)
            for layer in range(self.num_layers):
                x, normed, states[layer] = plan.lstm(layer, x, normed, states[layer])
                x, normed = plan.mlp(layer, x, normed)
            yield plan.project("out_proj", normed)

    def decoder(self, experts: Tensor, batch: int = 1) -> Decoder:
        return Decoder(self, experts, batch)

    def make_pass(self, params: Mapping[str, Tensor], noise: LowRank | None = None) -> Pass:
        return Pass(self, params, noise)


def population_losses(model: StackedExperts, tokens: Tensor, factors: Mapping[str, Factors],
                      offsets: Mapping[str, Tensor], score_from: int = 0) -> Tensor:
    """Each EGGROLL member's mean next-byte cross entropy (nats/byte) under its low-rank perturbation.

    Args:
        model: the experts whose weights are the unperturbed base.
        tokens: ``[E, M, b, T]`` bytes.
        factors: matrix name → ``(A [E, M, *stack, out, r], B [E, M, *stack, in, r])``, signed and
            scaled (member weights ``W + A·Bᵀ``); a missing name is unperturbed.
        offsets: ``{"norm_gains": [E, M, 2D + 1, d_t]}`` added to the gains, or empty.
        score_from: first target position scored.

    Returns:
        loss: ``[E, M]``.
    """
    experts, members, windows, steps = tokens.shape
    noise = LowRank(members, factors, offsets)
    losses = model.window_losses(tokens.reshape(experts, members * windows, steps), score_from, noise=noise)
    return losses.view(experts, members, windows).mean(2)


class Decoder:
    """Incremental decoding of some of the experts: each call gives the next-byte logits after its
    bytes, the LSTM state carried from the previous call, so a new byte costs one step instead of a
    pass over the text.

    A call of several bytes (a prompt) runs the model's own kernel; single bytes run the PyTorch
    loop on weights prepared once, not once per byte: one step of it costs about the step's
    matrix-vector products, where the library kernel re-packs its weights at every call.

    Args:
        model: the stacked experts.
        experts: ``[k]`` indices of the experts decoded side by side (a shared head is used as it is).
        batch: sequences decoded per expert.
    """

    def __init__(self, model: StackedExperts, experts: Tensor, batch: int = 1) -> None:
        self.model = model
        self.params = {name: param if model.is_shared(name) else param[experts]
                       for name, param in model.named_parameters()}
        self.step_plan = Pass(model, self.params, kernel=Kernel.python)
        self.state = model.zero_state(self.params, batch)

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens: [k, b, T]`` bytes that follow the previous call's (a prompt, then one byte at a
        time) → logits ``[k, b, 256]`` of the byte after the last of them."""
        plan = self.step_plan if tokens.shape[2] == 1 else Pass(self.model, self.params)
        *_, last = self.model.features(self.params, tokens, state=self.state, plan=plan)
        return linear(last[:, :, -1:], plan.head_t)[:, :, 0]
