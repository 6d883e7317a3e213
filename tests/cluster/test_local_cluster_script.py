"""`scripts/local_cluster.sh` refuses with one line where it cannot work. (No cluster needed:
default suite; nothing is installed or started.)"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.cluster.slurm import REPO

SCRIPT = REPO / "scripts" / "local_cluster.sh"


def _run(*args: str, env: dict | None = None, user: str | None = None) -> subprocess.CompletedProcess:
    command = [shutil.which("bash") or "/bin/bash", str(SCRIPT), *args]
    if user is not None:
        command = ["runuser", "-u", user, "--", *command]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, env=env)


def _one_line(result: subprocess.CompletedProcess, *fragments: str) -> None:
    assert result.returncode == 1 and result.stdout == "", result
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("local_cluster: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_an_unknown_verb_is_the_usage_line():
    _one_line(_run("start"), "usage: scripts/local_cluster.sh up|down|status")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("runuser") is None, reason="needs root to run as another user")
def test_up_and_down_refuse_without_root():
    for verb in ("up", "down"):
        _one_line(_run(verb, user="nobody"), "needs root")


@pytest.mark.skipif(os.geteuid() != 0, reason="the root check comes first")
def test_up_without_the_packages_or_apt_get_names_what_to_install(tmp_path):
    tools = tmp_path / "bin"  # a PATH with the shell's basics and python, but no SLURM, munge, PostgreSQL or apt-get
    tools.mkdir()
    for name in ("id", "dirname", "head"):
        (tools / name).symlink_to(shutil.which(name))
    (tools / "python").symlink_to(sys.executable)
    _one_line(_run("up", env={"PATH": str(tools)}), "apt-get not found", "slurm-wlm munge postgresql")
