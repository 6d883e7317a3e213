"""The four datatrove stages of `prepare` (see `soma_pl.data.preparation.prepare` for the folder they build).

```
select  (N tasks)  each task: its documents' held-out candidates (smallest seeded id hashes: the
                   few that may be validation documents with their text, the others with only
                   their test window), short-document counts, expert-validation candidates
                                                                              -> select/<rank>.json
plan    (1 task)   the global held-out choice from the union of the tasks' candidates; the
                   ensemble-validation windows; the test candidate windows and their overlap
                   index (`OverlapIndex`, built once)                          -> plan.json
write   (N tasks)  each task, one document at a time through its steps: reader -> held-out split
                   (`SplitHeldOut` tags each document's split) -> overlap screen (`ScreenOverlap`
                   marks the candidates a training document overlaps: any shared 50-byte
                   substring, exact)                                          -> screen/<rank>.json
                   -> filter (datatrove's `LambdaFilter` drops the held-out documents) -> tar
                   writer (`WriteShards`: train/train-<rank>-NNNNNN.tar, expert_val/val-<rank>-NNNNNN.tar)
                                                                              -> write/<rank>.json
finish  (1 task)   the manifest (sha256 of every shard), the screened test set (and the final
                   test set after it); the finished folder is renamed into place
```

Held-out and expert-validation choices depend only on seeded hashes of document ids, so any task
count gives the same evaluation sets and the same training documents. The shard files (how the
documents are grouped and ordered into tars) depend on the task count.
"""

from __future__ import annotations

import json
import os
import time
import warnings
from collections import Counter
from pathlib import Path

import numpy as np
from datatrove.data import Document as PipelineDocument
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.documents import Document
from soma_pl.data.corpus.readers import corpus_change, corpus_changed, corpus_fingerprint, corpus_inputs
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import FORMAT_VERSION, KIND, MANIFEST, existing_fingerprint
from soma_pl.data.formats.tar_shards import ShardRecord, ShardWriter, sha256_file
from soma_pl.data.preparation.config import PrepareConfig, config_json
from soma_pl.data.preparation.heldout import ExpertValChoice, HeldOutSelector, document_rank, validation_windows
from soma_pl.data.preparation.overlap import OverlapIndex
from soma_pl.data.runner.pipeline import from_pipeline, read_documents
from soma_pl.data.runner.task_files import base_pages, link_or_copy, peak_rss_mib
from soma_pl.errors import DataError
from soma_pl.io import atomic_folder, close_quietly, write_atomic, write_json_atomic

SCREEN_BATCH_BYTES = 4_000_000
"""Training bytes screened at once (one vectorised lookup)."""


class _Stage(PipelineStep):
    type = "🔪 - SOMA_PL"

    def __init__(self, config: PrepareConfig, stage: Path):
        super().__init__()
        self.config = config
        self.stage = Path(stage)

    def held_count(self) -> int:
        return self.config.val_documents + self.config.test_candidates


class SelectHeldOut(_Stage):
    """Per task: the `held_count` smallest-rank documents of its share, trimmed to what evaluation
    needs, and the expert-validation choice's smallest hashes."""

    name = "select held-out"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        # Only a document among a task's `val_documents` smallest ranks can be an ensemble-validation
        # document; the other held-out documents are test candidates and keep only their test window.
        keep_bytes = max(config.val_windows, 1) * WINDOW_BYTES
        validation = HeldOutSelector(config.seed, config.val_documents, keep_bytes)
        candidates = HeldOutSelector(config.seed, self.held_count(), keep_bytes, test_window=True)
        expert_val = ExpertValChoice(config.seed, config.expert_val_fraction, self.held_count() + 1)
        short, eligible = Counter(), 0
        for document in read_documents(data):
            expert_val.offer(document.doc_id)
            if len(document.text) < WINDOW_BYTES:  # no evaluation window in it: training text only
                short[document.source] += 1
                continue
            eligible += 1
            order = document_rank(config.seed, document.doc_id)
            validation.offer(document, order)
            candidates.offer(document, order)
        folder = self.stage / "select"
        write_json_atomic(folder / f"{rank:05d}.json", {
            "documents": eligible, "short": dict(short),
            "validation": save_documents(validation.selected(), folder / f"validation-{rank:05d}"),
            "candidates": save_documents(candidates.selected(), folder / f"candidates-{rank:05d}",
                                         offsets=candidates.offsets()),
            "expert_val_smallest": expert_val.smallest(), "peak_rss_mib": peak_rss_mib(),
            "seconds": round(time.perf_counter() - begun, 3),
        })
        return
        yield


class PlanHeldOut(_Stage):
    """One task: the global held-out choice, the ensemble-validation set and the test candidates."""

    name = "plan held-out"

    def __init__(self, config: PrepareConfig, stage: Path, tasks: int):
        super().__init__(config, stage)
        self.tasks = tasks

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with base_pages():
            self._plan()
        return
        yield

    def _plan(self) -> None:
        config, begun = self.config, time.perf_counter()
        parts = [json.loads((self.stage / "select" / f"{task:05d}.json").read_text()) for task in range(self.tasks)]
        held: list[tuple[Document, int]] = []  # (test window, its offset) of each held document
        full: dict[str, Document] = {}
        for part in parts:
            windows = self.stage / "select" / part["candidates"]
            held.extend(zip(load_documents(windows), json.loads(windows.with_suffix(".json").read_text())["offsets"],
                            strict=False))
            full.update((d.doc_id, d) for d in load_documents(self.stage / "select" / part["validation"]))
        held.sort(key=lambda pair: (document_rank(config.seed, pair[0].doc_id), pair[0].doc_id))
        held = held[: self.held_count()]
        short = sum((Counter(p["short"]) for p in parts), Counter())
        if not held and not short:
            raise DataError(f"empty corpus: no documents in {describe(config)}")
        if len(held) < self.held_count():
            raise DataError(f"corpus too small: {len(held)} documents of >= {WINDOW_BYTES} bytes, "
                            f"{self.held_count()} needed for held-out sets")
        val_docs = [full[d.doc_id] for d, _ in held[: config.val_documents]]
        candidates = held[config.val_documents :]
        held_ids = {d.doc_id for d, _ in held}
        expert_val = ExpertValChoice(config.seed, config.expert_val_fraction, self.held_count() + 1)
        for part in parts:
            for doc_id in part["expert_val_smallest"]:
                expert_val.offer(doc_id)
        expert_val.exclude(held_ids)
        EvalSet.from_picks(val_docs, validation_windows(val_docs, config.val_windows, WINDOW_BYTES)).save(
            self.stage / "ensemble_val.npz")
        candidate_set = EvalSet.from_picks([d for d, _ in candidates], [(i, 0) for i in range(len(candidates))])
        candidate_set.offsets = np.array([offset for _, offset in candidates], dtype=np.int64)
        candidate_set.save(self.stage / "candidates.npz")
        threads = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
        windows = [w.tobytes() for w in candidate_set.windows]
        OverlapIndex(windows, config.shingle_bytes, threads=threads).save(self.stage)
        write_json_atomic(self.stage / "plan.json", {
            "held_ids": sorted(held_ids), "expert_val_fallback": expert_val.fallback,
            "final_only_ids": sorted(d.doc_id for d, _ in candidates[config.test_own_candidates :]),
            "short": dict(sorted(short.items())), "documents": sum(p["documents"] for p in parts),
            "seconds": round(time.perf_counter() - begun, 3),
        })


class SplitHeldOut(_Stage):
    """Per task: tag each document's `metadata["split"]` by the plan: `held` (an evaluation
    document), `final_only` (held out only for the final split), `expert_val` (a seeded hash of
    its id) or `train`."""

    name = "held-out split"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        plan = json.loads((self.stage / "plan.json").read_text())
        held, final_only = set(plan["held_ids"]), set(plan["final_only_ids"])
        expert_val = ExpertValChoice(self.config.seed, self.config.expert_val_fraction, 0)
        expert_val.fallback = plan["expert_val_fallback"]
        for document in data:
            if document.id in held:
                split = "final_only" if document.id in final_only else "held"
            else:
                split = "expert_val" if expert_val.holds(document.id) else "train"
            document.metadata["split"] = split
            self.stat_update(split)
            yield document


SCREENED_AS = {"train": "training", "expert_val": "training", "final_only": "final_only"}
"""Which marks a document of each split screens the candidates into (a held document: none)."""


class ScreenOverlap(_Stage):
    """Per task: mark the test candidates sharing a `shingle_bytes`-long substring with a training
    document (expert validation included), passing every document on; `SCREEN_BATCH_BYTES` at a
    time through the planning task's `OverlapIndex`.

    The documents held out only for the final split would be training documents in a build without
    one: the candidates are screened against them too, apart, so that `test` excludes what it would
    exclude without a final split and keeps its documents."""

    name = "overlap screen"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        with base_pages():
            windows = [w.tobytes() for w in EvalSet.load(self.stage / "candidates.npz").windows]
            index = OverlapIndex.load(self.stage, windows, self.config.shingle_bytes)
        marks = {which: np.zeros(len(windows), dtype=bool) for which in ("training", "final_only")}
        pending = {which: [] for which in marks}  # texts not screened yet: up to SCREEN_BATCH_BYTES each
        size = dict.fromkeys(marks, 0)

        def screen(which: str) -> None:
            with base_pages():
                marks[which][index.find(pending[which])] = True
            pending[which], size[which] = [], 0

        for document in data:  # each passed on at once: the marks are read only when the task ends
            which = SCREENED_AS.get(document.metadata["split"])
            if which is not None:
                pending[which].append(document.text)
                size[which] += len(document.text)
                if size[which] >= SCREEN_BATCH_BYTES:
                    screen(which)
            yield document
        screen("training")
        screen("final_only")
        write_json_atomic(self.stage / "screen" / f"{rank:05d}.json", {
            "contaminated": np.flatnonzero(marks["training"]).tolist(),
            "contaminated_by_final_only": np.flatnonzero(marks["final_only"]).tolist()})


def is_training(document: PipelineDocument) -> bool:
    """The documents `WriteShards` takes (`LambdaFilter` drops the others: the held-out ones)."""
    return document.metadata["split"] in ("train", "expert_val")


class WriteShards(_Stage):
    """Per task: write the training documents into its own WebDataset shards, by `metadata["split"]`
    (train/train-<rank>-NNNNNN.tar, expert_val/val-<rank>-NNNNNN.tar)."""

    name = "write shards"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        writers = {"train": ShardWriter(self.stage / "train", f"train-{rank:05d}", config.shard_max_bytes),
                   "expert_val": ShardWriter(self.stage / "expert_val", f"val-{rank:05d}", config.shard_max_bytes)}
        counts = {split: Counter() for split in ("documents", "bytes", "val_documents", "val_bytes")}
        try:
            for document in data:
                split, source = document.metadata["split"], document.metadata["source"]
                writers[split].write(from_pipeline(document))
                prefix = "val_" if split == "expert_val" else ""
                counts[f"{prefix}documents"][source] += 1
                counts[f"{prefix}bytes"][source] += len(document.text)
            records = {split: writer.close() for split, writer in writers.items()}
        except BaseException:
            close_quietly(writers.values())
            raise
        write_json_atomic(self.stage / "write" / f"{rank:05d}.json", {
            "records": {split: [r.to_json() for r in rs] for split, rs in records.items()},
            "counts": {key: dict(counter) for key, counter in counts.items()},
            "peak_rss_mib": peak_rss_mib(), "seconds": round(time.perf_counter() - begun, 3),
        })
        return
        yield


class FinishPrepare(_Stage):
    """One task: merge the tasks' results into the prepared folder and rename it into place."""

    name = "finish prepared folder"

    def __init__(self, config: PrepareConfig, stage: Path, tasks: int, fingerprint: str, corpus: dict,
                 started: float):
        super().__init__(config, stage)
        self.tasks, self.fingerprint, self.corpus, self.started = tasks, fingerprint, corpus, started

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        output = Path(self.config.output_dir).expanduser()
        if existing_fingerprint(output) == self.fingerprint:
            return  # finished before a kill stopped the task from marking itself complete
        self._check_corpus()
        with atomic_folder(output, KIND, "dataset.output_dir", corpus_inputs(self.config.corpus)) as work:
            manifest = self._merge(work)
            manifest["fingerprint"] = self.fingerprint
            write_json_atomic(work / MANIFEST, manifest)
        return
        yield

    def _check_corpus(self) -> None:
        try:
            change = corpus_change(self.corpus, corpus_fingerprint(self.config.corpus))
        except DataError as error:
            change = str(error)
        if change:
            raise corpus_changed(change)

    def _merge(self, work: Path) -> dict:
        config = self.config
        plan = json.loads((self.stage / "plan.json").read_text())
        parts = [json.loads((self.stage / "write" / f"{task:05d}.json").read_text()) for task in range(self.tasks)]
        shards = {split: [ShardRecord(**r) for p in parts for r in p["records"][split]]
                  for split in ("train", "expert_val")}
        if not shards["train"]:
            raise DataError(f"no training documents left in {describe(config)}")
        screens = [json.loads((self.stage / "screen" / f"{task:05d}.json").read_text()) for task in range(self.tasks)]
        test_splits = self._test_splits(work, {i for p in screens for i in p["contaminated"]},
                                        {i for p in screens for i in p["contaminated_by_final_only"]})
        for record in shards["train"] + shards["expert_val"]:
            (work / record.path).parent.mkdir(parents=True, exist_ok=True)
            link_or_copy(self.stage / record.path, work / record.path)
        totals = {key: sum((Counter(p["counts"][key]) for p in parts), Counter())
                  for key in ("documents", "bytes", "val_documents", "val_bytes")}
        val = EvalSet.load(self.stage / "ensemble_val.npz")
        val.save(work / "ensemble_val.npz")
        sources = sorted(totals["documents"])
        return {
            "format": FORMAT_VERSION,
            "config": config_json(config),
            "seed": config.seed,
            "window_bytes": WINDOW_BYTES,
            "train": {"documents": sum(totals["documents"].values()), "bytes": sum(totals["bytes"].values()),
                      "sources": {s: {"documents": totals["documents"][s], "bytes": totals["bytes"][s]}
                                  for s in sources},
                      "shards": [s.to_json() for s in shards["train"]]},
            "expert_val": {"documents": sum(totals["val_documents"].values()),
                           "bytes": sum(totals["val_bytes"].values()), "fraction": config.expert_val_fraction,
                           "shards": [s.to_json() for s in shards["expert_val"]]},
            "short_documents": plan["short"],
            "ensemble_val": {"file": "ensemble_val.npz", "documents": len(set(val.doc_ids.tolist())),
                             "windows": len(val), "wanted": config.val_windows,
                             "sha256": sha256_file(work / "ensemble_val.npz")},
            **test_splits,
            "tasks": self.tasks,
            "peak_rss_mib": {"select": [self._select_part(task)["peak_rss_mib"] for task in range(self.tasks)],
                             "write": [p["peak_rss_mib"] for p in parts]},
            "task_seconds": {"select": [self._select_part(task)["seconds"] for task in range(self.tasks)],
                             "plan": plan["seconds"], "write": [p["seconds"] for p in parts]},
            "prepare_seconds": round(time.time() - self.started, 3),
        }

    def _test_splits(self, work: Path, contaminated: set[int], by_final_only: set[int]) -> dict:
        """Write `test.npz` (and `test_final.npz`) into `work`; return their manifest entries.

        `test` takes, in held-out rank order, the first `test_windows` of its own candidates (the
        first `test_own_candidates`) that share nothing with a training document nor with a document
        held out only for the final split: what it takes without a final split. `test_final` takes
        the next `final_test_windows` of the other candidates that share nothing with a training
        document.

        Args:
            contaminated: the candidates sharing a substring with a training document.
            by_final_only: the candidates sharing one with a document held out only for the final split.

        Raises:
            DataError: a final split is asked for and too few candidates pass the screen to fill it.
        """
        config = self.config
        candidates = EvalSet.load(self.stage / "candidates.npz")
        own = min(config.test_own_candidates, len(candidates))
        excluded = (contaminated | by_final_only) & set(range(own))
        chosen = [i for i in range(own) if i not in excluded][: config.test_windows]
        taken = set(chosen)
        clean = [i for i in range(len(candidates)) if i not in contaminated and i not in taken]
        final = clean[: config.final_test_windows]
        if len(final) < config.final_test_windows:
            raise DataError(f"too few clean test documents: {len(clean) + len(chosen)} of {len(candidates)} candidates "
                            f"pass the overlap screen, {config.test_windows} test + {config.final_test_windows} final "
                            f"test needed in {describe(config)}: raise dataset.test_oversample or use a larger corpus")
        screening = (f"excluded candidates sharing any {config.shingle_bytes}-byte substring with a training document "
                     "(exact: hashed lookups verified on the bytes)")
        position = "one window per document at a seeded uniform offset"
        candidates.select(chosen).save(work / "test.npz")
        entries = {"test": {"file": "test.npz", "documents": len(chosen), "windows": len(chosen),
                            "wanted": config.test_windows, "sha256": sha256_file(work / "test.npz"),
                            "window_position": position, "screening": screening, "candidates": own,
                            "excluded": len(excluded),
                            "unused_clean_candidates": len(clean) - len(final)}}
        if config.final_test_windows:
            entries["test"]["screening"] += ", or with a document held out only for the final split"
            entries["test"]["excluded_by_final_only"] = len(excluded - contaminated)
            candidates.select(final).save(work / "test_final.npz")
            entries["test_final"] = {
                "file": "test_final.npz", "documents": len(final), "windows": len(final),
                "wanted": config.final_test_windows, "sha256": sha256_file(work / "test_final.npz"),
                "window_position": position, "screening": screening,
                "candidates": len(candidates) - len(chosen), "added_candidates": len(candidates) - own,
                "excluded": len(contaminated),
                "drawn": "the candidates left after `test` that pass the screen, in held-out rank order",
                "use": "reported only by the final runs of a reproduction; development reports `test`"}
        return entries

    def _select_part(self, task: int) -> dict:
        return json.loads((self.stage / "select" / f"{task:05d}.json").read_text())


def describe(config: PrepareConfig) -> str:
    kind = str(getattr(config.corpus.kind, "value", config.corpus.kind))
    return "the demo corpus" if kind == "demo" else ", ".join(config.corpus.paths)


def warn_about(manifest: dict) -> None:
    """The warnings of a finished build (its tasks may have run in other processes)."""
    for name, label in (("ensemble_val", "ensemble validation: only {} of {} windows available"),
                        ("test", "test set: only {} of {} clean documents")):
        entry = manifest[name]
        if entry["windows"] < entry["wanted"]:
            warnings.warn(label.format(entry["windows"], entry["wanted"]), stacklevel=3)


def save_documents(documents: list[Document], path: Path, **extra: list) -> str:
    """Write documents as `<path>.bin` (their texts, back to back) and `<path>.json` (lengths,
    provenance and `extra` lists, written last); return the name to give `load_documents`. A stage's
    private hand-off: no tar parsing for the held-out documents the planning task reads back."""
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(b"".join(d.text for d in documents), path.with_suffix(".bin"))
    write_json_atomic(path.with_suffix(".json"), {
        "lengths": [len(d.text) for d in documents], "ids": [d.doc_id for d in documents],
        "sources": [d.source for d in documents], "titles": [d.title for d in documents], **extra})
    return path.name


def load_documents(path: Path) -> list[Document]:
    meta = json.loads(path.with_suffix(".json").read_text())
    text = path.with_suffix(".bin").read_bytes()
    ends = np.cumsum(meta["lengths"]).tolist()
    starts = [0, *ends[:-1]]
    if (ends[-1] if ends else 0) != len(text):
        raise DataError(f"{path.with_suffix('.bin')} does not hold the documents {path.with_suffix('.json')} lists")
    return [Document(text[a:b], source, doc_id, title)
            for a, b, source, doc_id, title in zip(starts, ends, meta["sources"], meta["ids"], meta["titles"],
                                                   strict=False)]
