"""The five datatrove stages of `shard` (see `soma_pl.data.sharding.shard` for the folder they build).

```
sequences (N tasks)  each task: its prepared shard files' documents joined end to end and cut into
                     1,024-byte sequences; each sequence's key (a seeded hash of file and position),
                     and the windows of its `kmeans_sample` smallest keys      -> seq/<rank>.*
fit       (1 task)   the sample: the `kmeans_sample` sequences of smallest key over all tasks; the
                     router fitted on their whole 1,024 bytes (tf–idf → SVD → balanced k-means; or
                     the random deal) and each sampled sequence's cluster      -> fit/*
assign    (N tasks)  each task: every sequence's expert (its sample cluster, else its nearest
                     centroid on the whole sequence; random: the deal), and whether the router,
                     reading only the first 256 bytes, picks it                -> assign/<rank>.*
write     (N tasks)  each task: every sequence written to its expert's shards, the smallest keys of
                     each expert (`expert_val_fraction`) to its expert-validation shards
                     (expert-NNN/{train,val}-<rank>-NNNNNN.tar)                -> write/<rank>.json
finish    (1 task)   router.pt, experts.json (sha256 of every shard); the folder renamed into place
```

Sequence keys depend on the seed and the prepared shard files alone, so any task count gives the
same experts and splits; only the grouping of sequences into tar files depends on it. A task's memory
is bounded by one prepared shard file and its sample; the fitting task's by the sample.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path

import numpy as np
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from tqdm import tqdm

from soma_pl import ROUTE_BYTES
from soma_pl.data.corpus.documents import Document
from soma_pl.data.formats.expert_sets import (
    EXPERTS_MANIFEST,
    FORMAT_VERSION,
    KIND,
    ROUTER_FILE,
    ExpertShardWriter,
    experts_fingerprint,
    experts_json,
)
from soma_pl.data.formats.tar_shards import iter_shard_documents
from soma_pl.data.runner.pipeline import to_pipeline
from soma_pl.data.runner.task_files import link_or_copy, peak_rss_mib, save_npz
from soma_pl.data.sharding.assign import (
    SEQUENCE_BYTES,
    cut_sequences,
    deal,
    fit_router,
    held_out_thresholds,
    nearest,
    sequence_keys,
)
from soma_pl.data.sharding.config import ShardConfig, Sharding
from soma_pl.errors import DataError
from soma_pl.io import atomic_folder, write_json_atomic
from soma_pl.models.router import Router

BLOCK = 4096
"""Sequences encoded at once."""


class PreparedShardsReader(PipelineStep):
    """The prepared dataset's shard files (training, then expert validation: the prepared split is
    no concern of `shard`, which cuts its own), dealt to tasks as datatrove deals files: task r reads
    files r, r + tasks, ..., in order (the same order in every pass). Each document's metadata says
    where it is (`place`: file, position).

    Args:
        paths: the shard files.
        progress: show a bar per task on stderr over its shard files, named `<stage> task <r>`
            (as `prepare`'s readers show theirs).
    """

    name = "soma_pl prepared shards"
    type = "📖 - READER"

    def __init__(self, paths: list[Path], progress: bool = False, stage: str = "read"):
        super().__init__()
        self.paths = [str(p) for p in paths]
        self.progress, self.stage_name = progress, stage

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        mine = [(index, path) for index, path in enumerate(self.paths) if index % world_size == rank]
        with tqdm(total=len(mine), desc=f"shard {self.stage_name} task {rank}", unit="file",
                  disable=not self.progress) as bar:
            for index, path in mine:
                for number, document in enumerate(iter_shard_documents(Path(path))):
                    self.stat_update("documents")
                    shared = to_pipeline(document)
                    shared.metadata["place"] = (index, number)  # corpus order: shard file, then position
                    yield shared
                bar.update()


class _Stage(PipelineStep):
    type = "🔪 - SOMA_PL"

    def __init__(self, config: ShardConfig, stage: Path, tasks: int = 1):
        super().__init__()
        self.config, self.stage, self.tasks = config, Path(stage), tasks

    def load(self, folder: str, task: int | str) -> dict:
        return dict(np.load(self.stage / folder / f"{task:05d}.npz" if isinstance(task, int) else
                            self.stage / folder / f"{task}.npz"))

    def meta(self, folder: str, task: int | str) -> dict:
        name = f"{task:05d}" if isinstance(task, int) else task
        return json.loads((self.stage / folder / f"{name}.json").read_text())

    def finish(self, folder: str, task: int | str, begun: float, record: dict, **arrays: np.ndarray) -> None:
        name = f"{task:05d}" if isinstance(task, int) else task
        if arrays:
            save_npz(self.stage / folder / f"{name}.npz", **arrays)
        write_json_atomic(self.stage / folder / f"{name}.json",
                          {**record, "peak_rss_mib": peak_rss_mib(), "seconds": round(time.perf_counter() - begun, 3)})


def file_sequences(data: DocumentsPipeline) -> Iterator[tuple[int, np.ndarray, list[str]]]:
    """Per prepared shard file of a task, in order: `(file index, its sequences [n, 1025] uint8,
    the source of each sequence's first byte)` (`cut_sequences` over the file's documents)."""
    current, texts, sources = None, [], []

    def cut():
        windows, first = cut_sequences(texts)
        return current, windows, [sources[i] for i in first]

    for shared in data or ():
        file = shared.metadata["place"][0]
        if current is not None and file != current:
            yield cut()
            texts, sources = [], []
        current = file
        texts.append(shared.text)
        sources.append(shared.metadata["source"])
    if current is not None:
        yield cut()


class CutSequences(_Stage):
    """Per task: its sequences' keys, files, positions and sources; its sample candidates."""

    name = "cut sequences"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        begun, size = time.perf_counter(), self.config.kmeans_sample
        names: dict[str, int] = {}
        keys, files, sources = [], [], []
        best_keys, best_windows = np.zeros(0, np.uint64), np.zeros((0, SEQUENCE_BYTES + 1), np.uint8)
        for file, windows, starts in file_sequences(data):
            mine = sequence_keys(self.config.seed, file, len(windows))
            keys.append(mine)
            files.append(np.full(len(windows), file, dtype=np.int32))
            sources.append(np.array([names.setdefault(n, len(names)) for n in starts], dtype=np.int32))
            best_keys, best_windows = np.concatenate([best_keys, mine]), np.concatenate([best_windows, windows])
            if len(best_keys) > size:
                keep = np.argpartition(best_keys, size - 1)[:size]
                best_keys, best_windows = best_keys[keep], best_windows[keep]
        save_npz(self.stage / "seq" / f"{rank:05d}-sample.npz", keys=best_keys, windows=best_windows)
        self.finish("seq", rank, begun, {"sources": list(names)}, keys=_join(keys, np.uint64),
                    files=_join(files, np.int32), sources=_join(sources, np.int32))
        return
        yield


def _join(parts: list[np.ndarray], dtype: type) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype)


class FitRouter(_Stage):
    """One task: the sample and the router fitted on it."""

    name = "fit router"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        candidates = [self.load("seq", f"{task:05d}-sample") for task in range(self.tasks)]
        keys = np.concatenate([c["keys"] for c in candidates])
        windows = np.concatenate([c["windows"] for c in candidates])
        order = np.argsort(keys, kind="stable")[: config.kmeans_sample]  # by key: any task count, one order
        keys, texts = keys[order], [row[:SEQUENCE_BYTES].tobytes() for row in windows[order]]
        if len(texts) < config.num_experts:
            raise DataError(f"shard.prepared={config.prepared} gives {len(texts)} sequences of "
                            f"{SEQUENCE_BYTES} bytes, fewer than shard.num_experts={config.num_experts}")
        random = Sharding(config.sharding) is Sharding.random
        router, labels = fit_router(texts, config.num_experts, config.seed, config.svd_dim, config.tfidf_max_features,
                                    config.tfidf_min_df, config.kmeans_n_init,
                                    deal(keys, config.num_experts) if random else None)
        router.save(self.stage / "fit" / ROUTER_FILE)
        self.finish("fit", "fit", begun, {"sample": len(keys), "vocabulary": len(router.encoder.vocabulary),
                                          "svd_dim": router.encoder.output_dim}, keys=keys, labels=labels)
        return
        yield


class AssignSequences(_Stage):
    """Per task: each sequence's expert, and whether the router reading 256 bytes agrees."""

    name = "assign sequences"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        router = Router.load(self.stage / "fit" / ROUTER_FILE)
        kept = config.kept_experts
        saved = router if kept == config.num_experts else Router(router.encoder, router.centroids[:kept])
        fitted = self.load("fit", "fit")
        labels, whole, prefix, counted = [], 0, 0, 0
        for file, windows, _ in file_sequences(data):
            keys = sequence_keys(config.seed, file, len(windows))
            for start in range(0, len(windows), BLOCK):
                rows, block = windows[start : start + BLOCK], keys[start : start + BLOCK]
                texts = [row[:SEQUENCE_BYTES].tobytes() for row in rows]
                closest = nearest(router, texts)
                mine = deal(block, config.num_experts) if Sharding(config.sharding) is Sharding.random else closest
                at = np.minimum(np.searchsorted(fitted["keys"], block), max(len(fitted["keys"]) - 1, 0))
                sampled = fitted["keys"][at] == block
                mine = np.where(sampled, fitted["labels"][at], mine)
                labels.append(mine)
                # the saved router's agreement, over the sequences of the experts written
                held = mine < kept
                whole += int(((closest if saved is router else nearest(saved, texts)) == mine)[held].sum())
                prefix += int((nearest(saved, [t[:ROUTE_BYTES] for t in texts]) == mine)[held].sum())
                counted += int(held.sum())
        labels = _join(labels, np.int64)
        self.finish("assign", rank, begun, {"whole_agreeing": whole, "prefix_agreeing": prefix, "counted": counted},
                    labels=labels)
        return
        yield


class WriteExperts(_Stage):
    """Per task: every sequence into its own shards of its expert, training or expert validation."""

    name = "write experts"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun, experts = self.config, time.perf_counter(), self.config.num_experts
        every = [(self.load("seq", t)["keys"], self.load("assign", t)["labels"]) for t in range(self.tasks)]
        every_key = np.concatenate([keys for keys, _ in every])
        replicated = Sharding(config.sharding) is Sharding.global_iid  # every expert holds every sequence
        if replicated:  # each expert holds out the same 1% of the whole corpus
            thresholds = np.repeat(held_out_thresholds(np.zeros(len(every_key), np.int64), every_key, 1,
                                                       config.expert_val_fraction), experts)
        else:
            thresholds = held_out_thresholds(np.concatenate([labels for _, labels in every]), every_key, experts,
                                             config.expert_val_fraction)
        labels, names, kept = every[rank][1], self.meta("seq", rank)["sources"], config.kept_experts
        writer = ExpertShardWriter(self.stage, kept, config.shard_max_bytes, task=rank)
        sizes = [{split: {"sequences": 0, "bytes": 0} for split in ("train", "val")} for _ in range(kept)]
        contingency = [Counter() for _ in range(kept)]
        position = 0
        try:
            for file, windows, sources in file_sequences(data):
                keys = sequence_keys(config.seed, file, len(windows))
                if position + len(windows) > len(labels):
                    raise DataError("prepared shards changed between the passes of shard")
                for number, (window, source) in enumerate(zip(windows, sources, strict=True)):
                    owner = int(labels[position])
                    for expert in range(kept) if replicated else (owner,) if owner < kept else ():
                        held = bool(keys[number] <= thresholds[expert])
                        split = "val" if held else "train"
                        writer.write(expert, Document(window.tobytes(), source, f"{file}:{number}"), validation=held)
                        sizes[expert][split]["sequences"] += 1
                        sizes[expert][split]["bytes"] += len(window)
                        contingency[expert][source] += not held
                    position += 1
            records = experts_json(writer.close())
        except BaseException:
            writer.abandon()
            raise
        if position != len(labels):
            raise DataError("prepared shards changed between the passes of shard")
        self.finish("write", rank, begun, {"records": records, "sizes": sizes, "sources": names,
                                           "contingency": [dict(c) for c in contingency]})
        return
        yield


class FinishShard(_Stage):
    """One task: the router and experts.json; the finished folder renamed into place."""

    name = "finish sharded folder"

    def __init__(self, config: ShardConfig, stage: Path, tasks: int, fingerprint: str, manifest: dict,
                 started: float):
        super().__init__(config, stage, tasks)
        self.fingerprint, self.manifest, self.started = fingerprint, manifest, started

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, experts = self.config, self.config.kept_experts
        output = Path(config.output_dir).expanduser()
        if experts_fingerprint(output) == self.fingerprint:
            return  # finished before a kill stopped the task from marking itself complete
        parts = [self.meta("write", task) for task in range(self.tasks)]
        assigned = [self.meta("assign", task) for task in range(self.tasks)]
        cut = [self.meta("seq", task) for task in range(self.tasks)]
        fitted = self.meta("fit", "fit")
        contingency = [sum((Counter(p["contingency"][e]) for p in parts), Counter()) for e in range(experts)]
        names = sorted({name for c in contingency for name in c})
        sizes = [{split: {key: sum(p["sizes"][e][split][key] for p in parts) for key in ("sequences", "bytes")}
                  for split in ("train", "val")} for e in range(experts)]
        records = [{split: [r for p in parts for r in p["records"][e][split]] for split in ("train", "val")}
                   for e in range(experts)]
        totals = {entry: {key: sum(s[split][key] for s in sizes) for key in ("sequences", "bytes")}
                  for entry, split in (("train", "train"), ("expert_val", "val"))}
        every = sum(len(self.load("seq", task)["keys"]) for task in range(self.tasks))  # each counted once
        members = [s["train"]["sequences"] + s["val"]["sequences"] for s in sizes]
        # the sequences written, each counted once (every expert holds every one under global_iid)
        sequences = every if Sharding(config.sharding) is Sharding.global_iid else sum(members)
        counted = sum(a["counted"] for a in assigned)  # the kept experts' sequences: what the agreement is over
        fitted_router = Router.load(self.stage / "fit" / ROUTER_FILE)
        router = Router(fitted_router.encoder, fitted_router.centroids[:experts], self.fingerprint)
        with atomic_folder(output, KIND, "shard.output_dir", config.inputs()) as work:
            for expert in records:
                for record in expert["train"] + expert["val"]:
                    (work / record["path"]).parent.mkdir(parents=True, exist_ok=True)
                    link_or_copy(self.stage / record["path"], work / record["path"])
            router.save(work / ROUTER_FILE)
            write_json_atomic(work / EXPERTS_MANIFEST, {
                "format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "dataset_fingerprint": self.manifest["fingerprint"],
                "config": json.loads(json.dumps(asdict(config), default=str)), "dataset_dir": str(config.prepared),
                "router": ROUTER_FILE, "sequences": sequences, "sequence_bytes": SEQUENCE_BYTES, **totals,
                "expert_sizes": sizes,
                "shard_sizes": {"min_sequences": min(members), "max_sequences": max(members),
                                "largest_over_smallest": round(max(members) / max(min(members), 1), 4)},
                "kmeans_sample": fitted["sample"], "vocabulary": fitted["vocabulary"], "svd_dim": fitted["svd_dim"],
                "contingency": [{name: int(c[name]) for name in names} for c in contingency],
                "purity": round(sum(max(c.values(), default=0) for c in contingency)
                                / max(totals["train"]["sequences"], 1), 4),
                "router_agreement": {
                    "whole_sequence": round(sum(a["whole_agreeing"] for a in assigned) / max(counted, 1), 4),
                    "first_256_bytes": round(sum(a["prefix_agreeing"] for a in assigned) / max(counted, 1), 4)},
                "tasks": self.tasks,
                "peak_rss_mib": {stage: [m["peak_rss_mib"] for m in metas]
                                 for stage, metas in (("sequences", cut), ("assign", assigned), ("write", parts))}
                                | {"fit": fitted["peak_rss_mib"]},
                "task_seconds": {stage: [m["seconds"] for m in metas]
                                 for stage, metas in (("sequences", cut), ("assign", assigned), ("write", parts))}
                                | {"fit": fitted["seconds"]},
                "shard_seconds": round(time.time() - self.started, 3),
                "num_experts": experts,
                **({"kept_from": {"num_experts": config.num_experts, "sequences": every}}
                   if experts < config.num_experts else {}),
                "experts": [{"train": e["train"], "val": e["val"]} for e in records],
            })
        return
        yield
