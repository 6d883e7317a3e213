"""`prepare` with `executor.kind: ray` (docs/data.md's settings, at 2 tasks) on the Ray cluster
running on this machine (`ray start --head`) gives the files, sha256 for sha256, that the local
executor gives."""

from __future__ import annotations

import json

import pytest

from tests.cluster.commands import executor, prepare_args, run_cli
from tests.cluster.outputs import assert_same_output

pytestmark = pytest.mark.cluster


def test_prepare_on_ray_gives_the_local_executors_files(ray_head, local_runs, tmp_path):
    result = run_cli(*prepare_args(tmp_path / "data"), *executor("dataset", "ray"))
    assert "Connected to Ray cluster" in result.stderr, result.stderr[-2000:]  # the running one, not a new one
    assert json.loads(result.stdout)["output_dir"] == str(tmp_path / "data")
    assert_same_output(local_runs / "data", tmp_path / "data")
