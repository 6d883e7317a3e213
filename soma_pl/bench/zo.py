"""`bench zo`: throughput of batched zero-order (SPSA) updates against plain inference and a naive loop.

Every record times whole updates on random bytes: an update is :func:`spsa_estimate`, the estimate
written into ``.grad`` and one ``torch.optim.SGD`` step. Token-forwards per update are
``2 · n_pert · B · T`` per expert (± evaluations of ``B`` windows of ``T`` predicted bytes). Each
time is the median of ``repeats`` runs after ``warmup`` untimed ones, on this process's threads; the
runs compared take turns, and a ratio of two of them (``efficiency``, ``speedup``) is the median of
the ratios within each turn, all of which the record lists.

Records:
    ``zo``: one expert of width d_t, batched SPSA vs inference of the unperturbed model on the
    same rows and vs a naive MeZO-style loop (one direction and sign at a time).
    ``soma_batched_vs_sequential``: E experts updated as one batched module vs one after another.
    ``eggroll``: one model of width d_t, an EGGROLL update (``2 · n_pert · B`` members, rank-r
    perturbations inside the matmul, ``2 · n_pert`` members per window) vs inference on the same
    rows: the same token count as the ``zo`` record.
"""

from __future__ import annotations

import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass

import torch
from torch import Tensor
from tqdm import tqdm

from soma_pl.bench.memory import PEAK_SIZE, fma_peak_gflops, forward_flops_per_token, matmul_peak_gflops
from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import direction_keys, parameter_directions
from soma_pl.estimators.eggroll import EGGROLLConfig, FitnessShaping, eggroll_estimate
from soma_pl.estimators.spsa import SPSAConfig, spsa_estimate
from soma_pl.eval.checks import check_counts
from soma_pl.io import emit_json
from soma_pl.models.devices import resolve_device
from soma_pl.models.stacked import LOW_RANK_MATRICES, StackedExperts, population_losses

ROW_CANDIDATES: tuple[int | None, ...] = (None, 1024, 512, 256, 128, 64)
"""Chunk sizes (windows per loss call) tried when ``max_rows`` is not given; None = all at once.
On CPU small chunks can win: every perturbed copy of the recurrent weights is read at every time
step, and 128 copies of a d_t = 181 body overflow the cache (64 rows = 4 copies fit in L2)."""


@dataclass(frozen=True)
class ZOBenchSettings:
    """What one record measures; shared by all records of a run."""

    n_pert: int = 64
    """Directions per update."""
    micro_batch: int = 8
    """Windows per expert per update (B; one micro-batch)."""
    context: int = 256
    """Predicted bytes per window (T); windows hold T + 1 bytes."""
    repeats: int = 5
    """Timed turns per measurement (the median is reported; ratios are medians of each turn's)."""
    warmup: int = 1
    """Untimed runs before each measurement (allocator, caches, thread pool)."""
    max_rows: int | None = None
    """Windows per loss call; None: the fastest of :data:`ROW_CANDIDATES`, measured on the spot."""
    naive_directions: int = 8
    """Directions the naive loop is timed on; its time is scaled to n_pert."""
    embed_dim: int = 32
    """Head width d_E."""
    num_layers: int = 2
    """LSTM layers per expert."""
    eps: float = 1e-3
    """SPSA ε."""
    lr: float = 1e-3
    """SGD learning rate (small: the weights barely move over a benchmark's updates)."""
    seed: int = 0
    """Seed of the weights, the windows and the directions."""
    eggroll_rank: int = 1
    """r of the EGGROLL record's perturbations."""
    device: str = "cpu"
    """Where the models and windows live (``cuda`` for the GPU check of the SOMA record)."""

    def __post_init__(self) -> None:
        check_counts("bench zo", n_pert=self.n_pert, micro_batch=self.micro_batch, context=self.context,
                     repeats=self.repeats, max_rows=self.max_rows, naive_directions=self.naive_directions,
                     embed_dim=self.embed_dim, num_layers=self.num_layers, eggroll_rank=self.eggroll_rank)
        if self.warmup < 0:
            raise ConfigError(f"bench zo: --warmup={self.warmup} must be >= 0")
        for name in ("eps", "lr"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"bench zo: --{name}={getattr(self, name)} must be > 0")


def _synchronize() -> None:
    # CUDA work is asynchronous: a clock read before it finishes would time only the launches.
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def turn_seconds(runs: Mapping[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, list[float]]:
    """Wall time of each ``run()`` in each of ``repeats`` turns, after ``warmup`` untimed calls each.

    The runs take turns (a, b, a, b, ...) so that a slow spell from another process on the machine
    lands on all of them alike and their ratios stay fair. CUDA is synchronised around every call.
    """
    for run in runs.values():
        for _ in range(warmup):
            run()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            _synchronize()
            started = time.perf_counter()
            run()
            _synchronize()
            times[name].append(time.perf_counter() - started)
    return times


def medians(turns: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """Each run's median of its times in :func:`turn_seconds`."""
    return {name: statistics.median(values) for name, values in turns.items()}


def median_seconds(runs: Mapping[str, Callable[[], object]], repeats: int, warmup: int) -> dict[str, float]:
    """Median of each run's :func:`turn_seconds`."""
    return medians(turn_seconds(runs, repeats, warmup))


def turn_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> tuple[float, list[float]]:
    """The ratio of two runs' times within each turn, and their median: a slow spell on a shared
    machine lengthens both runs of a turn, so it moves their ratio less than either median."""
    ratios = [round(top / bottom, 4) for top, bottom in zip(numerator, denominator, strict=True)]
    return statistics.median(ratios), ratios


def random_windows(experts: int, settings: ZOBenchSettings) -> Tensor:
    """Seeded random bytes: ``[E, B, T + 1]`` uint8."""
    generator = torch.Generator().manual_seed(settings.seed)
    shape = (experts, settings.micro_batch, settings.context + 1)
    return torch.randint(0, 256, shape, generator=generator, dtype=torch.uint8).to(settings.device)


def build_model(experts: int, width: int, settings: ZOBenchSettings) -> StackedExperts:
    """Seeded experts of width d_t with a per-expert head (every parameter perturbed)."""
    torch.manual_seed(settings.seed)
    return StackedExperts(experts, width, settings.embed_dim, settings.num_layers).to(settings.device)


class Updater:
    """One model, its SGD optimizer and windows; each call runs one update (a fresh step)."""

    def __init__(self, model: StackedExperts, windows: Tensor, settings: ZOBenchSettings) -> None:
        self.model, self.windows, self.settings = model, windows, settings
        self.params = model.expert_parameters()
        self.optimizer = torch.optim.SGD(self.params.values(), lr=settings.lr)
        self.step = 0

    def spsa(self, max_rows: int | None) -> None:
        """Batched update: all ± evaluations of a chunk of directions in one loss call."""
        config = SPSAConfig(eps=self.settings.eps, n_pert=self.settings.n_pert,
                            micro_batch=self.settings.micro_batch, max_rows=max_rows)
        result = spsa_estimate(self.model.loss_per_group, self.params, self.windows, config,
                               step=self.step, seed=self.settings.seed)
        self._apply(result.gradient)

    @torch.no_grad()
    def naive(self, count: int) -> None:
        """MeZO-style update on ``count`` directions: perturb in place, one forward per sign.

        Directions come from the same counter-based generator as :meth:`spsa` (one at a time).
        """
        eps, experts = self.settings.eps, self.model.num_experts
        ids = torch.arange(experts, device=self.windows.device)
        gradient = {name: torch.zeros_like(param) for name, param in self.params.items()}
        for k in range(count):
            z = self._direction_views(ids, k)
            self._perturb(z, eps)
            plus = self.model.loss_per_group({}, self.windows)
            self._perturb(z, -2 * eps)
            minus = self.model.loss_per_group({}, self.windows)
            self._perturb(z, eps)
            delta = (plus - minus) / (2 * eps)
            for name, grad in gradient.items():
                grad += delta.view(experts, *[1] * (grad.dim() - 1)) * z[name]
        self._apply({name: grad / count for name, grad in gradient.items()})

    def eggroll(self, max_members: int | None) -> None:
        """EGGROLL update: ``2 · n_pert · B`` members, ``2 · n_pert`` sharing each window, at most
        ``max_members`` per forward."""
        settings = self.settings
        config = EGGROLLConfig(sigma=settings.eps, rank=settings.eggroll_rank,
                               population=2 * settings.n_pert * settings.micro_batch, group_size=2 * settings.n_pert,
                               fitness=FitnessShaping.group, max_members=max_members)
        matrices = [name for name in self.params if name in LOW_RANK_MATRICES]

        def member_losses(noise, tokens):
            return population_losses(self.model, tokens, noise.factors, noise.offsets)

        result = eggroll_estimate(member_losses, self.params, matrices, self.windows, config, step=self.step,
                                  seed=settings.seed)
        self._apply(result.gradient)

    def _direction_views(self, ids: Tensor, k: int) -> dict[str, Tensor]:
        """Direction k of every expert (the kind :meth:`spsa` uses), parameter-shaped ``[E, ...]``."""
        keys = direction_keys(self.settings.seed, self.step, ids, torch.tensor([k], device=ids.device))
        z = parameter_directions(SPSAConfig.direction, keys, self.model.expert_param_shapes())
        return {name: part[:, 0] for name, part in z.items()}

    def _perturb(self, z: dict[str, Tensor], scale: float) -> None:
        for name, param in self.params.items():
            param.add_(z[name], alpha=scale)

    def _apply(self, gradient: dict[str, Tensor]) -> None:
        for name, param in self.params.items():
            param.grad = gradient[name]
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1


@torch.no_grad()
def inference(model: StackedExperts, rows: Tensor, max_rows: int | None) -> None:
    """Loss of the unperturbed model on rows ``[E, R, T + 1]``, at most max_rows windows per call."""
    chunk = rows.shape[1] if max_rows is None else max(1, max_rows // rows.shape[0])
    for part in rows.split(chunk, dim=1):
        model.loss_per_group({}, part)


def choose_rows(run: Callable[[int | None], object], total_rows: int, smallest: int,
                settings: ZOBenchSettings) -> tuple[int | None, list[dict]]:
    """The fastest windows-per-call for ``run(max_rows)``: the given one, or the best candidate.

    Each distinct candidate (None = all ``total_rows`` in one call; ``smallest`` = the rows of the
    smallest possible call) is timed ``settings.repeats`` times, the candidates in turns, after one
    warmup run each, and the median chooses: on a noisy CPU one timing can be 40% off, and a choice
    made on it misleads the measurement that follows. Returns the choice and each candidate's
    median seconds.
    """
    if settings.max_rows is not None:
        return settings.max_rows, []
    candidates = [rows for rows in ROW_CANDIDATES if rows is None or smallest <= rows < total_rows]
    seconds = median_seconds({str(rows): lambda rows=rows: run(rows) for rows in candidates}, settings.repeats, 1)
    timings = [{"max_rows": rows, "seconds": seconds[str(rows)]} for rows in candidates]
    best = min(timings, key=lambda timing: timing["seconds"])
    return best["max_rows"], timings


def _throughput(tokens: int, seconds: float) -> float:
    return round(tokens / seconds, 1)


def _gflops(model: StackedExperts, tokens: int, seconds: Mapping[str, float]) -> dict[str, float]:
    """Achieved GFLOP/s of each timed side: `tokens` byte forwards of one expert each (an update's
    ± evaluations; its direction draws and SGD step are not counted as work)."""
    flops = tokens * forward_flops_per_token(model)
    return {name: round(flops / value / 1e9, 3) for name, value in seconds.items()}


def zo_record(width: int, settings: ZOBenchSettings) -> dict:
    """One expert of width d_t: batched SPSA updates vs inference and vs a naive MeZO loop.

    Inference runs the unperturbed model on the same windows repeated ``2 · n_pert`` times (the
    same token count as one update), under the same threads, dtype and time chunk, at its own
    fastest windows-per-call. The naive loop is timed on ``naive_directions`` directions and its
    time scaled linearly to n_pert (every direction costs the same two forwards; scaling its one
    optimizer step too overstates the naive time by a negligible few milliseconds). ``efficiency``: the
    median over turns of inference seconds / update seconds.
    """
    model, windows = build_model(1, width, settings), random_windows(1, settings)
    updater = Updater(model, windows, settings)
    total_rows = 2 * settings.n_pert * settings.micro_batch
    tokens = total_rows * settings.context
    repeated = windows.repeat(1, 2 * settings.n_pert, 1)
    max_rows, chunk_timings = choose_rows(updater.spsa, total_rows, 2 * settings.micro_batch, settings)
    inference_rows, _ = choose_rows(lambda rows: inference(model, repeated, rows), total_rows, 1, settings)
    timed = min(settings.n_pert, settings.naive_directions)
    turns = turn_seconds({
        "update": lambda: updater.spsa(max_rows),
        "inference": lambda: inference(model, repeated, inference_rows),
        "naive": lambda: updater.naive(timed),
    }, settings.repeats, settings.warmup)
    seconds = medians(turns)
    update, inferred = seconds["update"], seconds["inference"]
    naive = seconds["naive"] * settings.n_pert / timed
    efficiency, efficiency_turns = turn_ratios(turns["inference"], turns["update"])
    zo_speed, inference_speed = _throughput(tokens, update), _throughput(tokens, inferred)
    return {
        "record": "zo", "d_t": width, "experts": 1, "params": sum(p.numel() for p in model.parameters()),
        "n_pert": settings.n_pert, "micro_batch": settings.micro_batch, "context": settings.context,
        "max_rows": max_rows, "max_rows_timings": chunk_timings, "inference_max_rows": inference_rows,
        "token_forwards_per_update": tokens,
        "update_seconds": update, "inference_seconds": inferred, "naive_update_seconds": naive,
        "naive_directions_timed": timed,
        "zo_tokens_per_s": zo_speed, "inference_tokens_per_s": inference_speed,
        "efficiency": efficiency, "efficiency_turns": efficiency_turns, "naive_speedup": round(naive / update, 2),
        "gflops": _gflops(model, tokens, {"update": update, "inference": inferred, "naive": naive}),
    }


def soma_record(experts: int, width: int, settings: ZOBenchSettings) -> dict:
    """E experts of width d_t: one batched update of all of them vs E single-expert updates in turn.

    Both sides run the same SPSA update (n_pert, B, T) on the same windows, each at its own fastest
    windows-per-call; ``speedup``: the median over turns of sequential seconds / batched seconds.
    """
    windows = random_windows(experts, settings)
    batched = Updater(build_model(experts, width, settings), windows, settings)
    singles = [Updater(build_model(1, width, settings), windows[e : e + 1], settings)
               for e in range(experts)]
    rows_per_expert = 2 * settings.n_pert * settings.micro_batch
    pair_rows = 2 * settings.micro_batch
    max_rows, _ = choose_rows(batched.spsa, experts * rows_per_expert, experts * pair_rows, settings)
    single_rows, _ = choose_rows(singles[0].spsa, rows_per_expert, pair_rows, settings)

    def one_after_another() -> None:
        for single in singles:
            single.spsa(single_rows)

    turns = turn_seconds({"batched": lambda: batched.spsa(max_rows), "sequential": one_after_another},
                         settings.repeats, settings.warmup)
    seconds = medians(turns)
    together, sequential = seconds["batched"], seconds["sequential"]
    speedup, speedup_turns = turn_ratios(turns["sequential"], turns["batched"])
    tokens = experts * rows_per_expert * settings.context
    return {
        "record": "soma_batched_vs_sequential", "d_t": width, "experts": experts,
        "params": sum(p.numel() for p in batched.model.parameters()),
        "n_pert": settings.n_pert, "micro_batch": settings.micro_batch, "context": settings.context,
        "max_rows": max_rows, "sequential_max_rows": single_rows, "token_forwards_per_update": tokens,
        "batched_seconds": together, "sequential_seconds": sequential,
        "batched_tokens_per_s": _throughput(tokens, together),
        "sequential_tokens_per_s": _throughput(tokens, sequential),
        "speedup": speedup, "speedup_turns": speedup_turns,
        "gflops": _gflops(batched.model, tokens, {"batched": together, "sequential": sequential}),
    }


def eggroll_record(width: int, settings: ZOBenchSettings) -> dict:
    """One model of width d_t: EGGROLL updates vs inference of the unperturbed model on the same rows.

    Both sides evaluate ``2 · n_pert · B`` rows of T bytes (each window once per member that shares
    it), each at its own fastest rows per call; ``efficiency``: the median over turns of inference
    seconds / update seconds.
    The update includes regenerating the noise twice, shaping the fitness and the SGD step.
    """
    model, windows = build_model(1, width, settings), random_windows(1, settings)
    updater = Updater(model, windows, settings)
    group = 2 * settings.n_pert
    population = group * settings.micro_batch
    repeated = windows.repeat_interleave(group, dim=1)
    max_members, timings = choose_rows(updater.eggroll, population, 2, settings)
    inference_rows, _ = choose_rows(lambda rows: inference(model, repeated, rows), population, 1, settings)
    turns = turn_seconds({"update": lambda: updater.eggroll(max_members),
                          "inference": lambda: inference(model, repeated, inference_rows)},
                         settings.repeats, settings.warmup)
    seconds = medians(turns)
    update, inferred = seconds["update"], seconds["inference"]
    efficiency, efficiency_turns = turn_ratios(turns["inference"], turns["update"])
    tokens = population * settings.context
    eggroll_speed, inference_speed = _throughput(tokens, update), _throughput(tokens, inferred)
    return {
        "record": "eggroll", "d_t": width, "experts": 1, "params": sum(p.numel() for p in model.parameters()),
        "rank": settings.eggroll_rank, "population": population, "group_size": group,
        "windows": settings.micro_batch, "context": settings.context, "max_members": max_members,
        "max_members_timings": timings, "inference_max_rows": inference_rows, "token_forwards_per_update": tokens,
        "update_seconds": update, "inference_seconds": inferred,
        "eggroll_tokens_per_s": eggroll_speed, "inference_tokens_per_s": inference_speed,
        "efficiency": efficiency, "efficiency_turns": efficiency_turns,
        "gflops": _gflops(model, tokens, {"update": update, "inference": inferred}),
    }


def bench_zo(widths: Sequence[int] = (32, 181), settings: ZOBenchSettings = ZOBenchSettings(),
             soma_experts: int = 8, soma_width: int = 32, eggroll_widths: Sequence[int] = (),
             progress: bool = True) -> dict:
    """One ``zo`` record per width, then (unless ``soma_experts`` is 0) the SOMA record, then one
    ``eggroll`` record per width in ``eggroll_widths`` (`progress`: a bar on stderr).

    Returns ``{"benchmark": "zo", "machine": ..., "settings": ..., "results": [...]}``; the load
    average before and after shows whether other jobs shared the CPU.
    """
    load_before = os.getloadavg()
    peak = matmul_peak_gflops(settings.device)
    records = [(f"zo d_t={width}", lambda width=width: zo_record(width, settings)) for width in widths]
    if soma_experts:
        records.append((f"soma N={soma_experts}", lambda: soma_record(soma_experts, soma_width, settings)))
    records += [(f"eggroll d_t={width}", lambda width=width: eggroll_record(width, settings))
                for width in eggroll_widths]
    results = []
    with tqdm(records, desc="bench zo", unit="record", disable=not progress) as bar:
        for name, record in bar:
            bar.set_postfix_str(name)
            results.append(record())
    return {
        "benchmark": "zo",
        "machine": {"processor": platform.processor() or platform.machine(), "torch": torch.__version__,
                    "threads": torch.get_num_threads(), "load_average_before": load_before,
                    "peak_gflops": peak, "peak_gemm": f"torch.mm {PEAK_SIZE}x{PEAK_SIZE} float32",
                    "fma_peak_gflops_one_core": fma_peak_gflops() if settings.device == "cpu" else None,
                    "load_average_after": os.getloadavg()},
        "settings": asdict(settings),
        "results": results,
    }


def main(widths: tuple[int, ...] = (32, 181), settings: ZOBenchSettings = ZOBenchSettings(), soma_experts: int = 8,
         eggroll_widths: tuple[int, ...] | None = None, out: str = "bench_zo.json", progress: bool = True) -> None:
    """Zero-order update throughput: batched SPSA vs inference and a naive loop.

    Args:
        widths: body widths d_t, one `zo` record each.
        settings: what each record measures (its fields are top-level options: `--n_pert 64`).
        soma_experts: experts of the SOMA record; 0 skips it.
        eggroll_widths: body widths of the EGGROLL records; None: `widths`, [] skips them.
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    eggroll_widths = widths if eggroll_widths is None else eggroll_widths
    for name, values in (("widths", widths), ("eggroll_widths", eggroll_widths)):
        if any(value < 1 for value in values):
            raise ConfigError(f"bench zo: --{name}={list(values)}: every width must be >= 1")
    if soma_experts < 0:
        raise ConfigError(f"bench zo: --soma_experts={soma_experts} must be >= 0 (0 skips the SOMA record)")
    resolve_device(settings.device, "--device")
    emit_json(bench_zo(tuple(widths), settings, soma_experts=soma_experts, eggroll_widths=tuple(eggroll_widths),
                       progress=progress), out)
