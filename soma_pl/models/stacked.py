"""E byte-level LSTM experts in one module, every weight carrying a leading expert dimension.

Each expert (Table 2) is a tied byte embedding / output head of 256×d_E (d_E = 32), bias-free
projections d_E→d_t→d_E when d_t ≠ d_E, and a body of four bias-free LSTM layers of width d_t, each
behind an RMSNorm gain, with a final RMSNorm gain: 32·d_t² + 5·d_t body parameters. Layers are
pre-norm residual (``x + LSTM(norm(x))``) so that a deep recurrent stack trains from a cold start.

Zero-order training evaluates the loss at many perturbed copies of the weights. The functional
entry points (:meth:`StackedExperts.forward_with`, :meth:`StackedExperts.loss_per_group`) take
weights with a leading *group* dimension ``G`` (e.g. E experts × C perturbed copies, expert-major)
and run all groups as one batched computation: a loop over time only, never over experts or
directions. The same code runs under ``torch.no_grad()`` (ZO) and under autograd (BPTT).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from enum import Enum

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from soma_pl import VOCAB_SIZE
from soma_pl.models import recurrence
from soma_pl.models.recurrence import Kernel

NORM_EPS = 1e-6
"""Epsilon of every RMSNorm (the PyTorch norm and the native kernel's fused one)."""
_LSTM_GATES = 4
_EMBED_INIT_STD = 0.02
"""Small tied embeddings make the initial logits near-uniform (loss ≈ ln 256); the pre-norm
rescales the residual stream, so the body still sees unit-scale inputs."""


class HeadMode(str, Enum):
    """How the tied byte embedding / output head is held (member names are what configs write)."""

    per_expert = "per_expert"
    """Each expert owns a trainable head: ``head`` is ``[E, 256, d_E]`` (Table 2, N ≤ 8)."""
    shared = "shared"
    """One head for all experts: ``head`` is ``[256, d_E]`` (N = 256; the trainer freezes it)."""


def _group_matmul(x: Tensor, weight_t: Tensor) -> Tensor:
    """``x @ weight_t`` per group: x ``[G, ..., in]``, weight_t ``[G, in, out]`` → ``[G, ..., out]``"""
    flat = x.reshape(x.shape[0], -1, x.shape[-1])
    return torch.bmm(flat, weight_t).reshape(*x.shape[:-1], weight_t.shape[-1])


def _transposed(weight: Tensor) -> Tensor:
    """``[G, out, in]`` → contiguous ``[G, in, out]``."""
    return weight.transpose(1, 2).contiguous()


def rms_norm(x: Tensor, gain: Tensor) -> Tensor:
    """RMSNorm over the last dim. x: ``[G, b, T, d]``; gain: ``[G, d]``.

    PyTorch's ``rms_norm`` (3.3× faster on the CPU than ``pow``, ``mean``, ``rsqrt`` and two
    out-of-place products at d_t = 181, equal to the last bit there), then the per-group gain."""
    return F.rms_norm(x, (x.shape[-1],), eps=NORM_EPS) * gain[:, None, None, :]


def _embed(head: Tensor, tokens: Tensor) -> Tensor:
    """Embedding lookup. head: ``[G, 256, d_E]`` or shared ``[256, d_E]``; tokens: ``[G, b, T]``.

    A row gather of the heads stacked as one ``[G·256, d_E]`` table (``F.embedding``), not advanced
    indexing with a group index beside the bytes."""
    index = tokens.long()
    if head.dim() == 2:
        return F.embedding(index, head)
    offsets = torch.arange(0, head.shape[0] * VOCAB_SIZE, VOCAB_SIZE, device=head.device)[:, None, None]
    return F.embedding(index + offsets, head.reshape(-1, head.shape[-1]))


def _logits(head_t: Tensor, features: Tensor) -> Tensor:
    """Tied output head. head_t: :func:`_head_t`; features: ``[G, b, T, d_E]`` → logits ``[G, b, T, 256]``."""
    if head_t.dim() == 2:
        return features @ head_t
    return _group_matmul(features, head_t)


def _head_t(head: Tensor) -> Tensor:
    """The output head transposed once per pass: ``[d_E, 256]`` shared, ``[G, d_E, 256]`` per group."""
    return head.t() if head.dim() == 2 else _transposed(head)


def _lstm_chunk(
    x: Tensor, w_ih_t: Tensor, w_hh_t: Tensor, state: tuple[Tensor, Tensor]
) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One bias-free LSTM layer over a chunk of time steps, all groups at once (the ``python`` kernel).

    Args:
        x: ``[G, b, Tc, d]`` normalised layer input.
        w_ih_t: ``[G, d, 4d]`` transposed input weights, gate columns ordered (input, forget,
            output, cell).
        w_hh_t: ``[G, d, 4d]`` transposed recurrent weights, same order.
        state: ``(h, c)``, each ``[G, b, d]``.

    Returns:
        out: ``[G, b, Tc, d]`` hidden states; the final ``(h, c)``.
    """
    steps = x.shape[2]
    # Time-major input projections: one large GEMM for the chunk, then slice a contiguous [b, 4d]
    # block per step instead of recomputing it inside the recurrence.
    gates_in = _group_matmul(x.transpose(1, 2), w_ih_t)
    h, c = state
    outputs = []
    for t in range(steps):
        h, c = lstm_cell(torch.baddbmm(gates_in[:, t], h, w_hh_t), c)
        outputs.append(h)
    return torch.stack(outputs, dim=2), (h, c)


class _Layers:
    """The LSTM layers of one forward pass, each run by the kernel chosen for it once per pass.

    Per-pass weight preparation (PyTorch's gate order for ``library``, contiguous transposed
    weights for ``python``, packed recurrent weights for ``native``) happens here, not once per
    time chunk.
    """

    def __init__(self, kernel: Kernel, params: Mapping[str, Tensor]) -> None:
        w_ih, w_hh = params["w_ih"], params["w_hh"]
        self.kernel = recurrence.resolve_kernel(kernel, params)
        self.grad = recurrence.needs_grad(params)
        if self.kernel is Kernel.library:
            self.library = recurrence.library_weights(w_ih, w_hh)
        else:
            # Batched GEMMs read contiguous [in, out] operands about 1.7x faster than transposed
            # views (MKL, d_t = 181); one copy per pass, not per chunk or step.
            self.w_ih_t = [_transposed(w_ih[:, layer]) for layer in range(w_ih.shape[1])]
            if self.kernel is Kernel.native:
                self.packed = [recurrence.pack_recurrent(w_hh[:, layer]) for layer in range(w_hh.shape[1])]
            else:
                self.w_hh_t = [_transposed(w_hh[:, layer]) for layer in range(w_hh.shape[1])]

    def span(self, chunk: int, batch: int, steps: int) -> int:
        """Time steps per layer call. The library kernel re-packs its weights on every call, so it
        takes at least :data:`~soma_pl.models.recurrence.LIBRARY_ROW_STEPS` window-steps per call
        (the whole sequence under autograd, which keeps every step anyway); the others take ``chunk``."""
        if self.kernel is not Kernel.library:
            return chunk
        if self.grad:
            return steps
        return max(chunk, -(-recurrence.LIBRARY_ROW_STEPS // batch))

    def __call__(self, layer: int, x: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, tuple[Tensor, Tensor]]:
        """One layer's hidden states over a chunk of its normalised input ``x`` (every kernel but
        ``native``, which runs all layers at once: :meth:`residual_body`)."""
        if self.kernel is Kernel.library:
            return recurrence.library_chunk(x, self.library[layer], state)
        if self.kernel is Kernel.triton:
            from soma_pl.models.triton_lstm import triton_chunk

            return triton_chunk(_group_matmul(x.transpose(1, 2), self.w_ih_t[layer]), self.w_hh_t[layer], state)
        return _lstm_chunk(x, self.w_ih_t[layer], self.w_hh_t[layer], state)

    def residual_body(self, x: Tensor, gains: Tensor, states: list[tuple[Tensor, Tensor]]) -> Tensor:
        """Every layer on the native kernel, its residual add and the next RMSNorm inside each step.

        Args:
            x: ``[G, b, Tc, d]`` contiguous residual stream of this pass, updated in place.
            gains: ``[G, L + 1, d]`` norm gains.
            states: each layer's ``(h, c)``, replaced by its state after the chunk.

        Returns:
            The final norm's output, ``[G, b, Tc, d]``.
        """
        normed = rms_norm(x, gains[:, 0])
        for layer, packed in enumerate(self.packed):
            normed, states[layer] = recurrence.native_residual_chunk(
                _group_matmul(normed, self.w_ih_t[layer]), packed, states[layer], x, gains[:, layer + 1], NORM_EPS)
        return normed


def lstm_cell(gates: Tensor, c: Tensor) -> tuple[Tensor, Tensor]:
    """One LSTM step from its pre-activations. gates: ``[..., 4d]`` (input, forget, output, cell); c: ``[..., d]``."""
    width = c.shape[-1]
    sig = torch.sigmoid(gates[..., : 3 * width])
    cell = torch.tanh(gates[..., 3 * width :])
    # New tensors each step (no in-place updates) so autograd can backpropagate through time.
    c = torch.addcmul(sig[..., width : 2 * width] * c, sig[..., :width], cell)
    return sig[..., 2 * width :] * torch.tanh(c), c


class StackedExperts(nn.Module):
    """E byte-level LSTM language models whose weights carry a leading expert dimension.

    Parameters (per expert shapes after the leading ``E``):
        head: ``[256, d_E]`` tied embedding / output head (no leading ``E`` when shared);
        in_proj: ``[d_t, d_E]`` and out_proj: ``[d_E, d_t]``, only when ``d_t ≠ d_E``;
        norm_gains: ``[L + 1, d_t]`` (one RMSNorm gain before each layer, one final);
        w_ih, w_hh: ``[L, 4·d_t, d_t]`` bias-free LSTM weights.

    Args:
        num_experts: E (Table 2: N).
        width: body width d_t.
        embed_dim: head width d_E.
        num_layers: number of LSTM layers L.
        head: per-expert or shared head.
        time_chunk: time steps whose input projections and logits are held at once; bounds
            activation memory at ``G·b·time_chunk·4·d_t`` floats (one weight set without
            gradients: at least 4,096 window-steps per call, see :meth:`_Layers.span`).
        kernel: which LSTM implementation runs the layers (:mod:`soma_pl.models.recurrence`);
            ``auto`` picks by the call's number of weight sets, grad mode and device. All agree to
            float rounding.
        device: where to allocate (``"meta"`` counts parameters without allocating).
        dtype: parameter dtype.
    """

    def __init__(
        self,
        num_experts: int,
        width: int,
        embed_dim: int = 32,
        num_layers: int = 4,
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
        self.norm_gains = nn.Parameter(torch.empty(num_experts, num_layers + 1, width, **make))
        gates = _LSTM_GATES * width
        self.w_ih = nn.Parameter(torch.empty(num_experts, num_layers, gates, width, **make))
        self.w_hh = nn.Parameter(torch.empty(num_experts, num_layers, gates, width, **make))
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """PyTorch's LSTM init (uniform ±1/√d_t), fan-in normal projections, unit gains."""
        nn.init.normal_(self.head, std=_EMBED_INIT_STD)
        bound = 1.0 / math.sqrt(self.width)
        nn.init.uniform_(self.w_ih, -bound, bound)
        nn.init.uniform_(self.w_hh, -bound, bound)
        nn.init.ones_(self.norm_gains)
        if self.has_projections:
            nn.init.normal_(self.in_proj, std=1.0 / math.sqrt(self.embed_dim))
            nn.init.normal_(self.out_proj, std=1.0 / math.sqrt(self.width))

    def head_parameter_names(self) -> tuple[str, ...]:
        """Names of the tied embedding / output head parameters."""
        return ("head",)

    def body_parameter_names(self) -> tuple[str, ...]:
        """Names of the body parameters (LSTM layers, norm gains, projections)."""
        heads = self.head_parameter_names()
        return tuple(name for name, _ in self.named_parameters() if name not in heads)

    def is_shared(self, name: str) -> bool:
        """Whether parameter ``name`` has no expert dimension (the shared head)."""
        return name == "head" and self.head_mode == HeadMode.shared

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
        """Complete ``params`` (``[G, ...]`` each) with this module's own weights.

        A missing expert parameter is repeated expert-major over the ``G = E·C`` groups (group
        ``g`` belongs to expert ``g // C``; with every expert parameter given, G is free); the
        shared head is used as it is.
        """
        own = dict(self.named_parameters())
        unknown = set(params) - set(own)
        if unknown:
            raise KeyError(f"unknown parameter names {sorted(unknown)}; expected {sorted(own)}")
        missing = [name for name in own if name not in params and not self.is_shared(name)]
        if missing and groups % self.num_experts:
            raise ValueError(f"{groups} groups is not a multiple of {self.num_experts} experts")
        copies = groups // self.num_experts
        full = {}
        for name, param in own.items():
            if name in params:
                full[name] = params[name]
            elif self.is_shared(name):
                full[name] = param
            else:
                full[name] = param.repeat_interleave(copies, dim=0)
        return full

    def zero_state(self, params: Mapping[str, Tensor], batch: int) -> list[tuple[Tensor, Tensor]]:
        """Each layer's ``(h, c)`` before the first byte: zeros, ``[G, b, d_t]`` each (G from ``params``)."""
        zeros = params["w_hh"].new_zeros(params["w_hh"].shape[0], batch, self.width)
        return [(zeros, zeros)] * self.num_layers

    def features(self, params: Mapping[str, Tensor], tokens: Tensor, state: list[tuple[Tensor, Tensor]] | None = None,
                 layers: _Layers | None = None) -> Iterator[Tensor]:
        """Final features per span of time steps (:meth:`_Layers.span`). tokens: ``[G, b, T]`` →
        yields ``[G, b, Tc, d_E]``.

        ``state`` (:meth:`zero_state` when None) is where the layers start; a given list is updated
        in place to their state after the last byte, and ``layers`` are weights already prepared for
        a kernel, so that :class:`Decoder` carries both from call to call.
        """
        groups, batch, steps = tokens.shape
        states = self.zero_state(params, batch) if state is None else state
        gains = params["norm_gains"]
        lstm = layers or _Layers(self.kernel, params)
        span = lstm.span(self.time_chunk, batch, steps)
        if self.has_projections:
            in_proj_t, out_proj_t = _transposed(params["in_proj"]), _transposed(params["out_proj"])
        for start in range(0, steps, span):
            x = _embed(params["head"], tokens[:, :, start : start + span])
            if self.has_projections:
                x = _group_matmul(x, in_proj_t)
            if lstm.kernel is Kernel.native:
                x = lstm.residual_body(x, gains, states)
            else:
                for layer in range(self.num_layers):
                    out, states[layer] = lstm(layer, rms_norm(x, gains[:, layer]), states[layer])
                    x = x + out
                x = rms_norm(x, gains[:, self.num_layers])
            features = _group_matmul(x, out_proj_t) if self.has_projections else x
            yield features

    def forward_with(self, params: Mapping[str, Tensor], tokens: Tensor) -> Tensor:
        """Logits under the given weights.

        Args:
            params: name → ``[G, ...]`` weights (missing ones filled by :meth:`group_parameters`).
            tokens: ``[G, b, T]`` uint8 or long bytes.

        Returns:
            logits: ``[G, b, T, 256]``.
        """
        full = self.group_parameters(params, tokens.shape[0])
        head_t = _head_t(full["head"])
        chunks = [_logits(head_t, y) for y in self.features(full, tokens)]
        return torch.cat(chunks, dim=2)

    def target_log_probs(
        self, params: Mapping[str, Tensor], tokens: Tensor, score_from: int = 0
    ) -> Iterator[Tensor]:
        """Log-probability of each scored next byte, one time chunk at a time (no full logits kept).

        Args:
            params: name → ``[G, ...]`` weights (missing ones filled by :meth:`group_parameters`).
            tokens: ``[G, b, T]`` uint8 or long bytes; inputs ``[..., :-1]``, targets ``[..., 1:]``.
            score_from: first target position scored (evaluation: 256 of a 1,025-byte window).

        Yields:
            ``[G, b, Tc]`` log p(target) for consecutive chunks of the scored positions.
        """
        groups, batch, steps = tokens.shape
        if not 0 <= score_from < steps - 1:
            raise ValueError(f"score_from={score_from} leaves no targets in {steps} bytes")
        full = self.group_parameters(params, groups)
        head_t = _head_t(full["head"])
        start = 0
        for features in self.features(full, tokens[..., :-1]):
            stop = start + features.shape[2]
            first = max(score_from, start)
            if first < stop:
                yield -self._cross_entropy(head_t, features[:, :, first - start :],
                                           tokens[:, :, first + 1 : stop + 1])
            start = stop

    def _cross_entropy(self, head_t: Tensor, features: Tensor, targets: Tensor) -> Tensor:
        """Next-byte cross entropy ``[G, b, Tc]`` of features ``[G, b, Tc, d_E]``: the native fused
        head where the layers' kernel rule allows it (no logits written out), else the logits and
        ``F.cross_entropy``."""
        if recurrence.native_applies(self.kernel, head_t, features):
            return recurrence.native_head_nll(head_t, features, targets)
        logits = _logits(head_t, features)
        nll = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.long().reshape(-1), reduction="none")
        return nll.view(targets.shape)

    def window_losses(
        self, tokens: Tensor, score_from: int = 0, params: Mapping[str, Tensor] | None = None
    ) -> Tensor:
        """Mean scored next-byte cross entropy (nats/byte) of every window, per group.

        Args:
            tokens: ``[G, b, T]`` uint8 or long bytes.
            score_from: first target position scored.
            params: name → ``[G, ...]`` weights; None: this module's own (G = E).

        Returns:
            loss: ``[G, b]``.
        """
        total = sum(-chunk.sum(2) for chunk in self.target_log_probs(params or {}, tokens, score_from))
        return total / (tokens.shape[2] - 1 - score_from)

    def loss_per_group(self, params: Mapping[str, Tensor], tokens: Tensor, score_from: int = 0) -> Tensor:
        """Mean next-byte cross entropy (nats) per group. tokens: ``[G, b, T]`` → ``[G]``."""
        return self.window_losses(tokens, score_from, params).mean(1)

    def forward(self, tokens: Tensor) -> Tensor:
        """Logits of each expert on its own bytes. tokens: ``[E, b, T]`` → ``[E, b, T, 256]``."""
        return self.forward_with({}, tokens)


class Decoder:
    """Incremental decoding of some of the experts: each call gives the next-byte logits after its
    bytes, the LSTM state carried from the previous call, so a new byte costs one step instead of a
    pass over the text.

    A call of several bytes (a prompt) runs the model's own kernel; single bytes run the PyTorch
    loop on weights prepared once, not once per byte: one step of it costs about the step's
    matrix-vector products, where the library kernel re-packs its weights at every call (measured
    on the CPU at d_t = 509: 83 bytes/s against 20 for the library kernel and 8 for the native one).

    Args:
        model: the stacked experts.
        experts: ``[k]`` indices of the experts decoded side by side (a shared head is used as it is).
        batch: sequences decoded per expert.
    """

    def __init__(self, model: StackedExperts, experts: Tensor, batch: int = 1) -> None:
        self.model = model
        self.params = {name: param if model.is_shared(name) else param[experts]
                       for name, param in model.named_parameters()}
        self.step_layers = _Layers(Kernel.python, self.params)
        self.head_t = _head_t(self.params["head"])
        self.state = model.zero_state(self.params, batch)

    def __call__(self, tokens: Tensor) -> Tensor:
        """``tokens: [k, b, T]`` bytes that follow the previous call's (a prompt, then one byte at a
        time) → logits ``[k, b, 256]`` of the byte after the last of them."""
        layers = self.step_layers if tokens.shape[2] == 1 else None
        *_, last = self.model.features(self.params, tokens, self.state, layers)
        return _logits(self.head_t, last[:, :, -1])
