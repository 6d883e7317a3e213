"""`bench data`: training-stream throughput from prepared shards, in windows/s and MB/s.

A prepared dataset already at `dataset.output_dir` is read as it is, never rebuilt: a user pointing
the bench at a dataset wants that dataset's reading speed, and a rebuild would replace data that
runs and checkpoints may depend on (settings that differ from the folder's get a warning). Only a
folder that does not exist yet is prepared first.
"""

from __future__ import annotations

import itertools
import platform
import time
import warnings
from contextlib import suppress
from pathlib import Path

import torch

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.readers import corpus_inputs
from soma_pl.data.formats.manifest import MANIFEST, existing_fingerprint
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import SomaError
from soma_pl.io import check_apart, emit_json


def bench_data(dataset: PrepareConfig, batch_size: int = 64, batches: int = 200, warmup: int = 10,
               workers: tuple[int, ...] = (0, 2), experts_dir: str | None = None) -> dict:
    """Time `batches` training batches per worker count, after `warmup` batches (buffers filled).

    Returns a dict with one record per worker count under `results`.
    """
    results, source = [], data_source(dataset)
    for num_workers in workers:
        module = ByteDataModule(**source, experts_dir=experts_dir, batch_size=batch_size, num_workers=num_workers)
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


def data_source(dataset: PrepareConfig) -> dict:
    """`ByteDataModule` arguments: the prepared dataset at `dataset.output_dir` read as it is, or
    (none there yet) `dataset` to prepare."""
    folder = Path(dataset.output_dir).expanduser()
    if not (folder / MANIFEST).exists():
        return {"dataset": dataset}
    with suppress(SomaError):  # an unreadable corpus only means no comparison: the folder is read as it is
        if existing_fingerprint(folder) != dataset.fingerprint():
            warnings.warn(f"dataset.output_dir={folder} was prepared with other settings or another corpus than "
                          "given: benchmarked as it is (a bench never rebuilds a dataset)", stacklevel=3)
    return {"prepared": str(folder), "auto_prepare": False}


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
    check_apart(out, "--out", [dataset.output_dir, experts_dir, *corpus_inputs(dataset.corpus)])
    emit_json(bench_data(dataset, batch_size, batches, workers=tuple(workers), experts_dir=experts_dir), out)
