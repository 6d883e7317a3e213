"""How a datatrove pipeline is run (`ExecutorConfig`, a setting of `prepare` and `shard`), apart from
datatrove itself: a config names it, and a command's `--help` reads it, without importing datatrove.
"""

from __future__ import annotations

import multiprocessing
import os
from dataclasses import dataclass, field
from enum import Enum

from soma_pl.errors import ConfigError


class ExecutorKind(str, Enum):
    """Which datatrove executor runs the pipeline."""

    local = "local"
    slurm = "slurm"
    ray = "ray"


@dataclass
class ExecutorConfig:
    """How a datatrove pipeline is run.

    Attributes:
        kind: `local` (this machine), `slurm` (job arrays; the command returns once they are
            submitted, run it again when they are done to print the result) or `ray` (a running
            Ray cluster). Before submitting, a Slurm or Ray run checks that its cluster answers
            (`check_cluster`).
        tasks: parallel tasks of the reading stages; the corpus files are dealt out among them, so
            more tasks than files leaves some idle. None: the CPU cores of this machine.
        workers: tasks running at once (local), or concurrent array tasks (slurm). None: all.
        options: further keyword arguments of the executor, e.g. for local `start_method`
            (default: `fork` from a plain process, `forkserver` from one holding threads or torch,
            see `default_start_method`); for slurm `partition`,
            `time`, `cpus_per_task`, `mem_per_cpu_gb`, `venv_path`, `sbatch_args`; for ray
            `cpus_per_task`.
    """

    kind: ExecutorKind = ExecutorKind.local
    tasks: int | None = None
    workers: int | None = None
    options: dict = field(default_factory=dict)

    def task_count(self) -> int:
        return self.tasks if self.tasks is not None else (os.cpu_count() or 1)

    def validate(self, section: str) -> None:
        for key, value in (("tasks", self.tasks), ("workers", self.workers)):
            if value is not None and value < 1:
                raise ConfigError(f"{section}.executor.{key}={value} must be >= 1 (or null)")
        if ExecutorKind(self.kind) is ExecutorKind.slurm and not {"partition", "time"} <= set(self.options):
            raise ConfigError(f"{section}.executor.kind=slurm needs executor.options.partition and "
                              f"executor.options.time")
        if ExecutorKind(self.kind) is ExecutorKind.ray:
            import_ray()
        method, methods = self.options.get("start_method"), multiprocessing.get_all_start_methods()
        if ExecutorKind(self.kind) is ExecutorKind.local and method is not None and method not in methods:
            raise ConfigError(f"{section}.executor.options.start_method={method} is not a start method of this "
                              f"machine: choose one of {', '.join(methods)} (or leave it unset)")


def import_ray():
    """The `ray` module, or one line saying it is not installed."""
    try:
        import ray
    except ImportError:
        raise ConfigError("executor.kind=ray: ray is not installed (pip install ray), or set executor.kind "
                          "local") from None
    return ray
