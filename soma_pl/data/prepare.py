"""`prepare`: turn a corpus into a prepared dataset folder.

```
<output_dir>/
  train/train-000000.tar ...   training documents, WebDataset shards cut by size
  expert_val/val-000000.tar    the held-out 1% of the training documents: a monolithic model's
                               learning-rate decay signal (N = 1 is one expert, Table 1)
  ensemble_val.npz             fixed 1,025-byte windows from held-out documents
  test.npz                     one window per held-out, overlap-screened test document
  manifest.json                counts, bytes, sources, seed, screening, sha256 of every shard
```

Two streaming passes over the corpus: the first picks the held-out documents (smallest seeded hash of
the id), the second writes every other document into shards and screens the test candidates
against it. A seeded hash of the id also sends `expert_val_fraction` of the training documents
(at least one) to the expert-validation split, decided per document, so the choice is the same
whatever order or partition the corpus is read in. The folder is built under a temporary name and renamed into place with its manifest, so
an interrupted run leaves nothing that reads as a prepared dataset. The manifest records a hash of
the config and of the corpus's identity: an identical re-run is a no-op, a changed one rebuilds. Each
pass ends by checking that the corpus files are still those (paths, sizes, mtimes) seen at the
start, so a file that changes or disappears meanwhile stops the run instead of shrinking the
dataset. Only a folder soma_pl wrote as a prepared dataset is replaced (`soma_pl.io.atomic_folder`).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import time
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from soma_pl import WINDOW_BYTES
from soma_pl.data.documents import Document
from soma_pl.data.evalsets import EvalSet
from soma_pl.data.heldout import (HeldOutSelector, OverlapScreen, seeded_hash, test_window_offset,
                                  validation_windows)
from soma_pl.data.readers import CorpusConfig, CorpusKind, corpus_change, corpus_fingerprint, iter_corpus
from soma_pl.data.shards import ShardRecord, ShardWriter
from soma_pl.errors import ConfigError, DataError
from soma_pl.io import atomic_folder, close_quietly, write_json_atomic

MANIFEST = "manifest.json"
FORMAT_VERSION = 3
KIND = "prepared dataset"
"""What the output folder's marker calls it (`soma_pl.io.OUTPUT_MARKER`)."""


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
        test_oversample: test candidates held out per test window wanted, to absorb exclusions.
        shingle_bytes: a test candidate sharing a substring this long with a training document is
            excluded.
        shard_max_bytes: a training shard is cut once it reaches this size.
        expert_val_fraction: share of the training documents held out as the expert-validation
            split that drives a monolithic model's learning-rate decay (paper: 1%).
    """

    corpus: CorpusConfig = field(default_factory=CorpusConfig)
    output_dir: str = "data/demo"
    seed: int = 0
    val_documents: int = 202
    val_windows: int = 976
    test_windows: int = 4096
    test_oversample: float = 1.25
    shingle_bytes: int = 50
    shard_max_bytes: int = 64_000_000
    expert_val_fraction: float = 0.01

    @property
    def test_candidates(self) -> int:
        return math.ceil(self.test_windows * self.test_oversample)

    def fingerprint(self, corpus: dict | None = None) -> str:
        """Hash of everything the output depends on: settings, corpus identity (`corpus`, when
        already read by `corpus_fingerprint`), format."""
        settings = asdict(self)
        settings.pop("output_dir")
        corpus = corpus_fingerprint(self.corpus) if corpus is None else corpus
        identity = {"settings": settings, "corpus": corpus, "format": FORMAT_VERSION}
        return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()

    def validate(self) -> None:
        """Refuse settings that cannot build a usable dataset, naming the key (`dataset.<field>`).

        Raises:
            ConfigError: a count below 1, an oversampling below 1, a shingle longer than a test
                window (it could never exclude anything) or a fraction outside (0, 1).
        """
        counts = {"val_documents": self.val_documents, "val_windows": self.val_windows,
                  "test_windows": self.test_windows, "shard_max_bytes": self.shard_max_bytes}
        for key, value in counts.items():
            if value < 1:
                raise ConfigError(f"dataset.{key}={value} must be >= 1")
        if not (math.isfinite(self.test_oversample) and self.test_oversample >= 1):
            raise ConfigError(f"dataset.test_oversample={self.test_oversample} must be a finite number >= 1")
        if not 1 <= self.shingle_bytes <= WINDOW_BYTES:
            raise ConfigError(f"dataset.shingle_bytes={self.shingle_bytes} must be in [1, {WINDOW_BYTES}] "
                              f"(a test window's length)")
        if not 0 < self.expert_val_fraction < 1:
            raise ConfigError(f"dataset.expert_val_fraction={self.expert_val_fraction} must be in (0, 1)")


def prepare(config: PrepareConfig, progress: bool = True) -> Path:
    """Build `config.output_dir` unless an identical build is already there; return its path."""
    config.validate()
    output = Path(config.output_dir).expanduser()
    corpus = corpus_fingerprint(config.corpus)
    fingerprint = config.fingerprint(corpus)
    existing = read_manifest(output) if (output / MANIFEST).is_file() else None
    if existing is not None and existing.get("fingerprint") == fingerprint:
        return output
    with atomic_folder(output, KIND, "dataset.output_dir", corpus_inputs(config.corpus), MANIFEST) as work:
        if existing is not None:
            warnings.warn(f"{output}: prepared with another config or corpus; rebuilding", stacklevel=3)
        manifest = _build(config, work, progress, corpus)
        manifest["fingerprint"] = fingerprint
        write_json_atomic(work / MANIFEST, manifest)
    return output


def read_manifest(folder: Path) -> dict:
    """The manifest of a prepared folder.

    Raises:
        DataError: the folder or its manifest is missing or unreadable.
    """
    path = Path(folder) / MANIFEST
    try:
        return json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DataError(f"not a prepared dataset (no {MANIFEST}): {folder}") from error
    except (OSError, json.JSONDecodeError) as error:
        raise DataError(f"unreadable manifest {path}: {error}") from error


def corpus_inputs(corpus: CorpusConfig) -> list[str]:
    """The paths a corpus is read from (none for the demo corpus): no output may hold them."""
    return [] if CorpusKind(corpus.kind) is CorpusKind.demo else list(corpus.paths)


def _read_corpus(config: PrepareConfig, before: dict, stage: str, progress: bool) -> Iterator[Document]:
    """One pass over the corpus; after its last document, a check that the corpus files are still
    those `before` (`corpus_fingerprint`) lists, so both passes read the same documents.

    Raises:
        DataError: a file appeared, disappeared or changed size or mtime.
    """
    yield from tqdm(iter_corpus(config.corpus), desc=f"prepare: {stage}", unit="doc", disable=not progress)
    try:
        change = corpus_change(before, corpus_fingerprint(config.corpus))
    except DataError as error:
        change = str(error)
    if change:
        raise DataError(f"the corpus changed while prepare read it ({stage}): {change}; nothing was written: "
                        "run prepare again once the corpus is complete")


def _build(config: PrepareConfig, work: Path, progress: bool, corpus: dict) -> dict:
    if not 0 < config.expert_val_fraction < 1:
        raise ConfigError(f"dataset.expert_val_fraction={config.expert_val_fraction} must be in (0, 1)")
    started = time.perf_counter()
    keep_bytes = max(config.val_windows, 1) * WINDOW_BYTES
    held_count = config.val_documents + config.test_candidates
    selector = HeldOutSelector(config.seed, held_count, keep_bytes)
    expert_val = ExpertValChoice(config.seed, config.expert_val_fraction, held_count + 1)
    short = Counter()
    for document in _read_corpus(config, corpus, "select held-out", progress):
        if len(document.text) < WINDOW_BYTES:
            short[document.source] += 1
        else:
            selector.offer(document)
            expert_val.offer(document.doc_id)
    held = selector.selected()
    if not held and not short:
        raise DataError(f"empty corpus: no documents in {_describe(config.corpus)}")
    if len(held) < config.val_documents + config.test_candidates:
        raise DataError(f"corpus too small: {len(held)} documents of >= {WINDOW_BYTES} bytes, "
                        f"{config.val_documents + config.test_candidates} needed for held-out sets")
    if sum(short.values()):
        warnings.warn(f"skipped {sum(short.values())} documents shorter than {WINDOW_BYTES} bytes", stacklevel=2)
    val_docs, candidates = held[: config.val_documents], held[config.val_documents :]
    held_ids = {d.doc_id for d in held}
    offsets = [test_window_offset(config.seed, d) for d in candidates]
    screen = OverlapScreen([d.text[o : o + WINDOW_BYTES] for d, o in zip(candidates, offsets)], config.shingle_bytes)
    expert_val.exclude(held_ids)
    shards, train_stats = _write_training(config, work, held_ids, screen, expert_val,
                                          _read_corpus(config, corpus, "write shards", progress))
    val = _validation_set(val_docs, config.val_windows)
    test, test_stats = _test_set(candidates, offsets, screen.contaminated, config.test_windows, config.shingle_bytes)
    val.save(work / "ensemble_val.npz")
    test.save(work / "test.npz")
    return {
        "format": FORMAT_VERSION,
        "config": json.loads(json.dumps(asdict(config), default=str)),
        "seed": config.seed,
        "window_bytes": WINDOW_BYTES,
        "train": {**train_stats, "shards": [s.to_json() for s in shards["train"]]},
        "expert_val": {**train_stats.pop("expert_val"), "fraction": config.expert_val_fraction,
                       "shards": [s.to_json() for s in shards["expert_val"]]},
        "skipped_short_documents": dict(sorted(short.items())),
        "ensemble_val": {"file": "ensemble_val.npz", "documents": len(set(val.doc_ids)), "windows": len(val)},
        "test": {"file": "test.npz", **test_stats},
        "prepare_seconds": round(time.perf_counter() - started, 3),
    }


class ExpertValChoice:
    """Which training documents form the expert-validation split, decided one document at a time.

    A document is held out when its seeded hash falls below `fraction` of the hash range; the
    document of smallest hash is held out too, so the split is never empty. Pass 1 offers every
    eligible id (a bounded heap keeps the `keep` smallest hashes) and then excludes the documents
    held out for evaluation; pass 2 asks `holds(id)`.
    """

    def __init__(self, seed: int, fraction: float, keep: int):
        self.seed, self.threshold, self.keep = seed, int(fraction * 2**64), keep
        self._smallest: list[tuple[int, str]] = []  # max-heap by hash: (-hash, id)
        self.fallback: str | None = None

    def hash(self, doc_id: str) -> int:
        return seeded_hash(self.seed, "expert_val", doc_id)

    def offer(self, doc_id: str) -> None:
        item = (-self.hash(doc_id), doc_id)
        if len(self._smallest) < self.keep:
            heapq.heappush(self._smallest, item)
        elif item > self._smallest[0]:
            heapq.heapreplace(self._smallest, item)

    def exclude(self, held_ids: set[str]) -> None:
        """Fix the fallback: the smallest-hash training document that is not held out."""
        eligible = sorted((-negative, doc_id) for negative, doc_id in self._smallest if doc_id not in held_ids)
        self.fallback = eligible[0][1] if eligible else None

    def holds(self, doc_id: str) -> bool:
        return doc_id == self.fallback or self.hash(doc_id) < self.threshold


def _write_training(config: PrepareConfig, work: Path, held_ids: set[str], screen: OverlapScreen,
                    expert_val: ExpertValChoice, corpus: Iterable[Document]) -> tuple[dict[str, list[ShardRecord]], dict]:
    writers = {"train": ShardWriter(work / "train", "train", config.shard_max_bytes),
               "expert_val": ShardWriter(work / "expert_val", "val", config.shard_max_bytes)}
    documents, sizes, held_out = Counter(), Counter(), Counter()
    try:
        for document in corpus:
            if len(document.text) < WINDOW_BYTES or document.doc_id in held_ids:
                continue
            screen.screen(document.text)  # expert-validation documents are training data too
            if expert_val.holds(document.doc_id):
                writers["expert_val"].write(document)
                held_out["documents"] += 1
                held_out["bytes"] += len(document.text)
                continue
            writers["train"].write(document)
            documents[document.source] += 1
            sizes[document.source] += len(document.text)
        records = {split: writer.close() for split, writer in writers.items()}
    except BaseException:
        close_quietly(writers.values())
        raise
    if not records["train"]:
        raise DataError(f"no training documents left in {_describe(config.corpus)}")
    stats = {
        "documents": sum(documents.values()),
        "bytes": sum(sizes.values()),
        "sources": {s: {"documents": documents[s], "bytes": sizes[s]} for s in sorted(documents)},
        "expert_val": {"documents": held_out["documents"], "bytes": held_out["bytes"]},
    }
    return records, stats


def _validation_set(documents: list[Document], count: int) -> EvalSet:
    picks = validation_windows(documents, count, WINDOW_BYTES)
    if len(picks) < count:
        warnings.warn(f"ensemble validation: only {len(picks)} of {count} windows available", stacklevel=3)
    return EvalSet.from_picks(documents, picks)


def _test_set(candidates: list[Document], offsets: list[int], contaminated: np.ndarray, count: int,
              shingle_bytes: int) -> tuple[EvalSet, dict]:
    clean = [i for i, bad in enumerate(contaminated.tolist()) if not bad]
    chosen = clean[:count]
    if len(chosen) < count:
        warnings.warn(f"test set: only {len(chosen)} of {count} clean documents", stacklevel=3)
    stats = {
        "documents": len(chosen),
        "windows": len(chosen),
        "window_position": "one window per document at a seeded uniform offset",
        "screening": f"excluded candidates sharing any {shingle_bytes}-byte substring with a training document "
                     "(64-bit polynomial hashes of every shingle)",
        "candidates": len(candidates),
        "excluded": int(contaminated.sum()),
        "unused_clean_candidates": len(clean) - len(chosen),
    }
    return EvalSet.from_picks(candidates, [(i, offsets[i]) for i in chosen]), stats


def _describe(corpus: CorpusConfig) -> str:
    return "the demo corpus" if str(getattr(corpus.kind, "value", corpus.kind)) == "demo" else ", ".join(corpus.paths)
