"""What `shard` builds, from which prepared dataset, and where: `ShardConfig` (the `shard:` section of a
shard config), and the embedder of the first 256 bytes it names."""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import torch

from soma_pl.data.formats.expert_sets import FORMAT_VERSION
from soma_pl.data.formats.manifest import MANIFEST, read_manifest
from soma_pl.data.formats.tar_shards import sha256_file
from soma_pl.data.runner.pipeline import ExecutorConfig
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.devices import resolve_device
from soma_pl.models.router import EncoderKind, HashedNgramEncoder, SeedEncoder


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


def make_encoder(config: ShardConfig) -> torch.nn.Module:
    """The configured embedder of the first 256 bytes, on `config.device`."""
    if EncoderKind(config.embedder) is EncoderKind.seed:
        return SeedEncoder.from_checkpoint(config.seed_checkpoint).to(config.device)
    return HashedNgramEncoder(config.hashed_dim, tuple(config.hashed_orders), config.seed).to(config.device)
