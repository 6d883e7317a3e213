"""`bench memory`: peak memory of one zero-order update and of one BPTT update as the context grows.

Zero-order training runs at inference memory: an SPSA update only evaluates losses, so besides the
weights it holds the perturbed copies of one chunk of directions (`max_rows` windows per loss
call) and the activations of one time chunk (`StackedExperts.time_chunk` steps), whatever the
context. BPTT keeps every time step's activations for the backward pass, plus Adam's two moments:
its peak grows linearly with the context.

Each measurement runs in a fresh child process (`spawn`), so one configuration's allocations
never hide another's. On the CPU the peak is the child's peak resident set size (`VmHWM`), reset
after imports by writing `5` to `/proc/self/clear_refs` (Linux ≥ 4.0), above the resident size at
that moment (`baseline`); on CUDA it is `torch.cuda.max_memory_allocated` above what was allocated
before. Both peaks count the weights, the optimizer state and every intermediate.
"""

from __future__ import annotations

import gc
import multiprocessing
import os
import platform
import resource
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from soma_pl.errors import ConfigError
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.io import emit_json
from soma_pl.models.devices import resolve_device
from soma_pl.models.stacked import StackedExperts

_CLEAR_REFS = Path("/proc/self/clear_refs")
_STATUS = Path("/proc/self/status")
_RESET_PEAK_RSS = "5"  # proc(5): writing 5 to clear_refs resets the peak RSS (VmHWM)
_KIB = 1024


def _status_bytes(field: str) -> int | None:
    """A `/proc/self/status` size field (`VmRSS`, `VmHWM`) in bytes; None off Linux."""
    try:
        for line in _STATUS.read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * _KIB
    except OSError:
        return None
    return None


class PeakMemory:
    """Peak memory of the work done between :meth:`start` and :meth:`stop`, on CPU or CUDA."""

    def __init__(self, device: torch.device):
        self.device = device
        self.baseline = 0
        self.method = ""

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.baseline, self.method = torch.cuda.memory_allocated(self.device), "torch.cuda.max_memory_allocated"
            return
        try:
            _CLEAR_REFS.write_text(_RESET_PEAK_RSS)
            self.method = "peak RSS (VmHWM, reset after imports)"
        except OSError:  # not Linux, or not permitted: the peak then includes the imports
            self.method = "peak RSS (ru_maxrss, not reset)"
        self.baseline = _status_bytes("VmRSS") or 0

    def stop(self) -> dict:
        """`{"peak_bytes", "baseline_bytes", "peak_above_baseline_bytes", "memory_method"}`."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak = torch.cuda.max_memory_allocated(self.device)
        else:
            peak = _status_bytes("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _KIB
        return {"peak_bytes": peak, "baseline_bytes": self.baseline,
                "peak_above_baseline_bytes": peak - self.baseline, "memory_method": self.method}


def in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a new spawned Python process (a clean heap for peak memory)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(function, *args).result()


def round_robin(function: Callable[..., Any], configs: Sequence[tuple], rounds: int, desc: str,
                label: Callable[[tuple], str] = str, progress: bool = True) -> list[list[Any]]:
    """``function(*config)`` for every config, ``rounds`` times, each call in a fresh process, the
    configs taken in turn every round so that load from other jobs lands on all of them alike
    (`progress`: a bar named `desc` on stderr). Returns one list of ``rounds`` results per config,
    in config order."""
    runs: list[list[Any]] = [[] for _ in configs]
    with tqdm(total=rounds * len(configs), desc=desc, unit="run", disable=not progress) as bar:
        for _ in range(rounds):
            for index, config in enumerate(configs):
                bar.set_postfix_str(label(config))
                runs[index].append(in_fresh_process(function, *config))
                bar.update()
    return runs


def machine() -> dict:
    """What the measurement ran on; the load average shows whether other jobs shared the CPU."""
    return {"processor": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
            "torch": torch.__version__, "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
            "load_average": os.getloadavg()}


PEAK_SIZE = 2048
"""Side of the square float32 GEMM whose speed is read as the machine's peak."""


def fma_peak_gflops(seconds: float = 0.5) -> float | None:
    """One core's float32 multiply-add throughput (GFLOP/s), measured by the native kernel's
    register-only loop (12 independent 16-lane chains, no memory traffic): the arithmetic limit
    that a GEMM peak (:func:`matmul_peak_gflops`) and every kernel fall short of. None where the
    native kernel cannot be built. Roughly ``seconds`` long."""
    from soma_pl.models import recurrence

    extension = recurrence.grouped_extension()
    if extension is None:
        return None
    probe = 1_000_000
    rate = extension.fma_gflops(probe)
    iterations = max(probe, int(seconds * rate * 1e9 / (12 * 16 * 2)))
    return round(max(extension.fma_gflops(iterations) for _ in range(3)), 1)


def matmul_peak_gflops(device: torch.device | str = "cpu", size: int = PEAK_SIZE, repeats: int = 5,
                       threads: int | None = None) -> float:
    """This machine's attainable float32 GFLOP/s on `threads` threads (None: the current setting):
    the median of `repeats` products of two `size × size` matrices through `torch.mm` (the library
    our kernels and `torch.nn.LSTM` call), after one untimed call."""
    import statistics

    if threads:
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return matmul_peak_gflops(device, size, repeats)
        finally:
            torch.set_num_threads(previous)
    device = torch.device(device)
    generator = torch.Generator().manual_seed(0)
    a, b = (torch.randn(size, size, generator=generator).to(device) for _ in range(2))

    def timed() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - started

    timed()
    return round(2 * size**3 / statistics.median(timed() for _ in range(repeats)) / 1e9, 2)


def forward_flops_per_token(model) -> int:
    """Floating-point operations of one byte's forward through one expert: two per multiply-add of
    each weight matrix (input and recurrent gates, projections, output head; the embedding is a
    lookup and the norm gains an elementwise scale)."""
    return 2 * sum(param[0].numel() if not model.is_shared(name) else param.numel()
                   for name, param in model.named_parameters() if name != "norm_gains")


class TrainingMethod(str, Enum):
    """What one measured update is."""

    zo = "zo"
    """One SPSA estimate (± evaluations, `max_rows` windows per loss call) and an SGD step."""
    bptt = "bptt"
    """One forward over the whole context, one backward through time and an Adam step."""


@dataclass(frozen=True)
class MemorySettings:
    """The model and update measured at every context."""

    width: int = 181
    """Body width d_t (Table 2: the N = 8 expert)."""
    experts: int = 1
    """Experts in the stacked model."""
    micro_batch: int = 4
    """Windows per expert per update (B)."""
    n_pert: int = 2
    """SPSA directions; with one direction per loss call the peak does not depend on it."""
    max_rows: int | None = None
    """Windows per ZO loss call; None: one direction's ± pair (2·B rows per expert)."""
    time_chunk: int = 64
    """Time steps held at once; bounds ZO activation memory."""
    embed_dim: int = 32
    num_layers: int = 2
    eps: float = 1e-3
    lr: float = 1e-3
    seed: int = 0
    device: str = "cpu"
    threads: int | None = 1
    """torch threads in each child process; None: torch's default (every core). One thread keeps
    timings steady on a CPU shared with other jobs, where idle worker threads spin-wait."""


def _zo_update(model: StackedExperts, windows: torch.Tensor, settings: MemorySettings) -> None:
    params = model.expert_parameters()
    rows = settings.max_rows or 2 * settings.micro_batch * settings.experts
    config = SPSAConfig(eps=settings.eps, n_pert=settings.n_pert, micro_batch=settings.micro_batch, max_rows=rows)
    result = spsa_estimate(model.loss_per_group, params, windows, config, step=0, seed=settings.seed)
    optimizer = torch.optim.SGD(params.values(), lr=settings.lr)
    for name, param in params.items():
        param.grad = result.gradient[name]
    optimizer.step()


def _bptt_update(model: StackedExperts, windows: torch.Tensor, settings: MemorySettings) -> None:
    optimizer = torch.optim.Adam(model.parameters(), lr=settings.lr)
    model.loss_per_group({}, windows).mean().backward()
    optimizer.step()


def _model_and_windows(settings: MemorySettings, width: int, context: int) -> tuple[StackedExperts, torch.Tensor]:
    device = torch.device(settings.device)
    torch.manual_seed(settings.seed)
    model = StackedExperts(settings.experts, width, settings.embed_dim, settings.num_layers,
                           time_chunk=settings.time_chunk, device=device)
    shape = (settings.experts, settings.micro_batch, context + 1)
    return model, torch.randint(0, 256, shape, dtype=torch.uint8, device=device)


def measure_update(method: TrainingMethod, context: int, settings: MemorySettings) -> dict:
    """Peak memory and wall time of one update on `context` predicted bytes (run in a child).

    A first update of a width-8 model on 8 bytes runs before the meter starts: it pays the
    one-time costs (lazily imported optimizer machinery, kernel libraries: about 90 MB and
    seconds on the CPU) that would otherwise dwarf a zero-order update's own memory.
    """
    if settings.threads:
        torch.set_num_threads(settings.threads)
    update = _zo_update if TrainingMethod(method) is TrainingMethod.zo else _bptt_update
    update(*_model_and_windows(settings, 8, 8), settings)
    meter = PeakMemory(torch.device(settings.device))
    meter.start()
    model, windows = _model_and_windows(settings, settings.width, context)
    started = time.perf_counter()
    update(model, windows, settings)
    seconds = time.perf_counter() - started
    weights = sum(param.numel() * param.element_size() for param in model.parameters())
    return {"method": TrainingMethod(method).value, "context": context, "seconds": round(seconds, 3),
            "weight_bytes": weights, "threads": torch.get_num_threads(), **meter.stop()}


def bench_memory(contexts: Sequence[int] = (256, 512, 1024, 2048),
                 settings: MemorySettings = MemorySettings(), progress: bool = True) -> dict:
    """One record per (method, context), each from a fresh process; the curves per method.

    Returns ``{"benchmark": "memory", "machine", "settings", "results": [...], "curves":
    {"zo": {"contexts", "peak_above_baseline_mib"}, "bptt": ...}, "growth": {method: last / first}}``.
    """
    if not contexts or min(contexts) < 1:
        raise ConfigError(f"contexts {list(contexts)} must be positive")
    runs = [(method, context) for method in TrainingMethod for context in contexts]
    results = [in_fresh_process(measure_update, method, context, settings)
               for method, context in tqdm(runs, desc="bench memory", unit="run", disable=not progress)]
    curves = {}
    for method in TrainingMethod:
        rows = [record for record in results if record["method"] == method.value]
        curves[method.value] = {"contexts": [record["context"] for record in rows],
                                "peak_above_baseline_mib": [round(record["peak_above_baseline_bytes"] / 2**20, 1)
                                                            for record in rows]}
    growth = {method: round(curve["peak_above_baseline_mib"][-1] / max(curve["peak_above_baseline_mib"][0], 1e-9), 2)
              for method, curve in curves.items()}
    return {"benchmark": "memory", "machine": machine(), "settings": asdict(settings), "results": results,
            "curves": curves, "growth": growth}


def main(contexts: tuple[int, ...] = (256, 512, 1024, 2048), settings: MemorySettings = MemorySettings(),
         out: str = "bench_memory.json", progress: bool = True) -> None:
    """Peak memory of a ZO (SPSA) update and a BPTT update against context length.

    Args:
        contexts: predicted bytes per window, one measurement of each method each.
        settings: the model and the update measured.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    resolve_device(settings.device, "--settings.device")
    emit_json(bench_memory(tuple(contexts), settings, progress), out)
