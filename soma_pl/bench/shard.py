"""`bench shard`: `shard` throughput (MB/s of training text) and peak memory per task, at 1 and N
tasks, on a generated corpus in the FineWeb-Edu parquet schema.

The corpus (`bench prepare`'s generator) is prepared once, cut into `prepare_shard_mb`-sized
training shards (datatrove deals whole shards to `shard`'s tasks); then each measurement runs the
whole `shard` command (`python -m soma_pl.cli shard`, the paper's tf–idf router, N experts) in a
fresh process and times it from start to exit. Peak RSS and seconds are reported per task and
stage, as each task recorded them (`experts.json`). The sequences, assign and write stages are
parallel; the router's fit on the sample and the final merge run once whatever the task count.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

from soma_pl.bench.prepare import ROOT, run_prepare, scratch_folder, time_task_counts, timed, write_fineweb_corpus
from soma_pl.errors import ConfigError
from soma_pl.io import emit_json


def run_shard(prepared: Path, output: Path, tasks: int, experts: int, extra: tuple[str, ...] = ()) -> dict:
    """One whole `shard` command at `tasks` tasks: wall seconds and experts.json's figures."""
    command = [sys.executable, "-m", "soma_pl.cli", "shard", "--progress", "false",
               "--config", str(ROOT / "configs" / "shard" / "fineweb_n8.yaml"), f"--shard.prepared={prepared}",
               f"--shard.output_dir={output}", f"--shard.num_experts={experts}",
               f"--shard.executor.tasks={tasks}", *extra]
    seconds = timed(command, f"bench shard: shard failed at {tasks} tasks")
    manifest = json.loads((output / "experts.json").read_text())
    return {"tasks": tasks, "seconds": seconds, "in_process_seconds": manifest["shard_seconds"],
            "peak_rss_mib_per_task": manifest["peak_rss_mib"], "task_seconds": manifest["task_seconds"],
            "parallel_stage_seconds": round(sum(max(manifest["task_seconds"][stage])
                                                for stage in ("sequences", "assign", "write")), 3),
            "sequences": manifest["sequences"], "shard_sizes": manifest["shard_sizes"],
            "purity": manifest["purity"], "router_agreement": manifest["router_agreement"]}


def bench_shard(megabytes: float = 100.0, files: int = 8, tasks: tuple[int, ...] = (1, 2), experts: int = 8,
                prepare_shard_mb: float = 16.0, workdir: str | None = None, extra: tuple[str, ...] = (),
                rounds: int = 3, progress: bool = True, prepare_extra: tuple[str, ...] = ()) -> dict:
    """Generate and prepare the corpus, then time `shard` at each task count (`time_task_counts`).

    Returns:
        `corpus` (files, documents, text bytes), `prepared` (training documents, bytes and shards)
        and `time_task_counts`'s figures; every run's experts must agree (any task count gives the
        same sharding), which `same_experts` records.
    """
    with scratch_folder(workdir, "bench shard") as scratch:
        root = Path(scratch)
        corpus = write_fineweb_corpus(root / "corpus", int(megabytes * 1e6), files)
        prepared = root / "prepared"
        shard_bytes = f"--dataset.shard_max_bytes={int(prepare_shard_mb * 1e6)}"
        run_prepare(root / "corpus", prepared, max(tasks), (shard_bytes, *prepare_extra), "bench shard")
        manifest = json.loads((prepared / "manifest.json").read_text())
        train = {"documents": manifest["train"]["documents"], "bytes": manifest["train"]["bytes"],
                 "shards": len(manifest["train"]["shards"])}
        if train["shards"] < max(tasks):
            raise ConfigError(f"bench shard: {train['shards']} prepared shards cannot feed {max(tasks)} tasks; "
                              "lower --prepare_shard_mb")

        def measure(count: int, round_: int) -> dict:
            output = root / f"experts-{count}-{round_}"
            run = run_shard(prepared, output, count, experts, extra)
            shutil.rmtree(output)
            return run

        timing = time_task_counts(tasks, rounds, measure, train["bytes"], "bench shard", progress)
    sizes = {json.dumps(run["shard_sizes"]) for run in timing["runs"]}
    return {"bench": "shard", "corpus": corpus, "prepared": train, "experts": experts, "rounds": rounds,
            "same_experts": len(sizes) == 1, **timing}


def main(megabytes: float = 100.0, files: int = 8, tasks: tuple[int, ...] = (1, 2), experts: int = 8,
         prepare_shard_mb: float = 16.0, workdir: str | None = None, shard_args: tuple[str, ...] = (),
         prepare_args: tuple[str, ...] = (), rounds: int = 3, progress: bool = True,
         out: str = "bench_shard.json") -> None:
    """`shard` throughput and peak memory per task at 1 and N tasks, on a generated corpus.

    Args:
        megabytes: text in the generated corpus (MB), in the FineWeb-Edu parquet schema.
        files: parquet files of the corpus.
        tasks: task counts to time.
        experts: N, the experts (k-means clusters).
        prepare_shard_mb: size of the prepared training shards (MB); `shard` deals whole shards to tasks.
        workdir: where the scratch corpus goes; None: the system's temporary folder.
        shard_args: further `shard` arguments, e.g. `[--shard.kmeans_n_init=1]`.
        prepare_args: further `prepare` arguments, e.g. `[--dataset.test_windows=64]` for a small corpus.
        rounds: times each task count runs, taking turns.
        progress: show a progress bar.
        out: where to write the JSON.
    """
    if megabytes <= 0 or files < 1 or not tasks or min(tasks) < 1 or rounds < 1 or experts < 1 or prepare_shard_mb <= 0:
        raise ConfigError("bench shard: --megabytes and --prepare_shard_mb must be > 0, --files, --rounds, "
                          "--experts and every --tasks >= 1")
    emit_json(bench_shard(megabytes, files, tuple(tasks), experts, prepare_shard_mb, workdir, tuple(shard_args),
                          rounds, progress, tuple(prepare_args)), out)
