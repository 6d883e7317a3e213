"""`bench shard` end to end on a small generated corpus: both task counts give the same experts, and
the figures it reports follow from what it measured."""

from __future__ import annotations

import json

import pytest

from soma_pl.cli import main


def test_bench_shard_reports_throughput_stages_and_memory_per_task(tmp_path):
    out = tmp_path / "shard.json"
    main(["bench", "shard", "--megabytes=2", "--files=4", "--tasks=[1, 2]", "--experts=3", "--prepare_shard_mb=0.4",
          f"--workdir={tmp_path}", f"--out={out}", "--rounds=1", "--progress=false",
          "--shard_args=[--shard.kmeans_n_init=2]",
          "--prepare_args=[--dataset.val_documents=4, --dataset.val_windows=8, --dataset.test_windows=8]"])
    report = json.loads(out.read_text())
    one, two = report["runs"]
    assert (one["tasks"], two["tasks"]) == (1, 2) and report["experts"] == 3
    assert report["prepared"]["shards"] >= 2
    # Any task count gives the same sharding: the same documents in experts of the same sizes.
    assert report["same_experts"] and one["shard_sizes"] == two["shard_sizes"]
    assert one["documents"] == two["documents"] == report["prepared"]["documents"] > 100
    assert one["purity"] == two["purity"] and one["router_agreement"] == two["router_agreement"]
    for run in (one, two):
        assert run["mb_per_second"] == pytest.approx(report["prepared"]["bytes"] / 1e6 / run["seconds"], rel=0.02)
        for stage in ("embed", "write"):
            assert len(run["task_seconds"][stage]) == len(run["peak_rss_mib_per_task"][stage]) == run["tasks"]
            assert all(0 < s < run["seconds"] for s in run["task_seconds"][stage])
        assert run["parallel_stage_seconds"] == pytest.approx(
            max(run["task_seconds"]["embed"]) + max(run["task_seconds"]["write"]), abs=2e-3)
        assert 0 < run["task_seconds"]["fit"] < run["seconds"]
    assert report["speedup_over_1_task"]["2"] == pytest.approx(one["seconds"] / two["seconds"], abs=0.01)


def test_bench_shard_refuses_more_tasks_than_prepared_shards(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "shard", "--megabytes=1", "--files=2", "--tasks=[1, 8]", "--prepare_shard_mb=100",
              f"--workdir={tmp_path}", f"--out={tmp_path / 'x.json'}", "--progress=false",
              "--prepare_args=[--dataset.val_documents=4, --dataset.val_windows=8, --dataset.test_windows=8]"])
    assert "prepared shards cannot feed 8 tasks; lower --prepare_shard_mb" in capsys.readouterr().err
