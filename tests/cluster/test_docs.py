"""The cluster commands of docs/distributed.md and docs/data.md are the ones tests/cluster runs: the
job scripts are quoted whole, every `sbatch` line submits one of them with files that exist, and
the executor settings are read from docs/data.md by the tests. (No cluster needed: default suite.)"""

from __future__ import annotations

import shlex

import yaml

from tests.cluster.commands import docs_executor
from tests.cluster.slurm import REPO, SCRIPTS

DISTRIBUTED = (REPO / "docs" / "distributed.md").read_text()


def _sbatch_commands() -> list[list[str]]:
    blocks = DISTRIBUTED.split("```")[1::2]
    lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
    return [shlex.split(line, comments=True) for line in lines if line.startswith("sbatch ")]


def test_the_job_scripts_are_quoted_whole_in_distributed_md():
    scripts = sorted(SCRIPTS.glob("*.sbatch"))
    assert [s.name for s in scripts] == ["fit.sbatch", "sweep.sbatch"]
    for script in scripts:
        assert f"```bash\n{script.read_text().rstrip()}\n```" in DISTRIBUTED, script.name


def test_every_sbatch_line_submits_a_job_script_with_files_that_exist():
    commands = _sbatch_commands()
    assert len(commands) == 5
    for words in commands:
        script = next(word for word in words[1:] if not word.startswith("-"))
        assert (REPO / script).parent == SCRIPTS and (REPO / script).is_file(), words
        for option in ("--config", "--sweep"):
            if option in words:
                assert (REPO / words[words.index(option) + 1]).is_file(), words
    assert {next(w for w in c[1:] if not w.startswith("-")) for c in commands} == {
        "scripts/slurm/fit.sbatch", "scripts/slurm/sweep.sbatch"}


def test_data_md_gives_the_executor_settings_the_cluster_tests_run():
    slurm = docs_executor("slurm")
    assert slurm["kind"] == "slurm" and {"partition", "time"} <= set(yaml.safe_load(slurm["options"]))
    assert docs_executor("ray")["kind"] == "ray"
