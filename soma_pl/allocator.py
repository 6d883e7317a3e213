"""Freed memory kept in the process, so large tensors stop faulting their pages in on every allocation.

PyTorch's CPU tensors come from the C library's ``malloc``. glibc serves a block above its mmap
threshold (at most 32 MiB, adjusted as blocks are freed) with a fresh ``mmap`` and gives it back on
``free``, and it trims the top of its heap once more than twice that threshold lies free there. A
zero-order update allocates the same large activations and input projections at every time chunk
of every loss call, so each of them is handed back to the kernel and faulted in again page by page:
on this project's CPUs a fresh ``[65536, 128]`` GEMM output (32 MiB) took 26 ms where the same
product into a reused buffer took 6 ms. :func:`retain_freed_memory` raises both thresholds, so
freed blocks stay in the heap and the next allocation of that size reuses pages already mapped.
The process's resident size then stays near its peak instead of falling after each call; the peak
itself does not grow.

The command line (``python -m soma_pl.cli``) calls it at start; ``SOMA_PL_MALLOC=default`` leaves
the C library's behaviour as it is. Outside glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import platform

MALLOC_ENV = "SOMA_PL_MALLOC"
"""``default`` keeps the C library's own thresholds (the command line then changes nothing)."""
RETAINED_BYTES = 1 << 30
"""Blocks up to this size come from the heap and stay there when freed (1 GiB)."""
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)


def retain_freed_memory(limit: int = RETAINED_BYTES) -> bool:
    """Raise glibc's mmap and trim thresholds to ``limit`` bytes for the rest of the process.

    Returns:
        Whether the thresholds were set: False outside glibc on Linux, when the C library refuses
        the value, or when ``SOMA_PL_MALLOC=default``.
    """
    if os.environ.get(MALLOC_ENV, "").strip().lower() == "default":
        return False
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    value = min(limit, 2**31 - 1)
    return bool(mallopt(_M_MMAP_THRESHOLD, value)) and bool(mallopt(_M_TRIM_THRESHOLD, value))
