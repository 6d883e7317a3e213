"""`prepare` and `shard` as a user types them, on a small corpus."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.cluster.slurm import REPO, job_environment


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m soma_pl.cli ARGS` in the repository root, as a user types it; it must succeed."""
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], cwd=REPO, env=job_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


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
