"""Compute accounting and budgets under expert parallelism: 3 experts on 2 gloo processes
(shares of 1 and 2 experts) count what one process counts, stop where it stops, and resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from soma_pl.lightning_cli import make_cli
from tests.lit.multiprocess import fit_on_processes
from tests.lit.test_expert_parallel import EXPERTS, _soma_args, sharded  # noqa: F401

pytestmark = pytest.mark.slow

# tiny_soma.yaml: 2 · n_pert 4 · micro-batch 2 · 24 predicted bytes per expert and update
FORWARDS_PER_UPDATE = 2 * 4 * 2 * 24 * EXPERTS
BUDGET = f"--budget.token_forwards={5.5 * FORWARDS_PER_UPDATE}"  # reached at update 6


def _compute(root: Path, run: str) -> dict:
    return json.loads(next((root / run).rglob("compute.json")).read_text())


def test_two_processes_count_and_stop_as_one(sharded, corpus_dir, tmp_path):  # noqa: F811
    root, experts = sharded
    make_cli(["fit", *_soma_args(corpus_dir, root, experts, "budget_one", BUDGET)])
    fit_on_processes(_soma_args(corpus_dir, root, experts, "budget_two", BUDGET), 2, tmp_path / "two")
    fit_on_processes(_soma_args(corpus_dir, root, experts, "budget_resumed", BUDGET, "--trainer.max_steps=4"), 2,
                     tmp_path / "a")
    fit_on_processes(_soma_args(corpus_dir, root, experts, "budget_resumed", BUDGET, "--ckpt_path=last"), 2,
                     tmp_path / "b")
    one = _compute(root, "budget_one")
    assert (one["ranks"], one["experts"], one["updates"]) == (1, EXPERTS, 6)
    assert one["accounting"] == "batched"
    for run in ("budget_two", "budget_resumed"):
        two = _compute(root, run)
        assert (two["ranks"], two["experts"], two["updates"]) == (2, EXPERTS, 6), run
        assert two["accounting"] == "batched"  # rank 1 batches two experts
        assert two["token_forwards"] == one["token_forwards"] == 6 * FORWARDS_PER_UPDATE
        assert two["budget"]["stopped_at_step"] == one["budget"]["stopped_at_step"] == 6
        means = two["expert_mean_update_seconds"]
        assert len(means) == EXPERTS and means[1] == means[2]  # rank 1's two experts share its time
        assert two["aggregate_device_hours"] == pytest.approx(6 * sum(means) / 3600)
        assert two["physical_device_hours"] == pytest.approx(2 * two["elapsed_training_seconds"] / 3600)
