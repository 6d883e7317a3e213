"""`shard`: cut a prepared dataset into 1,024-byte sequences, fit the router, and write N expert shard sets
(the first `keep_experts` of them where that is set).

```
<output_dir>/
  expert-000/train-<task>-000000.tar ... val-<task>-000000.tar   expert 0's sequences (train / expert validation)
  ...
  router.pt                                        tf–idf vocabulary and idf, SVD, mean, a unit centroid per expert
  experts.json                                     written last: shard records, sizes, contingency, agreement
```

The paper's recipe (§4, App. D): the prepared training and expert-validation documents, joined end
to end in corpus order, are cut into non-overlapping 1,024-byte sequences (each stored as a 1,025-byte
training window: the sequence and the byte after it, so every byte is a target once). Semantic
sharding fits word-level tf–idf (`tfidf_max_features`, sublinear tf, English stop words,
`tfidf_min_df`; bytes decoded as UTF-8 ignoring errors) → truncated SVD (`svd_dim`) → mean removed,
unit length → balanced k-means on a sample of `kmeans_sample` sequences; every sequence is assigned
on its whole 1,024 bytes (a sampled one keeps its balanced cluster, any other goes to its nearest
centroid). Clustering comes first; then each expert holds out the `expert_val_fraction` of its own
sequences of smallest key as its expert-validation split. Evaluation routes on the first 256 bytes
only (`Router`). Random sharding (the Fig. 9 ablation) deals sequences by a seeded hash. Ensemble-
validation and test documents never reach a shard: `prepare` held them out.

It runs as a datatrove pipeline (`soma_pl.data.sharding.steps`) on the executor of `shard.executor`,
local with all cores by default; any task count gives the same experts and splits. The finished folder
is renamed into place with experts.json last; experts.json records a fingerprint, so an identical
re-run is a no-op and a changed one rebuilds. experts.json also records the prepared dataset's
fingerprint, and router.pt the sharding's, so training and evaluation can refuse shards or a router
that belong to another dataset or sharding. Only a folder soma_pl wrote as a sharded dataset is
replaced, never an input or a folder holding one.
"""


from __future__ import annotations

import time
import warnings
from pathlib import Path

from soma_pl.data.formats.expert_sets import EXPERTS_MANIFEST, KIND, experts_fingerprint
from soma_pl.data.formats.manifest import open_prepared
from soma_pl.data.formats.tar_shards import ShardRecord, Verify, verify_shards
from soma_pl.data.preparation.prepare import prepare_recipe
from soma_pl.data.runner.pipeline import chain
from soma_pl.data.runner.staging import check_unchanged, remove_staging, run_build
from soma_pl.data.sharding.assign import SEQUENCE_BYTES
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.steps import (
    AssignSequences,
    CutSequences,
    FinishShard,
    FitRouter,
    PreparedShardsReader,
    WriteExperts,
)
from soma_pl.errors import DataError, SomaError
from soma_pl.io import check_output
from soma_pl.locks import build_lock


def shard(config: ShardConfig, progress: bool = True) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path.

    The build is a datatrove pipeline (`soma_pl.data.sharding.steps`) in a staging folder beside the
    output, run by `config.executor`: a killed run started again skips its finished tasks. With a
    Slurm or Ray executor the stages may still be running when this returns (the output then has
    no experts.json yet): run it again once they are done.

    Processes sharding into one folder at once take turns (`soma_pl.locks.build_lock`): the first
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
    paths = verify_shards(root, [ShardRecord(**r) for split in ("train", "expert_val")
                                 for r in manifest[split]["shards"]], Verify.sha256)
    if not run_build(config.executor, output, "shard", "shard.output_dir", fingerprint,
                     lambda stage: _stages(config, paths, stage, fingerprint, manifest, started, progress),
                     lambda: experts_fingerprint(output) == fingerprint):
        return output
    remove_staging(output, "shard")
    return output


def check_splits(manifest: dict, root: Path, experts: int) -> None:
    """Refuse a prepared dataset too small to give every expert two sequences, with one line.

    Raises:
        DataError: fewer than 2·N sequences' bytes in the training and expert-validation splits.
    """
    total = manifest["train"]["bytes"] + manifest["expert_val"]["bytes"]
    if total // SEQUENCE_BYTES < 2 * experts:
        raise DataError(f"shard.prepared={root} holds {total} training bytes, fewer than two "
                        f"{SEQUENCE_BYTES}-byte sequences for each of shard.num_experts={experts}: "
                        "a larger corpus or fewer experts")


def _stages(config: ShardConfig, paths: list[Path], stage: Path, fingerprint: str, manifest: dict,
            started: float, progress: bool = False) -> list[tuple[str, object]]:
    """The five executors, each depending on the one before: `(name, executor)`. `paths`: the
    prepared shard files, training then expert validation."""
    tasks = max(1, min(config.executor.task_count(), len(paths)))

    def reader(name: str) -> PreparedShardsReader:
        return PreparedShardsReader(paths, progress, name)

    pipelines = [("sequences", [reader("sequences"), CutSequences(config, stage, tasks)], tasks),
                 ("fit", [FitRouter(config, stage, tasks)], 1),
                 ("assign", [reader("assign"), AssignSequences(config, stage, tasks)], tasks),
                 ("write", [reader("write"), WriteExperts(config, stage, tasks)], tasks),
                 ("finish", [FinishShard(config, stage, tasks, fingerprint, manifest, started)], 1)]
    return chain(config.executor, pipelines, stage, "shard")
