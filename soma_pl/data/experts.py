"""Per-expert shard sets: `<folder>/expert-NNN/{train,val}-*.tar` listed in `experts.json`.

Written by semantic (or random) sharding; read by `ByteDataModule` to give each expert its own
stream. `experts.json` is written last and atomically: a folder without it is not a sharded dataset.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from soma_pl.data.documents import Document
from soma_pl.data.shards import ShardRecord, ShardWriter
from soma_pl.errors import DataError
from soma_pl.io import write_json_atomic

EXPERTS_MANIFEST = "experts.json"


@dataclass
class ExpertShards:
    """One expert's shards (paths relative to the experts folder)."""

    train: list[ShardRecord] = field(default_factory=list)
    val: list[ShardRecord] = field(default_factory=list)


class ExpertShardWriter:
    """Write each expert's training and expert-validation documents into its own shards."""

    def __init__(self, folder: Path, num_experts: int, shard_max_bytes: int):
        self.folder = Path(folder)
        self._writers = [
            {split: ShardWriter(self.folder / f"expert-{e:03d}", split, shard_max_bytes) for split in ("train", "val")}
            for e in range(num_experts)
        ]

    def write(self, expert: int, document: Document, validation: bool = False) -> None:
        self._writers[expert]["val" if validation else "train"].write(document)

    def close(self, extra: dict | None = None) -> list[ExpertShards]:
        """Close every shard and write `experts.json` (with `extra` fields); return the records."""
        experts = [ExpertShards(w["train"].close(), w["val"].close()) for w in self._writers]
        payload = {
            **(extra or {}),
            "num_experts": len(experts),
            "experts": [{"train": [r.to_json() for r in e.train], "val": [r.to_json() for r in e.val]}
                        for e in experts],
        }
        write_json_atomic(self.folder / EXPERTS_MANIFEST, payload)
        return experts


def read_expert_shards(folder: Path) -> list[ExpertShards]:
    """The per-expert shard records of a sharded dataset folder.

    Raises:
        DataError: no `experts.json`, or it cannot be read.
    """
    path = Path(folder) / EXPERTS_MANIFEST
    try:
        payload = json.loads(path.read_text())
        return [
            ExpertShards([ShardRecord(**r) for r in e["train"]], [ShardRecord(**r) for r in e.get("val", [])])
            for e in payload["experts"]
        ]
    except FileNotFoundError as error:
        raise DataError(f"not a sharded dataset (no {EXPERTS_MANIFEST}): {folder}") from error
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise DataError(f"unreadable {path}: {error}") from error
