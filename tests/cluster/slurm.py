"""Submitting to, watching and cancelling jobs on the SLURM cluster `scripts/local_cluster.sh up` starts."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "scripts" / "slurm"
DONE = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL",
        "DEADLINE"}


def job_environment() -> dict[str, str]:
    """This process's environment for a job: this interpreter's folder first on PATH (so `python` in
    a job script is the one running the tests), W&B offline, and no rank variables of a parent run."""
    ranks = ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK", "WORLD_SIZE")
    env = {k: v for k, v in os.environ.items() if k not in ranks and not k.startswith("SLURM_")}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["WANDB_MODE"] = "offline"
    return env


def ray_command() -> str | None:
    """The `ray` command of this interpreter's installation: beside it (a virtual environment), else
    on PATH; None when there is none."""
    beside = Path(sys.executable).with_name("ray")
    return str(beside) if beside.exists() else shutil.which("ray")


def submit(script: str, *args: str, options: tuple[str, ...] = (), output: Path) -> str:
    """`sbatch OPTIONS scripts/slurm/SCRIPT ARGS` from the repository root; the job id. The job's
    output goes to `output` (`%j`, `%a` expand)."""
    command = ["sbatch", "--parsable", f"--output={output}", *options, str(SCRIPTS / script), *args]
    result = subprocess.run(command, cwd=REPO, env=job_environment(), capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"{' '.join(command)}: {result.stderr}"
    return result.stdout.strip().split(";")[0]


def state(job: str) -> str:
    """A job's state as `scontrol` reports it (PENDING, RUNNING, COMPLETED, CANCELLED, ...). For an
    array, the state of its tasks joined by commas, sorted."""
    result = subprocess.run(["scontrol", "show", "job", "-o", job], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    states = sorted({field.split("=", 1)[1] for line in result.stdout.splitlines() for field in line.split()
                     if field.startswith("JobState=")})
    return ",".join(states)


def wait(job: str, timeout: float, poll: float = 1.0) -> str:
    """Wait until every task of `job` has ended; its final state(s)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        now = state(job)
        if set(now.split(",")) <= DONE:
            return now
        time.sleep(poll)
    subprocess.run(["scancel", job], timeout=30)
    raise AssertionError(f"job {job} did not end in {timeout} s (state {now}); cancelled it")


def wait_for(condition, timeout: float, what: str, poll: float = 0.5):
    """Poll `condition()` until it returns something true; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(poll)
    raise AssertionError(f"{what} did not happen in {timeout} s")


def cancel(job: str) -> str:
    """`scancel JOB` and wait for it to end; its final state."""
    subprocess.run(["scancel", job], check=True, timeout=30)
    return wait(job, timeout=60)


def jobs_named(prefix: str) -> dict[str, str]:
    """The queued or running jobs whose name starts with `prefix`: id (array tasks as `id_task`, a
    pending array as `id_[range]`) -> state (PENDING, RUNNING, ...)."""
    result = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], capture_output=True, text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    return {job: now for job, name, now in (line.split() for line in result.stdout.splitlines())
            if name.startswith(prefix)}
