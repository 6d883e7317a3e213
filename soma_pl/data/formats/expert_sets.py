"""Per-expert shard sets: `<folder>/expert-NNN/{train,val}-*.tar` listed in `experts.json`.

Written by semantic (or random) sharding: each record is one 1,025-byte window (a 1,024-byte sequence
of the prepared documents and the byte after it); an expert's `train` shards hold its sequences but
its held-out 1%, which its `val` shards hold. Read by `ByteDataModule` to give each expert its own
stream and decay signal.
`experts.json` is written last and atomically: a folder without it is not a sharded dataset.
It records the fingerprint of the prepared dataset the shards were cut from (`dataset_fingerprint`),
so a reader can refuse shards of another dataset (whose documents may be its test documents).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from soma_pl.data.corpus.documents import Document
from soma_pl.data.formats.manifest import outside
from soma_pl.data.formats.tar_shards import ShardRecord, ShardWriter
from soma_pl.errors import DataError
from soma_pl.io import close_quietly, write_json_atomic

EXPERTS_MANIFEST = "experts.json"
ROUTER_FILE = "router.pt"
FORMAT_VERSION = 3
KIND = "sharded dataset"
"""What the output folder's marker calls it (`soma_pl.io.OUTPUT_MARKER`)."""


@dataclass
class ExpertShards:
    """One expert's shards (paths relative to the experts folder)."""

    train: list[ShardRecord] = field(default_factory=list)
    val: list[ShardRecord] = field(default_factory=list)


class ExpertShardWriter:
    """Write each expert's training and expert-validation documents into its own shards
    (`expert-NNN/{train,val}[-<task>]-NNNNNN.tar`: one series per task when tasks write side by side)."""

    def __init__(self, folder: Path, num_experts: int, shard_max_bytes: int, task: int | None = None):
        self.folder = Path(folder)
        suffix = "" if task is None else f"-{task:05d}"
        self._writers = [
            {split: ShardWriter(self.folder / f"expert-{e:03d}", f"{split}{suffix}", shard_max_bytes)
             for split in ("train", "val")}
            for e in range(num_experts)
        ]

    def write(self, expert: int, document: Document, validation: bool = False) -> None:
        self._writers[expert]["val" if validation else "train"].write(document)

    def abandon(self) -> None:
        """Close every shard after a failure, ignoring errors (the folder is discarded)."""
        close_quietly(writer for writers in self._writers for writer in writers.values())

    def close(self) -> list[ExpertShards]:
        """Close every shard; each expert's records."""
        return [ExpertShards(w["train"].close(), w["val"].close()) for w in self._writers]


def experts_json(experts: list[ExpertShards]) -> list[dict]:
    """The `experts` entry of `experts.json`: each expert's shard records."""
    return [{"train": [r.to_json() for r in e.train], "val": [r.to_json() for r in e.val]} for e in experts]


def write_experts_manifest(folder: Path, experts: list[ExpertShards], extra: dict | None = None) -> None:
    """Write `experts.json` (last: it makes the folder a sharded dataset) with `extra` fields."""
    write_json_atomic(Path(folder) / EXPERTS_MANIFEST,
                      {**(extra or {}), "num_experts": len(experts), "experts": experts_json(experts)})


def read_experts_manifest(folder: str | Path) -> dict:
    """The `experts.json` of a sharded dataset folder.

    Raises:
        DataError: the folder or its experts.json is missing or unreadable.
    """
    path = Path(folder) / EXPERTS_MANIFEST
    try:
        payload = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise DataError(f"not a sharded dataset (no {EXPERTS_MANIFEST}): {folder}") from error
    except (OSError, ValueError) as error:
        raise DataError(f"unreadable {path}: {error}") from error
    if not isinstance(payload, dict):
        raise DataError(f"unreadable {path}: not a JSON object")
    return payload


def experts_fingerprint(folder: Path) -> str | None:
    """The fingerprint recorded in the `experts.json` of `folder`, or None (none there, or unreadable:
    a rebuild replaces it)."""
    try:
        return read_experts_manifest(folder).get("fingerprint")
    except DataError:
        return None


def expert_shards(folder: str | Path, payload: dict) -> list[ExpertShards]:
    """The per-expert shard records of an `experts.json` read from `folder`.

    Raises:
        DataError: the records are malformed, or one names a path outside `folder`.
    """
    try:
        experts = [
            ExpertShards([ShardRecord(**r) for r in e["train"]], [ShardRecord(**r) for r in e.get("val", [])])
            for e in payload["experts"]
        ]
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise DataError(f"unreadable {Path(folder) / EXPERTS_MANIFEST}: {error}") from error
    escaping = next((r.path for e in experts for r in (*e.train, *e.val) if outside(r.path)), None)
    if escaping is not None:
        raise DataError(f"unreadable {Path(folder) / EXPERTS_MANIFEST}: it names {escaping!r}, a path outside "
                        "the sharded dataset folder")
    return experts


def read_expert_shards(folder: str | Path) -> list[ExpertShards]:
    """The per-expert shard records of a sharded dataset folder (see `read_experts_manifest`)."""
    return expert_shards(folder, read_experts_manifest(folder))


def check_sharded_from(folder: str | Path, payload: dict, dataset_dir: str | Path,
                       dataset_fingerprint: str | None) -> None:
    """Refuse expert shards cut from another prepared dataset than `dataset_dir`.

    Args:
        folder: the sharded dataset folder; payload: its `experts.json`.
        dataset_dir: the prepared dataset in use; dataset_fingerprint: its manifest's `fingerprint`.

    Raises:
        DataError: `experts.json` names another dataset fingerprint, or none (older shards).
    """
    recorded = payload.get("dataset_fingerprint")
    if recorded is None:
        raise DataError(f"{Path(folder) / EXPERTS_MANIFEST} does not record which prepared dataset it was sharded "
                        f"from (an older soma_pl): run shard again on {dataset_dir}")
    if recorded != dataset_fingerprint:
        raise DataError(f"experts_dir={folder} was sharded from another prepared dataset than {dataset_dir} "
                        f"(dataset fingerprint {recorded[:12]}, now {str(dataset_fingerprint)[:12]}), so its shards "
                        f"may hold that dataset's validation and test documents: run shard again on {dataset_dir}")
