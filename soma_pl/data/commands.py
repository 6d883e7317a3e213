"""The `prepare` and `shard` commands: build a dataset folder, then print a JSON summary of it."""

from __future__ import annotations

import json

from soma_pl.data import sharding
from soma_pl.data.prepare import MANIFEST, PrepareConfig, prepare, read_manifest
from soma_pl.data.sharding import ShardConfig, read_shard_manifest

SHARD_SUMMARY = ("num_experts", "documents", "kmeans_sample", "shard_sizes", "rebalanced_documents", "contingency",
                 "purity", "router_agreement", "tasks", "shard_seconds")
"""`experts.json` entries that `shard` prints as they are."""


def prepare_dataset(dataset: PrepareConfig = PrepareConfig(), progress: bool = True) -> None:
    """Build a prepared dataset folder (shards, evaluation sets, manifest).

    Args:
        dataset: what to build and where (the `dataset:` section of `configs/data/<name>.yaml`).
        progress: show progress bars.
    """
    output = prepare(dataset, progress=progress)
    if not (output / MANIFEST).is_file():  # a Slurm or Ray executor: its jobs are still running
        print(json.dumps({"output_dir": str(output), "submitted": True,
                          "note": "run the same command again once the jobs are done"}, indent=2))
        return
    manifest = read_manifest(output)
    summary = {
        "output_dir": str(output),
        "train_documents": manifest["train"]["documents"],
        "train_bytes": manifest["train"]["bytes"],
        "shards": len(manifest["train"]["shards"]),
        "ensemble_val_windows": manifest["ensemble_val"]["windows"],
        "test_windows": manifest["test"]["windows"],
        "test_excluded": manifest["test"]["excluded"],
        "tasks": manifest["tasks"],
        "prepare_seconds": manifest["prepare_seconds"],
    }
    print(json.dumps(summary, indent=2))


def shard_dataset(shard: ShardConfig = ShardConfig(), progress: bool = True) -> None:
    """Split a prepared dataset into N expert shard sets and fit the router.

    Args:
        shard: what to split, how and where (the `shard:` section of `configs/shard/<name>.yaml`).
        progress: show progress bars.
    """
    output = sharding.shard(shard, progress=progress)  # `shard`, the argument, hides the function
    manifest = read_shard_manifest(output)
    summary = {"output_dir": str(output), "router": str(output / manifest["router"]),
               "embedder": manifest["config"]["embedder"], "sharding": manifest["config"]["sharding"],
               **{key: manifest[key] for key in SHARD_SUMMARY},
               "train_documents": [e["train"]["documents"] for e in manifest["expert_sizes"]],
               "val_documents": [e["val"]["documents"] for e in manifest["expert_sizes"]]}
    print(json.dumps(summary, indent=2))
