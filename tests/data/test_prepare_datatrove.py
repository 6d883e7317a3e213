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
from soma_pl.data.preparation import overlap
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.overlap import OverlapIndex
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.runner.executor import ExecutorConfig
from soma_pl.data.runner.pipeline import default_start_method, make_executor
from soma_pl.errors import ConfigError, DataError

from .corpora import write_jsonl_corpus

pytestmark = pytest.mark.worker_pool  # the stages' worker pool itself, as prepare runs it


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


@pytest.mark.parametrize("mode", ["shingles", "colliding-shingles"])
@pytest.mark.parametrize("size", [1, 7, 49, 50, 51])
def test_screen_is_exact_against_independent_shingles(size, mode, monkeypatch):
    if mode == "colliding-shingles":  # 256 hash values: most shingles share one with different ones
        hashes = overlap.shingle_hashes
        monkeypatch.setattr(overlap, "shingle_hashes", lambda data, width: hashes(data, width) & np.uint64(0xFF << 56))
    rng = np.random.default_rng(size)
    for _ in range(30):
        # Three letters: long shared substrings are common, so both answers occur often.
        windows = [rng.integers(97, 100, 1025, dtype=np.uint8).tobytes() for _ in range(4)]
        documents = [rng.integers(97, 100, int(rng.integers(0, 2500)), dtype=np.uint8).tobytes() for _ in range(3)]
        documents.append(b"xyz" + windows[0][300 : 300 + size] + b"xyz")  # exactly `size` shared bytes
        index = OverlapIndex(windows, size)
        found = np.zeros(len(windows), dtype=bool)
        found[index.find(documents)] = True
        training = set().union(*(_shingles(d, size) for d in documents))
        expected = [bool(_shingles(w, size) & training) for w in windows]
        assert found.tolist() == expected
        assert expected[0]
        if mode == "colliding-shingles" and size > 7:  # shared hashes of different shingles, one by one
            assert index.impure.size


@pytest.mark.parametrize("width", [1, 50, 51])
def test_shingle_hashes_are_the_polynomial_hash_across_chunk_boundaries(width):
    """Every position, in every chunk, gets sum_j data[i + j] * q**j mod 2**64 (q the base's inverse),
    then MurmurHash3's finisher: computed here with Python's integers."""
    mask = (1 << 64) - 1

    def reference(string: bytes) -> int:
        inverse = pow(0x9E3779B97F4A7C15, -1, 1 << 64)  # q: the odd base's inverse modulo 2**64
        value = sum(byte * pow(inverse, j, 1 << 64) for j, byte in enumerate(string)) & mask
        for factor in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53, None):
            value ^= value >> 33
            value = value * factor & mask if factor else value
        return value

    data = np.random.default_rng(width).integers(0, 256, 3 * overlap.HASH_CHUNK + 77, dtype=np.uint8)
    hashes = overlap.shingle_hashes(data, width)
    assert hashes.size == data.size - width + 1
    for i in [0, 1, overlap.HASH_CHUNK - 1, overlap.HASH_CHUNK, 2 * overlap.HASH_CHUNK + 5, hashes.size - 1]:
        assert int(hashes[i]) == reference(data[i : i + width].tobytes()), i


def test_a_saved_index_loads_mapped_and_finds_what_the_built_one_finds(tmp_path):
    rng = np.random.default_rng(0)
    windows = [rng.integers(128, 256, 1025, dtype=np.uint8).tobytes() for _ in range(3)]
    built = OverlapIndex(windows, 50)
    built.save(tmp_path)
    loaded = OverlapIndex.load(tmp_path, windows, 50)
    assert isinstance(loaded.keys.base, np.memmap)  # mapped, not read
    documents = [b"a" * 9 + windows[1][100:150], windows[2][500:549]]  # 50 shared bytes, then 49
    assert built.find(documents).tolist() == loaded.find(documents).tolist() == [1]


@pytest.mark.parametrize("threads", [1, 2, 3, 4, 16])
def test_keys_sort_and_filter_as_numpy_and_a_set_do(threads):
    rng = np.random.default_rng(threads)
    keys = rng.integers(0, 1 << 63, 3_000_000, dtype=np.int64).astype(np.uint64) * np.uint64(2)
    keys[::7] = keys[0]  # repeated keys
    assert np.array_equal(overlap.sort_keys(keys.copy(), threads), np.sort(keys))
    bits = overlap.filter_size(keys.size >> 8)
    queries = np.concatenate([keys[:1000], rng.integers(0, 1 << 63, 100_000, dtype=np.int64).astype(np.uint64)])
    top = {int(k) >> (64 - bits) for k in keys}
    expected = [int(q) >> (64 - bits) in top for q in queries]
    assert overlap.passes(overlap.key_filter(keys, bits), queries, bits).tolist() == expected


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
