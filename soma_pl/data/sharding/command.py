"""The `shard` command: build a sharded dataset folder, then print a JSON summary of it."""

from __future__ import annotations

import json

from soma_pl.data.formats.expert_sets import EXPERTS_MANIFEST, read_experts_manifest
from soma_pl.data.sharding.config import ShardConfig

SHARD_SUMMARY = ("num_experts", "sequences", "train", "expert_val", "kmeans_sample", "vocabulary", "shard_sizes",
                 "contingency", "purity", "router_agreement", "tasks", "shard_seconds")
"""`experts.json` entries that `shard` prints as they are: `sequences` is every 1,024-byte sequence
written (those of the kept experts under `keep_experts`; `kept_from` then gives N and every sequence
cut), `train` and `expert_val` its two parts (sequences and bytes); `shard_sizes` counts each expert's
sequences; `contingency` and `purity` are over training sequences by the source of their first byte;
`router_agreement` is the share of sequences whose nearest centroid of the saved router is their
expert, reading the whole sequence and reading its first 256 bytes (what evaluation routes on)."""


def shard_dataset(shard: ShardConfig = ShardConfig(), progress: bool = True) -> None:
    """Split a prepared dataset into N expert shard sets and fit the router.

    Args:
        shard: what to split, how and where (the `shard:` section of `configs/shard/<name>.yaml`).
        progress: show progress bars.
    """
    # torch and datatrove only when it runs; `shard_dataset`'s argument `shard` hides the name
    from soma_pl.data.sharding.shard import shard as run_shard

    output = run_shard(shard, progress=progress)
    if not (output / EXPERTS_MANIFEST).is_file():  # a Slurm or Ray executor: its jobs are still running
        print(json.dumps({"output_dir": str(output), "submitted": True,
                          "note": "run the same command again once the jobs are done"}, indent=2))
        return
    manifest = read_experts_manifest(output)
    summary = {"output_dir": str(output), "router": str(output / manifest["router"]),
               "sharding": manifest["config"]["sharding"],
               **{key: manifest[key] for key in SHARD_SUMMARY},
               **{f"{name}_{key}": [e[split][key] for e in manifest["expert_sizes"]]
                  for name, split in (("train", "train"), ("expert_val", "val")) for key in ("sequences", "bytes")}}
    print(json.dumps(summary, indent=2))
