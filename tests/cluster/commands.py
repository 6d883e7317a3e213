"""`prepare` and `shard` as a user types them, on the demo corpus (docs/data.md's first commands,
into the test's folders)."""

from __future__ import annotations

import json
import shlex
import subprocess
import sys
from pathlib import Path

import yaml

from tests.cluster.slurm import REPO, job_environment


def run_cli(*args: str) -> subprocess.CompletedProcess:
    """`python -m soma_pl.cli ARGS` in the repository root, as a user types it; it must succeed."""
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], cwd=REPO, env=job_environment(),
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def docs_executor(kind: str) -> dict[str, str]:
    """The `--dataset.executor.*` settings of docs/data.md's `prepare` command for executor `kind`
    (`slurm`, `ray`): setting -> value."""
    text = (REPO / "docs" / "data.md").read_text()
    for block in text.split("```")[1::2]:
        words = shlex.split(block.replace("\\\n", " "))
        pairs = zip(words[:-1], words[1:], strict=True)
        settings = {word.removeprefix("--dataset.executor."): value for word, value in pairs
                    if word.startswith("--dataset.executor.")}
        if words[:4] == ["python", "-m", "soma_pl.cli", "prepare"] and settings.get("kind") == kind:
            return settings
    raise AssertionError(f"docs/data.md has no prepare command with --dataset.executor.kind {kind}")


def executor(section: str, kind: str, partition: str | None = None) -> list[str]:
    """docs/data.md's executor settings of `kind` for `section` (`dataset`, `shard`), at 2 tasks,
    on `partition` where the docs name another."""
    settings = {**docs_executor(kind), "tasks": "2"}
    if partition is not None:
        options = yaml.safe_load(settings["options"])
        settings["options"] = json.dumps({**options, "partition": partition})
    return [f"--{section}.executor.{key}={value}" for key, value in settings.items()]


def prepare_args(output: Path) -> list[str]:
    return ["prepare", "--config", "configs/data/demo.yaml", f"--dataset.output_dir={output}",
            "--dataset.executor.tasks=2", "--progress=false"]


def shard_args(prepared: Path, output: Path) -> list[str]:
    return ["shard", "--config", "configs/shard/demo_n2.yaml", f"--shard.prepared={prepared}",
            f"--shard.output_dir={output}", "--shard.executor.tasks=2", "--progress=false"]
