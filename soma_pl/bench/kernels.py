"""`bench kernels`: our expert against the same expert built from `torch.nn`, with the same weights, side by side.

The reference is what a researcher would otherwise write (:class:`soma_pl.models.reference.TorchExpert`):
``torch.nn.Embedding`` tied to the output head, bias-free ``torch.nn.Linear`` projections, and per
block ``x + nn.LSTM(nn.LayerNorm(x))`` then ``x + MLP(nn.LayerNorm(x))`` (``bias=False`` throughout;
the LSTM on oneDNN on the CPU, cuDNN on a GPU), loaded with exactly our weights (the same gate order).
Three measurements per width, each a ratio of tokens per second:

- ``inference``: one weight set, logits of ``b`` windows of ``T`` bytes, no gradients.
- ``bptt``: one weight set, forward, cross entropy and backward through time.
- ``grouped``: our zero-order forward, ``G`` groups with different weights (``E`` experts × ``2·n_pert``
  perturbed copies) of ``b`` windows each, against ``nn.LSTM`` on all ``G·b`` windows with one weight
  set: the same FLOPs, so the ratio says what having many weight sets costs.

Every pair is checked for equal outputs first (``max_abs_diff``: logits, gradients, or group 0's
logits with group 0's weights), then timed interleaved: each round runs every configuration in a
fresh process (``spawn``), ours and the reference alternating inside it; the reported throughput is
the median over rounds. The load average before and after goes into the JSON, so a busy machine shows.
"""

from __future__ import annotations

import os
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.nn.functional as F
from torch import Tensor

from soma_pl import VOCAB_SIZE
from soma_pl.bench.memory import (
    PEAK_SIZE,
    fma_peak_gflops,
    forward_flops_per_token,
    machine,
    matmul_peak_gflops,
    round_robin,
)
from soma_pl.bench.zo import median_seconds
from soma_pl.errors import ConfigError
from soma_pl.io import emit_json
from soma_pl.models import recurrence
from soma_pl.models.devices import resolve_device
from soma_pl.models.recurrence import Kernel
from soma_pl.models.reference import TorchExpert
from soma_pl.models.stacked import StackedExperts

KINDS = ("inference", "bptt", "grouped")
BACKWARD_FACTOR = 3
"""A forward and backward through time, counted as three forwards' multiply-adds (the backward
computes the gradients of both the activations and the weights)."""


@dataclass(frozen=True)
class KernelShape:
    """One width and its batch shapes."""

    width: int
    """Body width d_t."""
    batch: int
    """Windows (b) of the single-weight-set measurements."""
    groups: int
    """Weight sets G of the grouped measurement (experts × 2·n_pert)."""
    group_batch: int
    """Windows per group in the grouped measurement."""


DEFAULT_SHAPES = (
    KernelShape(32, batch=16, groups=64, group_batch=8),
    KernelShape(181, batch=4, groups=16, group_batch=8),
    KernelShape(509, batch=1, groups=4, group_batch=4),
)
"""Table 2's widths (N = 256, 8, 1 experts), b·T = 16k / 4k / 1k tokens for one weight set at
T = 1,024, and zero-order groups as an update's loss call holds them (8 windows per copy)."""


@dataclass(frozen=True)
class KernelSettings:
    """What every configuration shares."""

    context: int = 1024
    """Bytes per window T (the scored part of an evaluation window is 768 of 1,024)."""
    grouped_context: int = 256
    """Bytes per window of the grouped (zero-order) measurement: the training context."""
    rounds: int = 3
    """Fresh processes per configuration, interleaved with the others; the median is reported."""
    repeats: int = 3
    """Timed calls of each side per process, alternating; the process reports their median."""
    warmup: int = 1
    """Untimed calls of each side first."""
    embed_dim: int = 32
    num_layers: int = 2
    time_chunk: int = 64
    device: str = "cpu"
    threads: int | None = 1
    """torch threads in each child; None: torch's default. One thread keeps timings steady on a shared CPU."""
    seed: int = 0
    kernel: Kernel = Kernel.auto
    """Our kernel choice (:mod:`soma_pl.models.recurrence`); ``python`` times the reference loop."""
    kinds: tuple[str, ...] = field(default=KINDS)
    """Which measurements to run."""


def _loss(logits: Tensor, tokens: Tensor) -> Tensor:
    return F.cross_entropy(logits[..., :-1, :].reshape(-1, VOCAB_SIZE), tokens[..., 1:].reshape(-1).long())


def _perturbed_copies(model: StackedExperts, groups: int, generator: torch.Generator) -> dict[str, Tensor]:
    """``groups`` copies of the weights, each moved by its own small perturbation (different weights)."""
    copies = {}
    for name, param in model.expert_parameters().items():
        noise = torch.randn((groups, *param.shape[1:]), generator=generator).to(param.device)
        copies[name] = param.detach().repeat_interleave(groups, 0) + 1e-3 * noise
    return copies


def _pair(kind: str, shape: KernelShape, settings: KernelSettings, model: StackedExperts, reference: TorchExpert,
          generator: torch.Generator):
    """(check, ours, theirs, tokens per call) for one measurement; `check` returns the max abs difference."""
    device = model.head.device
    if kind == "grouped":
        tokens = torch.randint(0, 256, (shape.groups, shape.group_batch, settings.grouped_context), generator=generator,
                               dtype=torch.uint8).to(device)
        copies = _perturbed_copies(model, shape.groups, generator)
        flat = tokens.reshape(-1, settings.grouped_context)

        def check() -> float:
            with torch.no_grad():
                same = {name: param.detach().expand(shape.groups, *param.shape[1:]) for name, param
                        in model.expert_parameters().items()}
                return (model.forward_with(same, tokens).reshape_as(reference(flat))
                        - reference(flat)).abs().max().item()

        def ours() -> None:
            with torch.no_grad():
                model.forward_with(copies, tokens)

        def theirs() -> None:
            with torch.no_grad():
                reference(flat)

        return check, ours, theirs, tokens.numel()
    tokens = torch.randint(0, 256, (shape.batch, settings.context), generator=generator, dtype=torch.uint8).to(device)
    if kind == "inference":
        def check() -> float:
            with torch.no_grad():
                return (model.forward_with({}, tokens[None])[0] - reference(tokens)).abs().max().item()

        def ours() -> None:
            with torch.no_grad():
                model.forward_with({}, tokens[None])

        def theirs() -> None:
            with torch.no_grad():
                reference(tokens)

        return check, ours, theirs, tokens.numel()

    def ours() -> None:
        model.zero_grad(set_to_none=True)
        _loss(model.forward_with({}, tokens[None]).squeeze(0), tokens).backward()

    def theirs() -> None:
        reference.zero_grad(set_to_none=True)
        _loss(reference(tokens), tokens).backward()

    def check() -> float:
        ours()
        theirs()
        return (model.w_hh.grad[0] - reference.recurrent_gradients()).abs().max().item()

    return check, ours, theirs, tokens.numel()


def measure_pair(kind: str, shape: KernelShape, settings: KernelSettings) -> dict:
    """One process's measurement of one configuration: equality, then alternating timed calls."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    model = StackedExperts(1, shape.width, settings.embed_dim, settings.num_layers, time_chunk=settings.time_chunk,
                           device=device, kernel=settings.kernel)
    reference = TorchExpert.of(model)
    generator = torch.Generator().manual_seed(settings.seed)
    check, ours, theirs, tokens = _pair(kind, shape, settings, model, reference, generator)
    difference = check()
    seconds = median_seconds({"ours": ours, "nn_lstm": theirs}, settings.repeats, settings.warmup)
    groups = shape.groups if kind == "grouped" else 1
    with torch.set_grad_enabled(kind == "bptt"):
        kernel = recurrence.resolve_kernel(model.kernel, {"w_hh": model.w_hh.expand(groups, *model.w_hh.shape[1:])})
    return {"max_abs_diff": difference, "tokens": tokens, "kernel": kernel.value, "threads": torch.get_num_threads(),
            "seconds": seconds,
            "flops_per_token": forward_flops_per_token(model) * (BACKWARD_FACTOR if kind == "bptt" else 1)}


def bench_kernels(shapes: Sequence[KernelShape] = DEFAULT_SHAPES, settings: KernelSettings = KernelSettings(),
                  progress: bool = True) -> dict:
    """Every (width, kind) pair, ``rounds`` fresh processes each, interleaved across configurations.

    Returns ``{"benchmark": "kernels", "machine", "load_average_after", "settings", "results":
    [{"d_t", "kind", "ours_tokens_per_s", "nn_lstm_tokens_per_s", "ratio", "max_abs_diff", ...}]}``.
    """
    unknown = set(settings.kinds) - set(KINDS)
    if unknown or not settings.kinds:
        raise ConfigError(f"kinds {sorted(settings.kinds)}: choose from {list(KINDS)}")
    if not shapes or min(min(s.width, s.batch, s.groups, s.group_batch) for s in shapes) < 1:
        raise ConfigError("every shape needs width, batch, groups and group_batch >= 1")
    if min(settings.rounds, settings.repeats) < 1 or settings.warmup < 0:
        raise ConfigError(f"rounds={settings.rounds} and repeats={settings.repeats} must be >= 1, warmup >= 0")
    if settings.context < 2 or settings.grouped_context < 2:
        raise ConfigError("context and grouped_context must be >= 2 bytes")
    configs = [(kind, shape) for shape in shapes for kind in settings.kinds]
    if settings.device == "cpu":
        recurrence.grouped_extension()  # build the native kernel once, before any child needs it
    before = {**machine(), "peak_gflops": matmul_peak_gflops(settings.device, threads=settings.threads),
              "peak_gemm": f"torch.mm {PEAK_SIZE}x{PEAK_SIZE} float32, the children's threads",
              "fma_peak_gflops_one_core": fma_peak_gflops() if settings.device == "cpu" else None}
    runs = round_robin(measure_pair, [(kind, shape, settings) for kind, shape in configs], settings.rounds,
                       "bench kernels", lambda config: f"d_t={config[1].width} {config[0]}", progress)
    results = [_summary(kind, shape, settings, runs[index]) for index, (kind, shape) in enumerate(configs)]
    return {"benchmark": "kernels", "machine": before, "load_average_after": os.getloadavg(),
            "settings": asdict(settings), "shapes": [asdict(shape) for shape in shapes], "results": results,
            "ratios": {f"d_t={r['d_t']} {r['kind']}": r["ratio"] for r in results}}


def _summary(kind: str, shape: KernelShape, settings: KernelSettings, runs: list[dict]) -> dict:
    tokens = runs[0]["tokens"]
    ours = statistics.median(run["seconds"]["ours"] for run in runs)
    theirs = statistics.median(run["seconds"]["nn_lstm"] for run in runs)
    ratios = [run["seconds"]["nn_lstm"] / run["seconds"]["ours"] for run in runs]
    return {"d_t": shape.width, "kind": kind, "kernel": runs[0]["kernel"], "tokens_per_call": tokens,
            "groups": shape.groups if kind == "grouped" else 1,
            "windows": shape.groups * shape.group_batch if kind == "grouped" else shape.batch,
            "context": settings.grouped_context if kind == "grouped" else settings.context,
            "ours_tokens_per_s": round(tokens / ours, 1), "nn_lstm_tokens_per_s": round(tokens / theirs, 1),
            "ours_gflops": round(tokens * runs[0]["flops_per_token"] / ours / 1e9, 3),
            "nn_lstm_gflops": round(tokens * runs[0]["flops_per_token"] / theirs / 1e9, 3),
            "ratio": round(theirs / ours, 3), "ratio_per_round": [round(ratio, 3) for ratio in ratios],
            "max_abs_diff": max(run["max_abs_diff"] for run in runs), "threads": runs[0]["threads"]}


def main(shapes: tuple[KernelShape, ...] = DEFAULT_SHAPES, settings: KernelSettings = KernelSettings(),
         device: str | None = None, out: str = "bench_kernels.json", progress: bool = True) -> None:
    """Our LSTM stack against torch.nn.LSTM with the same weights: inference, BPTT, grouped.

    Interleaved fresh processes; the ratios are in the JSON.

    Args:
        shapes: widths and batch shapes (width, batch, groups, group_batch).
        settings: what every shape shares.
        device: cpu, cuda, ...; overrides `settings.device`.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    settings = settings if device is None else replace(settings, device=device)
    resolve_device(settings.device, "--device" if device is not None else "--settings.device")
    emit_json(bench_kernels(list(shapes), settings, progress), out)
