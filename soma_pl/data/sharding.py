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
It runs as a datatrove pipeline (`soma_pl.data.shard_steps`: embed, fit, write,
finish) on the executor of `shard.executor`, local with all cores by default; per-task memory is
bounded whatever the corpus size, and any task count gives the same experts and splits. The
finished folder is renamed into place with experts.json last; experts.json records a fingerprint,
so an identical re-run is a no-op and a changed one rebuilds. experts.json also records the
prepared dataset's fingerprint, and router.pt the sharding's, so training and evaluation can refuse
shards or a router that belong to another dataset or sharding. Only a folder soma_pl wrote as a
sharded dataset is replaced, never an input or a folder holding one.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import warnings
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import torch

from soma_pl.data.expert_sets import EXPERTS_MANIFEST, read_experts_manifest
from soma_pl.data.pipeline import ExecutorConfig, ExecutorKind, chain
from soma_pl.data.prepare import MANIFEST, open_prepared, prepare_recipe, read_manifest
from soma_pl.data.staging import build_lock, remove_staging, run_build
from soma_pl.data.tar_shards import ShardRecord, Verify, sha256_file, verify_shards
from soma_pl.errors import ConfigError, DataError, SomaError
from soma_pl.io import check_output
from soma_pl.models.devices import resolve_device
from soma_pl.models.router import EncoderKind, HashedNgramEncoder, SeedEncoder

ROUTER_FILE = "router.pt"
FORMAT_VERSION = 2
KIND = "sharded dataset"
"""What the output folder's marker calls it (`soma_pl.io.OUTPUT_MARKER`)."""


class Sharding(str, Enum):
    """How documents are assigned to experts."""

    semantic = "semantic"
    """Mini-batch k-means on the embeddings of the first 256 bytes (the paper)."""
    random = "random"
    """Dealt round-robin in the order of a seeded hash of the document id (Fig. 9 ablation)."""


@dataclass
class ShardConfig:
    """What `shard` builds, from which prepared dataset, and where.

    Attributes:
        prepared: the prepared dataset folder whose training and expert-validation splits are cut
            between the experts; everything else about it is read from its manifest.
        recipe: a data config (`configs/data/<name>.yaml`) that builds `prepared` first when it is
            missing or was built from another corpus or config. None: `prepared` must exist.
        num_experts: N, the number of experts (and of clusters).
        output_dir: the sharded dataset folder (what `ByteDataModule(experts_dir=...)` reads).
        embedder: how the first 256 bytes are embedded: `seed` (the seed model's mean final
            features, the paper's) or `hashed` (hashed byte n-gram counts, needs no model).
        seed_checkpoint: Lightning checkpoint of the monolithic seed model; required by `seed`.
        sharding: `semantic` (k-means clusters) or `random` (seeded deal, the Fig. 9 ablation).
        seed: seeds k-means, the random deal, the k-means sample and the hashed encoder.
        kmeans_batch_size: documents per mini-batch of k-means.
        kmeans_n_init: k-means restarts; the one of least inertia is kept.
        min_expert_fraction: after k-means, an expert holding fewer than this fraction of the
            average documents per expert takes the documents nearest to its centroid from experts
            that hold more; likewise for the expert-validation documents (at least one each).
        shard_max_bytes: an expert's tar shard is cut once it reaches this size.
        hashed_dim: buckets of the hashed encoder.
        hashed_orders: byte n-gram lengths counted by the hashed encoder.
        hashed_center: remove the corpus's mean hashed encoding before clustering (and routing).
        embed_batch_size: documents embedded at once.
        device: where the embedder runs (`cpu`, `cuda`, ...).
        kmeans_sample: documents k-means is fitted on, the smallest seeded sample keys (bounded
            memory whatever the corpus size); the others go to their nearest fitted centroid.
        executor: how the datatrove pipeline runs (local tasks x workers, Slurm, Ray); it does not
            change which document goes to which expert, so it is not part of the fingerprint.
    """

    prepared: str = "data/demo"
    recipe: str | None = None
    num_experts: int = 3
    output_dir: str = "data/demo-experts"
    embedder: EncoderKind = EncoderKind.hashed
    seed_checkpoint: str | None = None
    sharding: Sharding = Sharding.semantic
    seed: int = 0
    kmeans_batch_size: int = 1024
    kmeans_n_init: int = 10
    min_expert_fraction: float = 0.25
    shard_max_bytes: int = 64_000_000
    hashed_dim: int = 256
    hashed_orders: list[int] = field(default_factory=lambda: [1, 2, 3])
    hashed_center: bool = True
    embed_batch_size: int = 64
    device: str = "cpu"
    kmeans_sample: int = 1_000_000
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    def validate(self) -> None:
        """Raises ConfigError naming the first setting that cannot work."""
        checks = [
            (self.num_experts >= 1, f"shard.num_experts={self.num_experts} must be >= 1"),
            (0 <= self.min_expert_fraction <= 1,
             f"shard.min_expert_fraction={self.min_expert_fraction} must be in [0, 1]"),
            (min(self.kmeans_batch_size, self.kmeans_n_init, self.embed_batch_size) >= 1,
             "shard.kmeans_batch_size, kmeans_n_init and embed_batch_size must be >= 1"),
            (self.shard_max_bytes >= 1, f"shard.shard_max_bytes={self.shard_max_bytes} must be >= 1"),
            (self.kmeans_sample >= 2 * self.num_experts,
             f"shard.kmeans_sample={self.kmeans_sample} must be >= 2 x num_experts"),
            (EncoderKind(self.embedder) is not EncoderKind.seed or bool(self.seed_checkpoint),
             "shard.embedder=seed needs shard.seed_checkpoint (the seed model's Lightning checkpoint)"),
            (Path(self.output_dir).expanduser().resolve() != Path(self.prepared).expanduser().resolve(),
             f"shard.output_dir={self.output_dir} must differ from the prepared dataset folder"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        resolve_device(self.device, "shard.device")
        self.executor.validate("shard")

    def inputs(self) -> list[str]:
        """What a sharding reads: the prepared dataset, its corpus, the seed checkpoint."""
        seed = [self.seed_checkpoint] if EncoderKind(self.embedder) is EncoderKind.seed else []
        corpus = []
        if (Path(self.prepared).expanduser() / MANIFEST).is_file():
            with suppress(DataError, KeyError, TypeError):  # unreadable: refused where the dataset is opened
                corpus = list(read_manifest(Path(self.prepared).expanduser())["config"]["corpus"]["paths"])
        return [self.prepared, *corpus, *seed]

    def fingerprint(self, manifest: dict) -> str:
        """Hash of everything the output depends on: settings, the prepared training and
        expert-validation shards, the seed model, the format."""
        settings = asdict(self)
        for key in ("output_dir", "prepared", "recipe", "executor"):
            settings.pop(key)
        checkpoint = None
        if EncoderKind(self.embedder) is EncoderKind.seed:
            path = Path(self.seed_checkpoint).expanduser()
            if not path.is_file():
                raise DataError(f"seed checkpoint not found: {path}")
            checkpoint = sha256_file(path)
        identity = {"settings": settings, "dataset": manifest.get("fingerprint"),
                    "shards": {split: [s["sha256"] for s in manifest[split]["shards"]]
                               for split in ("train", "expert_val")},
                    "seed_checkpoint": checkpoint, "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


def shard(config: ShardConfig, progress: bool = True) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path.

    The build is a datatrove pipeline (`soma_pl.data.shard_steps`) in a staging folder beside the
    output, run by `config.executor`: a killed run started again skips its finished tasks. With a
    Slurm or Ray executor the stages may still be running when this returns (the output then has
    no experts.json yet): run it again once they are done.
    """
    config.validate()
    output = Path(config.output_dir).expanduser()
    if _up_to_date(config, output):  # no build, so no lock
        remove_staging(output, "shard")
        return output
    with build_lock(output, "shard"):  # checked again inside: another process may have built it
        return _build_shards(config, progress, output)


def _up_to_date(config: ShardConfig, output: Path) -> bool:
    """Whether `output` holds this config's experts already (False when in any doubt)."""
    if not (output / EXPERTS_MANIFEST).is_file():
        return False
    try:
        manifest = open_prepared(Path(config.prepared).expanduser(), "shard.prepared")
    except SomaError:
        return False
    return _read_fingerprint(output) == config.fingerprint(manifest)


def _build_shards(config: ShardConfig, progress: bool, output: Path) -> Path:
    """`shard` under the folder's build lock."""
    started = time.time()
    check_output(output, KIND, "shard.output_dir", config.inputs())  # before hours of work
    root = Path(config.prepared).expanduser()
    if config.recipe is not None:
        prepare_recipe(config.recipe, root, "shard.prepared", progress=progress)
    manifest = open_prepared(root, "shard.prepared")
    check_splits(manifest, root, config.num_experts)
    fingerprint = config.fingerprint(manifest)
    if (output / EXPERTS_MANIFEST).is_file():
        if _read_fingerprint(output) == fingerprint:
            remove_staging(output, "shard")
            return output
        warnings.warn(f"{output}: sharded with another config or dataset; rebuilding", stacklevel=2)
    paths = {split: verify_shards(root, [ShardRecord(**r) for r in manifest[split]["shards"]], Verify.sha256)
             for split in ("train", "expert_val")}
    if not run_build(config.executor, output, "shard", "shard.output_dir", fingerprint,
                     lambda stage: _stages(config, paths, stage, fingerprint, manifest, started, progress),
                     lambda: _read_fingerprint(output) == fingerprint):
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
    from soma_pl.data.shard_steps import EmbedDocuments, FinishShard, FitExperts, PreparedShardsReader, WriteExperts

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


read_shard_manifest = read_experts_manifest  # the name cli.py and the notebooks use


def make_encoder(config: ShardConfig) -> torch.nn.Module:
    """The configured embedder of the first 256 bytes, on `config.device`."""
    if EncoderKind(config.embedder) is EncoderKind.seed:
        return SeedEncoder.from_checkpoint(config.seed_checkpoint).to(config.device)
    return HashedNgramEncoder(config.hashed_dim, tuple(config.hashed_orders), config.seed).to(config.device)


def assign_labels(config: ShardConfig, embeddings: np.ndarray, deal_keys: np.ndarray) -> tuple[np.ndarray, int]:
    """Each document's expert `[n]` int64, and how many documents rebalancing moved: k-means on
    the (centred) `embeddings`, or for random sharding a deal in the order of the `deal_keys`."""
    experts, count = config.num_experts, len(embeddings)
    if Sharding(config.sharding) is Sharding.random:
        return deal(deal_keys, experts), 0
    from sklearn.cluster import MiniBatchKMeans

    kmeans = MiniBatchKMeans(n_clusters=experts, random_state=config.seed, n_init=config.kmeans_n_init,
                             batch_size=config.kmeans_batch_size)
    labels = kmeans.fit_predict(embeddings).astype(np.int64)
    minimum = max(1, int(config.min_expert_fraction * count / experts))
    return rebalance(labels, kmeans.transform(embeddings), minimum)


def assign_expert_val(config: ShardConfig, embeddings: np.ndarray, deal_keys: np.ndarray,
                      centroids: np.ndarray) -> tuple[np.ndarray, int]:
    """Each expert-validation document's expert `[n]` int64, and how many rebalancing moved.

    The rule that placed the training documents, with the fitted `centroids` `[N, D]` in place of
    a new k-means fit: each document goes to its nearest centroid, then an expert holding fewer
    than `min_expert_fraction` of the average, and at least one, takes the documents nearest its
    centroid from experts that hold more (`rebalance`), so no expert is left without a decay
    signal; for random sharding the same seeded deal in the order of the `deal_keys`. Needs at
    least N documents (`check_splits`).

    Args:
        embeddings: `[n, D]` the documents' centred encodings.
        deal_keys: `[n]` uint64 their seeded deal keys.
        centroids: `[N, D]` the fitted centroids (each expert's mean over its training sample).
    """
    experts, count = config.num_experts, len(embeddings)
    if Sharding(config.sharding) is Sharding.random:
        return deal(deal_keys, experts), 0
    distances = centroid_distances(embeddings, centroids)
    minimum = max(1, int(config.min_expert_fraction * count / experts))
    return rebalance(distances.argmin(axis=1).astype(np.int64), distances, minimum)


def deal(deal_keys: np.ndarray, experts: int) -> np.ndarray:
    """Random sharding: documents dealt to experts round-robin in the order of their seeded deal
    keys `[n]`, so the experts' counts differ by at most one. `[n]` int64."""
    labels = np.empty(len(deal_keys), dtype=np.int64)
    labels[np.argsort(deal_keys, kind="stable")] = np.arange(len(deal_keys)) % experts
    return labels


def centroid_distances(embeddings: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """`[n, N]` squared Euclidean distance of each embedding `[n, D]` to each centroid `[N, D]`."""
    embeddings = np.asarray(embeddings, dtype=np.float64)
    return ((embeddings ** 2).sum(1)[:, None] + (centroids.astype(np.float64) ** 2).sum(1)[None]
            - 2 * embeddings @ centroids.T.astype(np.float64))


def rebalance(labels: np.ndarray, distances: np.ndarray, minimum: int) -> tuple[np.ndarray, int]:
    """Give every expert at least `minimum` documents.

    An expert below it takes, nearest to its centroid first, documents from experts holding more
    than `minimum`, so no donor falls below it (feasible whenever `minimum · N ≤ n`).

    Args:
        labels: `[n]` expert of each document.
        distances: `[n, N]` distance of each document to each centroid.
        minimum: least documents per expert.

    Returns:
        the new labels `[n]` and the number of documents moved.
    """
    labels = labels.copy()
    counts = np.bincount(labels, minlength=distances.shape[1])
    moved = 0
    for expert in range(distances.shape[1]):
        for document in np.argsort(distances[:, expert], kind="stable"):
            if counts[expert] >= minimum:
                break
            donor = labels[document]
            if donor != expert and counts[donor] > minimum:
                labels[document] = expert
                counts[donor] -= 1
                counts[expert] += 1
                moved += 1
    return labels, moved


def expert_centroids(embeddings: np.ndarray, labels: np.ndarray, experts: int) -> np.ndarray:
    """Mean embedding of each expert's documents: `[N, D]` float32 (the router's centroids)."""
    sums = np.zeros((experts, embeddings.shape[1]), dtype=np.float64)
    np.add.at(sums, labels, embeddings)
    counts = np.bincount(labels, minlength=experts)[:, None]
    return (sums / np.maximum(counts, 1)).astype(np.float32)


def _read_fingerprint(folder: Path) -> str | None:
    try:
        return read_shard_manifest(folder).get("fingerprint")
    except DataError:
        return None


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
    output = _shard(shard, progress=progress)
    manifest = read_shard_manifest(output)
    summary = {"output_dir": str(output), "router": str(output / manifest["router"]),
               "embedder": manifest["config"]["embedder"], "sharding": manifest["config"]["sharding"],
               **{key: manifest[key] for key in SHARD_SUMMARY},
               **{f"{name}_{key}": [e[split][key] for e in manifest["expert_sizes"]]
                  for name, split in (("train", "train"), ("expert_val", "val")) for key in ("documents", "bytes")}}
    print(json.dumps(summary, indent=2))


_shard = shard  # `shard_dataset`'s argument `shard` hides the function
