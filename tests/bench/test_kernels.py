"""`bench kernels`: the nn.LSTM reference really is our model, and the record adds up (no timings asserted)."""

from __future__ import annotations

import json

import pytest
import torch

from soma_pl.bench import kernels, memory
from soma_pl.bench.kernels import KernelSettings, KernelShape, bench_kernels
from soma_pl.cli import main
from soma_pl.models.reference import TorchExpert
from soma_pl.models.stacked import StackedExperts

SHAPES = (KernelShape(8, batch=2, groups=3, group_batch=2), KernelShape(12, batch=1, groups=2, group_batch=1))
SETTINGS = KernelSettings(context=24, grouped_context=10, rounds=2, repeats=1, warmup=0, embed_dim=8, num_layers=2,
                          time_chunk=8, threads=None)
SECONDS = ({"ours": 0.2, "nn_lstm": 0.3}, {"ours": 0.4, "nn_lstm": 0.9})
"""Each process's median seconds in round 1 and in round 2 (`report` fixes them): across the rounds the
medians are 0.3 (ours) and 0.6 (nn.LSTM), a ratio of 2.0; the rounds' own ratios are 1.5 and 2.25."""


@pytest.mark.parametrize("width", [8, 12])  # 12 ≠ d_E: input and output projections
def test_reference_stack_of_standard_layers_computes_our_logits(width):
    torch.manual_seed(0)
    model = StackedExperts(1, width, embed_dim=8, num_layers=3, time_chunk=5, kernel="python")
    tokens = torch.randint(0, 256, (3, 17), dtype=torch.uint8)
    with torch.no_grad():
        ours = model.forward_with({}, tokens[None])[0]
        theirs = TorchExpert.of(model)(tokens)
    assert (ours - theirs).abs().max().item() <= 1e-5


@pytest.fixture()
def report(monkeypatch) -> tuple[dict, list]:
    """The bench with every process run in this one and its median times fixed by `SECONDS`; the calls."""
    calls = []

    def in_process(function, kind, shape, settings):
        calls.append((shape.width, kind))
        return function(kind, shape, settings)

    def scripted_medians(runs, repeats, warmup):
        for run in runs.values():
            run()
        return SECONDS[(len(calls) - 1) // 6]  # six configurations per round

    monkeypatch.setattr(memory, "in_fresh_process", in_process)
    monkeypatch.setattr(kernels, "median_seconds", scripted_medians)
    return bench_kernels(SHAPES, SETTINGS), calls


def test_every_pair_is_checked_equal_and_rounds_interleave(report):
    record, calls = report
    one_round = [(width, kind) for width in (8, 12) for kind in ("inference", "bptt", "grouped")]
    assert calls == one_round * 2
    json.loads(json.dumps(record))
    assert len(record["machine"]["load_average"]) == 3 and len(record["load_average_after"]) == 3
    assert [(r["d_t"], r["kind"]) for r in record["results"]] == one_round
    for result in record["results"]:
        assert result["max_abs_diff"] <= 1e-5, result
        assert result["kernel"] == {"inference": "library", "bptt": "library", "grouped": "native"}[result["kind"]]
    grouped = record["results"][2]
    assert grouped["tokens_per_call"] == 3 * 2 * 10 and grouped["groups"] == 3 and grouped["windows"] == 6
    assert record["results"][0]["tokens_per_call"] == 2 * 24
    for result in record["results"]:  # the figures of the times `report` fixed
        tokens = result["tokens_per_call"]
        assert (result["ours_tokens_per_s"], result["nn_lstm_tokens_per_s"]) == (round(tokens / 0.3, 1),
                                                                                 round(tokens / 0.6, 1))
        assert result["ratio"] == 2.0 and result["ratio_per_round"] == [1.5, 2.25]
    assert record["ratios"] == {f"d_t={width} {kind}": 2.0 for width, kind in one_round}


def test_cli_writes_json_and_refuses_unknown_kinds(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(memory, "in_fresh_process", lambda function, *args: function(*args))
    out = tmp_path / "kernels.json"
    common = ["--shapes", "[{width: 8, batch: 1, groups: 2, group_batch: 1}]", "--settings.context", "9",
              "--settings.grouped_context", "5", "--settings.rounds", "1", "--settings.repeats", "1",
              "--settings.num_layers", "1", "--settings.embed_dim", "8", "--out", str(out)]
    main(["bench", "kernels", *common, "--settings.kinds", "[grouped]"])
    assert [r["kind"] for r in json.loads(out.read_text())["results"]] == ["grouped"]
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "kernels", *common, "--settings.kinds", "[forward]"])
    assert exit_info.value.code == 2 and "kinds" in capsys.readouterr().err
