"""`bench shard` end to end on a small generated corpus: both task counts give the same experts, and
the figures it reports follow from what it measured."""

from __future__ import annotations

import json

import pytest

from soma_pl.bench import shard
from soma_pl.bench.shard import run_shard
from soma_pl.cli import main
from tests.bench.scripted import scripted_run


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
    # Any task count gives the same sharding: the same sequences in experts of the same sizes.
    assert report["same_experts"] and one["shard_sizes"] == two["shard_sizes"]
    assert one["sequences"] == two["sequences"] > 100
    assert one["shard_sizes"]["largest_over_smallest"] <= 1.05
    assert one["purity"] == two["purity"] and one["router_agreement"] == two["router_agreement"]
    for run in (one, two):
        for stage in ("sequences", "assign", "write"):
            assert len(run["task_seconds"][stage]) == len(run["peak_rss_mib_per_task"][stage]) == run["tasks"]
            assert all(0 < s < run["seconds"] for s in run["task_seconds"][stage])
        assert 0 < run["task_seconds"]["fit"] < run["seconds"]
    assert set(report["speedup_over_1_task"]) == {"1", "2"}  # its figures: tests/bench/test_prepare_bench.py


def test_a_shard_run_reads_its_figures_off_the_experts_manifest(monkeypatch, tmp_path):
    """`shard` replaced by a scripted `experts.json`: the run's figures are its, the parallel stages the
    slowest task of each parallel stage."""
    manifest = {"shard_seconds": 7.5, "peak_rss_mib": {"sequences": [60, 70], "assign": [60, 61], "write": [50, 55]},
                "task_seconds": {"fit": 0.25, "sequences": [1.75, 1.25], "assign": [0.5, 0.75], "write": [0.5, 2.0]},
                "sequences": 90,
                "shard_sizes": [40, 30, 20], "purity": 0.9, "router_agreement": 0.95}

    monkeypatch.setattr(shard, "timed", scripted_run("shard.output_dir", "experts.json", manifest, 8.0))
    run = run_shard(tmp_path / "prepared", tmp_path / "out", tasks=2, experts=3)
    assert (run["tasks"], run["seconds"], run["in_process_seconds"]) == (2, 8.0, 7.5)
    assert run["parallel_stage_seconds"] == 1.75 + 0.75 + 2.0
    assert run["task_seconds"] == manifest["task_seconds"] and run["peak_rss_mib_per_task"] == manifest["peak_rss_mib"]
    assert (run["sequences"], run["shard_sizes"], run["purity"], run["router_agreement"]) == (90, [40, 30, 20], 0.9,
                                                                                              0.95)


def test_bench_shard_refuses_more_tasks_than_prepared_shards(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main(["bench", "shard", "--megabytes=1", "--files=2", "--tasks=[1, 8]", "--prepare_shard_mb=100",
              f"--workdir={tmp_path}", f"--out={tmp_path / 'x.json'}", "--progress=false",
              "--prepare_args=[--dataset.val_documents=4, --dataset.val_windows=8, --dataset.test_windows=8]"])
    assert "prepared shards cannot feed 8 tasks; lower --prepare_shard_mb" in capsys.readouterr().err
