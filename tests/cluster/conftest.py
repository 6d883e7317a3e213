"""The services of `scripts/local_cluster.sh up`: each fixture skips its tests, with one line, where
its service is not running."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from tests.cluster.commands import prepare_args, run_cli, shard_args
from tests.cluster.slurm import ray_command
from tests.lit.conftest import corpus_dir  # noqa: F401 (fixtures the fits share)
from tests.lit.test_expert_parallel import sharded  # noqa: F401

START = "scripts/local_cluster.sh up starts it"


def _answer(command: list[str]) -> tuple[int, str]:
    try:
        result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except (FileNotFoundError, subprocess.TimeoutExpired) as error:
        return 1, str(error)
    return result.returncode, (result.stdout + result.stderr).strip()


@pytest.fixture(scope="session")
def slurm() -> str:
    """The partition of a SLURM cluster whose node takes jobs."""
    code, answer = _answer(["sinfo", "-h", "-o", "%P %T"])
    ready = [line.split()[0].rstrip("*") for line in answer.splitlines()
             if code == 0 and line.split()[-1].rstrip("*~#") in ("idle", "mixed", "allocated", "completing")]
    if not ready:
        said = answer.splitlines()[0] if answer else "no partition"
        pytest.skip(f"no SLURM node takes jobs here ({START}); sinfo: {said}")
    return ready[0]


@pytest.fixture()
def postgres_url():
    """A new, empty PostgreSQL database for one test (dropped after it); its URL."""
    sqlalchemy = pytest.importorskip("sqlalchemy")
    try:
        import psycopg  # noqa: F401 (the driver of postgresql:// URLs)
    except ImportError:
        pytest.skip(f"psycopg is not installed ({START})")
    name = f"soma_pl_test_{uuid.uuid4().hex[:12]}"
    try:
        engine = sqlalchemy.create_engine("postgresql:///soma_pl", isolation_level="AUTOCOMMIT")
        with engine.connect() as connection:
            connection.execute(sqlalchemy.text(f"CREATE DATABASE {name}"))
    except sqlalchemy.exc.OperationalError as error:
        pytest.skip(f"no PostgreSQL database soma_pl to connect to ({START}): {str(error).splitlines()[0]}")
    yield f"postgresql:///{name}"
    with engine.connect() as connection:
        connection.execute(sqlalchemy.text(f"DROP DATABASE {name} WITH (FORCE)"))
    engine.dispose()


@pytest.fixture(scope="session")
def ray_head() -> None:
    """A running Ray cluster on this machine."""
    try:
        import ray  # noqa: F401
    except ImportError:
        pytest.skip(f"ray is not installed ({START})")
    code, answer = _answer([ray_command() or "ray", "status"])
    if code != 0:
        said = answer.splitlines()[-1] if answer else "no answer"
        pytest.skip(f"no Ray cluster is running here ({START}); ray status: {said}")


@pytest.fixture(scope="session")
def local_runs(tmp_path_factory) -> Path:
    """`prepare` then `shard` of the demo corpus on the local executor; their root."""
    root = tmp_path_factory.mktemp("data_jobs")
    run_cli(*prepare_args(root / "data"))
    run_cli(*shard_args(root / "data", root / "experts"))
    return root
