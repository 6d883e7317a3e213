"""What a `prepare` or `shard` output folder holds, as sha256s, for comparing two runs."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

RECORDS = ("manifest.json", "experts.json", ".soma_pl-output.json")
"""The folders' records: besides shard sha256s they hold per-task seconds and memory, and the
ownership marker its writer's process id and time, which differ from run to run."""


def file_digests(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder` but its record, by relative path, computed here."""
    return {str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
            for path in sorted(folder.rglob("*")) if path.is_file() and path.name not in RECORDS}


def recorded_digests(folder: Path) -> dict[str, str]:
    """The sha256 the folder's record (`manifest.json` or `experts.json`) gives each file, by path."""
    found: dict[str, str] = {}

    def walk(node) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("path"), str) and isinstance(node.get("sha256"), str):
                found[node["path"]] = node["sha256"]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    for name in RECORDS[:2]:
        if (folder / name).exists():
            walk(json.loads((folder / name).read_text()))
    return found


def assert_same_output(first: Path, second: Path) -> None:
    files = file_digests(first)
    assert len(files) >= 4 and any(name.endswith(".tar") for name in files), files
    assert file_digests(second) == files
    recorded = recorded_digests(first)
    assert recorded and recorded_digests(second) == recorded
    assert {name: files[name] for name in recorded} == recorded  # the record's sha256s are the files'
