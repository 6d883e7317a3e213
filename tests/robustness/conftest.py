"""Fixtures shared by the command-line robustness tests: a tiny prepared dataset and a finished run."""

from __future__ import annotations

from pathlib import Path

import pytest

from soma_pl.cli import main
from tests.lit.conftest import fit_args
from tests.robustness.cli import tiny_dataset


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> tuple[Path, Path]:
    """`(corpus, prepared data)`, prepared as tests/lit/tiny_spsa.yaml prepares it (so `fit` reuses it)."""
    return tiny_dataset(tmp_path_factory.mktemp("dataset"))


@pytest.fixture(scope="module")
def four_steps(dataset, tmp_path_factory) -> Path:
    """A finished run of 4 updates, validated (and checkpointed) at update 4 (`checkpoints/`)."""
    run = tmp_path_factory.mktemp("four") / "run"
    main(fit_args(*dataset, run, "--trainer.max_steps=4"))
    return run
