"""How processes share the work: which ranks read which data, and which share of a count each owns.

Both the data module and the LightningModules use these, so they live below both.
"""

from __future__ import annotations

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
