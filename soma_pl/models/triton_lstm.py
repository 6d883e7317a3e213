"""The grouped LSTM layer on a CUDA GPU: one Triton kernel per layer and time chunk.

Many weight sets (experts × perturbed copies) without gradients is the zero-order hot path; on a GPU
the ``python`` kernel launches a ``baddbmm`` and a few elementwise kernels per time step. Here one
program takes 16 or 64 rows of one group (:func:`launch`) through every step of the chunk: per step, for
each block of hidden units, the four gates' products of the previous hidden state with the group's
recurrent weights (``tl.dot`` in IEEE float32, not TF32: a zero-order update divides a loss
difference by ε), then the gate activations and the cell, stored as the step's output. The hidden
state goes through a two-slot buffer in global memory (read one slot, write the other, a barrier
per step); the cell state is updated in place. No host synchronisation inside a chunk. EGGROLL's
members of one expert are the rows of one group, on its shared weights; each row adds its member's
rank-r recurrent term ``(h·B_hh)·A_hhᵀ`` inside the step (``low_rank``).

On CPU tensors the same kernel runs in Triton's interpreter (NumPy), which is how its arithmetic is
tested without a GPU (``tests/models/test_triton_lstm.py``). ``scripts/gpu_check.sh`` times it on
a device (``bench kernels``, ``bench zo`` with ``kernel: auto`` picking it on CUDA).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch
from torch import Tensor

try:
    import triton.language as tl  # the kernel's body names it (not needed on the CPU otherwise)
except ImportError:
    tl = None

BLOCK_ROWS = 16
"""Rows of one group per program (``tl.dot`` needs at least 16)."""


def available() -> bool:
    """Whether Triton can be imported (it ships with CUDA builds of torch; not needed on the CPU)."""
    return tl is not None


def _chunk_body(gates_in, w_hh_t, hidden, cell, out, a_hh, b_hh, steps, rows, width, windows, members,
                BLOCK_B: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr,
                PRECISION: tl.constexpr, RANK: tl.constexpr):  # traced by Triton
    # one grid axis (CUDA caps the others at 65,535 programs); 64-bit offsets (tensors past 2^31 elements)
    blocks = (rows + BLOCK_B - 1) // BLOCK_B
    program = tl.program_id(0).to(tl.int64)
    group = program // blocks
    row = (program % blocks) * BLOCK_B + tl.arange(0, BLOCK_B).to(tl.int64)
    row_ok = row < rows
    gates = 4 * width
    for t in range(steps):
        read = t % 2
        write = 1 - read
        for first in range(0, width, BLOCK_D):
            unit = first + tl.arange(0, BLOCK_D)
            ok = row_ok[:, None] & (unit < width)[None, :]
            at = gates_in + ((group * steps + t) * rows + row[:, None]) * gates + unit[None, :]
            acc_i = tl.load(at, mask=ok, other=0.0)
            acc_f = tl.load(at + width, mask=ok, other=0.0)
            acc_c = tl.load(at + 2 * width, mask=ok, other=0.0)
            acc_o = tl.load(at + 3 * width, mask=ok, other=0.0)
            for start in range(0, width, BLOCK_K):
                k = start + tl.arange(0, BLOCK_K)
                h = tl.load(hidden + ((group * 2 + read) * rows + row[:, None]) * width + k[None, :],
                            mask=row_ok[:, None] & (k < width)[None, :], other=0.0)
                w_at = w_hh_t + (group * width + k[:, None]) * gates + unit[None, :]
                w_ok = (k < width)[:, None] & (unit < width)[None, :]
                acc_i += tl.dot(h, tl.load(w_at, mask=w_ok, other=0.0), input_precision=PRECISION)
                acc_f += tl.dot(h, tl.load(w_at + width, mask=w_ok, other=0.0), input_precision=PRECISION)
                acc_c += tl.dot(h, tl.load(w_at + 2 * width, mask=w_ok, other=0.0), input_precision=PRECISION)
                acc_o += tl.dot(h, tl.load(w_at + 3 * width, mask=w_ok, other=0.0), input_precision=PRECISION)
            for r in range(RANK):  # EGGROLL: each row's member adds its own rank-r term (h·B_hh)·A_hhᵀ
                member = group * members + row // windows
                # Σ_k h·B_hh[:, r] for every row, repeated across the block's units by a product with
                # ones (tl.dot, a core op: no library reduction, which the interpreter cannot call)
                across = tl.full((BLOCK_K, BLOCK_D), 1.0, tl.float32)
                thin = tl.full((BLOCK_B, BLOCK_D), 0.0, tl.float32)
                for start in range(0, width, BLOCK_K):
                    k = start + tl.arange(0, BLOCK_K)
                    k_ok = row_ok[:, None] & (k < width)[None, :]
                    h = tl.load(hidden + ((group * 2 + read) * rows + row[:, None]) * width + k[None, :],
                                mask=k_ok, other=0.0)
                    b = tl.load(b_hh + (member[:, None] * width + k[None, :]) * RANK + r, mask=k_ok, other=0.0)
                    thin += tl.dot(h * b, across, input_precision=PRECISION)
                a_at = a_hh + (member[:, None] * gates + unit[None, :]) * RANK + r
                acc_i += thin * tl.load(a_at, mask=ok, other=0.0)
                acc_f += thin * tl.load(a_at + width * RANK, mask=ok, other=0.0)
                acc_c += thin * tl.load(a_at + 2 * width * RANK, mask=ok, other=0.0)
                acc_o += thin * tl.load(a_at + 3 * width * RANK, mask=ok, other=0.0)
            c_at = cell + (group * rows + row[:, None]) * width + unit[None, :]
            # sigmoid and tanh from exp (a core op: the interpreter runs it whenever Triton was imported)
            c = (tl.load(c_at, mask=ok, other=0.0) / (1.0 + tl.exp(-acc_f))
                 + (2.0 / (1.0 + tl.exp(-2.0 * acc_c)) - 1.0) / (1.0 + tl.exp(-acc_i)))
            h_new = (2.0 / (1.0 + tl.exp(-2.0 * c)) - 1.0) / (1.0 + tl.exp(-acc_o))
            tl.store(c_at, c, mask=ok)
            tl.store(hidden + ((group * 2 + write) * rows + row[:, None]) * width + unit[None, :], h_new, mask=ok)
            tl.store(out + ((group * rows + row[:, None]) * steps + t) * width + unit[None, :], h_new, mask=ok)
        tl.debug_barrier()  # the step's hidden state, written by every thread, is read by all at the next


@contextlib.contextmanager
def _interpreting(on: bool):
    """``TRITON_INTERPRET`` as Triton reads it when a kernel is decorated."""
    before = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1" if on else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = before


@functools.cache
def _kernel(interpret: bool):
    """The kernel compiled for the GPU, or interpreted (CPU tensors), decorated once each."""
    import triton

    with _interpreting(interpret):
        return triton.jit(_chunk_body, do_not_specialize=["steps", "rows", "windows", "members"])


def launch(width: int, rows: int) -> tuple[int, int]:
    """Rows per program and warps per program for a layer of ``width`` units and ``rows`` rows per
    group, from ``scripts/gpu_triton_sweep.py`` on an H200 (one chunk of 64 steps, median of 20;
    ``docs/kernels.md``, "On a GPU"): narrow layers with many rows per group take 64 rows in 8 warps
    (N = 256 inference: 13.8 against 11.6 TFLOP/s in 16 rows and 4 warps), other narrow layers 16
    rows in 4 warps (8 warps: 1.3 against 1.9 at d_t = 32), wider layers 16 rows in 8 warps
    (d_t = 181, 8 rows per group: 4.5 against 3.7 TFLOP/s; 64 rows in 4 warps at N = 8: 0.35)."""
    if width <= 64:
        return (64, 8) if rows >= 64 else (BLOCK_ROWS, 4)
    return BLOCK_ROWS, 8


def _blocks(width: int) -> tuple[int, int]:
    """Hidden units per output block and per product block (powers of two, 16 to 64)."""
    block = min(64, max(16, 1 << (width - 1).bit_length()))
    return block, block


def triton_chunk(gates_in: Tensor, w_hh_t: Tensor, state: tuple[Tensor, Tensor], *, block_rows: int | None = None,
                 num_warps: int | None = None, precision: str = "ieee", block_units: int | None = None,
                 low_rank: tuple[Tensor, Tensor] | None = None, windows: int = 1
                 ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One layer over a chunk with the Triton kernel (``python``'s arithmetic, float32).

    Args:
        gates_in: ``[G, Tc, b, 4d]`` input projections, gate columns (input, forget, cell, output).
        w_hh_t: ``[G, d, 4d]`` transposed recurrent weights, same order.
        state: ``(h, c)``, each ``[G, b, d]``.
        low_rank: EGGROLL's recurrent factors ``(A_hh [G·M, 4d, r], B_hh [G·M, d, r])`` of the
            ``M = b / windows`` members of each group (row ``j`` of group ``g`` belongs to member
            ``g·M + j // windows``), added inside each step as ``(h·B_hh)·A_hhᵀ``; None: none.
        windows: rows per member (with ``low_rank``).
        block_rows, num_warps: rows per program (a power of two, at least 16) and warps per
            program; None: :func:`launch`'s choice.
        precision, block_units: ``tl.dot``'s input precision (``ieee``; ``tf32x3``: three TF32
            products that carry float32's mantissa; ``tf32``) and hidden units per block (None: by
            width), for ``scripts/gpu_triton_sweep.py``.

    Returns:
        out: ``[G, b, Tc, d]``; the final ``(h, c)``.
    """
    groups, steps, rows, gates = gates_in.shape
    width = gates // 4
    hidden = torch.empty(groups, 2, rows, width, device=gates_in.device, dtype=torch.float32)
    hidden[:, 0] = state[0]
    cell = state[1].to(torch.float32, copy=True).contiguous()
    out = torch.empty(groups, rows, steps, width, device=gates_in.device, dtype=torch.float32)
    block_d, block_k = _blocks(width) if block_units is None else (block_units, block_units)
    chosen_rows, chosen_warps = launch(width, rows)
    block_rows, num_warps = block_rows or chosen_rows, num_warps or chosen_warps
    grid = (groups * -(-rows // block_rows),)
    interpret = gates_in.device.type == "cpu"
    device = contextlib.nullcontext() if interpret else torch.cuda.device(gates_in.device)
    rank, members, factors = 0, 1, (gates_in, gates_in)  # no factors: never read (RANK = 0, no rank loop)
    if low_rank is not None:
        a_hh, b_hh = low_rank
        rank, members = a_hh.shape[-1], rows // max(windows, 1)
        expected = ((groups * members, gates, rank), (groups * members, width, rank))
        if windows < 1 or members * windows != rows or (tuple(a_hh.shape), tuple(b_hh.shape)) != expected:
            raise ValueError(f"low_rank: A_hh {tuple(a_hh.shape)} and B_hh {tuple(b_hh.shape)} for {groups} groups of "
                             f"{rows} rows in members of {windows} windows (expected {expected[0]} and {expected[1]})")
        factors = tuple(factor.to(torch.float32).contiguous() for factor in low_rank)
    with _interpreting(interpret), device:
        _kernel(interpret)[grid](gates_in.contiguous(), w_hh_t.contiguous(), hidden, cell, out, *factors, steps, rows,
                                 width, windows, members, BLOCK_B=block_rows, BLOCK_D=block_d, BLOCK_K=block_k,
                                 PRECISION=precision, RANK=rank,
                                 num_warps=num_warps)
    return out, (hidden[:, steps % 2], cell)
