"""`prepare` and `shard` on a Slurm or Ray executor where no cluster takes the work: one line saying
what was tried, exit 2, nothing submitted and no output folder."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.data.corpora import write_jsonl_corpus
from tests.robustness.cli import cli, one_error, tiny_dataset

SLURM_OPTIONS = json.dumps({"partition": "cpu", "time": "1:00:00"})
NO_CONTROLLER = "sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)"


def _prepare(tmp_path: Path, *executor: str) -> list[str]:
    corpus = tmp_path / "corpus"
    write_jsonl_corpus(corpus, {"alpha": 6, "beta": 6}, min_words=50, max_words=100)
    return ["prepare", "--dataset.corpus.kind=jsonl", f"--dataset.corpus.paths=[{corpus}]",
            f"--dataset.output_dir={tmp_path / 'data'}", "--dataset.val_documents=2", "--dataset.val_windows=2",
            "--dataset.test_windows=2", "--dataset.executor.tasks=2", "--progress=false", *executor]


def _slurm(section: str) -> list[str]:
    return [f"--{section}.executor.kind=slurm", f"--{section}.executor.options={SLURM_OPTIONS}"]


def _fake_sbatch(folder: Path, dry_run_code: int, message: str) -> Path:
    """An `sbatch` that logs its arguments, answers a dry run (`--test-only`) with `dry_run_code`
    and fails anything else, writing `message` to stderr when it fails; the log's path."""
    folder.mkdir()
    log = folder / "calls.log"
    script = folder / "sbatch"
    script.write_text(f"""#!/bin/sh
echo "$@" >> "{log}"
if [ "$1" = "--test-only" ] && [ {dry_run_code} -eq 0 ]; then exit 0; fi
echo "{message}" >&2
exit 1
""")
    script.chmod(0o755)
    return log


def _path_without_sbatch(monkeypatch, tmp_path: Path) -> None:
    empty = tmp_path / "no-sbatch"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_prepare_on_slurm_without_sbatch_is_one_line(tmp_path, monkeypatch, capsys):
    args = _prepare(tmp_path, *_slurm("dataset"))
    _path_without_sbatch(monkeypatch, tmp_path)
    one_error(cli(capsys, *args), "executor.kind=slurm", "sbatch not found on PATH")
    assert not (tmp_path / "data").exists()


def test_prepare_on_slurm_with_no_controller_names_sbatchs_answer(tmp_path, monkeypatch, capsys):
    log = _fake_sbatch(tmp_path / "bin", 1, NO_CONTROLLER)
    monkeypatch.setenv("PATH", f"{log.parent}{os.pathsep}{os.environ['PATH']}")
    one_error(cli(capsys, *_prepare(tmp_path, *_slurm("dataset"))), "sbatch --test-only", "exit status 1",
              NO_CONTROLLER)
    calls = log.read_text().splitlines()
    assert len(calls) == 1 and calls[0].startswith("--test-only "), calls  # a dry run only: nothing queued
    script = Path(calls[0].split()[1])
    assert not script.exists()  # the dry run's job script was temporary


def test_a_submission_that_fails_after_the_dry_run_is_one_line(tmp_path, monkeypatch, capsys):
    log = _fake_sbatch(tmp_path / "bin", 0, "sbatch: error: QOSMaxSubmitJobPerUserLimit")
    monkeypatch.setenv("PATH", f"{log.parent}{os.pathsep}{os.environ['PATH']}")
    one_error(cli(capsys, *_prepare(tmp_path, *_slurm("dataset"))), "`sbatch` failed with exit status 1")
    calls = log.read_text().splitlines()
    assert [call.split()[0] for call in calls] == ["--test-only", "--export=ALL,RUN_OFFSET=0"], calls


def test_shard_on_slurm_without_sbatch_is_one_line(tmp_path, monkeypatch, capsys):
    _, data = tiny_dataset(tmp_path)
    args = ["shard", f"--shard.prepared={data}", "--shard.num_experts=2", f"--shard.output_dir={tmp_path / 'experts'}",
            "--progress=false", *_slurm("shard")]
    _path_without_sbatch(monkeypatch, tmp_path)
    one_error(cli(capsys, *args), "executor.kind=slurm", "sbatch not found on PATH")
    assert not (tmp_path / "experts").exists()


def test_prepare_on_ray_without_ray_is_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails, installed or not
    one_error(cli(capsys, *_prepare(tmp_path, "--dataset.executor.kind=ray")), "executor.kind=ray",
              "ray is not installed")
    assert not (tmp_path / "data").exists()


def _ray_cluster_runs_here() -> bool:
    """Whether a Ray cluster runs on this machine (`scripts/local_cluster.sh up` starts one): Ray's own
    search for its GCS processes, the one `ray.init(address="auto")` makes (`ray status` waits ~40 s
    to say there is none)."""
    from ray._private.services import find_gcs_addresses

    return bool(find_gcs_addresses())


def test_prepare_on_ray_without_a_cluster_is_one_line(tmp_path, monkeypatch, capsys):
    pytest.importorskip("ray")
    if _ray_cluster_runs_here():
        pytest.skip("a Ray cluster runs on this machine (scripts/local_cluster.sh down stops it)")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setenv("RAY_TMPDIR", str(tmp_path / "ray"))  # no cluster that `ray start` left here
    one_error(cli(capsys, *_prepare(tmp_path, "--dataset.executor.kind=ray")), "executor.kind=ray",
              "no Ray cluster to connect to")
    assert not (tmp_path / "data").exists()
