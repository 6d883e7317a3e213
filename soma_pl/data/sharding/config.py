"""What `shard` builds, from which prepared dataset, and where: `ShardConfig` (the `shard:` section of a
shard config)."""

from __future__ import annotations

import hashlib
import json
from contextlib import suppress
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

from soma_pl.data.formats.expert_sets import FORMAT_VERSION
from soma_pl.data.formats.manifest import MANIFEST, read_manifest
from soma_pl.data.runner.executor import ExecutorConfig
from soma_pl.errors import ConfigError, DataError


class Sharding(str, Enum):
    """How sequences are assigned to experts."""

    semantic = "semantic"
    """tf–idf → SVD → balanced spherical k-means on whole 1,024-byte sequences (the paper's)."""
    random = "random"
    """Dealt by a seeded hash of the sequence (Fig. 9 ablation)."""
    global_iid = "global_iid"
    """Every expert holds every sequence, each reading its own shuffled stream of the whole corpus
    (Fig. 9's global-IID condition, App. D.1); the router is the semantic one, for evaluation."""


@dataclass
class ShardConfig:
    """What `shard` builds, from which prepared dataset, and where.

    Attributes:
        prepared: the prepared dataset folder whose training and expert-validation documents are
            cut into 1,024-byte sequences and dealt between the experts; everything else about it is
            read from its manifest.
        recipe: a data config (`configs/data/<name>.yaml`) that builds `prepared` first when it is
            missing or was built from another corpus or config. None: `prepared` must exist.
        num_experts: N, the number of experts (and of clusters).
        keep_experts: write only the first `keep_experts` experts of the N-way sharding, with their
            router centroids (None: all N). A fit of that many experts on the folder, from the same
            seed model, does the computation those experts of an N-way SOMA run do, since SOMA's
            experts exchange nothing (bit for bit on a CPU in one process): the paper forms Fig. 4's
            N = 4 from experts 0-3 of its N = 8 run (App. J).
        output_dir: the sharded dataset folder (what `ByteDataModule(experts_dir=...)` reads).
        sharding: `semantic` (the paper's router) or `random` (seeded deal, the Fig. 9 ablation).
        seed: seeds the sequence keys (sample and held-out shares), the SVD and k-means.
        expert_val_fraction: each expert's share of its own sequences held out as its
            expert-validation split (paper: 1%), at least one.
        kmeans_sample: sequences the router is fitted on (paper: 400,000), those of smallest key;
            sequences outside it go to their nearest centroid.
        kmeans_n_init: k-means restarts; the one of least inertia is kept.
        tfidf_max_features: the vocabulary's size cap (paper: 50,000).
        tfidf_min_df: least sequences a term appears in (paper: 5).
        svd_dim: truncated SVD dimensions (paper: 128).
        shard_max_bytes: an expert's tar shard is cut once it reaches this size.
        executor: how the datatrove pipeline runs (local tasks x workers, Slurm, Ray); it does not
            change which sequence goes to which expert, so it is not part of the fingerprint.
    """

    prepared: str = "data/demo"
    recipe: str | None = None
    num_experts: int = 3
    keep_experts: int | None = None
    output_dir: str = "data/demo-experts"
    sharding: Sharding = Sharding.semantic
    seed: int = 0
    expert_val_fraction: float = 0.01
    kmeans_sample: int = 400_000
    kmeans_n_init: int = 10
    tfidf_max_features: int = 50_000
    tfidf_min_df: int = 5
    svd_dim: int = 128
    shard_max_bytes: int = 64_000_000
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    @property
    def kept_experts(self) -> int:
        """The experts written: `keep_experts`, or all N."""
        return self.keep_experts or self.num_experts

    def validate(self) -> None:
        """Raises ConfigError naming the first setting that cannot work."""
        checks = [
            (self.num_experts >= 1, f"shard.num_experts={self.num_experts} must be >= 1"),
            (self.keep_experts is None or 1 <= self.keep_experts <= self.num_experts,
             f"shard.keep_experts={self.keep_experts} must be in [1, shard.num_experts={self.num_experts}]"),
            (0 < self.expert_val_fraction < 1,
             f"shard.expert_val_fraction={self.expert_val_fraction} must be in (0, 1)"),
            (min(self.kmeans_n_init, self.tfidf_max_features, self.tfidf_min_df, self.svd_dim) >= 1,
             "shard.kmeans_n_init, tfidf_max_features, tfidf_min_df and svd_dim must be >= 1"),
            (self.shard_max_bytes >= 1, f"shard.shard_max_bytes={self.shard_max_bytes} must be >= 1"),
            (self.kmeans_sample >= 2 * self.num_experts,
             f"shard.kmeans_sample={self.kmeans_sample} must be >= 2 x num_experts"),
            (Path(self.output_dir).expanduser().resolve() != Path(self.prepared).expanduser().resolve(),
             f"shard.output_dir={self.output_dir} must differ from the prepared dataset folder"),
        ]
        for ok, message in checks:
            if not ok:
                raise ConfigError(message)
        self.executor.validate("shard")

    def inputs(self) -> list[str]:
        """What a sharding reads: the prepared dataset and its corpus."""
        corpus = []
        if (Path(self.prepared).expanduser() / MANIFEST).is_file():
            with suppress(DataError, KeyError, TypeError):  # unreadable: refused where the dataset is opened
                corpus = list(read_manifest(Path(self.prepared).expanduser())["config"]["corpus"]["paths"])
        return [self.prepared, *corpus]

    def fingerprint(self, manifest: dict) -> str:
        """Hash of everything the output depends on: settings, the prepared training and
        expert-validation shards, the format."""
        settings = asdict(self)
        for key in ("output_dir", "prepared", "recipe", "executor"):
            settings.pop(key)
        if self.kept_experts == self.num_experts:  # every expert kept: the folder a sharding without the setting makes
            settings.pop("keep_experts")
        identity = {"settings": settings, "dataset": manifest.get("fingerprint"),
                    "shards": {split: [s["sha256"] for s in manifest[split]["shards"]]
                               for split in ("train", "expert_val")},
                    "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
