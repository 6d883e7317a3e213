"""What `prepare` builds, and where: `PrepareConfig` (the `dataset:` section of a data config)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.readers import CorpusConfig, corpus_fingerprint
from soma_pl.data.formats.manifest import FORMAT_VERSION
from soma_pl.data.runner.executor import ExecutorConfig
from soma_pl.errors import ConfigError


@dataclass
class PrepareConfig:
    """What `prepare` builds, and where.

    Attributes:
        corpus: the documents to read.
        output_dir: the prepared dataset folder.
        seed: decides which documents are held out.
        val_documents: held-out documents for ensemble validation (paper: 202).
        val_windows: ensemble-validation windows taken round-robin from them (paper: 976).
        test_windows: test documents, one window each, after the overlap screen (paper: 4,096).
        final_test_windows: documents of the final test split, one window each, screened like the
            test ones: a second test split that no development result touches, reported only by
            the final runs of a reproduction (0: none; `test` holds the same documents either way).
        test_oversample: test candidates held out per test window wanted (test and final test
            together), to absorb exclusions.
        shingle_bytes: a test candidate sharing a substring this long with a training document is
            excluded.
        shard_max_bytes: a training shard is cut once it reaches this size.
        expert_val_fraction: share of the training documents held out as the expert-validation
            split that drives a monolithic model's learning-rate decay (paper: 1%).
        executor: how the datatrove pipeline runs (local tasks x workers, Slurm, Ray); it does not
            change which documents go where, so it is not part of the fingerprint.
    """

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    output_dir: str = "data/demo"
    seed: int = 0
    val_documents: int = 202
    val_windows: int = 976
    test_windows: int = 4096
    final_test_windows: int = 0
    test_oversample: float = 1.25
    shingle_bytes: int = 50
    shard_max_bytes: int = 64_000_000
    expert_val_fraction: float = 0.01
    executor: ExecutorConfig = field(default_factory=ExecutorConfig)

    @property
    def test_candidates(self) -> int:
        """Held-out candidates of both test splits."""
        return math.ceil((self.test_windows + self.final_test_windows) * self.test_oversample)

    @property
    def test_own_candidates(self) -> int:
        """The first candidates (in held-out rank order): the ones `test` draws from, the same with or
        without a final split."""
        return math.ceil(self.test_windows * self.test_oversample)

    def fingerprint(self, corpus: dict | None = None) -> str:
        """Hash of everything the output depends on: settings, corpus identity (`corpus`, when
        already read by `corpus_fingerprint`), format."""
        settings = asdict(self)
        settings.pop("output_dir")
        settings.pop("executor")
        corpus = corpus_fingerprint(self.corpus) if corpus is None else corpus
        identity = {"settings": settings, "corpus": corpus, "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()

    def validate(self) -> None:
        """Refuse settings that cannot build a usable dataset, naming the key (`dataset.<field>`).

        Raises:
            ConfigError: a count below 1 (`final_test_windows` below 0), an oversampling below 1, a
                shingle longer than a test window (it could never exclude anything) or a fraction
                outside (0, 1).
        """
        counts = {"val_documents": self.val_documents, "val_windows": self.val_windows,
                  "test_windows": self.test_windows, "shard_max_bytes": self.shard_max_bytes}
        for key, value in counts.items():
            if value < 1:
                raise ConfigError(f"dataset.{key}={value} must be >= 1")
        if self.final_test_windows < 0:
            raise ConfigError(f"dataset.final_test_windows={self.final_test_windows} must be >= 0 (0: no final split)")
        if not (math.isfinite(self.test_oversample) and self.test_oversample >= 1):
            raise ConfigError(f"dataset.test_oversample={self.test_oversample} must be a finite number >= 1")
        if not 1 <= self.shingle_bytes <= WINDOW_BYTES:
            raise ConfigError(f"dataset.shingle_bytes={self.shingle_bytes} must be in [1, {WINDOW_BYTES}] "
                              f"(a test window's length)")
        if not 0 < self.expert_val_fraction < 1:
            raise ConfigError(f"dataset.expert_val_fraction={self.expert_val_fraction} must be in (0, 1)")
        self.executor.validate("dataset")


def config_json(config: PrepareConfig) -> dict:
    """The config as plain JSON (what the manifest records)."""
    return json.loads(json.dumps(asdict(config), default=str))


def load_prepare_config(recipe: str | Path) -> PrepareConfig:
    """The `dataset:` section of a data config (`configs/data/<name>.yaml`).

    Raises:
        ConfigError: the file is missing or its `dataset:` section does not parse.
    """
    from jsonargparse import ArgumentParser

    path = Path(recipe).expanduser()
    if not path.is_file():
        raise ConfigError(f"data config not found: {path}")
    parser = ArgumentParser(exit_on_error=False)
    parser.add_argument("--dataset", type=PrepareConfig)
    try:
        return parser.instantiate_classes(parser.parse_path(str(path))).dataset
    except Exception as error:  # jsonargparse reports every parse problem its own way
        raise ConfigError(f"{path}: {str(error).strip().splitlines()[0]}") from error


def recipe_config(recipe: str | Path, folder: str | Path) -> PrepareConfig:
    """What a data config `recipe` builds into `folder` (`prepare_recipe`, a data module's `recipe`)."""
    config = load_prepare_config(recipe)
    config.output_dir = str(folder)
    return config
