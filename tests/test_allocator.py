"""The command line keeps freed memory in the process (glibc's thresholds), unless told not to."""

from __future__ import annotations

import os
import platform
import subprocess
import sys

import pytest

from soma_pl.allocator import MALLOC_ENV, retain_freed_memory

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's mallopt")

_PROBE = """
import os, sys
import torch
from soma_pl.allocator import retain_freed_memory
page = os.sysconf("SC_PAGE_SIZE")
def resident():
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * page
set_ = retain_freed_memory()
before = resident()
block = torch.ones(16 << 20)  # 64 MiB, above glibc's largest default mmap threshold
del block
print(set_, (resident() - before) >> 20)
"""


def _probe(**env: str) -> tuple[bool, int]:
    environment = {**os.environ, **env}
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, env=environment, check=True)
    was_set, kept = done.stdout.split()
    return was_set == "True", int(kept)


def test_a_freed_block_stays_mapped_once_the_thresholds_are_raised() -> None:
    was_set, kept_mib = _probe()
    assert was_set
    assert kept_mib >= 60  # the 64 MiB block's pages stay resident for the next allocation


def test_the_default_setting_hands_a_freed_block_back() -> None:
    was_set, kept_mib = _probe(**{MALLOC_ENV: "default"})
    assert not was_set
    assert kept_mib < 8  # munmap on free: the pages left the process


def test_the_default_setting_is_read_at_each_call(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(MALLOC_ENV, "Default ")
    assert retain_freed_memory() is False
