"""`bench zo` on a tiny model: the record structure and its closed-form fields, never timings."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from soma_pl.bench.zo import ZOBenchSettings, bench_zo, eggroll_record

TINY = ZOBenchSettings(n_pert=4, micro_batch=2, context=16, repeats=1)
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def report() -> dict:
    return bench_zo(widths=(8,), settings=TINY, soma_experts=2, soma_width=8)


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
    efficiency = record["zo_tokens_per_s"] / record["inference_tokens_per_s"]
    assert record["efficiency"] == pytest.approx(efficiency, rel=1e-3)
    assert record["zo_tokens_per_s"] == pytest.approx(
        record["token_forwards_per_update"] / record["update_seconds"], rel=1e-3)


def test_soma_record_speedup_is_sequential_over_batched(report):
    record = report["results"][1]
    assert (record["experts"], record["d_t"]) == (2, 8)
    assert record["token_forwards_per_update"] == 2 * (2 * 4 * 2 * 16)
    assert record["batched_seconds"] > 0 and record["sequential_seconds"] > 0
    assert record["speedup"] == pytest.approx(record["sequential_seconds"] / record["batched_seconds"], rel=1e-2)


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
    efficiency = record["eggroll_tokens_per_s"] / record["inference_tokens_per_s"]
    # Rounded to 4 decimals, so compared with an absolute tolerance (a slow spell can make it small).
    assert record["efficiency"] == pytest.approx(efficiency, rel=1e-3, abs=1e-4)
    ratio = record["inference_seconds"] / record["update_seconds"]
    assert record["efficiency"] == pytest.approx(ratio, rel=1e-2, abs=1e-4)
