"""The four datatrove stages of `shard` (see `soma_pl.data.sharding.shard` for the folder they build).

```
embed   (N tasks)  each task: the first 256 bytes of each document of its prepared training and
                   expert-validation shards, encoded -> embed/<rank>.f32 (raw float32 rows) and
                   embed/<rank>.npz (per document: source, split, seeded sample and deal keys; the
                   sum of its training documents' encodings)
fit     (1 task)   per split, a sample: the `kmeans_sample` documents of smallest sample key over all
                   tasks. The hashed encoder's centre (training documents); k-means and rebalancing
                   on the training sample (or the random deal); the expert-validation sample's
                   nearest fitted centroids, rebalanced (or the same deal)    -> fit/*.npz
write   (N tasks)  each task: every document's expert (its sample's choice, else its nearest fitted
                   centroid, or for random sharding its deal key modulo N), written into its own
                   shards of that expert, in the document's prepared split
                   (expert-NNN/{train,val}-<rank>-NNNNNN.tar); per expert, sums of training
                   encodings and counts per source                             -> write/<rank>.json
finish  (1 task)   router.pt (centroids: each expert's mean encoding over its training documents),
                   experts.json (sha256 of every shard); the finished folder renamed into place
```

A task's memory is bounded by its batch of encodings and the fitting task's by the samples, whatever
the corpus size. Which documents are sampled, and the samples' order, depend only on seeded hashes
of document ids, so any task count gives the same experts; only the grouping of documents into tar
files depends on it. When a split fits in its sample, every training document's expert is the
k-means (and rebalancing) choice and every expert-validation document's its nearest fitted centroid,
rebalanced so that each expert has at least one; a document outside its sample goes to its nearest
fitted centroid (random sharding: its deal key modulo N).
"""

from __future__ import annotations

import json
import time
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
from datatrove.data import DocumentsPipeline
from datatrove.pipeline.base import PipelineStep
from tqdm import tqdm

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
from soma_pl.data.preparation.heldout import seeded_hash
from soma_pl.data.runner.pipeline import from_pipeline, to_pipeline
from soma_pl.data.runner.task_files import link_or_copy, peak_rss_mib, save_npz
from soma_pl.data.sharding.assign import assign_expert_val, assign_labels, expert_centroids
from soma_pl.data.sharding.config import ShardConfig, Sharding, make_encoder
from soma_pl.errors import DataError
from soma_pl.io import atomic_folder, write_json_atomic
from soma_pl.models.router import EncoderKind, Router, prefix_batch


class PreparedShardsReader(PipelineStep):
    """The prepared dataset's training shards, then its expert-validation shards, dealt to tasks as
    datatrove deals files: task r reads files r, r + tasks, ..., in order (the same order in every
    pass). Each document's metadata says where it is (`place`: file, position) and whether it is an
    expert-validation document (`expert_val`).

    Args:
        paths: the training shard files.
        progress: show a bar per task on stderr over its shard files, named `<stage> task <r>`
            (as `prepare`'s readers show theirs).
        expert_val_paths: the expert-validation shard files.
    """

    name = "soma_pl prepared shards"
    type = "📖 - READER"

    def __init__(self, paths: list[Path], progress: bool = False, stage: str = "read",
                 expert_val_paths: list[Path] = ()):
        super().__init__()
        self.paths = [str(p) for p in [*paths, *expert_val_paths]]
        self.training_files = len(paths)
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
                    shared.metadata["expert_val"] = index >= self.training_files
                    yield shared
                bar.update()


class _Stage(PipelineStep):
    type = "🔪 - SOMA_PL"

    def __init__(self, config: ShardConfig, stage: Path, threads: int | None = None):
        """`threads`: torch threads of each task (None: torch's default); tasks that share a
        machine's cores split them instead of each starting one thread per core."""
        super().__init__()
        self.config = config
        self.stage = Path(stage)
        self.threads = threads

    def share_cores(self) -> None:
        if self.threads is not None and torch.get_num_threads() != self.threads:
            torch.set_num_threads(self.threads)


def _centred(raw: np.ndarray, center: np.ndarray) -> np.ndarray:
    """Encodings as the centred encoder gives them (`HashedNgramEncoder.encode`): unit(raw - center)."""
    if not center.any():
        return np.asarray(raw, dtype=np.float32)
    rows = torch.from_numpy(np.array(raw, dtype=np.float32)) - torch.from_numpy(center)  # a copy: memmaps are read-only
    return (rows / rows.norm(dim=1, keepdim=True).clamp_min(1e-12)).numpy()  # router._unit


class EmbedDocuments(_Stage):
    """Per task: encode each document's first 256 bytes; keep its keys, not its text."""

    name = "embed"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        self.share_cores()
        encoder = make_encoder(config)
        folder = self.stage / "embed"
        folder.mkdir(parents=True, exist_ok=True)
        names: dict[str, int] = {}
        sources, sample, deal, expert_val, places, batch = [], [], [], [], [], []
        total = None
        raw = folder / f"{rank:05d}.f32"
        with open(raw, "wb") as rows:
            def flush() -> None:
                nonlocal total
                if batch:
                    encoded = encoder.encode(prefix_batch(batch, config.device)).cpu().numpy().astype(np.float32)
                    rows.write(encoded.tobytes())
                    # the centre is the training documents' mean: nothing is fitted on validation data
                    training = ~np.array(expert_val[len(expert_val) - len(batch):], dtype=bool)
                    total = encoded[training].astype(np.float64).sum(0) + (0 if total is None else total)
                    batch.clear()

            for shared in data or ():
                document = from_pipeline(shared)
                places.append(shared.metadata["place"])
                expert_val.append(shared.metadata["expert_val"])
                batch.append(document.text)
                sources.append(names.setdefault(document.source, len(names)))
                sample.append(seeded_hash(config.seed, "sample", document.doc_id))
                deal.append(seeded_hash(config.seed, "deal", document.doc_id))
                if len(batch) == config.embed_batch_size:
                    flush()
            flush()
        dim = int(encoder.output_dim)
        save_npz(folder / f"{rank:05d}.npz", sources=np.array(sources, dtype=np.int32),
                 sample=np.array(sample, dtype=np.uint64), deal=np.array(deal, dtype=np.uint64),
                 expert_val=np.array(expert_val, dtype=bool), places=np.array(places, dtype=np.int64).reshape(-1, 2),
                 sum=np.zeros(dim) if total is None else total)
        write_json_atomic(folder / f"{rank:05d}.json", {"documents": len(sources), "dim": dim, "sources": list(names),
                                                         "peak_rss_mib": peak_rss_mib(),
                                                         "seconds": round(time.perf_counter() - begun, 3)})
        return
        yield


def load_embeddings(stage: Path, rank: int) -> np.ndarray:
    """A task's raw encodings, `[n, dim]` float32, memory-mapped."""
    meta = json.loads((stage / "embed" / f"{rank:05d}.json").read_text())
    if meta["documents"] == 0:
        return np.zeros((0, meta["dim"]), dtype=np.float32)
    return np.memmap(stage / "embed" / f"{rank:05d}.f32", dtype=np.float32, mode="r",
                     shape=(meta["documents"], meta["dim"]))


class FitExperts(_Stage):
    """One task: the samples, the centre, k-means (or the random deal) on the training sample and
    the expert-validation sample's experts by the same rule."""

    name = "fit experts"

    def __init__(self, config: ShardConfig, stage: Path, tasks: int):
        super().__init__(config, stage)
        self.tasks = tasks

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        keys = [dict(np.load(self.stage / "embed" / f"{task:05d}.npz")) for task in range(self.tasks)]
        # `shard` checked that each split holds at least one document per expert (`check_splits`)
        documents = {split: sum(int((k["expert_val"] == split).sum()) for k in keys) for split in (False, True)}
        center = np.zeros(keys[0]["sum"].shape, dtype=np.float32)
        if EncoderKind(config.embedder) is EncoderKind.hashed and config.hashed_center:
            center = (sum(k["sum"] for k in keys) / documents[False]).astype(np.float32)
        tasks, positions = self._sample(keys, expert_val=False)
        embeddings = self._embeddings(tasks, positions, center)
        labels, moved = assign_labels(config, embeddings, _gather(keys, "deal", tasks, positions))
        centroids = expert_centroids(embeddings, labels, config.num_experts)
        val_tasks, val_positions = self._sample(keys, expert_val=True)
        val_labels, val_moved = assign_expert_val(config, self._embeddings(val_tasks, val_positions, center),
                                                  _gather(keys, "deal", val_tasks, val_positions), centroids)
        folder = self.stage / "fit"
        for task in range(self.tasks):
            mine, theirs = tasks == task, val_tasks == task
            save_npz(folder / f"{task:05d}.npz", positions=np.concatenate([positions[mine], val_positions[theirs]]),
                     labels=np.concatenate([labels[mine], val_labels[theirs]]))
        save_npz(folder / "fit.npz", center=center, centroids=centroids)
        write_json_atomic(folder / "fit.json", {
            "documents": documents[False], "expert_val_documents": documents[True], "sample": len(tasks),
            "expert_val_sample": len(val_tasks), "rebalanced_documents": moved,
            "rebalanced_expert_val_documents": val_moved, "random": Sharding(config.sharding) is Sharding.random,
            "peak_rss_mib": peak_rss_mib(), "seconds": round(time.perf_counter() - begun, 3)})
        return
        yield

    def _sample(self, keys: list[dict], expert_val: bool) -> tuple[np.ndarray, np.ndarray]:
        """A split's sample, `(tasks [n], positions [n])`: its `kmeans_sample` documents of smallest
        sample key over all tasks (each task's own smallest first; ties: task, position), in corpus
        order (shard file, then position), so that any task count, and a split inside the sample,
        is clustered exactly as one pass over it would be."""
        size = min(self.config.kmeans_sample, sum(int((k["expert_val"] == expert_val).sum()) for k in keys))
        picks = []
        for task, k in enumerate(keys):
            members = np.flatnonzero(k["expert_val"] == expert_val)
            if len(members) > size:
                members = members[np.argpartition(k["sample"][members], size - 1)[:size]]
            picks.append(np.stack([k["sample"][members], np.full(len(members), task, dtype=np.uint64),
                                   members.astype(np.uint64)], axis=1))
        picks = np.concatenate(picks)
        picks = picks[np.lexsort((picks[:, 2], picks[:, 1], picks[:, 0]))][:size]  # by key (ties: task, position)
        tasks, positions = picks[:, 1].astype(np.int64), picks[:, 2].astype(np.int64)
        places = _gather(keys, "places", tasks, positions)
        order = np.lexsort((places[:, 1], places[:, 0]))
        return tasks[order], positions[order]

    def _embeddings(self, tasks: np.ndarray, positions: np.ndarray, center: np.ndarray) -> np.ndarray:
        """The centred encodings `[n, dim]` of the documents at `(tasks, positions)`, in their order."""
        raw = np.zeros((len(tasks), len(center)), dtype=np.float32)
        for task in range(self.tasks):
            mine = tasks == task
            raw[mine] = load_embeddings(self.stage, task)[positions[mine]]
        return _centred(raw, center)


def _gather(keys: list[dict], name: str, tasks: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`keys[task][name][position]` for each (task, position) pair, in their order."""
    first = keys[0][name]
    out = np.zeros((len(tasks), *first.shape[1:]), dtype=first.dtype)
    for task, k in enumerate(keys):
        mine = tasks == task
        out[mine] = k[name][positions[mine]]
    return out


class WriteExperts(_Stage):
    """Per task: each document's expert, written into the task's own shards of that expert in the
    document's prepared split (training or expert validation)."""

    name = "write experts"

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config, begun = self.config, time.perf_counter()
        self.share_cores()
        experts = config.num_experts
        fit = dict(np.load(self.stage / "fit" / "fit.npz"))
        fitted = json.loads((self.stage / "fit" / "fit.json").read_text())
        chosen = dict(np.load(self.stage / "fit" / f"{rank:05d}.npz"))
        keys = dict(np.load(self.stage / "embed" / f"{rank:05d}.npz"))
        raw = load_embeddings(self.stage, rank)
        validation = keys["expert_val"]
        labels, sums, agreeing = self._assign(raw, fit, keys["deal"], fitted["random"], chosen, validation)
        names = json.loads((self.stage / "embed" / f"{rank:05d}.json").read_text())["sources"]
        writer = ExpertShardWriter(self.stage, experts, config.shard_max_bytes, task=rank)
        sizes = [{split: {"documents": 0, "bytes": 0} for split in ("train", "val")} for _ in range(experts)]
        contingency = [Counter() for _ in range(experts)]
        written = 0
        try:
            for position, document in enumerate(from_pipeline(d) for d in data or ()):
                written += 1
                if position >= len(labels):
                    raise DataError("prepared shards changed between the two passes")
                expert, held = int(labels[position]), bool(validation[position])
                split = "val" if held else "train"
                writer.write(expert, document, validation=held)
                sizes[expert][split]["documents"] += 1
                sizes[expert][split]["bytes"] += len(document.text)
                if not held:
                    contingency[expert][names[keys["sources"][position]]] += 1
            records = experts_json(writer.close())
        except BaseException:
            writer.abandon()
            raise
        if written != len(labels):
            raise DataError("prepared shards changed between the two passes")
        write_json_atomic(self.stage / "write" / f"{rank:05d}.json", {
            "records": records, "sizes": sizes, "contingency": [dict(c) for c in contingency],
            "sums": sums.tolist(), "counts": np.bincount(labels[~validation], minlength=experts).tolist(),
            "agreeing": agreeing, "peak_rss_mib": peak_rss_mib(),
            "seconds": round(time.perf_counter() - begun, 3)})
        return
        yield

    def _assign(self, raw: np.ndarray, fit: dict, deal: np.ndarray, random: bool, chosen: dict,
                validation: np.ndarray) -> tuple[np.ndarray, np.ndarray, int]:
        """Every document's expert (its sample's choice, else the nearest fitted centroid or, for
        random sharding, the deal key modulo N); per expert the sum of its training documents'
        centred encodings; how many training documents their nearest fitted centroid places in
        their expert. `validation` `[n]` bool marks the expert-validation documents. A block of
        encodings at a time: memory does not grow with the task's documents."""
        experts, block = self.config.num_experts, 65536
        fixed = np.full(len(raw), -1, dtype=np.int64)
        fixed[chosen["positions"]] = chosen["labels"]
        labels = np.empty(len(raw), dtype=np.int64)
        sums, agreeing = np.zeros((experts, len(fit["center"]))), 0
        for start in range(0, len(raw), block):
            embeddings = _centred(raw[start : start + block], fit["center"])
            nearest = _nearest(embeddings, fit["centroids"])
            mine = (deal[start : start + block] % np.uint64(experts)).astype(np.int64) if random else nearest
            mine = np.where(fixed[start : start + block] >= 0, fixed[start : start + block], mine)
            labels[start : start + block] = mine
            training = ~validation[start : start + block]
            np.add.at(sums, mine[training], embeddings[training].astype(np.float64))
            agreeing += int(((nearest == mine) & training).sum())
        return labels, sums, agreeing


def _nearest(embeddings: np.ndarray, centroids: np.ndarray) -> np.ndarray:
    """Index of the nearest centroid per row (‖x‖² is the same for every centroid)."""
    if not len(embeddings):
        return np.zeros(0, dtype=np.int64)
    return ((centroids ** 2).sum(1)[None] - 2 * embeddings @ centroids.T).argmin(axis=1).astype(np.int64)


class FinishShard(_Stage):
    """One task: the router and experts.json; the finished folder renamed into place."""

    name = "finish sharded folder"

    def __init__(self, config: ShardConfig, stage: Path, tasks: int, fingerprint: str, manifest: dict,
                 started: float):
        super().__init__(config, stage)
        self.tasks, self.fingerprint, self.manifest, self.started = tasks, fingerprint, manifest, started

    def run(self, data: DocumentsPipeline = None, rank: int = 0, world_size: int = 1) -> DocumentsPipeline:
        config = self.config
        output = Path(config.output_dir).expanduser()
        if experts_fingerprint(output) == self.fingerprint:
            return  # finished before a kill stopped the task from marking itself complete
        experts = config.num_experts
        parts = [json.loads((self.stage / "write" / f"{task:05d}.json").read_text()) for task in range(self.tasks)]
        fitted = json.loads((self.stage / "fit" / "fit.json").read_text())
        fit = dict(np.load(self.stage / "fit" / "fit.npz"))
        counts = np.sum([p["counts"] for p in parts], axis=0)
        sums = np.sum([p["sums"] for p in parts], axis=0)
        centroids = (sums / np.maximum(counts, 1)[:, None]).astype(np.float32)
        encoder = make_encoder(replace(config, device="cpu"))  # saved on the CPU, as the router loads
        if hasattr(encoder, "center"):
            encoder.center.copy_(torch.from_numpy(fit["center"]))
        contingency = [sum((Counter(p["contingency"][e]) for p in parts), Counter()) for e in range(experts)]
        names = sorted({name for c in contingency for name in c})
        sizes = [{split: {key: sum(p["sizes"][e][split][key] for p in parts) for key in ("documents", "bytes")}
                  for split in ("train", "val")} for e in range(experts)]
        records = [{split: [r for p in parts for r in p["records"][e][split]] for split in ("train", "val")}
                   for e in range(experts)]
        totals = self._check_totals(sizes)
        documents = totals["train"]["documents"]
        with atomic_folder(output, KIND, "shard.output_dir", config.inputs()) as work:
            for expert in records:
                for record in expert["train"] + expert["val"]:
                    (work / record["path"]).parent.mkdir(parents=True, exist_ok=True)
                    link_or_copy(self.stage / record["path"], work / record["path"])
            Router(encoder, torch.from_numpy(centroids), sharding=self.fingerprint).save(work / ROUTER_FILE)
            volume = [s["train"]["bytes"] for s in sizes]
            members = [s["train"]["documents"] for s in sizes]
            write_json_atomic(work / EXPERTS_MANIFEST, {
                "format": FORMAT_VERSION, "fingerprint": self.fingerprint,
                "dataset_fingerprint": self.manifest["fingerprint"],
                "config": json.loads(json.dumps(asdict(config), default=str)), "dataset_dir": str(config.prepared),
                "router": ROUTER_FILE, "documents": documents, **totals, "expert_sizes": sizes,
                "shard_sizes": {"min_documents": min(members), "max_documents": max(members),
                                "min_bytes": min(volume), "max_bytes": max(volume)},
                "rebalanced_documents": fitted["rebalanced_documents"],
                "rebalanced_expert_val_documents": fitted["rebalanced_expert_val_documents"],
                "kmeans_sample": fitted["sample"], "expert_val_sample": fitted["expert_val_sample"],
                "contingency": [{name: int(c[name]) for name in names} for c in contingency],
                "purity": round(sum(max(c.values(), default=0) for c in contingency) / max(documents, 1), 4),
                "router_agreement": round(sum(p["agreeing"] for p in parts) / max(documents, 1), 4),
                "tasks": self.tasks,
                "peak_rss_mib": {"embed": [self._embed(t)["peak_rss_mib"] for t in range(self.tasks)],
                                 "fit": fitted["peak_rss_mib"], "write": [p["peak_rss_mib"] for p in parts]},
                "task_seconds": {"embed": [self._embed(t)["seconds"] for t in range(self.tasks)],
                                 "fit": fitted["seconds"], "write": [p["seconds"] for p in parts]},
                "shard_seconds": round(time.time() - self.started, 3),
                "num_experts": experts,
                "experts": [{"train": e["train"], "val": e["val"]} for e in records],
            })
        return
        yield

    def _check_totals(self, sizes: list[dict]) -> dict:
        """`{"train": {documents, bytes}, "expert_val": {...}}` over all experts, which must be the
        prepared splits' (every document in exactly one expert), and every expert must hold
        documents of both.

        Raises:
            DataError: the experts' documents differ from the prepared splits', or an expert has
                none of a split.
        """
        totals = {}
        for entry, split in (("train", "train"), ("expert_val", "val")):
            totals[entry] = {key: sum(s[split][key] for s in sizes) for key in ("documents", "bytes")}
            prepared = {key: self.manifest[entry][key] for key in ("documents", "bytes")}
            if totals[entry] != prepared:
                raise DataError(f"{self.config.prepared}: the experts hold {totals[entry]} of the prepared {entry} "
                                f"split's {prepared}: its shards changed while shard ran; run shard again")
            empty = [e for e, s in enumerate(sizes) if not s[split]["documents"]]
            if empty:
                raise DataError(f"{self.config.prepared}: expert {empty[0]} received no {entry} document; "
                                "prepare again with more documents in that split")
        return totals

    def _embed(self, task: int) -> dict:
        return json.loads((self.stage / "embed" / f"{task:05d}.json").read_text())
