"""`sbatch scripts/slurm/fit.sbatch` on a real SLURM cluster: 2 tasks of 1 CPU (gloo) through
Lightning's SLURMEnvironment train the weights one process trains, for DDPP and for expert-parallel
SOMA; a job cancelled with `scancel` and submitted again with `--ckpt_path last` ends with the weights
of the uninterrupted job (an expert-parallel one also when it resumes on one task)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from soma_pl.lightning_cli import make_cli
from tests.cluster.slurm import cancel, submit, wait, wait_for
from tests.lit.conftest import final_weights, fit_args
from tests.lit.multiprocess import max_difference
from tests.lit.test_expert_parallel import _checkpoint, _soma_args

pytestmark = pytest.mark.cluster

JOB_SECONDS = 600
# As tests/lit/test_ddpp.py: B = 6 windows in micro-batches of 2, n_pert = 3: 9 directions, 4 + 5 per rank.
DDPP = ["--data.init_args.batch_size=6", "--model.init_args.spsa.n_pert=3", "--trainer.max_steps=6",
        "--trainer.val_check_interval=3", "--model.init_args.spsa.exchange=scalars"]


def save_ranks(folder: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.lit.multiprocess.SaveRankState", f"--trainer.callbacks.folder={folder}"]


def pause_at(step: int, marker: Path) -> list[str]:
    return ["--trainer.callbacks+=tests.cluster.pause.PauseAtStep", f"--trainer.callbacks.step={step}",
            f"--trainer.callbacks.marker={marker}"]


def run_job(folder: Path, *args: str) -> None:
    """`sbatch scripts/slurm/fit.sbatch ARGS`, waited for; it must complete."""
    job = submit("fit.sbatch", *args, output=folder / "slurm-%j.out")
    final = wait(job, JOB_SECONDS)
    log = _log(folder, job)
    assert final == "COMPLETED", f"job {job} ended {final}:\n{log}"
    # Lightning took the ranks from SLURM (its SLURMEnvironment), one process per task.
    assert log.count("SLURM auto-requeueing enabled") == 2, log


def _log(folder: Path, job: str) -> str:
    path = folder / f"slurm-{job}.out"
    return path.read_text() if path.exists() else "(no output)"


def ranks_of(folder: Path) -> list[dict]:
    return [torch.load(folder / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.fixture(scope="module")
def ddpp_runs(slurm, corpus_dir, tmp_path_factory):
    """A one-process run and the same run as a 2-task DDPP job; their root folder."""
    root = tmp_path_factory.mktemp("ddpp_job")
    make_cli(fit_args(corpus_dir, root / "data", root / "one", *DDPP))
    run_job(root, *fit_args(corpus_dir, root / "data", root / "job", *DDPP, *save_ranks(root / "ranks"))[1:])
    return root


def test_a_ddpp_job_of_two_tasks_trains_the_weights_of_one_process(ddpp_runs):
    ranks = ranks_of(ddpp_runs / "ranks")
    assert max_difference(ranks[0]["weights"], ranks[1]["weights"]) == 0.0
    assert max_difference(final_weights(ddpp_runs / "one"), final_weights(ddpp_runs / "job")) == 0.0
    # Two ranks, each its own share of the 9 directions: the job ran on 2 processes, not one.
    assert [r["token_forwards"] for r in ranks] == [2 * 4 * 2 * 24, 2 * 5 * 2 * 24]
    assert {r["exchange_bytes"] for r in ranks} == {2 * 5 * 2 * 4}


def test_a_cancelled_ddpp_job_resubmitted_with_ckpt_path_last_ends_with_the_uninterrupted_weights(
        ddpp_runs, corpus_dir, tmp_path):
    marker = tmp_path / "paused"
    args = fit_args(corpus_dir, ddpp_runs / "data", tmp_path / "run", *DDPP)[1:]
    job = submit("fit.sbatch", *args, *pause_at(4, marker), output=tmp_path / "slurm-%j.out")
    wait_for(marker.exists, JOB_SECONDS, f"job {job} reaching update 4")
    assert cancel(job) == "CANCELLED"
    checkpoint = tmp_path / "run" / "checkpoints" / "last.ckpt"
    assert torch.load(checkpoint, map_location="cpu", weights_only=False)["global_step"] == 3  # the last validation's

    run_job(tmp_path, *args, "--ckpt_path=last")
    resumed = torch.load(checkpoint, map_location="cpu", weights_only=False)
    assert resumed["global_step"] == 6
    assert max_difference(final_weights(ddpp_runs / "job"), resumed["state_dict"]) == 0.0


@pytest.fixture(scope="module")
def soma_runs(slurm, sharded, corpus_dir, tmp_path_factory):
    """A one-process SOMA run of 3 experts and the same run as a 2-task expert-parallel job:
    `(root of both, experts folder, the job's folder)`."""
    root, experts = sharded
    folder = tmp_path_factory.mktemp("soma_job")
    make_cli(["fit", *_soma_args(corpus_dir, root, experts, "one")])
    run_job(folder, *_soma_args(corpus_dir, root, experts, "job"), *save_ranks(folder / "ranks"))
    return root, experts, folder


def test_an_expert_parallel_soma_job_of_two_tasks_trains_the_experts_of_one_process(soma_runs):
    root, _, folder = soma_runs
    one, job = _checkpoint(root, "one"), _checkpoint(root, "job")
    assert max_difference(one["state_dict"], job["state_dict"]) == 0.0
    assert one["state_dict"]["plateau.scale"].min() < 1, "the test should see an expert's learning rate decay"
    for index, entry in one["optimizer_states"][0]["state"].items():
        assert torch.equal(entry["momentum_buffer"], job["optimizer_states"][0]["state"][index]["momentum_buffer"])
    ranks = ranks_of(folder / "ranks")
    assert [r["experts"] for r in ranks] == [(0, 1), (1, 3)]  # each rank trained its own share of the 3 experts
    for rank in ranks:
        low, high = rank["experts"]
        for name, weights in rank["weights"].items():
            assert torch.equal(weights, one["state_dict"][f"model.{name}"][low:high]), name


def test_a_cancelled_expert_parallel_job_resumes_on_one_task_to_the_uninterrupted_weights(soma_runs, corpus_dir,
                                                                                         tmp_path):
    root, experts, _ = soma_runs
    marker = tmp_path / "paused"
    args = _soma_args(corpus_dir, root, experts, "cancelled")
    job = submit("fit.sbatch", *args, *pause_at(5, marker), output=tmp_path / "slurm-%j.out")
    wait_for(marker.exists, JOB_SECONDS, f"job {job} reaching update 5")
    assert cancel(job) == "CANCELLED"
    assert _checkpoint(root, "cancelled")["global_step"] == 4  # the last validation's

    # Its checkpoint holds every expert, so the resumed job may have another number of tasks.
    resumed = submit("fit.sbatch", *args, "--ckpt_path=last", options=("--ntasks-per-node=1",),
                     output=tmp_path / "slurm-%j.out")
    assert wait(resumed, JOB_SECONDS) == "COMPLETED", _log(tmp_path, resumed)
    job, resumed = _checkpoint(root, "job"), _checkpoint(root, "cancelled")
    assert resumed["global_step"] == 8
    assert max_difference(job["state_dict"], resumed["state_dict"]) == 0.0
    for index, entry in job["optimizer_states"][0]["state"].items():
        assert torch.equal(entry["momentum_buffer"], resumed["optimizer_states"][0]["state"][index]["momentum_buffer"])
