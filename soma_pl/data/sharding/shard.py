"""`shard`: split a prepared dataset's training documents into N expert shard sets and fit the router.

```
<output_dir>/
  expert-000/train-<task>-000000.tar ... val-<task>-000000.tar   expert 0's documents (train / expert validation)
  ...
  router.pt                                        encoder of the first 256 bytes + N centroids
  experts.json                                     written last: shard records, sizes, contingency
```

Semantic sharding (the paper's) embeds each training document's first 256 bytes (the routed prefix)
and clusters the embeddings with mini-batch k-means, fitted on a bounded sample of documents (all of
them up to `kmeans_sample`); random sharding (the Fig. 9 ablation) deals the documents to experts
in the order of a seeded hash. Every side of a comparison trains on the same documents: each
document of the prepared `train` split goes to exactly one expert's training shards, and each of the
prepared `expert_val` split (the monolithic model's decay split) to the expert-validation shards of
the expert the same rule picks for it (its nearest fitted centroid, or the same seeded deal), so
`shard` holds out nothing of its own. The k-means fit, the hashed encoder's centre and the router's
centroids see only training documents; ensemble-validation and test documents never reach a shard.
It runs as a datatrove pipeline (`soma_pl.data.sharding.steps`: embed, fit, write,
finish) on the executor of `shard.executor`, local with all cores by default; per-task memory is
bounded whatever the corpus size, and any task count gives the same experts and splits. The
finished folder is renamed into place with experts.json last; experts.json records a fingerprint,
so an identical re-run is a no-op and a changed one rebuilds. experts.json also records the
prepared dataset's fingerprint, and router.pt the sharding's, so training and evaluation can refuse
shards or a router that belong to another dataset or sharding. Only a folder soma_pl wrote as a
sharded dataset is replaced, never an input or a folder holding one.
"""


from __future__ import annotations

import os
import time
import warnings
from pathlib import Path

from soma_pl.data.formats.expert_sets import EXPERTS_MANIFEST, KIND, experts_fingerprint
from soma_pl.data.formats.manifest import open_prepared
from soma_pl.data.formats.tar_shards import ShardRecord, Verify, verify_shards
from soma_pl.data.preparation.prepare import prepare_recipe
from soma_pl.data.runner.pipeline import ExecutorKind, chain
from soma_pl.data.runner.staging import check_unchanged, remove_staging, run_build
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.steps import EmbedDocuments, FinishShard, FitExperts, PreparedShardsReader, WriteExperts
from soma_pl.errors import DataError, SomaError
from soma_pl.io import build_lock, check_output


def shard(config: ShardConfig, progress: bool = True) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path.

    The build is a datatrove pipeline (`soma_pl.data.sharding.steps`) in a staging folder beside the
    output, run by `config.executor`: a killed run started again skips its finished tasks. With a
    Slurm or Ray executor the stages may still be running when this returns (the output then has
    no experts.json yet): run it again once they are done.

    Processes sharding into one folder at once take turns (`soma_pl.io.build_lock`): the first
    builds, the others then find it up to date.

    Raises:
        ConfigError: while this one waited for its turn, another process built a different sharding
            in the folder (`check_unchanged`).
    """
    config.validate()
    output = Path(config.output_dir).expanduser()
    if _up_to_date(config, output):  # no build, so no lock
        remove_staging(output, "shard")
        return output
    before = experts_fingerprint(output)
    with build_lock(output, "shard.output_dir"):  # checked again inside: another process may have built it
        return _build_shards(config, progress, output, before)


def _up_to_date(config: ShardConfig, output: Path) -> bool:
    """Whether `output` holds this config's experts already (False when in any doubt)."""
    if not (output / EXPERTS_MANIFEST).is_file():
        return False
    try:
        manifest = open_prepared(Path(config.prepared).expanduser(), "shard.prepared")
    except SomaError:
        return False
    return experts_fingerprint(output) == config.fingerprint(manifest)


def _build_shards(config: ShardConfig, progress: bool, output: Path, before: str | None) -> Path:
    """`shard` holding the folder; `before`: the fingerprint of what it held before the turn came."""
    started = time.time()
    check_output(output, KIND, "shard.output_dir", config.inputs())  # before hours of work
    root = Path(config.prepared).expanduser()
    if config.recipe is not None:
        prepare_recipe(config.recipe, root, "shard.prepared", progress=progress)
    manifest = open_prepared(root, "shard.prepared")
    check_splits(manifest, root, config.num_experts)
    fingerprint = config.fingerprint(manifest)
    if (output / EXPERTS_MANIFEST).is_file():
        existing = experts_fingerprint(output)
        if existing == fingerprint:
            remove_staging(output, "shard")
            return output
        check_unchanged(output, "shard.output_dir", before, existing, fingerprint)
        warnings.warn(f"{output}: sharded with another config or dataset; rebuilding", stacklevel=2)
    paths = {split: verify_shards(root, [ShardRecord(**r) for r in manifest[split]["shards"]], Verify.sha256)
             for split in ("train", "expert_val")}
    if not run_build(config.executor, output, "shard", "shard.output_dir", fingerprint,
                     lambda stage: _stages(config, paths, stage, fingerprint, manifest, started, progress),
                     lambda: experts_fingerprint(output) == fingerprint):
        return output
    remove_staging(output, "shard")
    return output


def check_splits(manifest: dict, root: Path, experts: int) -> None:
    """Refuse a prepared dataset whose splits cannot give every expert training and
    expert-validation documents, with one line naming what to do.

    Raises:
        DataError: no `expert_val` split (an older `prepare`), or fewer training or
            expert-validation documents than experts.
    """
    if "expert_val" not in manifest:
        raise DataError(f"shard.prepared={root} has no expert-validation split (prepared by an older soma_pl): "
                        "run prepare again")
    for split, name, fix in (("train", "training", "a larger corpus or fewer experts"),
                             ("expert_val", "expert-validation", "a larger dataset.expert_val_fraction")):
        documents = manifest[split].get("documents", 0)
        if documents < experts:
            raise DataError(f"shard.prepared={root} holds {documents} {name} documents, fewer than "
                            f"shard.num_experts={experts} (each expert needs one): prepare again with {fix}")


def _stages(config: ShardConfig, paths: dict[str, list[Path]], stage: Path, fingerprint: str, manifest: dict,
            started: float, progress: bool = False) -> list[tuple[str, object]]:
    """The four executors, each depending on the one before: `(name, executor)`. `paths`: the
    prepared `train` and `expert_val` shard files."""
    files = len(paths["train"]) + len(paths["expert_val"])
    tasks = max(1, min(config.executor.task_count(), files))  # whole shards are dealt out
    # The tasks run torch (the encoder), so local workers start from a fresh server process
    # (`default_start_method`: this process has imported torch) unless the config says otherwise.
    executor = config.executor
    threads = None
    if ExecutorKind(executor.kind) is ExecutorKind.local:  # the tasks running at once share this machine's cores
        threads = max(1, (os.cpu_count() or 1) // min(tasks, executor.workers or tasks))

    def reader(name: str) -> PreparedShardsReader:
        return PreparedShardsReader(paths["train"], progress, name, paths["expert_val"])

    pipelines = [("embed", [reader("embed"), EmbedDocuments(config, stage, threads)], tasks),
                 ("fit", [FitExperts(config, stage, tasks)], 1),
                 ("write", [reader("write"), WriteExperts(config, stage, threads)], tasks),
                 ("finish", [FinishShard(config, stage, tasks, fingerprint, manifest, started)], 1)]
    return chain(executor, pipelines, stage, "shard")
