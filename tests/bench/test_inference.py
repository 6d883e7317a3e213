"""`bench inference` on tiny configurations: record fields and closed-form relations, never timings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from soma_pl.bench import inference, memory
from soma_pl.bench.inference import InferenceModel, InferenceSettings, bench_inference
from soma_pl.cli import main
from soma_pl.models.stacked import HeadMode, StackedExperts

MODELS = (InferenceModel(1, 12, 2), InferenceModel(6, 8, 3, shared_head=True))
SETTINGS = InferenceSettings(repeats=2, rounds=2, embed_dim=8, num_layers=1, time_chunk=256)


@pytest.fixture(scope="module")
def report() -> dict:
    return bench_inference(MODELS, SETTINGS)  # each configuration in its own spawned process


def test_one_record_per_configuration_with_table12_fields(report):
    assert report["benchmark"] == "inference" and report["settings"]["repeats"] == 2
    assert [record["model"] for record in report["results"]] == ["N=1", "N=6"]
    json.loads(json.dumps(report))
    for record, config in zip(report["results"], MODELS, strict=False):
        expected = StackedExperts(config.experts, config.width, 8, 1, config.head)
        assert record["parameters"] == sum(p.numel() for p in expected.parameters())
        assert record["head"] == config.head.value and record["batch_size"] == config.batch_size
        assert record["scored_tokens_per_request"] == 768
        assert len(record["latencies_ms"]) == 4 and min(record["latencies_ms"]) > 0  # 2 rounds x 2 batches
        assert len(record["tokens_per_s_per_round"]) == 2
        assert record["peak_bytes"] > record["baseline_bytes"] > 0


def test_rounds_take_the_configurations_in_turn_and_record_the_load(monkeypatch):
    calls = []

    def in_process(function, config, settings):
        calls.append(config.name)
        return function(config, settings)

    monkeypatch.setattr(memory, "in_fresh_process", in_process)
    report = bench_inference(MODELS, InferenceSettings(repeats=1, rounds=3, embed_dim=8, num_layers=1,
                                                       time_chunk=256, threads=None))
    assert calls == ["N=1", "N=6"] * 3
    assert len(report["machine"]["load_average"]) == 3 and len(report["load_average_after"]) == 3


def test_top_k_is_capped_at_n_and_routing_load_adds_up(report):
    monolithic, soma = report["results"]
    assert (monolithic["top_k"], soma["top_k"]) == (1, 4)
    assert monolithic["routing"] == {"mean_windows_per_expert": 2.0, "max_windows_per_expert": 2}
    assert soma["routing"]["mean_windows_per_expert"] == pytest.approx(3 * 4 / 6, abs=0.01)
    assert 1 <= soma["routing"]["max_windows_per_expert"] <= 3  # an expert serves a window once
    assert report["throughput_ratio_to_n1"]["N=1 top-1"] == 1.0


LATENCIES = {("N=1", 0): (0.010, 0.030), ("N=6", 0): (0.040, 0.080), ("N=1", 1): (0.020, 0.050),
             ("N=6", 1): (0.060, 0.100)}
"""Seconds of each timed batch of each configuration in rounds 1 and 2 (after an untimed one)."""
MEMORY = {("N=1", 0): (100, 300), ("N=6", 0): (110, 250), ("N=1", 1): (120, 400), ("N=6", 1): (130, 350)}
"""`(VmRSS at the start, VmHWM at the end)` in MiB of each configuration's process in rounds 1 and 2."""
ROUTING = {"N=6": 0.007}
"""Seconds the router takes for a batch, timed on its own."""


def test_latency_throughput_and_peak_memory_follow_from_what_was_measured(monkeypatch):
    """Every process runs in this one on a fake clock and fake memory readings: the record's figures are
    the medians, throughputs and peaks of those readings."""
    processes = iter(LATENCIES)
    reading = SimpleNamespace(clock=iter(()), memory=iter(()))

    def in_process(function, config, settings):
        key = next(processes)
        first, second = LATENCIES[key]
        # warmup start; each timed batch's start and end, then (N > 1) the router's own start and end
        routed = [0.0, ROUTING[key[0]]] if key[0] != "N=1" else []
        reading.clock = iter([0.0, 0.0, first, *routed, 0.0, second, *routed])
        reading.memory = iter(MEMORY[key])
        return function(config, settings)

    monkeypatch.setattr(memory, "in_fresh_process", in_process)
    monkeypatch.setattr(inference, "time", SimpleNamespace(perf_counter=lambda: next(reading.clock)))
    monkeypatch.setattr(memory, "_status_bytes", lambda field: next(reading.memory) * 2**20)
    report = bench_inference(MODELS, SETTINGS)
    monolithic, soma = report["results"]
    assert monolithic["latencies_ms"] == [10.0, 30.0, 20.0, 50.0] and soma["latencies_ms"] == [40.0, 80.0, 60.0, 100.0]
    assert (monolithic["latency_ms"], soma["latency_ms"]) == (25.0, 70.0)  # medians of the four
    assert (monolithic["routing_ms"], soma["routing_ms"]) == (0.0, 7.0)
    assert (monolithic["routing_share"], soma["routing_share"]) == (0.0, 0.1)
    assert monolithic["tokens_per_s"] == round(2 * 768 / 0.025, 1) and soma["tokens_per_s"] == round(3 * 768 / 0.07, 1)
    assert monolithic["tokens_per_s_per_round"] == [round(2 * 768 / 0.020, 1), round(2 * 768 / 0.035, 1)]
    assert report["throughput_ratio_to_n1"]["N=6 top-4"] == round((3 * 768 / 0.07) / (2 * 768 / 0.025), 3)
    # The round with the larger peak, its own baseline.
    assert (monolithic["peak_bytes"], monolithic["baseline_bytes"]) == (400 * 2**20, 120 * 2**20)
    assert monolithic["peak_above_baseline_bytes"] == 280 * 2**20
    assert (soma["peak_bytes"], soma["peak_above_baseline_bytes"]) == (350 * 2**20, 220 * 2**20)


def test_cli_overrides_batch_sizes_and_rejects_a_wrong_count(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "in_fresh_process", lambda function, *args: function(*args))
    out = tmp_path / "bench.json"
    models = "[{experts: 1, width: 8, batch_size: 5}]"
    common = ["--settings.repeats", "1", "--settings.num_layers", "1", "--settings.embed_dim", "8",
              "--settings.threads", "null", "--out", str(out)]
    main(["bench", "inference", "--models", models, "--batch_sizes", "[2]", *common])
    record = json.loads(out.read_text())["results"][0]
    assert (record["batch_size"], record["d_t"], record["head"]) == (2, 8, HeadMode.per_expert.value)
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "inference", "--models", models, "--batch_sizes", "[2, 3]", *common])
    assert exit_info.value.code == 2 and "--batch_sizes" in capsys.readouterr().err
