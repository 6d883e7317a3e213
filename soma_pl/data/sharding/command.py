"""The `shard` command: build a sharded dataset folder, then print a JSON summary of it."""

from __future__ import annotations

import json

from soma_pl.data.formats.expert_sets import EXPERTS_MANIFEST, read_experts_manifest
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard as run_shard  # `shard_dataset`'s argument `shard` hides the name

SHARD_SUMMARY = ("num_experts", "documents", "train", "expert_val", "kmeans_sample", "shard_sizes",
                 "rebalanced_documents", "rebalanced_expert_val_documents", "contingency", "purity",
                 "router_agreement", "tasks", "shard_seconds")
"""`experts.json` entries that `shard` prints as they are: `train` and `expert_val` are the documents
and bytes of the prepared splits, all of them placed; `documents`, `shard_sizes`, `contingency`,
`purity` and `router_agreement` are over the training documents."""


def shard_dataset(shard: ShardConfig = ShardConfig(), progress: bool = True) -> None:
    """Split a prepared dataset into N expert shard sets and fit the router.

    Args:
        shard: what to split, how and where (the `shard:` section of `configs/shard/<name>.yaml`).
        progress: show progress bars.
    """
    output = run_shard(shard, progress=progress)
    if not (output / EXPERTS_MANIFEST).is_file():  # a Slurm or Ray executor: its jobs are still running
        print(json.dumps({"output_dir": str(output), "submitted": True,
                          "note": "run the same command again once the jobs are done"}, indent=2))
        return
    manifest = read_experts_manifest(output)
    summary = {"output_dir": str(output), "router": str(output / manifest["router"]),
               "embedder": manifest["config"]["embedder"], "sharding": manifest["config"]["sharding"],
               **{key: manifest[key] for key in SHARD_SUMMARY},
               **{f"{name}_{key}": [e[split][key] for e in manifest["expert_sizes"]]
                  for name, split in (("train", "train"), ("expert_val", "val")) for key in ("documents", "bytes")}}
    print(json.dumps(summary, indent=2))
