"""`bench memory`: peak memory measured in child processes; ZO flat in context, BPTT growing."""

from __future__ import annotations

import json

import pytest

from soma_pl.bench import memory
from soma_pl.bench.memory import MemorySettings, TrainingMethod, bench_memory, in_fresh_process, measure_update
from soma_pl.cli import main

TINY = MemorySettings(width=8, micro_batch=2, n_pert=2, embed_dim=8, num_layers=1, threads=None)


def test_a_child_process_measures_positive_peak_memory():
    settings = MemorySettings(width=32, micro_batch=4, num_layers=1, threads=None)  # activations ≈ 2 MB
    record = in_fresh_process(measure_update, TrainingMethod.bptt, 256, settings)
    assert (record["method"], record["context"]) == ("bptt", 256)
    assert record["peak_bytes"] > record["baseline_bytes"] > 0
    assert record["peak_above_baseline_bytes"] > record["weight_bytes"] > 0
    assert record["memory_method"].startswith("peak RSS")


def test_report_has_a_curve_per_method_over_the_contexts(tmp_path, monkeypatch):
    monkeypatch.setattr(memory, "in_fresh_process", lambda function, *args: function(*args))
    out = tmp_path / "memory.json"
    main(["bench", "memory", "--contexts", "[8, 16]", "--settings.width", "8", "--settings.micro_batch", "2",
          "--settings.embed_dim", "8", "--settings.num_layers", "1", "--settings.threads", "null", "--out", str(out)])
    report = json.loads(out.read_text())
    assert ([(r["method"], r["context"]) for r in report["results"]]
            == [("zo", 8), ("zo", 16), ("bptt", 8), ("bptt", 16)])
    for method in ("zo", "bptt"):
        curve = report["curves"][method]
        assert curve["contexts"] == [8, 16] and len(curve["peak_above_baseline_mib"]) == 2
    assert report["settings"]["width"] == 8 and report["machine"]["cpus"] > 0


def test_bad_contexts_are_a_config_error():
    with pytest.raises(memory.ConfigError):
        bench_memory((), TINY)


@pytest.mark.slow
def test_zo_memory_is_flat_in_context_while_bptt_grows():
    """BPTT keeps every step's activations (≈ 100 KiB a step here); ZO holds one time chunk."""
    settings = MemorySettings(width=64, micro_batch=8, n_pert=1, threads=1)
    report = bench_memory((128, 1024), settings)
    zo, bptt = (report["curves"][m]["peak_above_baseline_mib"] for m in ("zo", "bptt"))
    assert bptt[1] - bptt[0] > 50 and bptt[1] > 3 * bptt[0]
    assert abs(zo[1] - zo[0]) < 10


@pytest.mark.parametrize("head", ["per_expert", "shared"])
def test_forward_flops_per_token_count_each_weight_matrix_once_per_expert(head):
    from soma_pl.models.stacked import StackedExperts

    experts, width, embed, layers = 3, 12, 8, 2
    model = StackedExperts(experts, width, embed, layers, head=head)
    # output head 256·d_E, projections d·d_E and d_E·d; per block the gates 4d·d input and recurrent
    # and the MLP's 4d·d in and d·4d out
    macs = 256 * embed + 2 * width * embed + layers * 4 * 4 * width * width
    assert memory.forward_flops_per_token(model) == 2 * macs


def test_the_peak_is_a_gemms_speed_and_leaves_the_thread_setting_as_it_was():
    import torch

    before = torch.get_num_threads()
    assert memory.matmul_peak_gflops(size=256, repeats=3, threads=1) > 0
    assert torch.get_num_threads() == before
