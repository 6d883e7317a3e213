"""`shard`: split a prepared dataset's training documents into N expert shard sets and fit the router.

```
<output_dir>/
  expert-000/train-000000.tar ... val-000000.tar   expert 0's documents (train / expert validation)
  ...
  router.pt                                        encoder of the first 256 bytes + N centroids
  experts.json                                     written last: shard records, sizes, contingency
```

Semantic sharding (the paper's) embeds each training document's first 256 bytes (the routed prefix)
and clusters the embeddings with mini-batch k-means; random sharding (the Fig. 9 ablation) deals the
documents to experts in the order of a seeded hash. Held-out documents never reach a shard: only the
prepared training shards are read. Two streaming passes (embed, then write); only the embeddings are
held in memory. The folder is built under a temporary name and renamed into place with experts.json
last; experts.json records a fingerprint, so an identical re-run is a no-op and a changed one rebuilds.
experts.json also records the prepared dataset's fingerprint, and router.pt the sharding's, so
training and evaluation can refuse shards or a router that belong to another dataset or sharding.
Only a folder soma_pl wrote as a sharded dataset is replaced, never an input or a folder holding one.
"""

from __future__ import annotations

import hashlib
import json
import time
import warnings
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from soma_pl.data.documents import Document
from soma_pl.data.experts import EXPERTS_MANIFEST, ExpertShardWriter, read_experts_manifest
from soma_pl.data.heldout import seeded_hash
from soma_pl.data.prepare import MANIFEST, open_prepared, prepare_recipe, read_manifest
from soma_pl.data.shards import ShardRecord, Verify, iter_shard_documents, sha256_file, verify_shards
from soma_pl.io import atomic_folder, check_output
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.router import EncoderKind, HashedNgramEncoder, Router, SeedEncoder, prefix_batch

ROUTER_FILE = "router.pt"
FORMAT_VERSION = 1
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
        prepared: the prepared dataset folder whose training shards are split; everything else about
            it is read from its manifest.
        recipe: a data config (`configs/data/<name>.yaml`) that builds `prepared` first when it is
            missing or was built from another corpus or config. None: `prepared` must exist.
        num_experts: N, the number of experts (and of clusters).
        output_dir: the sharded dataset folder (what `ByteDataModule(experts_dir=...)` reads).
        embedder: how the first 256 bytes are embedded: `seed` (the seed model's mean final
            features, the paper's) or `hashed` (hashed byte n-gram counts, needs no model).
        seed_checkpoint: Lightning checkpoint of the monolithic seed model; required by `seed`.
        sharding: `semantic` (k-means clusters) or `random` (seeded deal, the Fig. 9 ablation).
        val_fraction: share of each expert's documents, chosen by a seeded hash, that go to its
            expert-validation split (paper: 1%); at least one document per expert.
        seed: seeds k-means, the random deal, the validation choice and the hashed encoder.
        kmeans_batch_size: documents per mini-batch of k-means.
        kmeans_n_init: k-means restarts; the one of least inertia is kept.
        min_expert_fraction: after k-means, an expert holding fewer than this fraction of the
            average documents per expert takes the documents nearest to its centroid from experts
            that hold more.
        shard_max_bytes: an expert's tar shard is cut once it reaches this size.
        hashed_dim: buckets of the hashed encoder.
        hashed_orders: byte n-gram lengths counted by the hashed encoder.
        hashed_center: remove the corpus's mean hashed encoding before clustering (and routing).
        embed_batch_size: documents embedded at once.
        device: where the embedder runs (`cpu`, `cuda`, ...).
    """

    prepared: str = "data/demo"
    recipe: str | None = None
    num_experts: int = 3
    output_dir: str = "data/demo-experts"
    embedder: EncoderKind = EncoderKind.hashed
    seed_checkpoint: str | None = None
    sharding: Sharding = Sharding.semantic
    val_fraction: float = 0.01
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

    def validate(self) -> None:
        """Raises ConfigError naming the first setting that cannot work."""
        checks = [
            (self.num_experts >= 1, f"shard.num_experts={self.num_experts} must be >= 1"),
            (0 <= self.val_fraction < 1, f"shard.val_fraction={self.val_fraction} must be in [0, 1)"),
            (0 <= self.min_expert_fraction <= 1, f"shard.min_expert_fraction={self.min_expert_fraction} must be in [0, 1]"),
            (min(self.kmeans_batch_size, self.kmeans_n_init, self.embed_batch_size) >= 1,
             "shard.kmeans_batch_size, kmeans_n_init and embed_batch_size must be >= 1"),
            (EncoderKind(self.embedder) is not EncoderKind.seed or bool(self.seed_checkpoint),
             "shard.embedder=seed needs shard.seed_checkpoint (the seed model's Lightning checkpoint)"),
            (Path(self.output_dir).expanduser().resolve() != Path(self.prepared).expanduser().resolve(),
             f"shard.output_dir={self.output_dir} must differ from the prepared dataset folder"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)

    def inputs(self) -> list[str]:
        """What a sharding reads: the prepared dataset, its corpus, the seed checkpoint."""
        seed = [self.seed_checkpoint] if EncoderKind(self.embedder) is EncoderKind.seed else []
        corpus = []
        if (Path(self.prepared).expanduser() / MANIFEST).is_file():
            corpus = read_manifest(Path(self.prepared).expanduser()).get("config", {}).get("corpus", {}).get("paths", [])
        return [self.prepared, *corpus, *seed]

    def fingerprint(self, manifest: dict) -> str:
        """Hash of everything the output depends on: settings, the prepared shards, the seed model."""
        settings = asdict(self)
        for key in ("output_dir", "prepared", "recipe"):
            settings.pop(key)
        checkpoint = None
        if EncoderKind(self.embedder) is EncoderKind.seed:
            path = Path(self.seed_checkpoint).expanduser()
            if not path.is_file():
                raise DataError(f"seed checkpoint not found: {path}")
            checkpoint = sha256_file(path)
        identity = {"settings": settings, "dataset": manifest.get("fingerprint"),
                    "shards": [s["sha256"] for s in manifest["train"]["shards"]],
                    "seed_checkpoint": checkpoint, "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()


@dataclass
class DocumentIndex:
    """What the embedding pass keeps per training document (never the text).

    Attributes:
        embeddings: `[n, D]` float32 encodings of the first 256 bytes.
        sources: `[n]` index into `source_names`.
        source_names: the distinct `Document.source` values, in order of first appearance.
        deal_keys: `[n]` uint64 seeded hashes of the ids (random sharding's order).
        val_keys: `[n]` uint64 seeded hashes of the ids (expert-validation choice).
    """

    embeddings: np.ndarray
    sources: np.ndarray
    source_names: list[str]
    deal_keys: np.ndarray
    val_keys: np.ndarray


def shard(config: ShardConfig, progress: bool = True) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path."""
    config.validate()
    output = Path(config.output_dir).expanduser()
    check_output(output, KIND, "shard.output_dir", config.inputs(), EXPERTS_MANIFEST)  # before hours of work
    root = Path(config.prepared).expanduser()
    if config.recipe is not None:
        prepare_recipe(config.recipe, root, progress=progress)
    manifest = open_prepared(root, "shard.prepared")
    fingerprint = config.fingerprint(manifest)
    if (output / EXPERTS_MANIFEST).is_file():
        if _read_fingerprint(output) == fingerprint:
            return output
        warnings.warn(f"{output}: sharded with another config or dataset; rebuilding", stacklevel=2)
    with atomic_folder(output, KIND, "shard.output_dir", config.inputs(), EXPERTS_MANIFEST) as work:
        _build(config, root, manifest, work, fingerprint, progress)
    return output


read_shard_manifest = read_experts_manifest  # the name cli.py and the notebooks use


def make_encoder(config: ShardConfig) -> torch.nn.Module:
    """The configured embedder of the first 256 bytes, on `config.device`."""
    if EncoderKind(config.embedder) is EncoderKind.seed:
        return SeedEncoder.from_checkpoint(config.seed_checkpoint).to(config.device)
    return HashedNgramEncoder(config.hashed_dim, tuple(config.hashed_orders), config.seed).to(config.device)


def _build(config: ShardConfig, root: Path, manifest: dict, work: Path, fingerprint: str, progress: bool) -> None:
    started = time.perf_counter()
    paths = verify_shards(root, [ShardRecord(**r) for r in manifest["train"]["shards"]], Verify.sha256)
    encoder = make_encoder(config)
    index = _embed_documents(paths, encoder, config, progress)
    if isinstance(encoder, HashedNgramEncoder) and config.hashed_center:
        index.embeddings = encoder.fit_center(torch.from_numpy(index.embeddings)).numpy()
    if len(index.sources) < 2 * config.num_experts:
        raise DataError(f"{root}: {len(index.sources)} training documents cannot fill {config.num_experts} experts "
                        "(each needs one training and one validation document)")
    labels, moved = assign_experts(config, index)
    centroids = expert_centroids(index.embeddings, labels, config.num_experts)
    Router(encoder, torch.from_numpy(centroids), sharding=fingerprint).save(work / ROUTER_FILE)
    validation = validation_mask(labels, index.val_keys, config.num_experts, config.val_fraction)
    writer = ExpertShardWriter(work, config.num_experts, config.shard_max_bytes)
    try:
        sizes = _write_experts(paths, labels, validation, writer, config.num_experts, progress)
        writer.close(extra={
            "format": FORMAT_VERSION,
            "fingerprint": fingerprint,
            "dataset_fingerprint": manifest["fingerprint"],
            "config": json.loads(json.dumps(asdict(config), default=str)),
            "dataset_dir": str(root),
            "router": ROUTER_FILE,
            "documents": int(len(labels)),
            "expert_sizes": sizes,
            "shard_sizes": _min_max(sizes),
            "rebalanced_documents": moved,
            **_cluster_report(index, labels, centroids, config.num_experts),
            "shard_seconds": round(time.perf_counter() - started, 3),
        })
    except BaseException:
        writer.abandon()
        raise


def _iter_documents(paths: list[Path]) -> Iterator[Document]:
    for path in paths:
        yield from iter_shard_documents(path)


def _embed_documents(paths: list[Path], encoder: torch.nn.Module, config: ShardConfig, progress: bool) -> DocumentIndex:
    """Pass 1: embed each training document's first 256 bytes, in batches."""
    embeddings, sources, deal, val = [], [], [], []
    names: dict[str, int] = {}
    batch: list[bytes] = []

    def flush() -> None:
        if batch:
            embeddings.append(encoder.encode(prefix_batch(batch, config.device)).cpu().numpy())
            batch.clear()

    for document in tqdm(_iter_documents(paths), desc="shard: embed", unit="doc", disable=not progress):
        batch.append(document.text)
        sources.append(names.setdefault(document.source, len(names)))
        deal.append(seeded_hash(config.seed, "deal", document.doc_id))
        val.append(seeded_hash(config.seed, "val", document.doc_id))
        if len(batch) == config.embed_batch_size:
            flush()
    flush()
    if not sources:
        raise DataError(f"no training documents in {paths[0].parent if paths else 'the prepared dataset'}")
    return DocumentIndex(np.concatenate(embeddings).astype(np.float32), np.array(sources, dtype=np.int64),
                         list(names), np.array(deal, dtype=np.uint64), np.array(val, dtype=np.uint64))


def assign_experts(config: ShardConfig, index: DocumentIndex) -> tuple[np.ndarray, int]:
    """Each document's expert `[n]` int64, and how many documents rebalancing moved."""
    experts, count = config.num_experts, len(index.sources)
    if Sharding(config.sharding) is Sharding.random:
        labels = np.empty(count, dtype=np.int64)
        labels[np.argsort(index.deal_keys, kind="stable")] = np.arange(count) % experts
        return labels, 0
    from sklearn.cluster import MiniBatchKMeans

    kmeans = MiniBatchKMeans(n_clusters=experts, random_state=config.seed, n_init=config.kmeans_n_init,
                             batch_size=config.kmeans_batch_size)
    labels = kmeans.fit_predict(index.embeddings).astype(np.int64)
    minimum = max(2, int(config.min_expert_fraction * count / experts))
    return rebalance(labels, kmeans.transform(index.embeddings), minimum)


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


def validation_mask(labels: np.ndarray, keys: np.ndarray, experts: int, fraction: float) -> np.ndarray:
    """`[n]` bool: the documents of smallest seeded hash in each expert, at least one, never all."""
    mask = np.zeros(len(labels), dtype=bool)
    for expert in range(experts):
        members = np.flatnonzero(labels == expert)
        take = min(max(1, round(fraction * len(members))), len(members) - 1)
        mask[members[np.argsort(keys[members], kind="stable")[:take]]] = True
    return mask


def _write_experts(paths: list[Path], labels: np.ndarray, validation: np.ndarray, writer: ExpertShardWriter,
                   experts: int, progress: bool) -> list[dict]:
    """Pass 2: write every document into its expert's train or val shards; return per-expert sizes."""
    sizes = [{split: {"documents": 0, "bytes": 0} for split in ("train", "val")} for _ in range(experts)]
    written = 0
    documents = tqdm(_iter_documents(paths), total=len(labels), desc="shard: write", unit="doc", disable=not progress)
    for position, document in enumerate(documents):
        if position >= len(labels):
            raise DataError("training shards changed between the two passes")
        expert, is_val = int(labels[position]), bool(validation[position])
        writer.write(expert, document, validation=is_val)
        entry = sizes[expert]["val" if is_val else "train"]
        entry["documents"] += 1
        entry["bytes"] += len(document.text)
        written += 1
    if written != len(labels):
        raise DataError("training shards changed between the two passes")
    return sizes


def _min_max(sizes: list[dict]) -> dict:
    documents = [s["train"]["documents"] + s["val"]["documents"] for s in sizes]
    volume = [s["train"]["bytes"] + s["val"]["bytes"] for s in sizes]
    return {"min_documents": min(documents), "max_documents": max(documents),
            "min_bytes": min(volume), "max_bytes": max(volume)}


def _cluster_report(index: DocumentIndex, labels: np.ndarray, centroids: np.ndarray, experts: int) -> dict:
    """Expert × source contingency, purity, and how often the router's top-1 agrees with the shard."""
    table = np.zeros((experts, len(index.source_names)), dtype=np.int64)
    np.add.at(table, (labels, index.sources), 1)
    # ‖x‖² is the same for every centroid, so the nearest centroid minimises ‖c‖² − 2·x·c: [n, N].
    distances = (centroids ** 2).sum(1)[None] - 2 * index.embeddings @ centroids.T
    return {
        "contingency": [{name: int(table[e, s]) for s, name in enumerate(index.source_names)} for e in range(experts)],
        "purity": round(float(table.max(axis=1).sum() / len(labels)), 4),
        "router_agreement": round(float((distances.argmin(axis=1) == labels).mean()), 4),
    }


def _read_fingerprint(folder: Path) -> str | None:
    try:
        return read_shard_manifest(folder).get("fingerprint")
    except DataError:
        return None
