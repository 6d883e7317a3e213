"""`bench inference` (Table 12): warm inference throughput, batch latency and peak memory.

A request is one 1,025-byte window: the router reads its first 256 bytes and picks the top-k
experts (k = 4, at most N), only those experts run over the 1,024 input bytes
(:func:`soma_pl.eval.ensemble.score_top_k`), and the average of their next-byte distributions
scores the last 768 targets. Throughput is ``batch · 768 / latency`` scored tokens per second, the
latency the median of 7 warm batches (one untimed batch first) in each of 3 rounds, routing
included; routing's own time is recorded beside it (`routing_share`: paper 0.87% at N = 8, 7.50% at
N = 256). Each round runs every configuration in a fresh child process, one after another, so that
load from other jobs falls on all configurations alike; the load average before and after is
recorded. Peak memory is measured as in :mod:`soma_pl.bench.memory`.

The default configurations are Table 2's equal-total-size ensembles, with random weights (weights
do not change the speed): N = 1 (d_t = 509), N = 2 (361), N = 8 (181) and N = 256 (32, one shared
head). The router is the paper's (:func:`~soma_pl.data.sharding.assign.fit_router`: tf–idf, SVD,
balanced k-means on the CPU), fitted on the 1,024-byte sequences of the Python reference text
(``pydoc_data.topics``, always present), and the requests are windows of that text: tf–idf's cost
depends on the words it reads. Its load over the experts is uneven; the routed forward runs each
expert's windows in slots of the mean load (:func:`~soma_pl.eval.ensemble.slot_layout`), so padding
costs at most one slot per expert; the record reports the load. Default batch sizes fit a 2-core CPU; the
paper's GPU batches are 768, 768, 1,024 and 4,096.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace

import torch
from torch import Tensor

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.bench.memory import PeakMemory, machine, round_robin
from soma_pl.errors import ConfigError
from soma_pl.eval.ensemble import score_top_k
from soma_pl.io import emit_json
from soma_pl.models import recurrence
from soma_pl.models.devices import resolve_device
from soma_pl.models.router import Router
from soma_pl.models.stacked import HeadMode, StackedExperts

SCORED_TOKENS = WINDOW_BYTES - 1 - ROUTE_BYTES
"""Scored targets per request (768)."""

@dataclass(frozen=True)
class InferenceModel:
    """One timed configuration (a Table 12 row)."""

    experts: int
    """N."""
    width: int
    """Expert body width d_t."""
    batch_size: int
    """Requests (windows) per batch."""
    shared_head: bool = False
    """One head shared by all experts (N = 256) instead of one per expert."""

    @property
    def head(self) -> HeadMode:
        return HeadMode.shared if self.shared_head else HeadMode.per_expert

    @property
    def name(self) -> str:
        return f"N={self.experts}"


TABLE2_MODELS = (
    InferenceModel(1, 509, 16),
    InferenceModel(2, 361, 16),
    InferenceModel(8, 181, 32),
    InferenceModel(256, 32, 256, shared_head=True),
)


@dataclass(frozen=True)
class InferenceSettings:
    """What every configuration shares."""

    top_k: int = 4
    """Experts averaged per request (capped at N)."""
    repeats: int = 7
    """Timed batches per process."""
    rounds: int = 3
    """Fresh processes per configuration, taken round-robin across configurations so that a slow
    spell from another job lands on all of them alike; the median over every timed batch is reported."""
    warmup: int = 1
    """Untimed batches first."""
    embed_dim: int = 32
    num_layers: int = 2
    time_chunk: int = 64
    """Time steps whose activations are held at once."""
    device: str = "cpu"
    threads: int | None = 1
    """torch threads in each child process; None: torch's default (every core). One thread keeps
    timings steady on a CPU shared with other jobs, where idle worker threads spin-wait."""
    seed: int = 0


def reference_windows() -> Tensor:
    """The Python reference text's topics joined and cut into 1,025-byte windows `[n, 1025]` uint8."""
    from soma_pl.data.corpus.demo import iter_demo_documents
    from soma_pl.data.sharding.assign import cut_sequences

    windows, _ = cut_sequences([document.text for document in iter_demo_documents("python_docs")])
    return torch.from_numpy(windows)


def build_router(experts: int, windows: Tensor, seed: int = 0) -> Router:
    """The paper's router with N centroids, fitted on `windows`' first 1,024 bytes (one k-means start)."""
    from soma_pl.data.sharding.assign import fit_router

    router, _ = fit_router([row[:-1].numpy().tobytes() for row in windows], experts, seed, n_init=1)
    return router


def _request(model: StackedExperts, router: Router | None, windows: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Route and score one batch: returns the experts chosen ``[b, k]`` and the losses ``[b]``."""
    if router is None:
        top = torch.zeros(windows.shape[0], 1, dtype=torch.long, device=windows.device)
    else:
        top = router.top_k(windows, k)
    return top, score_top_k(model, top, windows, ROUTE_BYTES).loss


def _routing_seconds(router: Router | None, windows: Tensor, k: int) -> float:
    """The router's own time for the batch (it runs on the CPU), again after the timed request."""
    if router is None:
        return 0.0
    started = time.perf_counter()
    router.top_k(windows, k)
    return time.perf_counter() - started


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def measure_model(config: InferenceModel, settings: InferenceSettings) -> dict:
    """Latency, throughput, routing load and peak memory of one configuration (run in a child)."""
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = torch.device(settings.device)
    if device.type == "cpu":  # loading the native kernel (and the build check's imports) is setup, not the peak
        recurrence.grouped_extension()
    text = reference_windows()  # fitting the router is setup, not the peak
    router = build_router(config.experts, text, settings.seed).to(device) if config.experts > 1 else None
    meter = PeakMemory(device)
    meter.start()
    torch.manual_seed(settings.seed)
    model = StackedExperts(config.experts, config.width, settings.embed_dim, settings.num_layers, config.head,
                           settings.time_chunk, device=device)
    k = min(settings.top_k, config.experts)
    picks = torch.randperm(len(text), generator=torch.Generator().manual_seed(settings.seed))
    windows = text[picks[torch.arange(config.batch_size) % len(text)]].to(device)
    latencies, routing = [], []
    for repeat in range(settings.warmup + settings.repeats):
        _sync(device)
        started = time.perf_counter()
        top, _ = _request(model, router, windows, k)
        _sync(device)
        if repeat >= settings.warmup:
            latencies.append(time.perf_counter() - started)
            routing.append(_routing_seconds(router, windows, k))
    load = torch.bincount(top.reshape(-1), minlength=config.experts)
    latency = statistics.median(latencies)
    return {
        "model": config.name, "experts": config.experts, "d_t": config.width, "head": config.head.value,
        "parameters": sum(param.numel() for param in model.parameters()), "top_k": k,
        "batch_size": config.batch_size, "scored_tokens_per_request": SCORED_TOKENS,
        "latency_ms": round(latency * 1e3, 2), "latencies_ms": [round(t * 1e3, 2) for t in latencies],
        "routing_ms": [round(t * 1e3, 3) for t in routing],
        "tokens_per_s": round(config.batch_size * SCORED_TOKENS / latency, 1),
        "routing": {"mean_windows_per_expert": round(float(load.float().mean()), 2),
                    "max_windows_per_expert": int(load.max())},
        "threads": torch.get_num_threads(), **meter.stop(),
    }


def bench_inference(models: Sequence[InferenceModel] = TABLE2_MODELS,
                    settings: InferenceSettings = InferenceSettings(), progress: bool = True) -> dict:
    """One record per configuration, each from a fresh process, and throughput ratios to N = 1.

    Returns ``{"benchmark": "inference", "machine", "settings", "results": [...],
    "throughput_ratio_to_n1": {name: ratio}}``; the paper's Table 12 is in `experiments/table12.yaml`.
    """
    if not models or min(min(m.experts, m.width, m.batch_size) for m in models) < 1:
        raise ConfigError("every inference configuration needs experts, width and batch_size >= 1")
    if min(settings.top_k, settings.repeats, settings.rounds) < 1 or settings.warmup < 0:
        raise ConfigError(f"top_k={settings.top_k}, repeats={settings.repeats} and rounds={settings.rounds} "
                          "must be >= 1, warmup >= 0")
    before = machine()
    runs = round_robin(measure_model, [(config, settings) for config in models], settings.rounds, "bench inference",
                       lambda config: config[0].name, progress)
    results = [_combine(config, records) for config, records in zip(models, runs, strict=False)]
    monolithic = next((record for record in results if record["experts"] == 1), None)
    ratios = {}
    if monolithic is not None:
        ratios = {f"{record['model']} top-{record['top_k']}":
                  round(record["tokens_per_s"] / monolithic["tokens_per_s"], 3)
                  for record in results}
    return {"benchmark": "inference", "table": "Table 12", "machine": before, "load_average_after": os.getloadavg(),
            "settings": asdict(settings), "results": results, "throughput_ratio_to_n1": ratios}


def _combine(config: InferenceModel, records: list[dict]) -> dict:
    """One configuration's rounds: the median over all their timed batches, the largest peak memory."""
    latencies = [latency for record in records for latency in record["latencies_ms"]]
    latency = statistics.median(latencies)
    peak = max(records, key=lambda record: record["peak_bytes"])
    routing = statistics.median(t for record in records for t in record["routing_ms"])
    return {**records[0], "latency_ms": round(latency, 3), "latencies_ms": latencies,
            "routing_ms": round(routing, 3), "routing_share": round(routing / latency, 5),
            "tokens_per_s": round(config.batch_size * SCORED_TOKENS / (latency / 1e3), 1),
            "tokens_per_s_per_round": [record["tokens_per_s"] for record in records],
            **{key: peak[key] for key in ("peak_bytes", "baseline_bytes", "peak_above_baseline_bytes")}}


def main(models: tuple[InferenceModel, ...] = TABLE2_MODELS, batch_sizes: tuple[int, ...] | None = None,
         settings: InferenceSettings = InferenceSettings(), out: str = "bench_inference.json",
         progress: bool = True) -> None:
    """Table 12: warm inference throughput, latency and peak memory, routing included.

    Args:
        models: the configurations timed (experts, width, batch_size, shared_head); default: Table 2's.
        batch_sizes: the batch size of each configuration, in order (overrides `models`' own).
        settings: what every configuration shares.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    models = list(models)
    if batch_sizes is not None:
        if len(batch_sizes) != len(models):
            raise ConfigError(f"--batch_sizes has {len(batch_sizes)} entries for {len(models)} models")
        models = [replace(model, batch_size=size) for model, size in zip(models, batch_sizes, strict=False)]
    resolve_device(settings.device, "--settings.device")
    emit_json(bench_inference(models, settings, progress), out)
