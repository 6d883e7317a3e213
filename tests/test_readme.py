"""The README as a newcomer reads it: short, two commands that exist, links that resolve, and CI
running its test command as written."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from soma_pl.cli import COMMANDS

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def _two_commands() -> list[str]:
    section = README.split("## Two commands", 1)[1]
    block = section.split("```bash\n", 1)[1].split("```", 1)[0]
    return block.strip().splitlines()


def test_readme_is_short_and_opens_with_what_the_project_is():
    assert len(README.splitlines()) <= 150
    intro = README.split("```", 1)[0]
    assert "Scaling Zero-Order Pretraining through Model Sharding" in intro
    assert "Chaubard" in intro and "Kochenderfer" in intro


def test_the_two_commands_install_then_run_the_main_job_and_the_tests():
    main_job, tests = _two_commands()
    install, run = (part.strip() for part in main_job.split("&&"))
    assert install.startswith("pip install ") and install.endswith(" -e .")
    command = run.split()
    assert command[:3] == ["python", "-m", "soma_pl.cli"]
    assert command[3] in COMMANDS
    assert tests.startswith("pip install ") and tests.endswith("-e '.[dev]' && python -m pytest -q")


def test_ci_runs_the_readme_test_command_then_the_slow_and_the_cluster_checks():
    printed = subprocess.run([str(ROOT / ".ci" / "run"), "--print"], capture_output=True, text=True, check=True)
    assert printed.stdout.splitlines() == [_two_commands()[1], "ruff check .",
                                           "python -m pytest -q -m 'slow and not cuda' -n 0",
                                           "scripts/local_cluster.sh up", "python -m pytest -q -m cluster -n 0"]
    assert "set -euo pipefail" in (ROOT / ".ci" / "run").read_text()
    tests = " ".join(README.split("## Tests", 1)[1].split())
    assert "`python -m pytest -q -m 'slow and not cuda' -n 0`" in tests
    assert "CI (`.ci/run`) runs it, `ruff check .`" in tests
    assert "then `scripts/local_cluster.sh up`" in tests and "`python -m pytest -q -m cluster -n 0`" in tests


def test_the_lint_configuration_is_the_one_ci_and_pre_commit_run():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    import yaml

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    lint = project["tool"]["ruff"]
    assert lint["line-length"] == 120 and set(lint["lint"]["select"]) == {"E", "F", "W", "B", "I", "UP"}
    pinned = [d for d in project["project"]["optional-dependencies"]["dev"] if d.startswith("ruff==")]
    hooks = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())["repos"][0]["hooks"]
    assert len(pinned) == 1 and hooks[0]["entry"].startswith("ruff check")
    assert (ROOT / "LICENSE").read_text().split()[:3] == ["Apache", "License", "Version"]
    assert project["project"]["license"] == {"text": "Apache-2.0"}


JUPYTER_COMMANDS = {"jupyter nbconvert": "nbconvert", "jupyter-execute": "nbclient"}
"""A Jupyter command the docs name, and the package that brings it."""


def test_the_dev_extra_brings_each_jupyter_command_the_docs_name():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    dev = [*extras["dev"], *(extras["notebooks"] if "soma_pl[notebooks]" in extras["dev"] else [])]
    packages = {re.split(r"[\s<>=!~;\[]", requirement, maxsplit=1)[0] for requirement in dev}
    docs = " ".join(path.read_text() for path in [ROOT / "README.md", *ROOT.glob("*/*.md")])
    named = [command for command in JUPYTER_COMMANDS if command in docs]
    assert "jupyter nbconvert" in named
    assert [JUPYTER_COMMANDS[command] for command in named if JUPYTER_COMMANDS[command] not in packages] == []


def test_links_and_the_figure_resolve():
    targets = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", README)
    assert "results/main_job/figure.png" in targets
    figure = ROOT / "results" / "main_job" / "figure.png"
    assert figure.read_bytes().startswith(b"\x89PNG") and figure.stat().st_size < 300_000
    missing = [t for t in targets if not t.startswith("http") and not (ROOT / t).exists()]
    assert missing == []
