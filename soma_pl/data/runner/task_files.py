"""What the tasks of a `prepare` or `shard` stage write into the staging folder, and how the finished
files reach the output: hand-off arrays written atomically (a killed task leaves nothing that reads
as finished), hard links from the staging folder into the output, and a task's peak memory (which
the manifests record).
"""

from __future__ import annotations

import contextlib
import io
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from soma_pl.io import write_atomic


def peak_rss_mib() -> float:
    """Peak resident memory of this process so far, MiB (the process that ran the task)."""
    import resource
    import sys

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return round(peak / (1 << 20 if sys.platform == "darwin" else 1 << 10), 1)


@contextlib.contextmanager
def base_pages() -> Iterator[None]:
    """Within it, this process's new large NumPy arrays use base pages, unless `NUMPY_MADVISE_HUGEPAGE`
    is set (NumPy's own switch, which then wins); the setting before is restored on leaving.

    NumPy asks Linux for transparent huge pages on every array of 4 MB or more (`madvise`). Where
    the kernel's THP defrag setting is `madvise` (a common default), each such allocation may then
    stall in direct compaction once the page cache has fragmented memory: a fresh task process that
    allocates a dozen 40 MB arrays spent 2.4 s in it on a 2-core VM, against 0.2 s on base pages.
    The stages that build and screen the held-out sets allocate many such short-lived arrays and
    gain nothing from huge pages.
    """
    core = getattr(np, "_core", None) or np.core  # NumPy 2 / 1.26
    toggle = getattr(core.multiarray, "_set_madvise_hugepage", None)
    if toggle is None or "NUMPY_MADVISE_HUGEPAGE" in os.environ:
        yield
        return
    before = toggle(False)
    try:
        yield
    finally:
        toggle(before)


def link_or_copy(source: Path, target: Path) -> None:
    """A hard link (no copy of a shard's bytes); a copy where the file system refuses links."""
    try:
        os.link(source, target)
    except OSError:
        import shutil

        shutil.copyfile(source, target)


def save_npy(path: Path, array: np.ndarray) -> None:
    """`np.save` written atomically, the array's memory written as it is (no copy into a buffer)."""
    array = np.ascontiguousarray(array)
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(array))
    write_atomic([header.getvalue(), memoryview(array).cast("B")], path)


def save_npz(path: Path, **arrays: np.ndarray) -> None:
    """`np.savez` written atomically (in a folder made on demand)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    write_atomic(buffer.getvalue(), path)
