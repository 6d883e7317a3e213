"""`MemoryCheck`: an update that cannot fit in memory is refused before the first one runs.

A zero-order update's memory grows with its settings, not with anything the first steps show: with
`spsa.n_pert` 10⁹ one loss call would hold 10⁹ directions and 2·10⁹ copies of the weights, and the
process grows until the kernel kills it, with no line saying why. Before training starts, the module
states a lower bound of what one update holds at once (`EstimatesMemory`: the perturbed weight
copies and activations of one loss call, sized as its chunking sizes them); when it exceeds
`MARGIN` of the memory available on the module's device (CUDA: free device memory; CPU:
`MemAvailable` of /proc/meminfo, or what the process's cgroup may still take where that is less
(a container's or a batch job's limit), shared by this machine's processes of the run), the run ends with one
line naming what does not fit and the settings that shrink it. Where the available memory cannot be
read (not Linux), nothing is checked.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import torch

from soma_pl.contracts import EstimatesMemory
from soma_pl.errors import ConfigError

MARGIN = 0.9
"""The share of the available memory a lower bound may take: the rest of an update (losses, the
optimizer's work, the allocator's slack) needs some."""
MEMINFO = Path("/proc/meminfo")
CGROUPS = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
UNLIMITED = 2**62
"""cgroup v1 writes no limit as a page-rounded 2^63 − 1."""


def cgroup_headroom() -> int | None:
    """What this process's memory cgroup may still take (its limit less its usage), or None where it
    has no limit or none can be read. cgroup v2 (`0::<path>`: memory.max, memory.current) or v1's
    memory controller (`memory.limit_in_bytes`, `memory.usage_in_bytes`); a cgroup namespace shows the
    process's own group at the mount's top."""
    try:
        lines = CGROUPS.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":
            folders, files = [CGROUP_ROOT / path.lstrip("/"), CGROUP_ROOT], ("memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            mount = CGROUP_ROOT / controllers
            folders, files = [mount / path.lstrip("/"), mount], ("memory.limit_in_bytes", "memory.usage_in_bytes")
        else:
            continue
        for folder in folders:
            try:
                limit, usage = ((folder / name).read_text().strip() for name in files)
            except OSError:
                continue
            if limit != "max" and int(limit) < UNLIMITED:
                return max(int(limit) - int(usage), 0)
            break
    return None


def available_bytes(device: torch.device) -> int | None:
    """Memory available for new allocations on `device`, or None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = MEMINFO.read_text().splitlines()
    except OSError:
        return None
    machine = next((int(line.split()[1]) * 1024 for line in lines if line.startswith("MemAvailable:")), None)
    limited = cgroup_headroom()
    return machine if limited is None or machine is None else min(machine, limited)


def gib(size: float) -> str:
    return f"{size / 2**30:,.1f} GiB"


class MemoryCheck(L.Callback):
    """Refuse, before the first update, a module whose update cannot fit in the memory available."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not isinstance(pl_module, EstimatesMemory):
            return
        need = pl_module.update_memory()
        available = available_bytes(pl_module.device)
        if available is not None and pl_module.device.type == "cpu":
            available //= trainer.num_devices  # this machine's processes of the run share its memory
        too_big = available is not None and need.bytes > MARGIN * available
        if trainer.strategy.reduce_boolean_decision(too_big, all=False):
            what = (f"one update needs at least {gib(need.bytes)} ({need.what}), more than {MARGIN:.0%} of the "
                    f"{gib(available)} available on {pl_module.device}" if too_big
                    else "another process of the run cannot fit one update in its memory")
            raise ConfigError(f"{what}: lower {need.settings}")
