"""Every test: datatrove stages on the tiny test corpora run their tasks in the test's own process.

Starting a pool of workers costs seconds per stage (a fork server that imports torch, then the
workers it forks), against milliseconds of work on a corpus of a few hundred KB. A test of the pool
itself is marked `worker_pool`; the CLI run in a subprocess is not reached by this."""

from __future__ import annotations

import dataclasses

import pytest

from soma_pl.data.runner import pipeline
from soma_pl.data.runner.executor import ExecutorKind

_POOL = {"on": False}
"""Whether the running test is marked `worker_pool` (its stages keep the configured workers)."""


@pytest.fixture(scope="session", autouse=True)
def _stages_in_process():
    """Session-wide, so that module-scoped fixtures' datasets are built in-process too."""
    make_executor = pipeline.make_executor

    def in_process(config, *args, **kwargs):
        if not _POOL["on"] and ExecutorKind(config.kind) is ExecutorKind.local and config.workers is None:
            config = dataclasses.replace(config, workers=1)
        return make_executor(config, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "make_executor", in_process)
        yield


@pytest.fixture(autouse=True)
def _worker_pool(request):
    _POOL["on"] = request.node.get_closest_marker("worker_pool") is not None
    yield
    _POOL["on"] = False
