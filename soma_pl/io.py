"""Atomic file writes: a temporary file beside the target, then a rename."""

from __future__ import annotations

import json
import os
from pathlib import Path


def write_json_atomic(path: str | Path, payload: dict) -> Path:
    """Write `payload` as indented JSON to `path` so that a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(temporary, path)
    return path
