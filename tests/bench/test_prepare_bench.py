"""`bench prepare` end to end on a small generated corpus: both task counts build the same dataset,
and the figures it reports follow from what it measured."""

from __future__ import annotations

import json

import pytest

from soma_pl.cli import main


def test_bench_prepare_reports_throughput_stages_and_memory_per_task(tmp_path, capsys):
    out = tmp_path / "prepare.json"
    main(["bench", "prepare", "--megabytes=1.5", "--files=4", "--tasks=[1, 2]", f"--workdir={tmp_path}",
          f"--out={out}", "--rounds=2", "--progress=false",
          "--prepare_args=[--dataset.val_documents=4, --dataset.val_windows=8, "
          "--dataset.test_windows=8, --dataset.shard_max_bytes=200000]"])
    report = json.loads(out.read_text())
    one, two = report["runs"]
    assert len(one["seconds_per_round"]) == len(two["seconds_per_round"]) == report["rounds"] == 2
    assert one["seconds"] in one["seconds_per_round"] and two["seconds"] in two["seconds_per_round"]
    assert (one["tasks"], two["tasks"]) == (1, 2)
    # Any task count holds out the same documents, so the training sets match.
    assert one["train_documents"] == two["train_documents"] > 100
    for run in (one, two):
        assert run["mb_per_second"] == pytest.approx(report["corpus"]["text_bytes"] / 1e6 / run["seconds"], rel=0.02)
        for stage in ("select", "write"):
            assert len(run["task_seconds"][stage]) == len(run["peak_rss_mib_per_task"][stage]) == run["tasks"]
            assert all(0 < s < run["seconds"] for s in run["task_seconds"][stage])
        assert run["parallel_stage_seconds"] == pytest.approx(
            max(run["task_seconds"]["select"]) + max(run["task_seconds"]["write"]), abs=2e-3)
        assert 0 < run["task_seconds"]["plan"] < run["seconds"]
    assert report["speedup_over_1_task"]["2"] == pytest.approx(one["seconds"] / two["seconds"], abs=0.01)
    assert report["parallel_stages_speedup_over_1_task"]["2"] == pytest.approx(
        one["median_parallel_stage_seconds"] / two["median_parallel_stage_seconds"], abs=0.01)
