"""Atomic writes: a temporary file or folder beside the target, then a rename."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def write_json_atomic(path: str | Path, payload: dict) -> Path:
    """Write `payload` as indented JSON to `path` so that a reader sees the old file or the new one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    temporary.write_text(json.dumps(payload, indent=2) + "\n")
    os.replace(temporary, path)
    return path


@contextmanager
def atomic_folder(output: Path) -> Iterator[Path]:
    """Build a folder under a temporary name beside `output`; when the block ends without error,
    the new folder replaces `output` by renames, so no reader ever sees a half-written folder. A
    failed or killed build leaves only a hidden `.<name>.tmp-<pid>` folder, never `output`."""
    output.parent.mkdir(parents=True, exist_ok=True)
    work = output.parent / f".{output.name}.tmp-{os.getpid()}"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir()
    try:
        yield work
        stale = output.parent / f".{output.name}.old-{os.getpid()}"
        if output.exists():
            os.replace(output, stale)
        os.replace(work, output)
        shutil.rmtree(stale, ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
