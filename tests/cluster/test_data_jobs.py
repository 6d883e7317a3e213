"""`prepare` and `shard` with `executor.kind: slurm` (docs/data.md's settings, at 2 tasks) on a real
SLURM cluster, on the demo corpus: the stages are submitted as job arrays, complete, and give the
files (sha256 for sha256) the local executor gives; a run whose jobs are cancelled with `scancel`
finishes when the command is run again."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.cluster.commands import executor, prepare_args, run_cli, shard_args
from tests.cluster.outputs import assert_same_output
from tests.cluster.slurm import jobs_named, wait_for

pytestmark = pytest.mark.cluster

STAGE_SECONDS = 300


def queue_empties(prefix: str = "soma_pl-") -> None:
    wait_for(lambda: not jobs_named(prefix), STAGE_SECONDS * 4, f"the {prefix}* jobs leaving the queue", poll=1)


def on_slurm(args: list[str], output: Path, partition: str) -> None:
    """Run a `prepare` or `shard` command on the Slurm executor as its docs say: once to submit,
    then, when the jobs are done, again to finish; the output must then exist."""
    section = "shard" if args[0] == "shard" else "dataset"
    run_cli(*args, *executor(section, "slurm", partition))
    assert not output.exists(), "the command should return once the jobs are submitted"
    assert jobs_named("soma_pl-"), "nothing was submitted"
    queue_empties()
    run_cli(*args, *executor(section, "slurm", partition))
    assert output.exists()


def test_prepare_and_shard_on_slurm_give_the_local_executors_files(slurm, local_runs, tmp_path):
    on_slurm(prepare_args(tmp_path / "data"), tmp_path / "data", slurm)
    assert_same_output(local_runs / "data", tmp_path / "data")
    on_slurm(shard_args(local_runs / "data", tmp_path / "experts"), tmp_path / "experts", slurm)
    assert_same_output(local_runs / "experts", tmp_path / "experts")


def test_a_cancelled_prepare_on_slurm_resumes_to_the_local_executors_files(slurm, local_runs, tmp_path):
    args = [*prepare_args(tmp_path / "data"), *executor("dataset", "slurm", slurm)]
    run_cli(*args)
    running = wait_for(lambda: [job for job, now in jobs_named("soma_pl-").items() if now == "RUNNING"],
                       STAGE_SECONDS, "a prepare task running", poll=0.2)
    subprocess.run(["scancel", *{job.split("_")[0] for job in jobs_named("soma_pl-")}], check=True, timeout=30)
    queue_empties()
    assert running and not (tmp_path / "data").exists()
    staging = next(tmp_path.glob(".data.prepare-*"))
    done = {stage.name: len(list((stage / "completions").glob("*"))) for stage in (staging / "logs").iterdir()}
    assert done.get("finish", 0) == 0, done  # the run was cut short

    out = run_cli(*args).stdout  # submits the tasks that did not finish
    assert json.loads(out)["submitted"] is True, out
    assert not (tmp_path / "data").exists()
    queue_empties()
    run_cli(*args)
    assert (tmp_path / "data").exists(), out
    assert_same_output(local_runs / "data", tmp_path / "data")
