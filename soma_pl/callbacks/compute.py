"""Compute accounting (Table 3) and compute budgets.

`ComputeAccounting` records every update's wall time (the modules' `UpdateRecord`, timed with CUDA
synchronised before the clock is read) and reports, as `compute/...` metrics and `compute.json` in
the run directory:

- `aggregate_device_hours = U · Σₑ t̄ₑ / 3600`: U updates (per expert: every expert is updated once
  per step) and t̄ₑ expert e's mean update time. This is the paper's "recorded expert mean times"
  row, the one its budgets and endpoints use. What t̄ₑ is depends on where the experts ran, and
  `accounting` (`Accounting`) says which of three it was: each expert on a device of its own, as the
  paper charges SOMA (H.1); experts batched on one device, each charged t/E (the CPU-scale mode);
  or one model on several devices, each device charged the whole step with its communication and
  waiting (DDPP, data-parallel BPTT: App. I.1, K).
- `physical_device_hours = ranks × elapsed training wall time / 3600` (validation, data loading and
  waiting included): the paper's "physical total".
- fixed-rate conventions `E · U · r / 3600` for each configured seconds-per-expert-update r (the
  paper: 0.168 s reference, 0.140 s normalisation for N = 256);
- `token_forwards` and forward `multiply_adds` (token-forwards × parameters per expert).

A W&B chart plots one metric against another only within one logged row, so every row of losses a
W&B run records also holds the compute axes (`COMPUTE_AXES`), declared with W&B's `define_metric`:
a chart can take token-forwards, multiply-adds or device-hours as its x instead of the step.

`ComputeBudget` stops a run once aggregate device-hours or token forwards reach a budget: sweeps and
equal-compute comparisons use it. Given a calibrated update time (`sweep calibrate`: the update timed
alone at fixed threads, as the paper's hours are estimated from recorded mean step times), its
device-hours are updates × that time, so where a run stops does not depend on the machine's other
work; the measured time is still recorded beside it. Both callbacks keep their totals in the checkpoint, so a resumed
run continues counting where the checkpoint left off.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.loggers import CSVLogger, TensorBoardLogger, WandbLogger
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn

from soma_pl.contracts import ReportsUpdates, UpdateRecord
from soma_pl.distributed import Accounting
from soma_pl.errors import ConfigError
from soma_pl.io import write_json_atomic

SECONDS_PER_HOUR = 3600.0
TALLY_FIELDS = 4
COMPUTE_AXES = ("compute/token_forwards", "compute/multiply_adds", "compute/aggregate_device_hours")
"""Compute spent so far, in every W&B row of losses: the x axes a chart may take instead of the step."""


def run_directory(trainer: L.Trainer) -> Path:
    """Where a run's files go: the first logger's folder, else `trainer.default_root_dir`.

    Read from the logger, not `trainer.log_dir`: under DDP that is a broadcast from rank 0, which
    hangs when only rank 0 asks (as callbacks that write files do).
    """
    logger = trainer.loggers[0] if trainer.loggers else None
    if logger is None:
        return Path(trainer.default_root_dir)
    folder = logger.log_dir if isinstance(logger, (CSVLogger, TensorBoardLogger)) else logger.save_dir
    return Path(folder or trainer.default_root_dir)


@dataclass
class Tally:
    """What one process has spent on updates since the run began (resumed sessions included)."""

    updates: int = 0
    seconds: float = 0.0
    """Summed update wall time of this process."""
    token_forwards: int = 0
    experts: int = 0
    """Experts this process updates (its slice under expert parallelism)."""

    def add(self, record: UpdateRecord) -> None:
        self.updates += 1
        self.seconds += record.seconds
        self.token_forwards += record.token_forwards
        self.experts = record.experts

    def row(self, device: torch.device) -> torch.Tensor:
        """`[4] float64` (exact for integers below 2⁵³) for a collective."""
        return torch.tensor([self.updates, self.seconds, self.token_forwards, self.experts],
                            dtype=torch.float64, device=device)

    @classmethod
    def from_row(cls, row: list[float]) -> Tally:
        return cls(int(row[0]), float(row[1]), int(row[2]), int(row[3]))


def gather_tallies(trainer: L.Trainer, tally: Tally) -> list[Tally]:
    """Every rank's tally in rank order. A collective when there are several ranks: every rank calls it."""
    rows = trainer.strategy.all_gather(tally.row(trainer.strategy.root_device))
    return [Tally.from_row(row) for row in rows.reshape(-1, TALLY_FIELDS).cpu().tolist()]


class NewRecord:
    """Hands out the module's `last_update` once: a step that sets no new record counts nothing."""

    def __init__(self):
        self.seen: UpdateRecord | None = None
        self.warned = False

    def __call__(self, pl_module: L.LightningModule) -> UpdateRecord | None:
        record = pl_module.last_update if isinstance(pl_module, ReportsUpdates) else None
        if record is None and not self.warned:
            self.warned = True
            rank_zero_warn(f"{type(pl_module).__name__} sets no `last_update`: compute is not counted")
        if record is None or record is self.seen:
            return None
        self.seen = record
        return record


def accounting_of(tallies: list[Tally], model_experts: int) -> Accounting:
    """Which `Accounting` every rank's tally (`tallies`) of a model of `model_experts` experts makes."""
    if sum(t.experts for t in tallies) > model_experts:
        return Accounting.every_device
    return Accounting.device_per_expert if all(t.experts <= 1 for t in tallies) else Accounting.batched


@dataclass(frozen=True)
class FixedRate:
    """A fixed-rate convention: every expert update costs `seconds_per_expert_update`."""

    seconds_per_expert_update: float
    device_hours: float


@dataclass(frozen=True)
class ComputeReport:
    """The contents of `compute.json` (Table 3's rows for one run)."""

    updates: int
    """U: updates per expert (the checkpoint's update counter)."""
    experts: int
    """Expert slots summed over ranks (under data parallelism, one slot per rank)."""
    ranks: int
    expert_mean_update_seconds: list[float]
    """t̄ₑ per expert slot, ranks in order."""
    aggregate_device_hours: float
    """U · Σₑ t̄ₑ / 3600."""
    physical_device_hours: float
    """ranks × elapsed training wall time / 3600."""
    elapsed_training_seconds: float
    token_forwards: int
    """Token forward passes evaluated by all ranks."""
    multiply_adds: int
    """Forward multiply-adds: token forwards × parameters per expert."""
    fixed_rate: list[FixedRate] = field(default_factory=list)
    device: str = "cpu"
    accounting: Accounting = Accounting.device_per_expert
    """Where the experts were updated, which decides what t̄ₑ is."""

    def metrics(self) -> dict[str, float]:
        """`compute/...` figures and `expert/<e>/mean_update_seconds` for the loggers."""
        metrics = {"compute/updates": float(self.updates),
                   "compute/aggregate_device_hours": self.aggregate_device_hours,
                   "compute/physical_device_hours": self.physical_device_hours,
                   "compute/token_forwards": float(self.token_forwards),
                   "compute/multiply_adds": float(self.multiply_adds)}
        for rate in self.fixed_rate:
            metrics[f"compute/fixed_{rate.seconds_per_expert_update:g}s_device_hours"] = rate.device_hours
        for expert, seconds in enumerate(self.expert_mean_update_seconds):
            metrics[f"expert/{expert}/mean_update_seconds"] = seconds
        return metrics


def compute_report(tallies: list[Tally], elapsed_seconds: float, reference_seconds: list[float],
                   device: str = "cpu", parameters_per_expert: int = 0, model_experts: int = 1) -> ComputeReport:
    """Table 3's figures from every rank's tally (`tallies`, rank order) of a model of `model_experts`."""
    updates = max((t.updates for t in tallies), default=0)
    per_expert = [t.seconds / (t.updates * t.experts) for t in tallies if t.updates and t.experts
                  for _ in range(t.experts)]
    experts = sum(t.experts for t in tallies)
    return ComputeReport(
        updates=updates, experts=experts, ranks=len(tallies), expert_mean_update_seconds=per_expert,
        aggregate_device_hours=updates * sum(per_expert) / SECONDS_PER_HOUR,
        physical_device_hours=len(tallies) * elapsed_seconds / SECONDS_PER_HOUR,
        elapsed_training_seconds=elapsed_seconds, token_forwards=sum(t.token_forwards for t in tallies),
        multiply_adds=sum(t.token_forwards for t in tallies) * parameters_per_expert,
        fixed_rate=[FixedRate(r, experts * updates * r / SECONDS_PER_HOUR) for r in reference_seconds],
        device=device, accounting=accounting_of(tallies, model_experts))


def _log(trainer: L.Trainer, metrics: dict[str, float], join_wandb_row: bool = False) -> None:
    """`metrics` to every logger at the update count; with `join_wandb_row`, W&B's take them into
    the row Lightning logs next instead of a row of their own (`join_next_wandb_row`)."""
    for logger in trainer.loggers:
        if not (join_wandb_row and isinstance(logger, WandbLogger)):
            logger.log_metrics(metrics, step=trainer.global_step)
    if join_wandb_row:
        join_next_wandb_row(trainer, metrics)


def join_next_wandb_row(trainer: L.Trainer, metrics: dict[str, float]) -> None:
    """Hand `metrics` to every W&B run uncommitted, so they join the next row Lightning logs: this
    update's training losses or this validation's losses."""
    for logger in trainer.loggers:
        if isinstance(logger, WandbLogger):
            logger.experiment.log(metrics, commit=False)


class ComputeAccounting(L.Callback):
    """Per-expert mean update times, aggregate and physical device-hours, fixed-rate conventions.

    Logs `compute/...` every `trainer.log_every_n_steps` updates and, when training ends, writes
    `<run dir>/<filename>` (atomic) and keeps the figures in `report` for `summary.json`. The totals
    go into the checkpoint; with several ranks, every rank's totals as of the latest validation
    (where the suite's checkpoints are saved), since only rank 0's callback state is written.

    Args:
        reference_seconds: fixed rates, seconds per expert update (the paper: [0.168, 0.140]).
        filename: name of the JSON file in the run directory.
    """

    def __init__(self, reference_seconds: list[float] | None = None, filename: str = "compute.json"):
        self.reference_seconds = list(reference_seconds or [])
        if any(r <= 0 for r in self.reference_seconds):
            raise ConfigError(f"compute.reference_seconds={self.reference_seconds}: rates must be positive")
        self.filename = filename
        self.tally = Tally()
        self.report: ComputeReport | None = None
        self._new_record = NewRecord()
        self._elapsed_before = 0.0
        self._session_start: float | None = None
        self._snapshot: list[Tally] = []
        self._rank, self._world = 0, 1

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._rank, self._world = trainer.global_rank, trainer.world_size

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._session_start = time.perf_counter()
        for logger in trainer.loggers:
            if isinstance(logger, WandbLogger):
                for axis in COMPUTE_AXES:
                    logger.experiment.define_metric(axis)

    def elapsed_seconds(self) -> float:
        """Training wall time of this and every earlier session of the run."""
        running = time.perf_counter() - self._session_start if self._session_start is not None else 0.0
        return self._elapsed_before + running

    def current_report(self, trainer: L.Trainer) -> ComputeReport:
        """The figures so far. A collective under several ranks: every rank calls it at the same update."""
        device = trainer.strategy.root_device
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else str(device)
        module = trainer.lightning_module
        experts = module.model.num_experts
        per_expert = sum(p.numel() for p in module.parameters()) // experts
        return compute_report(gather_tallies(trainer, self.tally), self.elapsed_seconds(), self.reference_seconds,
                              name, per_expert, experts)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        record = self._new_record(pl_module)
        if record is None:
            return
        self.tally.add(record)
        # Ranks count updates in lockstep, so they all reach this collective at the same update.
        if self.tally.updates % max(trainer.log_every_n_steps, 1) == 0:
            report = self.current_report(trainer)
            compute = {k: v for k, v in report.metrics().items() if k.startswith("compute/")}
            _log(trainer, compute, join_wandb_row=True)

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The forced checkpoint is saved when validation ends; every rank's tally is gathered here,
        # where all ranks are, because only rank 0's callback state reaches the checkpoint.
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking and self._world > 1:
            self._snapshot = gather_tallies(trainer, self.tally)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Every rank takes part in the report's collective; only W&B needs the axes in this row.
        if trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking \
                and any(isinstance(logger, WandbLogger) for logger in trainer.loggers):
            metrics = self.current_report(trainer).metrics()
            join_next_wandb_row(trainer, {axis: metrics[axis] for axis in COMPUTE_AXES})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.report = self.current_report(trainer)
        _log(trainer, self.report.metrics())
        if trainer.is_global_zero:
            payload = asdict(self.report)
            budget = next((c for c in trainer.callbacks if isinstance(c, ComputeBudget)), None)
            payload["budget"] = budget.summary() if budget is not None else None
            write_json_atomic(run_directory(trainer) / self.filename, payload)

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed session with nothing left to train never starts training: its report is the
        # restored totals, which `RunSummary` (a later callback) writes into the run's summary.json.
        if self.report is None and self.tally.updates:
            self.report = self.current_report(trainer)

    def state_dict(self) -> dict:
        tallies = [self.tally] if self._world == 1 else self._snapshot
        return {"tallies": [asdict(t) for t in tallies], "elapsed_seconds": self.elapsed_seconds()}

    def load_state_dict(self, state_dict: dict) -> None:
        tallies = [Tally(**t) for t in state_dict.get("tallies", [])]
        self._elapsed_before = float(state_dict.get("elapsed_seconds", 0.0))
        if len(tallies) == self._world:
            self.tally = tallies[self._rank]
            return
        if tallies:
            rank_zero_warn(f"the checkpoint's compute accounting has {len(tallies)} ranks, this run {self._world}: "
                           "earlier sessions are counted on rank 0")
        self.tally = Tally(updates=max((t.updates for t in tallies), default=0))
        if self._rank == 0:
            self.tally.seconds = sum(t.seconds for t in tallies)
            self.tally.token_forwards = sum(t.token_forwards for t in tallies)


class BudgetKind(str, Enum):
    """What a `ComputeBudget` limit counts."""

    device_hours = "device_hours"
    """Aggregate device-hours (summed measured update wall time): a wall-clock budget."""
    elapsed_hours = "elapsed_hours"
    """Estimated elapsed hours: the slowest expert's summed update time (U · maxₑ t̄ₑ with each expert
    on a device of its own; Fig. 7's common cutoff), each expert's time as `Accounting` charges it."""
    token_forwards = "token_forwards"
    """Token forward passes: exact, so the stopping update is deterministic."""


class ComputeBudget(L.Callback):
    """Stops `fit` at the first update where spent compute reaches a budget (None: no limit).

    The run stops after that update: it validates and checkpoints there, as with early stopping.
    Token forwards per update are fixed by the batch shape, so a `token_forwards` budget stops
    at update ⌈budget / forwards per update⌉ every time. A `device_hours` budget sums measured update
    times (the aggregate device-hours of `ComputeAccounting`), so where it stops varies with the
    machine's speed and load, unless `seconds_per_update` is given: then it counts updates × that
    calibrated time and stops at update ⌈budget / seconds_per_update⌉ every time. An `elapsed_hours`
    budget takes the slowest expert's summed update time, so an ensemble of N experts may spend up to
    N times it in device-hours. Totals are gathered from every
    rank each update (one small all-gather) so that all ranks stop together, and are kept in the
    checkpoint: a resumed run stops where an uninterrupted one would. Without a limit nothing is
    counted, so a budget first given when resuming counts from the resume.

    Args:
        device_hours: budget of aggregate device-hours.
        elapsed_hours: budget of estimated elapsed hours (the slowest expert's update time).
        token_forwards: budget of token forward passes (all ranks together).
        seconds_per_update: the calibrated aggregate update time (U·Σₑ t̄ₑ per update, every expert and
            rank counted) measured alone by `sweep calibrate`; device-hours are then updates × this.
    """

    def __init__(self, device_hours: float | None = None, elapsed_hours: float | None = None,
                 token_forwards: float | None = None, seconds_per_update: float | None = None):
        self.limits = {BudgetKind.device_hours: device_hours, BudgetKind.elapsed_hours: elapsed_hours,
                       BudgetKind.token_forwards: token_forwards}
        for kind, limit in self.limits.items():
            if limit is not None and limit <= 0:
                raise ConfigError(f"budget.{kind.value}={limit}: a budget must be positive (or null for none)")
        if seconds_per_update is not None and seconds_per_update <= 0:
            raise ConfigError(f"budget.seconds_per_update={seconds_per_update}: a calibrated time must be positive")
        if seconds_per_update is not None and elapsed_hours is not None:
            raise ConfigError("budget.seconds_per_update: a calibration times the aggregate update, not the slowest "
                              "expert's; an elapsed_hours budget counts measured time only")
        self.seconds_per_update = seconds_per_update
        self.seconds = 0.0
        self.expert_seconds: list[float] = []
        """Each rank's summed update time per expert of its own (rank order): its experts' elapsed time."""
        self.token_forwards = 0
        self.updates = 0
        self.reached: BudgetKind | None = None
        self.stopped_at_step: int | None = None
        self._new_record = NewRecord()

    def spent(self) -> dict[BudgetKind, float]:
        seconds = self.seconds if self.seconds_per_update is None else self.updates * self.seconds_per_update
        return {BudgetKind.device_hours: seconds / SECONDS_PER_HOUR,
                BudgetKind.elapsed_hours: max(self.expert_seconds, default=0.0) / SECONDS_PER_HOUR,
                BudgetKind.token_forwards: float(self.token_forwards)}

    def _exhausted(self) -> BudgetKind | None:
        spent = self.spent()
        return next((k for k, limit in self.limits.items() if limit is not None and spent[k] >= limit), None)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A resumed run may have spent its budget already (stop at once) or have been given more.
        self.reached = self._exhausted()
        if self.reached is not None:
            trainer.should_stop = True
        else:
            self.stopped_at_step = None

    @property
    def active(self) -> bool:
        return any(limit is not None for limit in self.limits.values())

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self.active:  # no limit, no per-update all-reduce
            return
        record = self._new_record(pl_module)
        if record is None:
            return
        spent = torch.tensor([record.seconds, record.token_forwards, record.seconds / max(record.experts, 1)],
                             dtype=torch.float64, device=trainer.strategy.root_device)
        ranks = trainer.strategy.all_gather(spent).reshape(-1, 3).cpu().tolist()  # one collective
        self.seconds += sum(seconds for seconds, _, _ in ranks)
        self.token_forwards += int(sum(forwards for _, forwards, _ in ranks))
        if len(self.expert_seconds) != len(ranks):  # the first update, or resumed on other ranks
            self.expert_seconds = [max(self.expert_seconds, default=0.0)] * len(ranks)
        self.expert_seconds = [total + each for total, (_, _, each) in zip(self.expert_seconds, ranks, strict=True)]
        self.updates += 1
        reached = self._exhausted()
        if reached is not None and self.reached is None:
            self.reached, self.stopped_at_step = reached, trainer.global_step
            trainer.should_stop = True
            rank_zero_info(f"compute budget reached: {reached.value} {self.spent()[reached]:g} >= "
                           f"{self.limits[reached]:g} after update {trainer.global_step}")

    def summary(self) -> dict:
        """Limits, what was spent, and where (if anywhere) the run stopped on the budget."""
        return {"limits": {k.value: v for k, v in self.limits.items()}, "seconds_per_update": self.seconds_per_update,
                "spent": {k.value: v for k, v in self.spent().items()} if self.active else None,
                "measured_device_hours": self.seconds / SECONDS_PER_HOUR if self.active else None,
                "reached": self.reached.value if self.reached else None, "stopped_at_step": self.stopped_at_step}

    def state_dict(self) -> dict:
        return {"seconds": self.seconds, "expert_seconds": self.expert_seconds, "token_forwards": self.token_forwards,
                "updates": self.updates,
                "reached": self.reached.value if self.reached else None, "stopped_at_step": self.stopped_at_step}

    def load_state_dict(self, state_dict: dict) -> None:
        self.seconds = float(state_dict["seconds"])
        self.expert_seconds = [float(seconds) for seconds in state_dict["expert_seconds"]]
        self.token_forwards = int(state_dict["token_forwards"])
        self.updates = int(state_dict["updates"])
        self.reached = BudgetKind(state_dict["reached"]) if state_dict.get("reached") else None
        self.stopped_at_step = state_dict.get("stopped_at_step")
