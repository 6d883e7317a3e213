"""`bench prepare` end to end on a small generated corpus: both task counts build the same dataset,
and the figures it reports follow from what it measured."""

from __future__ import annotations

import json

import pytest

from soma_pl.bench import prepare
from soma_pl.bench.prepare import run_prepare, time_task_counts
from soma_pl.cli import main
from tests.bench.scripted import scripted_run


def test_bench_prepare_reports_throughput_stages_and_memory_per_task(tmp_path, capsys):
    out = tmp_path / "prepare.json"
    scratch = tmp_path / "scratch" / "new"  # made on demand
    main(["bench", "prepare", "--megabytes=1.5", "--files=4", "--tasks=[1, 2]", f"--workdir={scratch}",
          f"--out={out}", "--rounds=2", "--progress=false",
          "--prepare_args=[--dataset.val_documents=4, --dataset.val_windows=8, "
          "--dataset.test_windows=8, --dataset.shard_max_bytes=200000]"])
    report = json.loads(out.read_text())
    one, two = report["runs"]
    assert len(one["seconds_per_round"]) == len(two["seconds_per_round"]) == report["rounds"] == 2
    assert (one["tasks"], two["tasks"]) == (1, 2)
    # Any task count holds out the same documents, so the training sets match.
    assert one["train_documents"] == two["train_documents"] > 100
    for run in (one, two):
        for stage in ("select", "write"):
            assert len(run["task_seconds"][stage]) == len(run["peak_rss_mib_per_task"][stage]) == run["tasks"]
            assert all(0 < s < run["seconds"] for s in run["task_seconds"][stage])
        assert 0 < run["task_seconds"]["plan"] < run["seconds"]
    assert set(report["speedup_over_1_task"]) == set(report["parallel_stages_speedup_over_1_task"]) == {"1", "2"}
    assert scratch.is_dir() and not any(scratch.iterdir()), "the scratch corpus goes with the bench"


def test_a_workdir_that_cannot_be_a_folder_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "prepare", f"--workdir={tmp_path / 'file' / 'x'}", f"--out={tmp_path / 'x.json'}"])
    assert exit_.value.code != 0
    assert "bench prepare: --workdir" in capsys.readouterr().err and not (tmp_path / "x.json").exists()


SECONDS = {1: [9.0, 12.0, 10.0], 2: [8.0, 5.0, 6.0]}
"""Scripted seconds of the whole command at 1 and 2 tasks in rounds 1, 2, 3."""
STAGES = {1: [7.0, 9.0, 8.0], 2: [3.0, 4.0, 5.0]}
"""Scripted seconds of the parallel stages in the same runs."""


def test_task_counts_take_turns_and_the_figures_follow_from_the_scripted_times():
    calls = []

    def measure(count: int, round_: int) -> dict:
        calls.append((count, round_))
        return {"tasks": count, "seconds": SECONDS[count][round_], "parallel_stage_seconds": STAGES[count][round_]}

    timing = time_task_counts((1, 2), 3, measure, text_bytes=30_000_000, desc="test", progress=False)
    assert calls == [(1, 0), (2, 0), (1, 1), (2, 1), (1, 2), (2, 2)]
    one, two = timing["runs"]
    # Each count's figures are those of its median round (10 s at 1 task, 6 s at 2 tasks).
    assert (one["seconds"], one["parallel_stage_seconds"], one["mb_per_second"]) == (10.0, 8.0, 3.0)
    assert (two["seconds"], two["parallel_stage_seconds"], two["mb_per_second"]) == (6.0, 5.0, 5.0)
    assert one["seconds_per_round"] == SECONDS[1] and two["seconds_per_round"] == SECONDS[2]
    assert (one["median_parallel_stage_seconds"], two["median_parallel_stage_seconds"]) == (8.0, 4.0)
    assert timing["speedup_over_1_task"] == {"1": 1.0, "2": round(10 / 6, 2)}
    assert timing["parallel_stages_speedup_over_1_task"] == {"1": 1.0, "2": 2.0}


def test_a_prepare_run_reads_its_figures_off_the_manifest(monkeypatch, tmp_path):
    """`prepare` replaced by a scripted manifest: the run's figures are the manifest's, its parallel stages
    the slowest select task plus the slowest write task."""
    manifest = {"prepare_seconds": 11.5, "peak_rss_mib": {"select": [90, 95], "write": [80, 85]},
                "task_seconds": {"plan": 0.5, "select": [2.0, 3.25], "write": [1.5, 1.0]},
                "train": {"documents": 120, "shards": [{}, {}, {}]}, "test": {"excluded": 2}}

    monkeypatch.setattr(prepare, "timed", scripted_run("dataset.output_dir", "manifest.json", manifest, 12.0))
    run = run_prepare(tmp_path / "corpus", tmp_path / "out", 2)
    assert (run["tasks"], run["seconds"], run["in_process_seconds"]) == (2, 12.0, 11.5)
    assert run["parallel_stage_seconds"] == 3.25 + 1.5
    assert run["task_seconds"] == manifest["task_seconds"] and run["peak_rss_mib_per_task"] == manifest["peak_rss_mib"]
    assert (run["train_documents"], run["test_excluded"], run["shards"]) == (120, 2, 3)


def test_a_source_corpus_cuts_each_file_at_blank_lines_into_documents_of_about_the_size(tmp_path):
    import pyarrow.parquet as pq

    from soma_pl.bench.prepare import source_documents, write_source_corpus

    source = tmp_path / "src"
    (source / "pkg").mkdir(parents=True)
    paragraphs = [f"def f{i}():\n    return {i}" for i in range(6)]  # 22 bytes each
    (source / "pkg" / "a.py").write_text("\n\n".join(paragraphs))
    (source / "b.py").write_text("x = 1")
    (source / "notes.txt").write_text("not python")
    documents = source_documents(source, 50)
    # a.py: three paragraphs joined are the first to reach 50 bytes (70), twice; b.py's one paragraph is its document
    assert [doc_id for doc_id, _ in documents] == ["<stdlib:b.py#0>", "<stdlib:pkg/a.py#0>", "<stdlib:pkg/a.py#1>"]
    assert [len(text) for _, text in documents] == [5, 70, 70]
    assert "\n\n".join(text for _, text in documents[1:]) == (source / "pkg" / "a.py").read_text()
    written = write_source_corpus(tmp_path / "corpus", 2, source, document_bytes=50)
    table = pq.read_table(sorted((tmp_path / "corpus").glob("*.parquet")))
    assert written["documents"] == table.num_rows == 3
    assert written["text_bytes"] == sum(len(t.encode()) for _, t in documents)
    assert set(table.column_names) >= {"text", "id", "dump", "url", "language", "int_score"}
