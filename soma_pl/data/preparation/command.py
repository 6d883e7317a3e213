"""The `prepare` command: build a prepared dataset folder, then print a JSON summary of it.

It imports no torch (nor `shard`, which does): a `prepare` process and its forked tasks start in
about half a second. `shard`'s command is `soma_pl.data.sharding.command.shard_dataset`.
"""

from __future__ import annotations

import json

from soma_pl.data.formats.manifest import MANIFEST, read_manifest
from soma_pl.data.preparation.config import PrepareConfig


def prepare_dataset(dataset: PrepareConfig = PrepareConfig(), progress: bool = True) -> None:
    """Build a prepared dataset folder (shards, evaluation sets, manifest).

    Args:
        dataset: what to build and where (the `dataset:` section of `configs/data/<name>.yaml`).
        progress: show progress bars.
    """
    from soma_pl.data.preparation.prepare import prepare  # datatrove: only when it runs

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
