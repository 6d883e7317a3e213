"""prepare: held-out sets, overlap screen, shards, manifest, determinism, atomicity."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import webdataset as wds

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.documents import Document
from soma_pl.data.corpus.readers import CorpusConfig, iter_corpus
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import read_manifest
from soma_pl.data.formats.tar_shards import ShardRecord, iter_shard_documents, verify_shards
from soma_pl.data.preparation.heldout import seeded_hash, validation_windows
from soma_pl.data.preparation.overlap import OverlapIndex
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.runner.executor import ExecutorConfig
from soma_pl.errors import DataError

from .corpora import write_jsonl_corpus


def training_documents(folder: Path) -> list[Document]:
    manifest = read_manifest(folder)
    return [d for s in manifest["train"]["shards"] for d in iter_shard_documents(folder / s["path"])]


def test_prepared_folder_is_consistent(small_config, jsonl_corpus):
    _, texts = jsonl_corpus
    folder = prepare(small_config, progress=False)
    manifest = read_manifest(folder)
    train = training_documents(folder)
    val = EvalSet.load(folder / "ensemble_val.npz")
    test = EvalSet.load(folder / "test.npz")
    short = sum(len(t.encode()) < WINDOW_BYTES for t in texts.values())
    assert sum(manifest["short_documents"].values()) == short > 0  # training text, never held out
    held = set(val.doc_ids) | set(test.doc_ids)
    assert not held & {d.doc_id for d in train}, "held-out documents leaked into training shards"
    expert_val = [d for s in manifest["expert_val"]["shards"] for d in iter_shard_documents(folder / s["path"])]
    assert len(expert_val) == manifest["expert_val"]["documents"] >= 1
    assert not {d.doc_id for d in expert_val} & ({d.doc_id for d in train} | held)
    assert manifest["train"]["documents"] == len(train) == (len(texts) - 6 - manifest["test"]["candidates"]
                                                           - len(expert_val))
    kept = [len(d.text) for d in [*train, *expert_val]]
    assert sum(n < WINDOW_BYTES for n in kept) > 0, "short documents are training text"
    assert manifest["train"]["bytes"] == sum(len(d.text) for d in train)
    assert (len(val), len(set(val.doc_ids))) == (20, 6)
    assert len(test) == 12 and len(set(test.doc_ids)) == 12
    assert len(manifest["train"]["shards"]) >= 3
    by_id = {f"{d.source}:{d.doc_id}": d for d in iter_corpus(small_config.corpus)}
    for evalset in (val, test):
        for window, doc_id, source, offset in zip(evalset.windows, evalset.doc_ids, evalset.sources, evalset.offsets,
                                                  strict=False):
            document = by_id[f"{source}:{doc_id}"].text
            assert window.tobytes() == document[offset : offset + WINDOW_BYTES]


def test_shards_open_with_stock_webdataset_and_tar(small_config):
    folder = prepare(small_config, progress=False)
    manifest = read_manifest(folder)
    first = folder / manifest["train"]["shards"][0]["path"]
    names = subprocess.run(["tar", "-tf", str(first)], capture_output=True, text=True, check=True).stdout.split()
    assert sorted(names[:2]) == ["000000000.json", "000000000.txt"]
    samples = list(wds.WebDataset(str(first), shardshuffle=False))
    assert len(samples) == manifest["train"]["shards"][0]["documents"] == len(names) // 2
    assert json.loads(samples[0]["json"])["source"].endswith(".jsonl")


@pytest.mark.parametrize("cut", [1, 10_000])
def test_shard_writer_writes_the_bytes_tarfile_writes(tmp_path, cut):
    from soma_pl.data.formats.tar_shards import ShardWriter

    rng = np.random.default_rng(0)
    sizes = [0, 1, 511, 512, 513, 1024, 9_999, *rng.integers(0, 5_000, 40).tolist()]
    documents = [Document(rng.integers(0, 256, n, dtype=np.uint8).tobytes(), f"src{n}", f"id-{i}", "é" * (i % 3))
                 for i, n in enumerate(sizes)]
    writer = ShardWriter(tmp_path / "ours", "train", max_bytes=cut)
    for document in documents:
        writer.write(document)
    records = writer.close()
    expected, key = [], 0  # the same samples through tarfile, cut where the writer cut
    for record in records:
        path = tmp_path / f"ref-{len(expected)}.tar"
        with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
            for document in documents[key : key + record.documents]:
                meta = json.dumps({"doc_id": document.doc_id, "source": document.source, "title": document.title})
                for extension, payload in (("json", meta.encode()), ("txt", document.text)):
                    member = tarfile.TarInfo(f"{key:09d}.{extension}")
                    member.size, member.mtime, member.mode = len(payload), 0, 0o444
                    member.uname = member.gname = "bigdata"
                    tar.addfile(member, io.BytesIO(payload))
                key += 1
        expected.append(path.read_bytes())
    assert key == len(documents) and 1 < len(records) <= len(documents) and (cut > 1 or len(records) == len(documents))
    assert [(tmp_path / "ours" / Path(r.path).name).read_bytes() for r in records] == expected


def _shingles(data: bytes, size: int) -> set[bytes]:
    return {data[i : i + size] for i in range(len(data) - size + 1)}


def test_test_windows_share_no_shingle_with_training(tmp_path, small_config):
    # Half the documents reappear with a new opening: their originals must be excluded from test.
    folder = tmp_path / "corpus"
    texts = write_jsonl_corpus(folder, {"alpha": 60, "beta": 60}, min_words=150, max_words=400)
    with open(folder / "copies.jsonl", "w") as handle:
        for key, text in list(texts.items())[::2]:
            handle.write(json.dumps({"text": f"a fresh opening for {key}. " + text[40:]}) + "\n")
    config = replace(small_config, corpus=CorpusConfig(kind="jsonl", paths=[str(folder)]), test_oversample=3.0)
    output = prepare(config, progress=False)
    manifest = read_manifest(output)
    train_shingles = set().union(*(_shingles(d.text, 50) for d in training_documents(output)))
    test = EvalSet.load(output / "test.npz")
    assert all(not _shingles(w.tobytes(), 50) & train_shingles for w in test.windows)
    assert manifest["test"]["excluded"] > 0
    assert manifest["test"]["documents"] == 12


def test_overlap_screen_threshold_is_exact():
    rng = np.random.default_rng(0)
    window = rng.integers(128, 256, 300, dtype=np.uint8).tobytes()  # no byte in common with the ASCII around it
    index = OverlapIndex([window, window[::-1]], shingle_bytes=50)
    assert index.find([b"unrelated" + window[100:149] + b"prefix"]).tolist() == []  # 49 shared bytes: not enough
    assert index.find([b"unrelated" + window[100:150] + b"prefix"]).tolist() == [0]  # 50 shared bytes


def test_validation_windows_round_robin():
    documents = [Document(b"a" * 3 * WINDOW_BYTES, "s", "d0"), Document(b"b" * WINDOW_BYTES, "s", "d1")]
    assert validation_windows(documents, 3, WINDOW_BYTES) == [(0, 0), (1, 0), (0, WINDOW_BYTES)]


def test_deterministic_for_a_seed(small_config, tmp_path):
    first = prepare(small_config, progress=False)
    second = prepare(replace(small_config, output_dir=str(tmp_path / "again")), progress=False)
    other_seed = prepare(replace(small_config, output_dir=str(tmp_path / "seed1"), seed=1), progress=False)
    shas = [[s["sha256"] for s in read_manifest(f)["train"]["shards"]] for f in (first, second, other_seed)]
    assert shas[0] == shas[1] and shas[0] != shas[2]
    for name in ("ensemble_val.npz", "test.npz"):
        a, b, c = (EvalSet.load(f / name) for f in (first, second, other_seed))
        assert np.array_equal(a.windows, b.windows) and list(a.doc_ids) == list(b.doc_ids)
        assert list(a.doc_ids) != list(c.doc_ids)


def test_identical_rerun_is_a_noop_and_a_change_rebuilds(small_config):
    folder = prepare(small_config, progress=False)
    stamp = (folder / "manifest.json").stat().st_mtime_ns
    prepare(small_config, progress=False)
    assert (folder / "manifest.json").stat().st_mtime_ns == stamp
    changed = replace(small_config, val_windows=10)
    with pytest.warns(UserWarning, match="rebuilding"):
        prepare(changed, progress=False)
    assert read_manifest(folder)["ensemble_val"]["windows"] == 10
    assert read_manifest(folder)["fingerprint"] == changed.fingerprint() != small_config.fingerprint()


def test_failure_mid_write_leaves_nothing_valid(small_config, monkeypatch):
    from soma_pl.data.formats.tar_shards import ShardWriter

    calls = {"n": 0}
    original = ShardWriter.write

    def failing_write(self, document):
        calls["n"] += 1
        if calls["n"] == 40:
            raise KeyboardInterrupt
        original(self, document)

    monkeypatch.setattr(ShardWriter, "write", failing_write)
    small_config = replace(small_config, executor=ExecutorConfig(tasks=2, workers=1))  # tasks in this process
    with pytest.raises(KeyboardInterrupt):
        prepare(small_config, progress=False)
    output = Path(small_config.output_dir)
    assert not output.exists()
    assert not list(output.parent.glob(f".{output.name}.tmp-*"))
    monkeypatch.setattr(ShardWriter, "write", original)
    assert read_manifest(prepare(small_config, progress=False))["train"]["documents"] > 0


def _prepare_command(corpus: Path, output: Path) -> list[str]:
    """`prepare` of a JSONL corpus in a process of its own."""
    return [sys.executable, "-m", "soma_pl.cli", "prepare", "--progress", "false", "--dataset.corpus.kind", "jsonl",
            f"--dataset.corpus.paths=[{corpus}]", f"--dataset.output_dir={output}", "--dataset.val_documents=4",
            "--dataset.val_windows=8", "--dataset.test_windows=4", "--dataset.shard_max_bytes=100000"]


def test_killed_prepare_leaves_nothing_that_reads_as_valid(tmp_path):
    write_jsonl_corpus(tmp_path / "corpus", {"alpha": 3000}, min_words=200, max_words=600)
    output = tmp_path / "prepared"
    command = _prepare_command(tmp_path / "corpus", output)
    # Its own process group, killed whole as a scheduler or Ctrl-C kills a job (a SIGKILL to the
    # main process alone would leave its datatrove pool workers waiting forever).
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 60
    while not list(tmp_path.glob(".prepared.prepare-*/train/*.tar")) and time.monotonic() < deadline:
        assert process.poll() is None, "prepare finished before it could be killed"
        time.sleep(0.02)
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    assert not output.exists()
    with pytest.raises(DataError, match="not a prepared dataset"):
        read_manifest(output)
    assert subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    assert read_manifest(output)["train"]["documents"] > 0, "the rerun resumes and finishes"


def test_processes_preparing_one_missing_dataset_at_once_take_turns(tmp_path):
    """A sweep's first trials each prepare the missing dataset: one builds, the others wait for its
    lock and find it up to date (without the lock one removed another's staging folder)."""
    write_jsonl_corpus(tmp_path / "corpus", {"alpha": 300}, min_words=200, max_words=600)
    output = tmp_path / "prepared"
    command = _prepare_command(tmp_path / "corpus", output)
    processes = [subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
                 for _ in range(3)]
    errors = [process.communicate(timeout=300)[1] for process in processes]
    assert [process.returncode for process in processes] == [0, 0, 0], errors
    assert read_manifest(output)["train"]["documents"] > 0
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no staging folder or lock is left"


def _children(pid: int) -> set[int]:
    """The processes whose parent is `pid` (from /proc)."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc; the kernel's parent-death signal")
def test_killing_only_the_main_process_leaves_no_worker_behind(tmp_path):
    # Two files: two tasks in a forked pool, beside datatrove's manager process. A SIGKILL to the
    # main process alone (an OOM killer, `kill -9 <pid>`) used to leave both waiting forever.
    write_jsonl_corpus(tmp_path / "corpus", {"alpha": 1500, "beta": 1500}, min_words=200, max_words=600)
    output = tmp_path / "prepared"
    command = [sys.executable, "-m", "soma_pl.cli", "prepare", "--progress", "false",
               "--dataset.corpus.kind", "jsonl", f"--dataset.corpus.paths=[{tmp_path / 'corpus'}]",
               f"--dataset.output_dir={output}", "--dataset.val_documents=4", "--dataset.val_windows=8",
               "--dataset.test_windows=4", "--dataset.shard_max_bytes=100000", "--dataset.executor.tasks=2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline, children = time.monotonic() + 60, set()
    while len(children) < 3 and time.monotonic() < deadline:  # the manager and the two pool workers
        assert process.poll() is None, "prepare finished before its workers could be seen"
        children = _children(process.pid)
        time.sleep(0.005)
    assert len(children) >= 3, f"expected a manager and two workers, saw {sorted(children)}"
    process.kill()
    process.wait()
    deadline = time.monotonic() + 10
    while any(map(_alive, children)) and time.monotonic() < deadline:
        time.sleep(0.05)
    left = sorted(pid for pid in children if _alive(pid))
    for pid in left:  # do not leak them into the rest of the session
        os.kill(pid, signal.SIGKILL)
    assert not left, f"{len(left)} of prepare's {len(children)} processes outlived it"
    assert subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).returncode == 0
    assert read_manifest(output)["train"]["documents"] > 0, "the rerun resumes and finishes"


def test_truncated_shard_is_never_read_as_valid(small_config):
    folder = prepare(small_config, progress=False)
    records = [ShardRecord(**s) for s in read_manifest(folder)["train"]["shards"]]
    path = folder / records[0].path
    data = path.read_bytes()
    # Cut inside the end-of-archive padding: tar still parses it as a complete, valid archive.
    path.write_bytes(data[:-1024])
    with tarfile.open(path) as archive:
        assert len(archive.getnames()) == 2 * records[0].documents
    with pytest.raises(DataError, match=f"truncated or altered shard .*{path.name}"):
        verify_shards(folder, records)
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(DataError, match=f"corrupt shard .*{path.name}"):
        list(iter_shard_documents(path))
    path.write_bytes(data[:-1] + b"x")
    with pytest.raises(DataError, match="sha256 differs"):
        verify_shards(folder, records, "sha256")


def test_empty_corpus_and_too_small_corpus(tmp_path, small_config):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "a.jsonl").write_text("")
    with pytest.raises(DataError, match="empty corpus"):
        prepare(replace(small_config, corpus=CorpusConfig(kind="jsonl", paths=[str(tmp_path / "empty")])))
    with pytest.raises(DataError, match="corpus too small"):
        prepare(replace(small_config, test_windows=500), progress=False)


@pytest.mark.parametrize("arguments, message", [
    (["--dataset.corpus.kind", "jsonl", "--dataset.corpus.paths=[/no/such/corpus]"],
     "corpus path not found: /no/such/corpus"),
    (["--dataset.bogus_key", "1"], "bogus_key"),
])
def test_cli_bad_input_exits_nonzero_with_a_clear_line(tmp_path, arguments, message):
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", "prepare", "--progress", "false",
                             f"--dataset.output_dir={tmp_path / 'out'}", *arguments],
                            capture_output=True, text=True)
    assert result.returncode != 0
    assert message in result.stderr.strip().splitlines()[-1]


def test_expert_val_split_is_the_seeded_one_percent_of_training_documents(small_config):
    """N = 1 is one expert: its decay signal is the held-out 1% of the training documents, each
    chosen by a seeded hash of its id (below 1% of the hash range), and never an empty split."""
    folder = prepare(small_config, progress=False)
    manifest = read_manifest(folder)
    expert_val = {d.doc_id for s in manifest["expert_val"]["shards"] for d in iter_shard_documents(folder / s["path"])}
    pool = expert_val | {d.doc_id for d in training_documents(folder)}
    below = {i for i in pool if seeded_hash(small_config.seed, "expert_val", i) < 2**64 // 100}
    smallest = min(pool, key=lambda i: seeded_hash(small_config.seed, "expert_val", i))
    assert expert_val == below | {smallest}
    assert manifest["expert_val"]["fraction"] == 0.01
