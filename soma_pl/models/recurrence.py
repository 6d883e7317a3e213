"""The LSTM sublayer kernels behind :class:`~soma_pl.models.stacked.StackedExperts`.

One LSTM sublayer, one time chunk, ``G`` groups of weights (experts × perturbed copies), with
EGGROLL's members as rows that add their own rank-r terms; the pass decides which kernel runs, once
(:func:`resolve_kernel`, called by :class:`~soma_pl.models.stacked.Pass`):

- ``library``: one weight set (``G = 1``: BPTT, the monolithic model, the seed model, one expert at
  a time) runs ``torch._VF.lstm``, the kernel behind ``torch.nn.LSTM``: oneDNN's fused LSTM on the
  CPU, cuDNN on a GPU. Our weights are stored in its gate order (input, forget, cell, output), so it
  reads them as they are. Differentiable, so BPTT uses it too.
- ``native``: many weight sets without gradients (the zero-order hot path and routed evaluation) on
  the CPU run the C++ loop in ``grouped_lstm.cpp``, built on first use with the system compiler
  (about a minute, announced by one line naming its cache folder; cached in ``$TORCH_EXTENSIONS_DIR``,
  by default ``~/.cache/torch_extensions``):
  each group runs the chunk's steps in turn (its recurrent weights stay in cache), a step one
  register-blocked product fused with the gate activations and the cell, no library call per step;
  the step also adds the hidden state to the residual stream and applies the MLP's LayerNorm
  (:func:`native_residual_chunk`), and groups that share weights (EGGROLL's members) run as one
  bundle of rows, each adding its rank-r terms.
  Where it cannot be built, ``python`` is used with one warning. The same library fuses the tied
  head's cross entropy (:func:`native_head_nll`), the MLP's GELU with the members' rank-r terms
  (:func:`native_gelu`) and their thin products (:func:`native_thin`) where :func:`native_applies`.
- ``triton``: many weight sets without gradients on a CUDA GPU, in float32: one Triton program per
  group and 16 or 64 rows runs every step of the chunk (:mod:`soma_pl.models.triton_lstm`); EGGROLL's
  members too, each row adding its member's rank-r term. Chosen by hand on
  CPU tensors, it runs in Triton's interpreter, which is how it is tested without a GPU.
- ``python``: the batched PyTorch loop over time (one ``baddbmm`` and a few elementwise kernels per
  step); the reference the others are tested against, and what grouped training under autograd
  (BPTT with ``N > 1`` experts) runs, and GPUs without Triton.

``Kernel.auto`` picks ``library`` for one weight set (no members); for several without gradients in float32,
``native`` on the CPU, and on a CUDA GPU ``triton`` (where Triton imports) for layers up to
:data:`TRITON_MAX_WIDTH` units and ``python`` above (:func:`cuda_choice`); ``python`` otherwise.
``SOMA_PL_LSTM_KERNEL=python|library|native|triton|auto`` overrides the choice for a whole process
(e.g. to compare against the reference).
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import sys
import warnings
from collections.abc import Mapping
from enum import Enum
from pathlib import Path

import torch
from torch import Tensor

KERNEL_ENV = "SOMA_PL_LSTM_KERNEL"
"""Environment variable that overrides :class:`Kernel` for every model in the process."""
LIBRARY_GATE_FLOATS = 1 << 22
"""Gate pre-activations (window-steps × 4·d_t floats, 16 MB) per library-kernel call without
gradients: the call re-packs its weights, so it should be long, and its activations stay bounded.
At the bench's and evaluation's shapes (b·T = 16k, 4k, 1k bytes at d_t = 32, 181, 509) that is the
whole window in one call, as ``torch.nn.LSTM`` takes it."""
TRITON_MAX_WIDTH = 256
"""Widest layer ``auto`` runs on the Triton kernel on a GPU. One Triton program streams its group's
recurrent weights at every step, which pays while they are small; on an H200 (``docs/kernels.md``,
"On a GPU"; one chunk of 64 steps) Triton ran 1.2-5.4x PyTorch's batched loop at d_t = 32 and 181
(six shapes, 8 to 512 rows per group) and 0.66x and 0.39x it at d_t = 361 (2 groups of 768 rows)
and 509 (4 of 4), where ``baddbmm`` spreads each step's product over the whole GPU. 256 lies
between the widths measured, not at a measured crossing."""
_SOURCE = Path(__file__).with_name("grouped_lstm.cpp")
_CFLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-fno-trapping-math"]
"""``-fno-trapping-math`` lets the compiler vectorise the float → int conversion in the fast exp."""


class Kernel(str, Enum):
    """Which implementation runs an LSTM layer (see the module docstring)."""

    auto = "auto"
    library = "library"
    native = "native"
    triton = "triton"
    python = "python"


def needs_grad(params: Mapping[str, Tensor]) -> bool:
    """Whether a forward pass under ``params`` records autograd history."""
    return torch.is_grad_enabled() and any(param.requires_grad for param in params.values())


def resolve_kernel(kernel: Kernel | str, params: Mapping[str, Tensor], low_rank: bool = False) -> Kernel:
    """The kernel a forward pass under ``params`` (``[G, ...]`` each) runs its LSTMs on: the
    override, else ``kernel`` made concrete for these weights, the current grad mode and whether the
    rows are EGGROLL's members (``low_rank``: their rank-r terms run on every kernel but ``library``)."""
    chosen = Kernel(os.environ.get(KERNEL_ENV) or kernel)
    weights = params["w_hh"]
    single = weights.shape[0] == 1 and not low_rank
    if chosen is Kernel.auto:
        chosen = Kernel.library if single else cuda_choice(weights.shape[-1]) if weights.is_cuda else Kernel.native
    if chosen is Kernel.library and (not single or _library_lacks_bf16(weights)):
        return Kernel.python
    if chosen is Kernel.triton:
        from soma_pl.models import triton_lstm

        usable = (triton_lstm.available() and not needs_grad(params)
                  and all(param.dtype == torch.float32 for param in params.values()))
        return Kernel.triton if usable else Kernel.python
    if chosen is Kernel.native and not native_applies(chosen, *params.values()):
        return Kernel.python
    return chosen


def cuda_choice(width: int) -> Kernel:
    """``auto``'s kernel for several weight sets of layers ``width`` units wide on a CUDA GPU."""
    return Kernel.triton if width <= TRITON_MAX_WIDTH else Kernel.python


def _library_lacks_bf16(weights: Tensor) -> bool:
    """Whether a bfloat16 pass (bf16 weights, or CPU autocast to bf16) would reach oneDNN's LSTM on
    a CPU without bf16 support, where it has no primitive for it (CPUs without AVX-512)."""
    if weights.device.type != "cpu":
        return False
    bf16 = weights.dtype == torch.bfloat16 or (torch.is_autocast_enabled("cpu")
                                               and torch.get_autocast_dtype("cpu") == torch.bfloat16)
    return bf16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported()


def library_weights(w_ih: Tensor, w_hh: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Per-layer weights of the one group for ``torch._VF.lstm``. w_ih, w_hh: ``[1, L, 4d, d]``."""
    return list(zip(w_ih.squeeze(0).unbind(0), w_hh.squeeze(0).unbind(0), strict=True))


def library_chunk(x: Tensor, weights: tuple[Tensor, Tensor], state: tuple[Tensor, Tensor]
                  ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One layer over a chunk with ``torch._VF.lstm``. x: ``[1, b, Tc, d]``; state ``[1, b, d]`` each."""
    h, c = state
    with warnings.catch_warnings():
        # cuDNN asks for weights in one flat buffer and copies them when they are not; one copy
        # per chunk is small next to the chunk's work.
        warnings.filterwarnings("ignore", message="RNN module weights are not part of single contiguous")
        out, h, c = torch._VF.lstm(x.squeeze(0), (h, c), list(weights), False, 1, 0.0, torch.is_grad_enabled(),
                                   False, True)
    return out[None], (h, c)


UNITS_PER_BLOCK = 16
"""Hidden units per block of the native kernel's packed recurrent weights (one vector of floats)."""


def pack_recurrent(weights: Tensor) -> Tensor:
    """Gate weights ``[G, 4d, k]`` (the recurrent ``[G, 4d, d]``, or EGGROLL's joint factor
    ``[G, 4d, 2r]``) in the native kernel's layout ``[G, nb, k, 4, 16]``: for each block of 16
    hidden units and each input k, the 16 weights of each gate (zero beyond d), so that a step
    reads them contiguously. ``nb = ceil(d / 16)``."""
    groups, gates, inputs = weights.shape
    width = gates // 4
    blocks = -(-width // UNITS_PER_BLOCK)
    by_gate = weights.reshape(groups, 4, width, inputs)
    padded = torch.nn.functional.pad(by_gate, (0, 0, 0, blocks * UNITS_PER_BLOCK - width))
    return padded.view(groups, 4, blocks, UNITS_PER_BLOCK, inputs).permute(0, 2, 4, 1, 3).contiguous()


def native_residual_chunk(gates_in: Tensor, packed: Tensor, state: tuple[Tensor, Tensor], residual: Tensor,
                          next_gain: Tensor, eps: float, low_rank: Mapping[str, Tensor] | None = None
                          ) -> tuple[Tensor, tuple[Tensor, Tensor]]:
    """One LSTM sublayer over a chunk with the native kernel, in the model's window-major layout, the
    residual add and the MLP's gain-only LayerNorm inside each step: ``residual += h`` in place, and
    the MLP's input returned in place of the hidden states (never written out).

    Args:
        gates_in: ``[G, b, Tc, 4d]`` input projections, contiguous.
        packed: :func:`pack_recurrent` of the recurrent weights (``[P, ...]``, P dividing G).
        state: ``(h, c)``, each ``[G, b, d]``.
        residual: ``[G, b, Tc, d]`` contiguous residual stream, updated in place.
        next_gain: ``[G, d]`` gain of the LayerNorm after the sublayer.
        eps: that norm's epsilon.
        low_rank: EGGROLL's rank-r terms (``thin_in`` ``[G, b, Tc, r]``, ``b_hh``, ``a_packed``), or None.

    Returns:
        ``layer_norm(residual) * next_gain``, ``[G, b, Tc, d]``; the final ``(h, c)``.
    """
    normed, h, c = grouped_extension().grouped_lstm_chunk(
        gates_in, packed, state[0], state[1], window_major=True, residual=residual,
        next_gain=next_gain.contiguous(), eps=eps, **(low_rank or {}))
    return normed, (h, c)


def native_applies(kernel: Kernel | str, *tensors: Tensor) -> bool:
    """Whether a pass over ``tensors`` may run a native kernel outside the layers' own choice (the
    tied head's cross entropy, EGGROLL's members) and where the layers' ``native`` choice stands
    (:func:`resolve_kernel`): not ``python``, no gradients, CPU, float32, the kernel built; for any
    number of weight sets."""
    chosen = Kernel(os.environ.get(KERNEL_ENV) or kernel)
    grad = torch.is_grad_enabled() and any(tensor.requires_grad for tensor in tensors)
    return (chosen is not Kernel.python and not grad
            and all(tensor.device.type == "cpu" and tensor.dtype == torch.float32 for tensor in tensors)
            and grouped_extension() is not None)


def native_head_nll(head_t: Tensor, features: Tensor, targets: Tensor,
                    low_rank: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """Next-byte cross entropy of every position under the tied head, the logits never written out.

    Args:
        head_t: ``[P, d_E, 256]``, P dividing G (group g reads head ``g // (G / P)``), or one shared
            ``[d_E, 256]``.
        features: ``[G, b, T, d_E]``.
        targets: ``[G, b, T]`` bytes.
        low_rank: each group's own rank-r part of its head (EGGROLL's members), ``(thin [G, b, T, r],
            head_low [G, r, 256])``: a position scores ``features·head_t + thin·head_low``; or None.

    Returns:
        ``[G, b, T]`` nats.
    """
    groups, batch, steps, dim = features.shape
    head = head_t.reshape(-1, *head_t.shape[-2:]).contiguous()
    low = {} if low_rank is None else {"thin": low_rank[0].reshape(groups, batch * steps, -1).contiguous(),
                                       "head_low": low_rank[1].contiguous()}
    nll = grouped_extension().grouped_head_nll(features.reshape(groups, -1, dim).contiguous(), head,
                                               targets.reshape(groups, -1).long().contiguous(), **low)
    return nll.view(groups, batch, steps)


def native_thin(x: Tensor, b: Tensor) -> Tensor:
    """Each row's products with its group's rank-r factor, ``x·B``: x ``[K, n, d]``, b ``[K, d, r]``
    → ``[K, n, r]``, reading x once (a batched matrix-vector product reads it at a fraction of the
    memory's speed at these shapes)."""
    return grouped_extension().grouped_thin(x.contiguous(), b.transpose(1, 2).contiguous())


def native_gelu(hidden: Tensor, low_rank_in: tuple[Tensor, Tensor, Tensor] | None = None,
                b_out: Tensor | None = None) -> Tensor | None:
    """The MLP's exact GELU over ``hidden`` in place, EGGROLL's rank-r terms of the MLP's two
    matrices beside it, each row once while it is in cache.

    Args:
        hidden: ``[K, n, h]`` contiguous, ``x·W_inᵀ`` (K groups of one member each); becomes
            ``GELU(x·W_inᵀ + (x·B_in)·A_inᵀ)``.
        low_rank_in: ``(x [K, n, d], A_in [K, h, r], B_in [K, d, r])``, x the MLP's input; or None.
        b_out: ``B_out [K, h, r]`` of the second matrix, or None.

    Returns:
        ``GELU(·)·B_out``, ``[K, n, r]`` (:func:`native_residual_norm` adds its ``·A_outᵀ``), or None without ``b_out``.
    """
    terms = {}
    if low_rank_in is not None:
        x, a, b = low_rank_in
        terms = {"normed": x.contiguous(), "a_in": a.transpose(1, 2).contiguous()}
        terms["b_in"] = b.transpose(1, 2).contiguous()
    if b_out is not None:
        terms["b_out"] = b_out.transpose(1, 2).contiguous()
    thin = grouped_extension().grouped_gelu(hidden, **terms)
    return None if b_out is None else thin


def native_residual_norm(x: Tensor, gains: Tensor, eps: float, delta: Tensor | None = None,
                         low_rank: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """``x += delta`` in place (none without it), plus each member's rank-r term, and the gain-only
    LayerNorm of the sum, one pass over each row.

    Args:
        x: ``[K, n, d]`` contiguous residual stream, updated in place.
        gains: ``[K, d]``: group k's rows take ``gains[k]``.
        delta: x's shape, or None.
        low_rank: ``(thin [K, n, r], A [K, d, r])``: ``thin·Aᵀ`` added as well (an EGGROLL member's
            term of the matrix that made delta); or None.

    Returns:
        ``layer_norm(x) · gains``, ``[K, n, d]``.
    """
    terms = {} if delta is None else {"delta": delta.contiguous()}
    if low_rank is not None:
        terms |= {"thin": low_rank[0].contiguous(), "a_low": low_rank[1].transpose(1, 2).contiguous()}
    return grouped_extension().grouped_residual_norm(x, gains.contiguous(), eps=eps, **terms)


def _build_tag() -> str:
    """Names the build by source (its text and its path), torch version and CPU, so a shared cache
    never serves a binary compiled for another processor (``-march=native``) or another torch, and
    two checkouts never rebuild each other's (the build file names the source's path)."""
    cpu = ""
    try:
        cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    except OSError:
        cpu = platform.processor()
    parts = (_SOURCE.read_bytes(), str(_SOURCE.resolve()).encode(), torch.__version__.encode(), cpu.encode(),
             " ".join(_CFLAGS).encode())
    digest = hashlib.sha256(b"\0".join(parts))
    return digest.hexdigest()[:12]


@functools.cache
def grouped_extension():
    """The compiled native kernel module, or None (with one warning) where it cannot be built."""
    if os.environ.get(KERNEL_ENV) == Kernel.python.value:
        return None
    try:
        from torch.utils.cpp_extension import _get_build_directory, load

        name = f"soma_pl_grouped_lstm_{_build_tag()}"
        folder = Path(_get_build_directory(name, verbose=False))  # where `load` builds and caches it
        if not (folder / f"{name}.so").is_file():  # a build takes about a minute: say so before it starts
            print(f"soma_pl: building the native LSTM kernel once for this machine (about a minute); cached in "
                  f"{folder}", file=sys.stderr, flush=True)
        return load(name=name, sources=[str(_SOURCE)], extra_cflags=_CFLAGS, build_directory=str(folder),
                    verbose=False)
    except Exception as error:  # no compiler, no ninja, an unsupported platform: the PyTorch loop still runs
        warnings.warn(f"native grouped LSTM kernel unavailable ({type(error).__name__}: {str(error)[:200]}); "
                      "using the PyTorch loop", RuntimeWarning, stacklevel=2)
        return None
