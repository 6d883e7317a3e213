"""The Triton grouped LSTM kernel (`soma_pl.models.triton_lstm`): its arithmetic in Triton's
interpreter on the CPU against the reference loop, where it is chosen, and on a GPU (`-m cuda`)."""

from __future__ import annotations

import pytest
import torch

from soma_pl.models import triton_lstm
from soma_pl.models.recurrence import TRITON_MAX_WIDTH, Kernel, cuda_choice, resolve_kernel
from soma_pl.models.stacked import StackedExperts, lstm_cell

pytest.importorskip("triton")

TOLERANCE = 1e-5


def _reference(gates_in, w_hh_t, state):
    h, c = state
    outputs = []
    for t in range(gates_in.shape[1]):
        h, c = lstm_cell(torch.baddbmm(gates_in[:, t], h, w_hh_t), c)
        outputs.append(h)
    return torch.stack(outputs, 2), (h, c)


@pytest.mark.parametrize(("groups", "steps", "rows", "width"),
                         [(3, 5, 4, 16), (2, 4, 20, 33), (2, 3, 7, 70), (1, 2, 16, 8), (2, 2, 70, 20)])
def test_a_chunk_matches_the_reference_loop_in_the_interpreter(groups, steps, rows, width):
    """Row blocks of 16 (a tail, two blocks) and of 64 (narrow layers, many rows: a tail), widths of
    one unit block, a tail and two blocks."""
    generator = torch.Generator().manual_seed(width)
    gates_in = torch.randn(groups, steps, rows, 4 * width, generator=generator)
    w_hh_t = torch.randn(groups, width, 4 * width, generator=generator) / width**0.5
    state = tuple(torch.randn(groups, rows, width, generator=generator) for _ in range(2))
    before = tuple(tensor.clone() for tensor in state)
    out, (h, c) = triton_lstm.triton_chunk(gates_in, w_hh_t, state)
    expected, (h_expected, c_expected) = _reference(gates_in, w_hh_t, state)
    assert out.shape == expected.shape == (groups, rows, steps, width)
    for got, want in ((out, expected), (h, h_expected), (c, c_expected)):
        assert (got - want).abs().max().item() <= TOLERANCE
    assert all(torch.equal(a, b) for a, b in zip(state, before, strict=True))  # the caller's state is not written


def test_a_model_on_the_triton_kernel_gives_the_reference_losses(monkeypatch):
    calls, chunk = [], triton_lstm.triton_chunk
    def counted(*args, **kwargs):
        calls.append(1)
        return chunk(*args, **kwargs)

    monkeypatch.setattr(triton_lstm, "triton_chunk", counted)
    torch.manual_seed(0)
    model = StackedExperts(2, 20, embed_dim=8, num_layers=2, time_chunk=5)
    tokens = torch.randint(0, 256, (4, 3, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    params = {name: p.detach().repeat_interleave(2, 0) + 0.05 * torch.randn((4, *p.shape[1:]))
              for name, p in model.expert_parameters().items()}
    with torch.no_grad():
        assert resolve_kernel(Kernel.triton, params) is Kernel.triton
        model.kernel = Kernel.triton
        got = model.loss_per_group(params, tokens)
        model.kernel = Kernel.python
        expected = model.loss_per_group(params, tokens)
    assert len(calls) == 2 * 3  # every layer and time chunk (12 steps in chunks of 5)
    assert (got - expected).abs().max().item() <= TOLERANCE


def test_triton_is_chosen_only_where_it_applies(monkeypatch):
    torch.manual_seed(0)
    model = StackedExperts(3, 8, embed_dim=8, num_layers=1)
    many = {"w_hh": model.w_hh}
    with torch.no_grad():
        assert resolve_kernel(Kernel.auto, many) is not Kernel.triton  # the CPU: native
        assert resolve_kernel(Kernel.triton, {"w_hh": model.w_hh.double()}) is Kernel.python
        monkeypatch.setattr(triton_lstm, "tl", None)  # Triton missing
        assert resolve_kernel(Kernel.triton, many) is Kernel.python
    monkeypatch.undo()
    assert resolve_kernel(Kernel.triton, many) is Kernel.python  # gradients: the kernel has no backward


HOPPER_SHARED_BYTES = 232_448
"""Shared memory one H100/H200 block may use (the limit the device reported when a variant exceeded it)."""


@pytest.mark.parametrize(("width", "rows", "rank"), [(32, 8, 0), (32, 96, 1), (181, 8, 1), (TRITON_MAX_WIDTH, 512, 0)])
def test_the_kernel_compiles_for_hopper_at_the_launch_settings(width, rows, rank):
    """Ahead of time for sm_90 (an H100/H200) on this CPU, with `launch`'s rows and warps: the code
    a GPU would run builds (with EGGROLL's rank-r terms too), within a block's shared memory."""
    pytest.importorskip("triton.backends.nvidia")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_rows, warps = triton_lstm.launch(width, rows)
    block, _ = triton_lstm._blocks(width)
    pointers = ("gates_in", "w_hh_t", "hidden", "cell", "out", "a_hh", "b_hh")
    signature = {**dict.fromkeys(pointers, "*fp32"), **dict.fromkeys(("steps", "rows", "width", "windows", "members"),
                                                                        "i32")}
    constants = {"BLOCK_B": block_rows, "BLOCK_D": block, "BLOCK_K": block, "PRECISION": "ieee", "RANK": rank}
    with triton_lstm._interpreting(False):
        source = ASTSource(fn=triton.jit(triton_lstm._chunk_body), signature={**signature, **dict.fromkeys(constants,
                                                                                   "constexpr")}, constexprs=constants)
        kernel = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps})
    ptx = kernel.asm["ptx"]
    assert "tf32" not in ptx and "mma" not in ptx and "fma.rn.f32" in ptx  # IEEE float32 products (tf32: mma)
    assert 0 < kernel.metadata.shared <= HOPPER_SHARED_BYTES


def test_low_rank_factors_of_the_wrong_shape_are_refused():
    generator = torch.Generator().manual_seed(0)
    gates_in, w_hh_t = torch.randn(2, 3, 6, 4 * 8, generator=generator), torch.randn(2, 8, 4 * 8, generator=generator)
    state = (torch.zeros(2, 6, 8), torch.zeros(2, 6, 8))
    a_hh, b_hh = torch.randn(6, 4 * 8, 2, generator=generator), torch.randn(6, 8, 2, generator=generator)
    wrong = (((a_hh, b_hh[..., :1]), 2), ((a_hh[:, :8], b_hh), 2), ((a_hh, b_hh), 4), ((a_hh, b_hh), 0))
    for factors, windows in wrong:  # B_hh of another rank, A_hh of another width, 6 rows not in 4s, no windows
        with pytest.raises(ValueError, match="low_rank"):
            triton_lstm.triton_chunk(gates_in, w_hh_t, state, low_rank=factors, windows=windows)


@pytest.mark.cuda
@pytest.mark.parametrize(("groups", "steps", "rows", "width"),
                         [(64, 32, 8, 181), (3, 9, 37, 20), (256, 16, 8, 32), (4, 16, 96, 32)])
def test_the_triton_kernel_matches_the_reference_loop_on_the_gpu(groups, steps, rows, width, monkeypatch):
    """Against the loop in float64, random state: float32 rounding only (no TF32)."""
    generator = torch.Generator(device="cuda").manual_seed(width)
    gates_in = torch.randn(groups, steps, rows, 4 * width, device="cuda", generator=generator)
    w_hh_t = torch.randn(groups, width, 4 * width, device="cuda", generator=generator) / width**0.5
    state = tuple(torch.randn(groups, rows, width, device="cuda", generator=generator) for _ in range(2))
    out, (h, c) = triton_lstm.triton_chunk(gates_in, w_hh_t, state)
    doubled = tuple(tensor.double() for tensor in state)
    expected, (h_expected, c_expected) = _reference(gates_in.double(), w_hh_t.double(), doubled)
    for got, want in ((out, expected), (h, h_expected), (c, c_expected)):
        assert ((got.double() - want).norm() / want.norm()).item() <= 1e-5
    with torch.no_grad():  # `auto` reads the width off w_hh, [G, 4d, d] per layer
        assert resolve_kernel(Kernel.auto, {"w_hh": w_hh_t.transpose(1, 2)}) is Kernel.triton
        wide = torch.zeros(2, 4 * 361, 361, device="cuda")
        assert resolve_kernel(Kernel.auto, {"w_hh": wide}) is Kernel.python


def test_auto_takes_triton_on_a_gpu_up_to_its_width_and_the_batched_loop_above():
    assert [cuda_choice(width) for width in (32, 181, TRITON_MAX_WIDTH)] == [Kernel.triton] * 3
    assert [cuda_choice(width) for width in (TRITON_MAX_WIDTH + 1, 361, 509)] == [Kernel.python] * 3
