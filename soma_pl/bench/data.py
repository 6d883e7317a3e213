"""`bench data`: training-stream throughput from prepared shards, in windows/s and MB/s."""

from __future__ import annotations

import itertools
import platform
import time

import torch

from soma_pl import WINDOW_BYTES
from soma_pl.data.datamodule import ByteDataModule
from soma_pl.data.prepare import PrepareConfig
from soma_pl.io import emit_json


def bench_data(dataset: PrepareConfig, batch_size: int = 64, batches: int = 200, warmup: int = 10,
               workers: tuple[int, ...] = (0, 2), experts_dir: str | None = None) -> dict:
    """Time `batches` training batches per worker count, after `warmup` batches (buffers filled).

    Returns a dict with one record per worker count under `results`.
    """
    results = []
    for num_workers in workers:
        module = ByteDataModule(dataset, experts_dir=experts_dir, batch_size=batch_size, num_workers=num_workers)
        module.prepare_data()
        module.setup("fit")
        loader = module.train_dataloader()
        iterator = iter(loader)
        for _ in range(warmup):
            next(iterator)
        started = time.perf_counter()
        rows = sum(batch.shape[0] * batch.shape[1] for batch in itertools.islice(iterator, batches))
        seconds = time.perf_counter() - started
        del iterator
        results.append({
            "num_workers": num_workers,
            "experts": module.num_experts,
            "batch_size": batch_size,
            "batches": batches,
            "seconds": round(seconds, 4),
            "windows_per_s": round(rows / seconds, 1),
            "mb_per_s": round(rows * WINDOW_BYTES / seconds / 1e6, 3),
        })
    return {
        "benchmark": "data",
        "dataset": dataset.output_dir,
        "machine": {"processor": platform.processor() or platform.machine(), "threads": torch.get_num_threads()},
        "results": results,
    }


def main(dataset: PrepareConfig = PrepareConfig(), experts_dir: str | None = None, batch_size: int = 64,
         batches: int = 200, workers: tuple[int, ...] = (0, 2), out: str = "bench_data.json") -> None:
    """Training-stream throughput from shards (windows/s, MB/s).

    Args:
        dataset: the prepared dataset (the `dataset:` section of `configs/data/<name>.yaml`).
        experts_dir: a sharded dataset folder; None: the prepared dataset's own shards.
        batch_size: windows per batch.
        batches: timed batches per worker count.
        workers: DataLoader worker counts to time.
        out: where to write the JSON.
    """
    emit_json(bench_data(dataset, batch_size, batches, workers=tuple(workers), experts_dir=experts_dir), out)
