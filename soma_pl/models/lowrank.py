"""The population forward of :class:`StackedExperts` under low-rank (EGGROLL) perturbations.

Member m of expert e runs with every matrix W (per expert ``[out, in]``) replaced by ``W + A·Bᵀ``
and every vector g by ``g + δ``, where ``A [out, r]``, ``B [in, r]`` and δ arrive already signed and
scaled by the estimator. ``A·Bᵀ`` is never formed: each product is ``x·Wᵀ + (x·B)·Aᵀ``, one GEMM of
all members' rows against the shared W plus two thin products of width r per member, so M members
cost about as much as inference on M windows. In the recurrence the rank-r terms of the input and
recurrent matrices join into one product of width 2r per step:
``(x_t·B_ih)·A_ihᵀ + (h·B_hh)·A_hhᵀ = [x_t·B_ih, h·B_hh]·[A_ih, A_hh]ᵀ``.

On the CPU the members' layers run on the native kernel (an expert's members one bundle of rows
on its packed weights); on a GPU on the Triton kernel (the members of an expert its rows, each
adding its rank-r recurrent term inside the step); elsewhere the PyTorch loop over time.

Matrices (:data:`LOW_RANK_MATRICES`): the tied head ``[256, d_E]`` (the embedding reads rows of
``W + A·Bᵀ``; the logits multiply by it), in_proj, out_proj and each layer's w_ih and w_hh. The
norm gains are vectors. Activations are laid out ``[E, M, b, T, d]`` (experts, members, windows,
time, features).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from soma_pl import VOCAB_SIZE
from soma_pl.models import recurrence
from soma_pl.models.stacked import NORM_EPS, StackedExperts, lstm_cell, rms_norm

LOW_RANK_MATRICES = ("head", "in_proj", "out_proj", "w_ih", "w_hh")
"""Parameters whose last two dims are ``(out, in)`` matrices (w_ih, w_hh stack one per layer)."""
NORM_GAINS = "norm_gains"
"""The only vector parameter: ``[L + 1, d_t]`` gains, perturbed by full noise."""

Factors = tuple[Tensor, Tensor]
"""``(A [E, M, *stack, out, r], B [E, M, *stack, in, r])``."""


def _members_linear(x: Tensor, weight: Tensor, factors: Factors | None) -> Tensor:
    """``x·Wᵀ + (x·B)·Aᵀ`` per member. x ``[E, M, n, in]``; weight ``[E, out, in]`` → ``[E, M, n, out]``."""
    experts, members, rows, width = x.shape
    out = torch.bmm(x.reshape(experts, members * rows, width), weight.transpose(1, 2))
    if factors is None:
        return out.view(experts, members, rows, -1)
    a, b = (factor.flatten(0, 1) for factor in factors)
    thin = torch.bmm(x.reshape(experts * members, rows, width), b)
    out = torch.baddbmm(out.view(experts * members, rows, -1), thin, a.transpose(1, 2))
    return out.view(experts, members, rows, -1)


def _members_embed(head: Tensor, factors: Factors | None, tokens: Tensor) -> Tensor:
    """Rows of ``head + A·Bᵀ``. head ``[E, 256, d_E]``; tokens ``[E, M, b, T]`` → ``[E, M, b, T, d_E]``."""
    experts, members, windows, steps = tokens.shape
    index = tokens.long()
    rows = head[torch.arange(experts, device=head.device).view(-1, 1, 1, 1), index]
    if factors is None:
        return rows
    a, b = factors
    flat = index.reshape(experts, members, windows * steps, 1).expand(-1, -1, -1, a.shape[-1])
    picked = torch.gather(a, 2, flat).flatten(0, 1)
    thin = torch.bmm(picked, b.flatten(0, 1).transpose(1, 2))
    return rows + thin.view(rows.shape)


def _layer(factors: Factors | None, layer: int) -> Factors | None:
    return None if factors is None else (factors[0][:, :, layer], factors[1][:, :, layer])


def _both(f_ih: Factors | None, f_hh: Factors | None) -> tuple[Factors, Factors]:
    """A layer's input and recurrent factors, the one missing beside its twin as zeros (not both None)."""
    f_ih = f_ih or tuple(torch.zeros_like(f) for f in f_hh)
    return f_ih, f_hh or tuple(torch.zeros_like(f) for f in f_ih)


def _members_lstm(x: Tensor, w_ih: Tensor, w_hh: Tensor, f_ih: Factors | None, f_hh: Factors | None,
                  state: tuple[Tensor, Tensor], triton: bool = False) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One bias-free LSTM layer over a time chunk for all members.

    Args:
        x: ``[E, M, b, Tc, d]`` normalised input; w_ih, w_hh: ``[E, 4d, d]``.
        f_ih, f_hh: factors ``(A [E, M, 4d, r], B [E, M, d, r])`` or None (unperturbed).
        state: ``(h, c)``, each ``[E, M, b, d]``.
        triton: run the recurrence on the Triton kernel (the members of an expert its rows, each
            adding its own rank-r term inside the step; the input terms join the projections first)
            instead of the PyTorch loop over time.

    Returns:
        out ``[E, M, b, Tc, d]``; the final ``(h, c)``.
    """
    experts, members, windows, steps, width = x.shape
    # Time-major shared-weight input projections (one GEMM, a contiguous [M·b, 4d] block per step),
    # as in the unperturbed forward; the rank-r terms are added per step.
    time_major = x.permute(0, 3, 1, 2, 4).reshape(experts, steps * members * windows, width)
    gates_in = torch.bmm(time_major, w_ih.transpose(1, 2)).view(experts, steps, members * windows, -1)
    w_hh_t = w_hh.transpose(1, 2)
    rows = x.reshape(experts * members, windows * steps, width)
    h, c = (part.reshape(experts, members * windows, width) for part in state)
    shape = (experts, members, windows, width)
    if triton:
        from soma_pl.models.triton_lstm import triton_chunk

        if f_ih is not None:  # (x_t·B_ih)·A_ihᵀ joins the projections
            term = torch.bmm(torch.bmm(rows, f_ih[1].flatten(0, 1)), f_ih[0].flatten(0, 1).transpose(1, 2))
            term = term.view(experts, members, windows, steps, -1).permute(0, 3, 1, 2, 4)
            gates_in = gates_in + term.reshape(gates_in.shape)
        factors = None if f_hh is None else tuple(factor.flatten(0, 1) for factor in f_hh)  # None: no rank loop
        out, (h, c) = triton_chunk(gates_in, w_hh_t, (h, c), low_rank=factors, windows=windows)
        return out.view(*shape[:3], steps, width), (h.view(shape), c.view(shape))
    low_rank = f_ih is not None or f_hh is not None
    if low_rank:
        f_ih, f_hh = _both(f_ih, f_hh)
        inputs_b = torch.bmm(rows, f_ih[1].flatten(0, 1)).view(experts * members, windows, steps, -1)
        joint_a = torch.cat((f_ih[0], f_hh[0]), dim=-1).flatten(0, 1).transpose(1, 2).contiguous()  # [E·M, 2r, 4d]
        recurrent_b = f_hh[1].flatten(0, 1)
    outputs = []
    for t in range(steps):
        gates = torch.baddbmm(gates_in[:, t], h, w_hh_t)
        if low_rank:
            per_member = h.view(experts * members, windows, width)
            thin = torch.cat((inputs_b[:, :, t], torch.bmm(per_member, recurrent_b)), dim=-1)
            gates = torch.baddbmm(gates.view(experts * members, windows, -1), thin, joint_a).view(gates.shape)
        h, c = lstm_cell(gates, c)
        outputs.append(h)
    return torch.stack(outputs, dim=2).view(*shape[:3], steps, width), (h.view(shape), c.view(shape))


def _native_low_rank(factors: Mapping[str, Factors], layers: int) -> list[tuple[Tensor, dict[str, Tensor]] | None]:
    """Each layer's rank-r terms for the native kernel, prepared once per pass: ``B_ih`` per member
    (``[E·M, d, r]``, for the chunk's ``x_t · B_ih``) and the kernel's ``b_hh`` and packed
    ``[A_ih, A_hh]``; None for a layer without them. A matrix missing beside its twin gets zeros
    (:func:`_both`)."""
    prepared = []
    for layer in range(layers):
        f_ih, f_hh = _layer(factors.get("w_ih"), layer), _layer(factors.get("w_hh"), layer)
        if f_ih is None and f_hh is None:
            prepared.append(None)
            continue
        f_ih, f_hh = _both(f_ih, f_hh)
        prepared.append((f_ih[1].flatten(0, 1), {
            "b_hh": f_hh[1].flatten(0, 1).contiguous(),
            "a_packed": recurrence.pack_recurrent(torch.cat((f_ih[0], f_hh[0]), dim=-1).flatten(0, 1)),
        }))
    return prepared


def _members_body_native(x: Tensor, gains: Tensor, w_ih: Tensor, recurrent: list[Tensor],
                         low_rank: list[tuple[Tensor, dict[str, Tensor]] | None],
                         states: list[tuple[Tensor, Tensor]]) -> Tensor:
    """Every layer for all members on the native kernel, in the model's window-major layout: each
    member a group of its b windows, the members of an expert sharing its packed recurrent weights,
    the rank-r terms added inside each step (``[A_ih, A_hh]`` packed per member), and each layer's
    residual add and the next RMSNorm inside the step
    (:func:`soma_pl.models.recurrence.native_residual_chunk`).

    Args:
        x: ``[E, M, b, Tc, d]`` contiguous residual stream of this pass, updated in place.
        gains: ``[E, M, L + 1, d]`` each member's norm gains.
        w_ih: ``[E, L, 4d, d]``; recurrent: each layer's packed ``w_hh`` (``[E, ...]``).
        low_rank: each layer's :func:`_native_low_rank`.
        states: each layer's ``(h, c)``, ``[E, M, b, d]`` each, replaced by its state after the chunk.

    Returns:
        The final norm's output, ``[E, M, b, Tc, d]``.
    """
    experts, members, windows, steps, width = x.shape
    groups, shape = experts * members, (experts, members, windows, width)
    stream = x.view(groups, windows, steps, width)
    flat_gains = gains.flatten(0, 1)
    normed = rms_norm(stream, flat_gains[:, 0])
    for layer, (packed, terms) in enumerate(zip(recurrent, low_rank, strict=True)):
        gates_in = torch.bmm(normed.view(experts, members * windows * steps, width), w_ih[:, layer].transpose(1, 2))
        step_terms = None
        if terms is not None:
            b_ih, kernel_terms = terms
            thin_in = torch.bmm(normed.view(groups, windows * steps, width), b_ih)
            step_terms = {"thin_in": thin_in.view(groups, windows, steps, -1), **kernel_terms}
        state = tuple(part.reshape(groups, windows, width) for part in states[layer])
        normed, (h, c) = recurrence.native_residual_chunk(
            gates_in.view(groups, windows, steps, -1), packed, state, stream, flat_gains[:, layer + 1], NORM_EPS,
            step_terms)
        states[layer] = (h.view(shape), c.view(shape))
    return normed.view(x.shape)


def _norm(x: Tensor, gains: Tensor) -> Tensor:
    """RMSNorm with a gain per member. x ``[E, M, b, Tc, d]``; gains ``[E, M, d]``."""
    flat = x.flatten(0, 1)
    return rms_norm(flat, gains.flatten(0, 1)).view(x.shape)


def _member_features(model: StackedExperts, params: Mapping[str, Tensor], factors: Mapping[str, Factors],
                     gains: Tensor, tokens: Tensor) -> Iterator[Tensor]:
    """Final features per time chunk. tokens ``[E, M, b, T]`` → yields ``[E, M, b, Tc, d_E]``."""
    experts, members, windows, steps = tokens.shape
    zeros = gains.new_zeros(experts, members, windows, model.width)
    states = [(zeros, zeros)] * model.num_layers
    tensors = (gains, *params.values(), *(f for pair in factors.values() for f in pair))
    triton = recurrence.triton_applies(model.kernel, model.width, *tensors)
    native = not triton and recurrence.native_applies(model.kernel, *tensors)
    recurrent = [params["w_hh"][:, layer] for layer in range(model.num_layers)]
    if native:
        recurrent = [recurrence.pack_recurrent(weights) for weights in recurrent]
        low_rank = _native_low_rank(factors, model.num_layers)
    for start in range(0, steps, model.time_chunk):
        x = _members_embed(params["head"], factors.get("head"), tokens[..., start : start + model.time_chunk])
        chunk = x.shape[:4]
        if model.has_projections:
            x = _members_linear(x.flatten(2, 3), params["in_proj"], factors.get("in_proj")).view(*chunk, -1)
        if native:
            x = _members_body_native(x.contiguous(), gains, params["w_ih"], recurrent, low_rank, states)
        else:
            for layer in range(model.num_layers):
                out, states[layer] = _members_lstm(
                    _norm(x, gains[:, :, layer]), params["w_ih"][:, layer], recurrent[layer],
                    _layer(factors.get("w_ih"), layer), _layer(factors.get("w_hh"), layer), states[layer], triton)
                x = x + out
            x = _norm(x, gains[:, :, model.num_layers])
        if model.has_projections:
            x = _members_linear(x.flatten(2, 3), params["out_proj"], factors.get("out_proj")).view(*chunk, -1)
        yield x


def _members_cross_entropy(model: StackedExperts, head: Tensor, factors: Factors | None, gains: Tensor):
    """Each position's next-byte cross entropy under its member's head ``W + A·Bᵀ``, as a function
    of features ``[E, M, n, d_E]`` and targets ``[E, M, ...]`` → ``[E, M, n]``.

    On the native kernel the logits are never written out: the features gain their rank-r
    coordinates ``x·B`` and each member's head its rows ``Aᵀ`` (``[x, x·B]·[W, A]ᵀ`` is the same
    product), or the members read their expert's head as it is; elsewhere the logits and
    ``F.cross_entropy``."""
    if not recurrence.native_applies(model.kernel, head, gains, *(factors or ())):
        def logits_path(scored: Tensor, targets: Tensor) -> Tensor:
            logits = _members_linear(scored, head, factors)
            nll = F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.long().reshape(-1), reduction="none")
            return nll.view(scored.shape[:3])
        return logits_path
    experts, members = gains.shape[:2]
    head_t = head.transpose(1, 2)  # [E, d_E, 256]
    if factors is not None:
        a, b = factors  # [E, M, 256, r], [E, M, d_E, r]
        expanded = head_t[:, None].expand(-1, members, -1, -1)
        head_t = torch.cat((expanded, a.transpose(2, 3)), dim=2).flatten(0, 1)  # [E·M, d_E + r, 256]

    def native_path(scored: Tensor, targets: Tensor) -> Tensor:
        features = scored.flatten(0, 1)
        if factors is not None:
            features = torch.cat((features, torch.bmm(features, factors[1].flatten(0, 1))), dim=-1)
        nll = recurrence.native_head_nll(head_t, features[:, None], targets.reshape(features.shape[0], 1, -1))
        return nll.view(scored.shape[:3])
    return native_path


def population_losses(model: StackedExperts, tokens: Tensor, factors: Mapping[str, Factors],
                      offsets: Mapping[str, Tensor], score_from: int = 0) -> Tensor:
    """Each member's mean next-byte cross entropy (nats/byte) under its low-rank perturbation.

    Args:
        model: the experts whose weights are the unperturbed base.
        tokens: ``[E, M, b, T]`` uint8 or long bytes; inputs ``[..., :-1]``, targets ``[..., 1:]``.
        factors: matrix name → ``(A [E, M, *stack, out, r], B [E, M, *stack, in, r])``, signed and
            scaled (member weights ``W + A·Bᵀ``); a missing name is unperturbed.
        offsets: ``{"norm_gains": [E, M, L + 1, d_t]}`` added to the gains, or empty.
        score_from: first target position scored.

    Returns:
        loss: ``[E, M]``.
    """
    unknown = (set(factors) - set(LOW_RANK_MATRICES)) | (set(offsets) - {NORM_GAINS})
    if unknown:
        raise KeyError(f"no low-rank path for {sorted(unknown)}")
    experts, members, windows, steps = tokens.shape
    if not 0 <= score_from < steps - 1:
        raise ValueError(f"score_from={score_from} leaves no targets in {steps} bytes")
    params = dict(model.named_parameters())
    head = params["head"]
    params["head"] = head.expand(experts, *head.shape) if model.is_shared("head") else head
    gains = params[NORM_GAINS][:, None].expand(-1, members, -1, -1)
    if NORM_GAINS in offsets:
        gains = gains + offsets[NORM_GAINS]
    cross_entropy = _members_cross_entropy(model, params["head"], factors.get("head"), gains)
    total, start = 0.0, 0
    for features in _member_features(model, params, factors, gains, tokens[..., :-1]):
        stop = start + features.shape[3]
        first = max(score_from, start)
        if first < stop:
            scored = features[:, :, :, first - start :].flatten(2, 3)
            nll = cross_entropy(scored, tokens[..., first + 1 : stop + 1])
            total = total + nll.view(experts, members, -1).sum(-1)
        start = stop
    return total / (windows * (steps - 1 - score_from))
