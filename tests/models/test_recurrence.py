"""The LSTM kernels agree with the PyTorch reference loop: outputs, states across chunks, gradients."""

from __future__ import annotations

import pytest
import torch

from soma_pl.models import recurrence, stacked, triton_lstm
from soma_pl.models.recurrence import Kernel, resolve_kernel
from soma_pl.models.reference import TorchExpert
from soma_pl.models.stacked import StackedExperts

TOLERANCE = 1e-5


def _model(experts: int, width: int, kernel: str) -> StackedExperts:
    torch.manual_seed(0)
    return StackedExperts(experts, width, embed_dim=8, num_layers=2, time_chunk=7, kernel=kernel)


def _copies(model: StackedExperts, groups: int) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {name: param.detach().repeat_interleave(groups // model.num_experts, 0)
            + 0.05 * torch.randn((groups, *param.shape[1:]), generator=generator)
            for name, param in model.expert_parameters().items()}


def _each_weight_set_alone(model: StackedExperts, params: dict[str, torch.Tensor], tokens: torch.Tensor
                           ) -> torch.Tensor:
    """Logits of every weight set run alone through standard layers (`TorchExpert`):
    independent of every kernel here, the reference loop included."""
    full = model.group_parameters(params, tokens.shape[0])
    logits = []
    for group in range(tokens.shape[0]):
        alone = StackedExperts(1, model.width, model.embed_dim, model.num_layers)
        for name, param in alone.named_parameters():
            param.copy_(full[name][group : group + 1])
        logits.append(TorchExpert.of(alone)(tokens[group]))
    return torch.stack(logits)


@pytest.mark.parametrize("kernel", [Kernel.library, Kernel.native, Kernel.auto])
@pytest.mark.parametrize(("experts", "width", "groups"), [(1, 8, 1), (1, 12, 1), (2, 12, 6), (3, 8, 3)])
def test_every_kernel_matches_the_reference_loop(kernel, experts, width, groups):
    """T = 20 bytes in chunks of 7: the state crosses chunk boundaries; d_t = 12 adds projections.

    Several weight sets under `library` run the reference loop itself (the library kernel takes one),
    so every case is also compared with each weight set run alone through `torch.nn.LSTM`."""
    tokens = torch.randint(0, 256, (groups, 3, 20), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    reference, model = _model(experts, width, "python"), _model(experts, width, kernel)
    params = {} if groups == experts else _copies(model, groups)
    with torch.no_grad():
        expected = reference.forward_with(params, tokens)
        got = model.forward_with(params, tokens)
        alone = _each_weight_set_alone(model, params, tokens)
    assert got.shape == expected.shape == alone.shape
    assert (got - expected).abs().max().item() <= TOLERANCE
    assert (got - alone).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(("width", "rows", "groups"), [(16, 4, 4), (33, 5, 4), (20, 11, 4), (100, 9, 4), (20, 1, 5)])
def test_native_kernel_matches_the_reference_across_unit_blocks_and_row_blocks(width, rows, groups):
    """The native kernel takes 16 hidden units and up to 4 rows at a time: widths of one whole
    block, of two blocks and a 1-unit tail, of a 4-unit tail, of seven blocks; rows that leave a
    tail of 1 and 3; one row per group runs two groups side by side, 5 groups leaving one alone."""
    tokens = torch.randint(0, 256, (groups, rows, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(6))
    experts = 2 if groups % 2 == 0 else 1
    reference, model = _model(experts, width, "python"), _model(experts, width, "native")
    params = _copies(model, groups)
    with torch.no_grad():
        expected = reference.forward_with(params, tokens)
        got = model.forward_with(params, tokens)
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_native_chunk_layouts_agree_and_saturate_like_the_library_activations():
    """Window-major ([G, b, T, 4d], the model's own) and time-major ([G, T, b, 4d], EGGROLL's) give the
    same bits, and pre-activations far into both tails (±60, where the approximate reciprocal and the
    exp's clamps act) give the reference cell's values: torch.sigmoid / torch.tanh, one step at a time."""
    groups, rows, steps, width = 3, 5, 6, 20
    generator = torch.Generator().manual_seed(7)
    gates = 20.0 * torch.randn(groups, steps, rows, 4 * width, generator=generator)
    gates[0, 0, 0, :8] = 60.0
    gates[0, 0, 1, :8] = -60.0
    weights = torch.randn(groups, 4 * width, width, generator=generator) / width**0.5
    state = tuple(torch.randn(groups, rows, width, generator=generator) for _ in range(2))
    extension = recurrence.grouped_extension()
    packed = recurrence.pack_recurrent(weights)
    time_major = extension.grouped_lstm_chunk(gates, packed, *state)
    window_major = extension.grouped_lstm_chunk(gates.transpose(1, 2).contiguous(), packed, *state, window_major=True)
    assert torch.equal(time_major[0], window_major[0].transpose(1, 2))
    assert torch.equal(time_major[1], window_major[1]) and torch.equal(time_major[2], window_major[2])
    h, c = state
    for step in range(steps):
        pre = gates[:, step] + torch.bmm(h, weights.transpose(1, 2))
        i, f, g, o = pre.split(width, dim=-1)
        c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
        h = torch.sigmoid(o) * torch.tanh(c)
        assert (time_major[0][:, step] - h).abs().max().item() <= TOLERANCE
    assert (time_major[2] - c).abs().max().item() <= TOLERANCE


def test_native_residual_chunk_adds_the_hidden_states_and_normalises_for_the_next_layer():
    """The fused step (``residual += h`` in place, the MLP's gain-only LayerNorm returned in place of
    h) against the plain step, an add and PyTorch's layer_norm; with EGGROLL's rank-r terms, window-major
    factors give the same bits as time-major ones. Width 20: a 4-unit tail; 5 rows: a row tail."""
    groups, rows, steps, width, rank = 3, 5, 6, 20, 2
    generator = torch.Generator().manual_seed(8)
    gates = 3.0 * torch.randn(groups, rows, steps, 4 * width, generator=generator)
    packed = recurrence.pack_recurrent(torch.randn(groups, 4 * width, width, generator=generator) / width**0.5)
    state = tuple(torch.randn(groups, rows, width, generator=generator) for _ in range(2))
    residual = torch.randn(groups, rows, steps, width, generator=generator) + 3.0  # a mean for the norm to remove
    gain = torch.rand(groups, width, generator=generator) + 0.5
    extension = recurrence.grouped_extension()
    plain = extension.grouped_lstm_chunk(gates, packed, *state, window_major=True)
    stream = residual.clone()
    normed, (h, c) = recurrence.native_residual_chunk(gates, packed, state, stream, gain, 1e-5)
    assert torch.equal(stream, residual + plain[0])
    expected = torch.nn.functional.layer_norm(residual + plain[0], (width,), eps=1e-5) * gain[:, None, None]
    assert (normed - expected).abs().max().item() <= TOLERANCE
    assert torch.equal(h, plain[1]) and torch.equal(c, plain[2])

    thin_in = torch.randn(groups, rows, steps, rank, generator=generator)
    low_rank = {"b_hh": torch.randn(groups, width, rank, generator=generator),
                "a_packed": recurrence.pack_recurrent(torch.randn(groups, 4 * width, 2 * rank, generator=generator))}
    window_major = extension.grouped_lstm_chunk(gates, packed, *state, thin_in=thin_in, window_major=True, **low_rank)
    time_major = extension.grouped_lstm_chunk(gates.transpose(1, 2).contiguous(), packed, *state,
                                              thin_in=thin_in.transpose(1, 2).contiguous(), **low_rank)
    assert not torch.equal(window_major[0], plain[0])  # the rank-r terms changed the gates
    assert torch.equal(window_major[0], time_major[0].transpose(1, 2))
    stream = residual.clone()
    fused, _ = recurrence.native_residual_chunk(gates, packed, state, stream, gain, 1e-5,
                                                {"thin_in": thin_in, **low_rank})
    assert torch.equal(stream, residual + window_major[0])
    expected = torch.nn.functional.layer_norm(residual + window_major[0], (width,), eps=1e-5) * gain[:, None, None]
    assert (fused - expected).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize("shared", [False, True])
def test_native_head_cross_entropy_matches_the_logits_path(shared):
    """The fused head (logits 4 rows × 64 at a time, never written out) against logits and
    `F.cross_entropy`, per-group and shared heads, 7 positions per row (a tail of 3 rows)."""
    generator = torch.Generator().manual_seed(7)
    head = torch.randn((256, 12) if shared else (3, 256, 12), generator=generator)
    features = 3 * torch.randn(3, 2, 7, 12, generator=generator)
    targets = torch.randint(0, 256, (3, 2, 7), dtype=torch.uint8, generator=generator)
    head_t = head.t() if shared else head.transpose(1, 2)
    logits = features @ head_t if shared else torch.einsum("gbtk,gkv->gbtv", features, head_t)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.long().reshape(-1), reduction="none")
    assert recurrence.native_applies(Kernel.auto, head_t, features)
    got = recurrence.native_head_nll(head_t, features, targets)
    assert got.shape == targets.shape
    assert (got.reshape(-1) - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()


def test_native_head_adds_each_groups_rank_r_part():
    """EGGROLL's members: 6 groups share 2 heads (3 members each) and each adds its own rank-2 part
    ``thin·head_low``; against the logits of the materialised heads ``W + (B·Aᵀ)ᵀ``."""
    generator = torch.Generator().manual_seed(8)
    head_t = torch.randn(2, 12, 256, generator=generator)
    a, b = torch.randn(6, 256, 2, generator=generator), torch.randn(6, 12, 2, generator=generator)
    features = 3 * torch.randn(6, 1, 7, 12, generator=generator)
    targets = torch.randint(0, 256, (6, 1, 7), dtype=torch.uint8, generator=generator)
    member_heads = head_t.repeat_interleave(3, 0) + b @ a.transpose(1, 2)
    logits = torch.einsum("gbtk,gkv->gbtv", features, member_heads)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), targets.long().reshape(-1), reduction="none")
    got = recurrence.native_head_nll(head_t, features, targets, (features @ b[:, None], a.transpose(1, 2)))
    assert (got.reshape(-1) - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()


@pytest.mark.parametrize("width", [1, 7, 8, 13, 128])
def test_native_gelu_is_the_exact_gelu(width):
    """The MLP's GELU, 0.5·x·(1 + erf(x/√2)), in place on rows of every register tail, against
    float64: within 2e-6 of it, relatively beyond |GELU| = 1 (measured: 1.06e-6 at x = -5.65, where
    1 + erf(x/√2) cancels; torch's float32 GELU is within 2.6e-7); NaN and +∞ stay (GELU's limit; torch's
    AVX-512 GELU gives NaN for +∞ in a vector and +∞ in a tail), -∞ gives NaN (-∞ · 0)."""
    x = torch.linspace(-12, 12, 24_001 * width).view(-1)
    rows = x.clone().view(1, -1, width)
    assert recurrence.native_gelu(rows) is None
    exact = torch.nn.functional.gelu(x.double())
    assert ((rows.view(-1).double() - exact).abs() <= 2e-6 * exact.abs().clamp(min=1)).all()
    special = torch.tensor([[[float("nan"), float("inf"), -float("inf"), 0.0]]])
    recurrence.native_gelu(special)
    assert special.isnan().tolist() == [[[True, False, True, False]]]
    assert special[0, 0, 1] == float("inf") and special[0, 0, 3] == 0.0


def test_native_gelu_adds_each_members_rank_r_terms_on_both_sides():
    """EGGROLL's members of the MLP: 4 groups (one member each) with rank-2 parts ``A·Bᵀ`` of both
    matrices; against each member's materialised matrices ``W + A·Bᵀ``, the hidden rows
    ``GELU(x·W_inᵀ)`` and the second matrix's thin product ``hidden·B_out``."""
    generator = torch.Generator().manual_seed(9)
    groups, rows, width, hidden_width, rank = 4, 11, 12, 48, 2
    x = torch.randn(groups, rows, width, generator=generator)
    w_in = torch.randn(hidden_width, width, generator=generator) / width ** 0.5
    a_in, b_in = (torch.randn(groups, size, rank, generator=generator) for size in (hidden_width, width))
    b_out = torch.randn(groups, hidden_width, rank, generator=generator)
    member_in = w_in + a_in @ b_in.transpose(1, 2)
    expected = torch.nn.functional.gelu(torch.einsum("gnk,gok->gno", x.double(), member_in.double()))
    hidden = (x @ w_in.t()).contiguous()
    thin = recurrence.native_gelu(hidden, (x, a_in, b_in), b_out)
    assert (hidden - expected).abs().max().item() <= TOLERANCE * expected.abs().max().item()
    assert (thin - expected.float() @ b_out).abs().max().item() <= TOLERANCE * thin.abs().max().item()


@pytest.mark.parametrize("width", [8, 20, 32])
def test_native_residual_norm_adds_and_normalises_each_group_under_its_gain(width):
    """``x += delta`` in place, then PyTorch's gain-only layer_norm of the sum under each group's
    gain; without delta, the norm alone and x untouched; with a rank-2 term ``thin·Aᵀ`` per group,
    that added too. Width 20: a register tail; 7 rows a group."""
    generator = torch.Generator().manual_seed(11)
    x = torch.randn(3, 7, width, generator=generator) + 3.0  # a mean for the norm to remove
    delta, gains = torch.randn(3, 7, width, generator=generator), torch.rand(3, width, generator=generator) + 0.5
    stream = x.clone()
    normed = recurrence.native_residual_norm(stream, gains, 1e-5, delta)
    assert torch.equal(stream, x + delta)
    expected = torch.nn.functional.layer_norm(x + delta, (width,), eps=1e-5) * gains[:, None]
    assert (normed - expected).abs().max().item() <= TOLERANCE
    alone = recurrence.native_residual_norm(stream, gains, 1e-5)
    assert torch.equal(stream, x + delta)
    assert (alone - expected).abs().max().item() <= TOLERANCE
    thin, a = torch.randn(3, 7, 2, generator=generator), torch.randn(3, width, 2, generator=generator)
    stream = x.clone()
    normed = recurrence.native_residual_norm(stream, gains, 1e-5, delta, (thin, a))
    total = x + delta + thin @ a.transpose(1, 2)
    assert (stream - total).abs().max().item() <= TOLERANCE
    expected = torch.nn.functional.layer_norm(total, (width,), eps=1e-5) * gains[:, None]
    assert (normed - expected).abs().max().item() <= TOLERANCE


def test_a_passs_residual_norm_is_the_same_fused_and_in_pytorch():
    """``Pass.residual_norm`` with a member's rank-r term: the fused pass (native, x in place) and
    the PyTorch one (the python kernel) give the same sum and norm, under each member's gains."""
    model = _model(2, 12, "native")
    params = model.group_parameters(_copies(model, 2), 2)
    generator = torch.Generator().manual_seed(12)
    x, delta = torch.randn(2, 6, 5, 12, generator=generator), torch.randn(2, 6, 5, 12, generator=generator)
    low_rank = (torch.randn(2, 30, 2, generator=generator), torch.randn(2, 12, 2, generator=generator))
    with torch.no_grad():
        fused = stacked.Pass(model, params)
        plain = stacked.Pass(model, params, kernel=Kernel.python)
        assert fused.fused and not plain.fused
        expected = plain.residual_norm(x, 2, delta, low_rank)
        stream = x.clone()
        result = fused.residual_norm(stream, 2, delta, low_rank)
    assert result[0] is stream
    for got, want in zip(result, expected, strict=True):
        assert (got - want).abs().max().item() <= TOLERANCE


@pytest.mark.parametrize(("width", "rank"), [(32, 1), (13, 3)])
def test_native_thin_is_the_batched_product(width, rank):
    generator = torch.Generator().manual_seed(10)
    x, b = torch.randn(5, 9, width, generator=generator), torch.randn(5, width, rank, generator=generator)
    assert (recurrence.native_thin(x, b) - torch.bmm(x, b)).abs().max().item() <= TOLERANCE


def test_library_kernel_backpropagates_the_same_gradients():
    tokens = torch.randint(0, 256, (1, 4, 30), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    gradients = {}
    for kernel in ("python", "library"):
        model = _model(1, 12, kernel)
        model.loss_per_group({}, tokens).sum().backward()
        gradients[kernel] = {name: param.grad for name, param in model.named_parameters()}
    for name, expected in gradients["python"].items():
        assert expected.abs().max() > 0, name
        assert (gradients["library"][name] - expected).abs().max().item() <= TOLERANCE, name


def test_the_choice_follows_groups_grad_mode_and_the_override(monkeypatch):
    model = _model(2, 8, "auto")
    one, many = {"w_hh": model.w_hh[:1]}, {"w_hh": model.w_hh}
    assert resolve_kernel(Kernel.auto, one) is Kernel.library
    with torch.no_grad():
        assert resolve_kernel(Kernel.auto, many) is Kernel.native
        assert resolve_kernel(Kernel.library, many) is Kernel.python  # one weight set only
    assert resolve_kernel(Kernel.auto, many) is Kernel.python  # gradients: the native kernel has no backward
    monkeypatch.setenv(recurrence.KERNEL_ENV, "python")
    assert resolve_kernel(Kernel.auto, one) is Kernel.python
    assert not recurrence.native_applies(Kernel.auto, model.head.detach(), model.head.detach())


def test_the_native_kernel_is_built_here_and_is_deterministic():
    assert recurrence.grouped_extension() is not None  # a C++ compiler is part of the supported setup
    model = _model(2, 8, "native")
    tokens = torch.randint(0, 256, (4, 2, 15), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
    params = _copies(model, 4)
    with torch.no_grad():
        assert torch.equal(model.forward_with(params, tokens), model.forward_with(params, tokens))


def test_non_finite_weights_give_non_finite_losses_in_every_kernel():
    """The trainers stop on a non-finite loss; no kernel may turn a NaN into a number."""
    tokens = torch.randint(0, 256, (2, 2, 10), dtype=torch.uint8, generator=torch.Generator().manual_seed(5))
    for kernel in ("python", "library", "native"):
        model = _model(2, 8, kernel)
        params = _copies(model, 2)
        params["w_hh"][1, 0, 0, 0] = float("nan")
        one = {name: value[:1] for name, value in params.items()}
        one["w_hh"] = params["w_hh"][1:]
        with torch.no_grad():
            losses = model.loss_per_group(params, tokens)
            single = _model(1, 8, kernel).loss_per_group(one, tokens[1:])
        assert torch.isfinite(losses[0]) and torch.isnan(losses[1]), kernel
        assert torch.isnan(single).all(), kernel


@pytest.mark.cuda
def test_cudnn_library_kernel_matches_the_reference_loop_on_the_gpu():
    """cuDNN runs the one-weight-set path on a GPU; the grouped path runs Triton there (else the loop)."""
    tokens = torch.randint(0, 256, (1, 4, 40), dtype=torch.uint8, device="cuda")
    outputs, gradients = {}, {}
    for kernel in ("python", "library"):
        model = _model(1, 12, kernel).cuda()
        loss = model.loss_per_group({}, tokens)
        loss.sum().backward()
        outputs[kernel], gradients[kernel] = loss.detach(), model.w_hh.grad
    assert torch.backends.cudnn.is_available()
    # cuDNN may use TF32 matrix units for float32: ‖Δ‖/‖ref‖ well under 1e-3.
    assert (outputs["library"] - outputs["python"]).abs().max().item() <= 1e-4
    assert ((gradients["library"] - gradients["python"]).norm() / gradients["python"].norm()).item() <= 1e-3
    with torch.no_grad():
        many = _model(3, 8, "auto").cuda()
        grouped = many.forward_with({}, tokens.expand(3, -1, -1))
        expected = Kernel.triton if triton_lstm.available() else Kernel.python
        assert resolve_kernel(Kernel.auto, {"w_hh": many.w_hh}) is expected
    assert torch.isfinite(grouped).all()
