"""prepare on datatrove: task-count independence, kill and resume, the exact screen, path-alone use."""

from __future__ import annotations

import json
import multiprocessing
import subprocess
import sys
import threading
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import yaml

from soma_pl.cli import main
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import FORMAT_VERSION, read_manifest
from soma_pl.data.formats.tar_shards import ShardWriter, iter_shard_documents
from soma_pl.data.preparation import heldout
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.heldout import OverlapScreen
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.runner.pipeline import ExecutorConfig, default_start_method, make_executor
from soma_pl.errors import ConfigError, DataError

from .corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def four_file_config(tmp_path: Path) -> PrepareConfig:
    """Four JSONL files (datatrove deals whole files to tasks), ids from the `id` key."""
    folder = tmp_path / "corpus"
    texts = write_jsonl_corpus(folder, {"alpha": 40, "beta": 40, "gamma": 40, "delta": 40}, min_words=150,
                               max_words=500)
    for path in folder.glob("*.jsonl"):  # corpus-wide unique ids, as FineWeb-Edu's `id` column
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "id": f"{path.stem}-{r['id']}"}) + "\n" for r in rows))
    assert len(texts) == 160
    return PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder)], id_field="id"),
                         output_dir=str(tmp_path / "one"), val_documents=5, val_windows=12, test_windows=10,
                         shard_max_bytes=60_000, executor=ExecutorConfig(tasks=1))


def _ids(folder: Path, split: str) -> list[str]:
    manifest = read_manifest(folder)
    return sorted(d.doc_id for s in manifest[split]["shards"] for d in iter_shard_documents(folder / s["path"]))


def _same_evaluation_sets(first: Path, second: Path) -> None:
    for name in ("ensemble_val.npz", "test.npz"):
        a, b = EvalSet.load(first / name), EvalSet.load(second / name)
        assert np.array_equal(a.windows, b.windows) and a.doc_ids.tolist() == b.doc_ids.tolist()
        assert a.offsets.tolist() == b.offsets.tolist()


def test_one_and_two_tasks_give_the_same_heldout_sets_and_training_documents(four_file_config, tmp_path):
    one = prepare(four_file_config, progress=False)
    two = prepare(replace(four_file_config, output_dir=str(tmp_path / "two"), executor=ExecutorConfig(tasks=2)),
                  progress=False)
    assert (read_manifest(one)["tasks"], read_manifest(two)["tasks"]) == (1, 2)
    _same_evaluation_sets(one, two)
    assert _ids(one, "train") == _ids(two, "train") and len(_ids(one, "train")) > 100
    assert _ids(one, "expert_val") == _ids(two, "expert_val")
    # Only the grouping into shard files depends on the task count.
    assert {s["path"].split("-")[1] for s in read_manifest(two)["train"]["shards"]} == {"00000", "00001"}
    held = set(EvalSet.load(one / "ensemble_val.npz").doc_ids) | set(EvalSet.load(one / "test.npz").doc_ids)
    assert not held & set(_ids(two, "train"))


def test_a_task_that_dies_midway_resumes_to_the_uninterrupted_output(four_file_config, tmp_path, monkeypatch):
    uninterrupted = prepare(replace(four_file_config, output_dir=str(tmp_path / "whole"),
                                    executor=ExecutorConfig(tasks=2, workers=1)), progress=False)
    config = replace(four_file_config, output_dir=str(tmp_path / "resumed"),
                     executor=ExecutorConfig(tasks=2, workers=1))
    original, calls = ShardWriter.write, {"n": 0}

    def dying_write(self, document):
        # The tenth training document of gamma.jsonl, the second task's share: the first has finished.
        calls["n"] += self.prefix.startswith("train-") and document.source.endswith("gamma.jsonl")
        if calls["n"] == 10:
            raise RuntimeError("killed")
        original(self, document)

    monkeypatch.setattr(ShardWriter, "write", dying_write)
    with pytest.raises(RuntimeError, match="killed"):
        prepare(config, progress=False)
    output = Path(config.output_dir)
    assert not output.exists(), "nothing half-written reads as prepared"
    staging = next(output.parent.glob(".resumed.prepare-*"))
    assert sorted(p.name for p in (staging / "logs" / "write" / "completions").iterdir()) == ["00000"]
    monkeypatch.setattr(ShardWriter, "write", original)
    written = []
    monkeypatch.setattr(ShardWriter, "write", lambda self, d: (written.append(d.doc_id), original(self, d)))
    resumed = prepare(config, progress=False)
    first_task = {d.doc_id for s in read_manifest(resumed)["train"]["shards"] if "train-00000" in s["path"]
                  for d in iter_shard_documents(resumed / s["path"])}
    assert written and not first_task & set(written), "the finished task was not run again"
    shas = [[s["sha256"] for s in read_manifest(f)["train"]["shards"]] for f in (uninterrupted, resumed)]
    assert shas[0] == shas[1]
    _same_evaluation_sets(uninterrupted, resumed)
    assert not list(output.parent.glob(".resumed.prepare-*")), "the staging folder goes once the build is done"


def _shingles(data: bytes, size: int) -> set[bytes]:
    return {data[i : i + size] for i in range(len(data) - size + 1)}


@pytest.mark.parametrize("mode", ["grams", "shingles", "colliding-shingles"])
@pytest.mark.parametrize("size", [1, 7, 49, 50, 51])
def test_screen_is_exact_against_independent_shingles(size, mode, monkeypatch):
    # grams: every batch by its gram lookups; shingles: every batch with a hit by the full-shingle index
    monkeypatch.setattr(heldout, "HITS_PER_BYTE", float("inf") if mode == "grams" else 0.0)
    if mode == "colliding-shingles":  # 256 hash values: most shingles share one with different ones
        hashes = heldout.shingle_hashes
        monkeypatch.setattr(heldout, "shingle_hashes", lambda data, width: hashes(data, width) & np.uint64(0xFF << 56))
    rng = np.random.default_rng(size)
    for _ in range(30):
        # Three letters: long shared substrings are common, so both answers occur often.
        windows = [rng.integers(97, 100, 1025, dtype=np.uint8).tobytes() for _ in range(4)]
        documents = [rng.integers(97, 100, int(rng.integers(0, 2500)), dtype=np.uint8).tobytes() for _ in range(3)]
        documents.append(b"xyz" + windows[0][300 : 300 + size] + b"xyz")  # exactly `size` shared bytes
        screen = OverlapScreen(windows, size)
        screen.screen_many(documents)
        training = set().union(*(_shingles(d, size) for d in documents))
        expected = [bool(_shingles(w, size) & training) for w in windows]
        assert screen.contaminated.tolist() == expected
        assert expected[0]
        assert ("shingles" not in screen._shared) == (mode == "grams")
        if mode == "colliding-shingles" and size > 7:  # shared hashes of different shingles, one by one
            assert screen._shared["shingles"].impure.size


def test_two_screens_of_the_same_windows_share_one_shingle_index_and_keep_their_own_marks(monkeypatch):
    monkeypatch.setattr(heldout, "HITS_PER_BYTE", 0.0)  # every batch with a gram hit goes to the shingle index
    rng = np.random.default_rng(0)
    windows = [rng.integers(128, 256, 1025, dtype=np.uint8).tobytes() for _ in range(3)]
    first = OverlapScreen(windows, 50)
    second = OverlapScreen(windows, 50, first.index_keys(), first.filter_bits(), share_with=first)
    first.screen_many([b"a" * 9 + windows[1][100:150]])
    second.screen_many([windows[2][500:560]])
    assert first._shared["shingles"] is second._shared["shingles"]
    assert first.contaminated.tolist() == [False, True, False]
    assert second.contaminated.tolist() == [False, False, True]


@pytest.mark.parametrize("shingles", [False, True])
def test_the_planned_shingle_index_screens_as_the_gram_index_does(four_file_config, tmp_path, monkeypatch, shingles):
    from soma_pl.data.preparation import steps

    for path in Path(four_file_config.corpus.paths[0]).glob("*.jsonl"):  # each document quotes the one before
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        path.write_text("".join(json.dumps({**r, "text": r["text"] + " " + rows[i - 1]["text"][:600]}) + "\n"
                                for i, r in enumerate(rows)))
    config = replace(four_file_config, executor=ExecutorConfig(tasks=2), test_windows=30)
    reference = prepare(replace(config, output_dir=str(tmp_path / "reference")), progress=False)
    assert read_manifest(reference)["test"]["screen_index"] == "grams"  # web-like text: grams
    monkeypatch.setattr(steps, "prefers_shingles", lambda *args: shingles)  # the forked tasks inherit it
    monkeypatch.setattr(heldout, "HITS_PER_BYTE", 0.0 if not shingles else float("inf"))  # grams: switch on any hit
    folder = prepare(replace(config, output_dir=str(tmp_path / "planned")), progress=False)
    manifest, expected = read_manifest(folder), read_manifest(reference)
    assert manifest["test"]["screen_index"] == ("shingles" if shingles else "grams")
    assert manifest["test"]["excluded"] == expected["test"]["excluded"] > 0
    _same_evaluation_sets(reference, folder)
    assert [s["sha256"] for s in manifest["train"]["shards"]] == [s["sha256"] for s in expected["train"]["shards"]]


def test_held_out_text_that_repeats_itself_prefers_the_shingle_index():
    rng = np.random.default_rng(0)
    lines = [b"    " * int(rng.integers(1, 4)) + rng.integers(97, 123, 20, dtype=np.uint8).tobytes() + b"\n"
             for _ in range(8)]  # a few indented lines, repeated in every window and document: code-like
    code = [b"".join(lines[i] for i in rng.integers(0, 8, 60)) for _ in range(80)]
    prose = [rng.integers(32, 127, 1500, dtype=np.uint8).tobytes() for _ in range(80)]
    assert heldout.prefers_shingles([c[:1025] for c in code[:64]], code[64:], 50)
    assert not heldout.prefers_shingles([p[:1025] for p in prose[:64]], prose[64:], 50)


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 16])
def test_keys_sort_and_filter_as_numpy_and_a_set_do(threads):
    rng = np.random.default_rng(threads)
    keys = rng.integers(0, 1 << 63, 3_000_000, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    keys[::7] = keys[0]  # repeated keys
    assert np.array_equal(heldout.sort_keys(keys.copy(), threads), np.sort(keys))
    bits = heldout.filter_size(keys.size >> 8)
    queries = np.concatenate([keys[:1000], rng.integers(0, 1 << 63, 100_000, dtype=np.int64).astype(np.uint64)])
    top = {int(k) >> (64 - bits) for k in keys}
    expected = [int(q) >> (64 - bits) in top for q in queries]
    assert heldout.passes(heldout.key_filter(keys, bits), queries, bits).tolist() == expected


def test_screen_sees_a_shared_passage_one_byte_short_as_clean():
    rng = np.random.default_rng(0)
    window = rng.integers(128, 256, 1025, dtype=np.uint8).tobytes()
    screen = OverlapScreen([window], 50)
    screen.screen_many([b"a" * 30 + window[200:249] + b"b" * 30, window[600:649]])
    assert not screen.contaminated[0]
    screen.screen_many([b"c" * 7 + window[600:650]])
    assert screen.contaminated[0]


def test_fit_takes_a_prepared_folder_by_path_alone(four_file_config, tmp_path, monkeypatch):
    folder = prepare(four_file_config, progress=False)
    config = yaml.safe_load((ROOT / "tests" / "lit" / "tiny_spsa.yaml").read_text())
    config["data"]["init_args"].pop("dataset")
    config["data"]["init_args"]["prepared"] = str(folder)
    config["trainer"]["max_steps"] = 2
    config["trainer"]["val_check_interval"] = 2
    (tmp_path / "fit.yaml").write_text(yaml.safe_dump(config))
    monkeypatch.setenv("WANDB_MODE", "offline")
    run = tmp_path / "run"
    main(["fit", "--config", str(tmp_path / "fit.yaml"), f"--trainer.default_root_dir={run}",
          "--trainer.logger=false"])
    assert (run / "checkpoints" / "last.ckpt").is_file()


def test_a_folder_from_another_version_is_refused_with_one_line(four_file_config, tmp_path, capsys):
    folder = prepare(four_file_config, progress=False)
    manifest = read_manifest(folder)
    (folder / "manifest.json").write_text(json.dumps({**manifest, "format": FORMAT_VERSION - 1}))
    from soma_pl.data.training.datamodule import ByteDataModule

    with pytest.raises(DataError, match=f"prepared by another soma_pl version .*format {FORMAT_VERSION - 1}"):
        ByteDataModule(prepared=str(folder)).setup()
    with pytest.raises(DataError, match=r"data.init_args.prepared=.*not a prepared dataset"):
        ByteDataModule(prepared=str(tmp_path / "nowhere")).setup()


def test_a_dataset_block_beside_a_prepared_folder_is_refused_not_ignored(tmp_path):
    from soma_pl.data.training.datamodule import ByteDataModule

    with pytest.raises(ConfigError, match=r"data.init_args.dataset is set but data.init_args.prepared="):
        ByteDataModule(dataset=PrepareConfig(output_dir=str(tmp_path / "elsewhere")), prepared=str(tmp_path / "x"))
    ByteDataModule(prepared=str(tmp_path / "x"))  # the default dataset block is not "set"


def test_the_prepare_command_imports_no_torch():
    # Its forked tasks start with what the main process imported: torch would cost every run 1.5 s.
    probe = ("import sys\nfrom soma_pl.cli import main\ntry:\n    main(['prepare', '--help'])\nexcept SystemExit:\n"
             "    pass\nprint('torch' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert "--dataset.corpus.paths" in result.stdout
    assert result.stdout.strip().splitlines()[-1] == "False"


class _Thread:
    def __init__(self, name: str):
        self.name = name


@pytest.mark.skipif("fork" not in multiprocessing.get_all_start_methods(), reason="no fork on this platform")
def test_local_workers_fork_only_from_a_plain_process(monkeypatch, tmp_path):
    main_thread = threading.main_thread()
    monkeypatch.delitem(sys.modules, "torch", raising=False)
    monkeypatch.setattr(threading, "enumerate", lambda: [main_thread])
    assert default_start_method() == "fork"
    monkeypatch.setattr(threading, "enumerate", lambda: [main_thread, _Thread("fsspecIO")])
    assert default_start_method() == "fork", "fsspec resets its IO thread in a forked child"
    monkeypatch.setattr(threading, "enumerate", lambda: [main_thread, _Thread("wandb-monitor")])
    assert default_start_method() == "forkserver"
    monkeypatch.setattr(threading, "enumerate", lambda: [main_thread])
    monkeypatch.setitem(sys.modules, "torch", object())
    assert default_start_method() == "forkserver", "torch's thread pools may hold locks"
    executor = make_executor(ExecutorConfig(tasks=2), [], 2, tmp_path / "logs", "probe")
    assert executor.start_method == "forkserver"
    executor = make_executor(ExecutorConfig(tasks=2, options={"start_method": "spawn"}), [], 2,
                             tmp_path / "logs", "probe")
    assert executor.start_method == "spawn", "the config's choice wins"
