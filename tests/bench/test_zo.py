"""`bench zo` on a tiny model: the record structure and its closed-form fields, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from soma_pl.bench import zo
from soma_pl.bench.zo import ZOBenchSettings, bench_zo, eggroll_record, median_seconds, turn_ratios

TINY = ZOBenchSettings(n_pert=4, micro_batch=2, context=16, repeats=1)
REPO = Path(__file__).resolve().parents[2]
SECONDS = {"update": 0.5, "inference": 0.125, "naive": 0.75, "batched": 0.4, "sequential": 1.0, "None": 2.0}
"""The seconds `scripted_turns` reports for each timed run in its one turn, by name. ``"None"``: the one
rows-per-call candidate of TINY's records (all rows in one call: each record has fewer rows than
the smallest candidate), as `choose_rows` names it."""
TOKENS = 2 * 4 * 2 * 16
"""Token forwards of one update of TINY: 2 · n_pert · B · T."""


def scripted_turns(runs, repeats, warmup):
    """`turn_seconds` with one turn whose times `SECONDS` fixes; every run still runs once."""
    for run in runs.values():
        run()
    return {name: [SECONDS[name]] for name in runs}


@pytest.fixture(scope="module")
def report() -> dict:
    return bench_zo(widths=(8,), settings=TINY, soma_experts=2, soma_width=8)


@pytest.fixture(scope="module")
def scripted() -> dict:
    """The report of `report`'s settings with every time fixed (`scripted_turns`)."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(zo, "turn_seconds", scripted_turns)
        return bench_zo(widths=(8,), settings=TINY, soma_experts=2, soma_width=8, eggroll_widths=(8,))


def test_median_seconds_takes_the_runs_in_turn_and_reports_each_median(monkeypatch):
    """A fake clock that only the runs move: each call of a run advances it by that run's next duration."""
    clock = SimpleNamespace(now=0.0, calls=[])
    durations = {"a": iter([100.0, 3.0, 1.0, 8.0]), "b": iter([100.0, 10.0, 30.0, 11.0])}  # warmup first

    def run(name: str):
        def call() -> None:
            clock.calls.append(name)
            clock.now += next(durations[name])
        return call

    monkeypatch.setattr(zo, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    assert median_seconds({"a": run("a"), "b": run("b")}, repeats=3, warmup=1) == {"a": 3.0, "b": 11.0}
    assert clock.calls == ["a", "b"] + ["a", "b"] * 3


def test_a_ratio_of_two_runs_is_the_median_of_each_turns_ratio():
    """A slow spell in turn 2 doubles both runs: the turns' ratios stay 0.9 (and one outlier turn 3
    reads 0.3), where the ratio of the two medians would read 0.45."""
    update, inference = [1.0, 2.0, 3.0], [0.9, 1.8, 0.9]
    assert turn_ratios(inference, update) == (0.9, [0.9, 0.9, 0.3])
    with pytest.raises(ValueError):
        turn_ratios(inference, update[:2])


def test_rows_per_call_are_chosen_on_medians_of_timings_in_turns(monkeypatch):
    """300 rows, calls of at least 100: candidates None (all 300), 256 and 128, 5 timings each. All
    rows in one call is fastest once (1 s) but slowest in the median; 256 rows has the smallest median."""
    clock = SimpleNamespace(now=0.0, calls=[])
    durations = {None: iter([50.0, 1.0, 9.0, 9.0, 2.0, 9.0]), 256: iter([50.0, 5.0, 5.0, 5.0, 9.0, 4.0]),
                 128: iter([50.0, 6.0, 4.0, 7.0, 6.0, 8.0])}  # warmup first

    def run(rows):
        clock.calls.append(rows)
        clock.now += next(durations[rows])

    monkeypatch.setattr(zo, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    chosen, timings = zo.choose_rows(run, total_rows=300, smallest=100, settings=ZOBenchSettings(repeats=5))
    assert chosen == 256
    assert timings == [{"max_rows": None, "seconds": 9.0}, {"max_rows": 256, "seconds": 5.0},
                       {"max_rows": 128, "seconds": 6.0}]
    assert clock.calls == [None, 256, 128] * 6
    assert zo.choose_rows(run, 300, 100, ZOBenchSettings(max_rows=64)) == (64, [])


def test_report_has_one_zo_record_per_width_and_the_soma_record(report):
    assert report["benchmark"] == "zo"
    assert report["machine"]["torch"] == torch.__version__
    assert report["machine"]["threads"] == torch.get_num_threads()
    assert [record["record"] for record in report["results"]] == ["zo", "soma_batched_vs_sequential"]
    json.loads(json.dumps(report))


def test_zo_record_throughputs_are_positive_and_consistent(report):
    record = report["results"][0]
    assert (record["d_t"], record["n_pert"], record["micro_batch"], record["context"]) == (8, 4, 2, 16)
    assert record["token_forwards_per_update"] == 2 * 4 * 2 * 16
    assert record["naive_directions_timed"] == 4
    assert record["max_rows"] is None  # all 16 rows fit below the smallest candidate
    assert record["params"] > 0
    for key in ("zo_tokens_per_s", "inference_tokens_per_s", "update_seconds", "inference_seconds",
                "naive_update_seconds", "naive_speedup"):
        assert record[key] > 0, key


def test_zo_record_figures_follow_from_the_measured_times(scripted):
    record = scripted["results"][0]
    assert record["record"] == "zo" and record["token_forwards_per_update"] == TOKENS
    assert (record["update_seconds"], record["inference_seconds"]) == (0.5, 0.125)
    assert record["naive_update_seconds"] == 0.75 * 4 / 4  # timed on 4 directions, scaled to n_pert = 4
    assert (record["zo_tokens_per_s"], record["inference_tokens_per_s"]) == (TOKENS / 0.5, TOKENS / 0.125)
    assert record["efficiency"] == 0.25 and record["efficiency_turns"] == [0.25] and record["naive_speedup"] == 1.5


def test_soma_record_speedup_is_sequential_over_batched(report):
    record = report["results"][1]
    assert (record["experts"], record["d_t"]) == (2, 8)
    assert record["token_forwards_per_update"] == 2 * (2 * 4 * 2 * 16)
    assert record["batched_seconds"] > 0 and record["sequential_seconds"] > 0


def test_soma_record_figures_follow_from_the_measured_times(scripted):
    record = scripted["results"][1]
    assert record["record"] == "soma_batched_vs_sequential" and record["token_forwards_per_update"] == 2 * TOKENS
    assert (record["batched_seconds"], record["sequential_seconds"]) == (0.4, 1.0)
    assert (record["batched_tokens_per_s"], record["sequential_tokens_per_s"]) == (2 * TOKENS / 0.4, 2 * TOKENS / 1.0)
    assert record["speedup"] == 2.5 and record["speedup_turns"] == [2.5]


def test_eggroll_record_figures_follow_from_the_measured_times(scripted):
    record = scripted["results"][2]
    assert record["record"] == "eggroll" and record["token_forwards_per_update"] == TOKENS
    assert (record["update_seconds"], record["inference_seconds"]) == (0.5, 0.125)
    assert (record["eggroll_tokens_per_s"], record["inference_tokens_per_s"]) == (TOKENS / 0.5, TOKENS / 0.125)
    assert record["efficiency"] == 0.25 and record["efficiency_turns"] == [0.25]


def test_cli_writes_the_report(tmp_path):
    out = tmp_path / "zo.json"
    args = ["bench", "zo", "--widths", "[8]", "--n_pert", "4", "--micro_batch", "2", "--context", "16",
            "--repeats", "1", "--max_rows", "8", "--soma_experts", "0", "--out", str(out)]
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", *args], capture_output=True, text=True,
                            cwd=REPO)
    assert result.returncode == 0, result.stderr
    report = json.loads(out.read_text())
    assert [(record["record"], record["d_t"]) for record in report["results"]] == [("zo", 8), ("eggroll", 8)]
    assert report["results"][0]["max_rows"] == 8
    assert report["results"][1]["max_members"] == 8
    assert report["settings"]["n_pert"] == 4


def test_eggroll_record_runs_the_same_token_count_as_the_zo_record():
    settings = ZOBenchSettings(n_pert=4, micro_batch=2, context=16, repeats=1, eggroll_rank=2)
    record = eggroll_record(8, settings)
    assert (record["record"], record["d_t"], record["rank"]) == ("eggroll", 8, 2)
    assert (record["population"], record["group_size"], record["windows"]) == (2 * 4 * 2, 2 * 4, 2)
    assert record["token_forwards_per_update"] == 2 * 4 * 2 * 16  # the zo record's ± rows
    assert record["max_members"] is None  # 16 members fit below the smallest candidate
    assert record["update_seconds"] > 0 and record["inference_seconds"] > 0
