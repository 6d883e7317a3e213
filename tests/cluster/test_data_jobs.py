"""`prepare` and `shard` with `executor.kind: slurm` on a real SLURM cluster: the stages are
submitted as job arrays, complete, and give the files (sha256 for sha256) the local executor gives;
a run whose jobs are cancelled with `scancel` finishes when the command is run again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.cluster.outputs import file_digests, recorded_digests
from tests.cluster.slurm import REPO, job_environment, jobs_named, wait_for
from tests.data.corpora import write_jsonl_corpus

pytestmark = pytest.mark.cluster

STAGE_SECONDS = 300


def run_cli(*args: str) -> str:
    """`python -m soma_pl.cli ARGS` in the repository root, as a user types it; its stdout."""
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], cwd=REPO, env=job_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def slurm_executor(section: str, partition: str) -> list[str]:
    options = {"partition": partition, "time": "00:30:00", "cpus_per_task": 1, "mem_per_cpu_gb": 1}
    return [f"--{section}.executor.kind=slurm", f"--{section}.executor.tasks=2",
            f"--{section}.executor.options={json.dumps(options)}"]


def prepare_args(corpus: Path, output: Path) -> list[str]:
    return ["prepare", "--dataset.corpus.kind=jsonl", f"--dataset.corpus.paths=[{corpus}]",
            f"--dataset.output_dir={output}", "--dataset.val_documents=2", "--dataset.val_windows=2",
            "--dataset.test_windows=2", "--dataset.expert_val_fraction=0.2", "--dataset.shard_max_bytes=20000",
            "--dataset.executor.tasks=2", "--progress=false"]


def shard_args(prepared: Path, output: Path) -> list[str]:
    return ["shard", f"--shard.prepared={prepared}", "--shard.num_experts=2", f"--shard.output_dir={output}",
            "--shard.shard_max_bytes=20000", "--shard.executor.tasks=2", "--progress=false"]


def queue_empties(prefix: str = "soma_pl-") -> None:
    wait_for(lambda: not jobs_named(prefix), STAGE_SECONDS * 4, f"the {prefix}* jobs leaving the queue", poll=1)


def on_slurm(args: list[str], output: Path, partition: str) -> None:
    """Run a `prepare` or `shard` command on the Slurm executor as its docs say: once to submit,
    then, when the jobs are done, again to finish; the output must then exist."""
    run_cli(*args, *slurm_executor(args[0] if args[0] == "shard" else "dataset", partition))
    assert not output.exists(), "the command should return once the jobs are submitted"
    assert jobs_named("soma_pl-"), "nothing was submitted"
    queue_empties()
    run_cli(*args, *slurm_executor(args[0] if args[0] == "shard" else "dataset", partition))
    assert output.exists()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("data_jobs") / "corpus"
    write_jsonl_corpus(folder, {"alpha": 16, "beta": 16}, min_words=150, max_words=400)
    return folder


@pytest.fixture(scope="module")
def local_runs(corpus) -> Path:
    """`prepare` then `shard` on the local executor; their root."""
    root = corpus.parent
    run_cli(*prepare_args(corpus, root / "data"))
    run_cli(*shard_args(root / "data", root / "experts"))
    return root


def assert_same_output(first: Path, second: Path) -> None:
    files = file_digests(first)
    assert len(files) >= 4 and any(name.endswith(".tar") for name in files), files
    assert file_digests(second) == files
    recorded = recorded_digests(first)
    assert recorded and recorded_digests(second) == recorded
    assert {name: files[name] for name in recorded} == recorded  # the record's sha256s are the files'


def test_prepare_and_shard_on_slurm_give_the_local_executors_files(slurm, local_runs, corpus, tmp_path):
    on_slurm(prepare_args(corpus, tmp_path / "data"), tmp_path / "data", slurm)
    assert_same_output(local_runs / "data", tmp_path / "data")
    on_slurm(shard_args(local_runs / "data", tmp_path / "experts"), tmp_path / "experts", slurm)
    assert_same_output(local_runs / "experts", tmp_path / "experts")


def test_a_cancelled_prepare_on_slurm_resumes_to_the_local_executors_files(slurm, local_runs, corpus, tmp_path):
    args = [*prepare_args(corpus, tmp_path / "data"), *slurm_executor("dataset", slurm)]
    run_cli(*args)
    running = wait_for(lambda: [job for job, now in jobs_named("soma_pl-").items() if now == "RUNNING"],
                       STAGE_SECONDS, "a prepare task running", poll=0.2)
    subprocess.run(["scancel", *{job.split("_")[0] for job in jobs_named("soma_pl-")}], check=True, timeout=30)
    queue_empties()
    assert running and not (tmp_path / "data").exists()
    staging = next(tmp_path.glob(".data.prepare-*"))
    done = {stage.name: len(list((stage / "completions").glob("*"))) for stage in (staging / "logs").iterdir()}
    assert done.get("finish", 0) == 0, done  # the run was cut short

    out = run_cli(*args)  # submits the tasks that did not finish
    assert json.loads(out)["submitted"] is True, out
    assert not (tmp_path / "data").exists()
    queue_empties()
    run_cli(*args)
    assert (tmp_path / "data").exists(), out
    assert_same_output(local_runs / "data", tmp_path / "data")
