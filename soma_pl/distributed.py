"""How processes share the work: which ranks read which data, and which share of a count each owns.

Both the data module and the LightningModules use these, so they live below both.
"""

from __future__ import annotations

import os
from enum import Enum


class RankSplit(str, Enum):
    """How the training stream is divided between DDP ranks (the module in training decides)."""

    documents = "documents"
    """Data parallel: each rank reads a disjoint part of every expert's documents (BPTT under DDP)."""
    replicated = "replicated"
    """Every rank reads the same global stream; each evaluates its own share of it (DDPP). The
    batches do not depend on the number of ranks: a run on W ranks sees a 1-process run's data."""
    experts = "experts"
    """Rank r reads only its contiguous share of the experts (expert-parallel SOMA)."""


def rank_share(count: int, rank: int, world_size: int) -> range:
    """Rank `rank`'s contiguous share of `count` items (experts, direction indices).

    Shares differ in size by at most one and cover `0 .. count-1` in rank order.
    """
    return range(rank * count // world_size, (rank + 1) * count // world_size)


RANK_VARIABLES = ("RANK", "LOCAL_RANK", "NODE_RANK", "GROUP_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")
"""What launchers set in each process of a multi-process run: torchrun (`RANK`, `LOCAL_RANK`,
`GROUP_RANK`), Lightning's own launcher for its processes after the first (`LOCAL_RANK`,
`NODE_RANK`), SLURM (`SLURM_PROCID`) and LSF (`JSM_NAMESPACE_RANK`)."""


def launching_process() -> bool:
    """Whether this process speaks for its whole run: global rank 0 of a multi-process run (on node
    0), or a process that no launcher started. Read from the environment, before any process group
    exists; what a run does once (taking its folder's lock) is done here only."""
    return all(os.environ.get(name, "0").strip() in ("", "0") for name in RANK_VARIABLES)


class Accounting(str, Enum):
    """Where the experts of a run were updated, which decides what each expert's t̄ₑ is (`meaning`)."""

    device_per_expert = "device_per_expert"
    batched = "batched"
    every_device = "every_device"

    @property
    def meaning(self) -> str:
        return {
            "device_per_expert": "each expert on a device of its own, t̄ₑ its own update time (Fully Sharded "
                                 "Optimization, H.1; a one-expert model on one device too)",
            "batched": "the experts batched on one device that updates them in t seconds, each charged t/E (the "
                       "CPU-scale mode)",
            "every_device": "one model on R devices, each updating it on a share of the batch or the perturbations "
                            "and charged the whole step, communication and waiting included (DDPP, data-parallel "
                            "BPTT: App. I.1, K)",
        }[self.value]
