"""What the layers hand each other: an update's cost, and the typed faces of the Lightning objects.

The data module, the LightningModules and the callbacks meet only through the Trainer. Each reads
from the others just what a Protocol here names, checked with `isinstance`, so no layer imports one
above it and a missing attribute is a type, not a silent `getattr` default.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from soma_pl.data.formats.evalsets import EvalSet
    from soma_pl.distributed import RankSplit


@dataclass(frozen=True)
class UpdateRecord:
    """What one update cost on this process; compute accounting and budgets read it."""

    seconds: float
    """Wall time of the update (on CUDA, between two events on the stream)."""
    token_forwards: int
    """Token forward passes the update evaluated: ``2 · n_pert · E · B · T`` for SPSA, ``E · B · T``
    for BPTT (its backward is not counted)."""
    experts: int
    """Experts this process updated (all experts of the module, or a rank's slice)."""


class UpdateClock:
    """Wall time of one update, with no host synchronisation of its own.

    On CUDA two events bracket the update on the stream, and `seconds` is read once the step's one
    host read (the finiteness check) has waited for the stream: the time from the device reaching
    the update's start to its finishing the update. On the CPU, `time.perf_counter`.
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.started = self.elapsed = 0.0
        if self.cuda:
            self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))

    def start(self) -> None:
        if self.cuda:
            self.events[0].record()
        else:
            self.started = time.perf_counter()

    def stop(self) -> None:
        if self.cuda:
            self.events[1].record()
        else:
            self.elapsed = time.perf_counter() - self.started

    def seconds(self) -> float:
        """The update's seconds; on CUDA read after the stream has passed `stop` (it waits otherwise)."""
        if self.cuda:
            self.events[1].synchronize()
            return self.events[0].elapsed_time(self.events[1]) / 1000
        return self.elapsed


@dataclass(frozen=True)
class UpdateMemory:
    """What one update holds at once on its device, at least (checked before the first update)."""

    bytes: int
    """A lower bound: the estimator's largest tensors and the activations the model documents."""
    what: str
    """What those bytes hold, for the message."""
    settings: str
    """The settings that make it smaller."""


@runtime_checkable
class ReportsUpdates(Protocol):
    """A module whose `training_step` records what its update cost (read by compute accounting)."""

    last_update: UpdateRecord | None


@runtime_checkable
class SplitsRanks(Protocol):
    """A module that tells the data module how ranks share the training stream."""

    @property
    def rank_split(self) -> RankSplit: ...


@runtime_checkable
class HoldsEvalSets(Protocol):
    """A data module with the evaluation windows' documents (for bootstrap intervals and reports)."""

    val_set: EvalSet | None
    test_set: EvalSet | None


@runtime_checkable
class BatchesWindows(Protocol):
    """A data module whose training batches hold `batch_size` windows per expert."""

    batch_size: int


@runtime_checkable
class ReadsExpertShards(Protocol):
    """A data module reading a sharded dataset (`experts.json`, `router.pt`), or none (`None`)."""

    experts_dir: str | None


@runtime_checkable
class RecordsData(Protocol):
    """A data module that knows the fingerprints of the data it read (checked against checkpoints)."""

    def data_in_use(self) -> dict[str, tuple[str | None, str]]: ...


@runtime_checkable
class EstimatesMemory(Protocol):
    """A module that can say, before it trains, how much memory one update needs."""

    def update_memory(self) -> UpdateMemory: ...
