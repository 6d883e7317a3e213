"""ByteDataModule and the training stream: provenance, expert blocks, determinism, disjointness."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.readers import iter_corpus
from soma_pl.data.formats.expert_sets import ExpertShardWriter, write_experts_manifest
from soma_pl.data.formats.manifest import read_manifest
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.data.training.stream import WindowStream, consumer_slice, fixed_windows, shard_windows
from soma_pl.errors import ConfigError, DataError

from .corpora import window_owners


def batches(stream, count: int, workers: int = 0) -> list[torch.Tensor]:
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return list(itertools.islice(iter(loader), count))


@pytest.fixture
def module(small_config) -> ByteDataModule:
    dm = ByteDataModule(small_config, batch_size=8, eval_batch_size=5, shuffle_buffer=32)
    dm.prepare_data()  # the dataset does not exist yet: prepare_data builds it
    dm.setup("fit")
    return dm


def _joined(module: ByteDataModule, split: str) -> list[bytes]:
    """Each shard file of a prepared split: its documents joined end to end."""
    from soma_pl.data.formats.tar_shards import iter_shard_documents

    manifest = read_manifest(module.root)
    return [b"".join(d.text for d in iter_shard_documents(module.root / s["path"])) for s in manifest[split]["shards"]]


def test_training_windows_are_the_joined_documents_cut_every_1024_bytes(module):
    """A prepared dataset's documents, joined per shard file and cut every 1,024 bytes (each window
    the sequence and the next byte): what the stream serves, and nothing held out."""
    expected = {stream[i * 1024 : i * 1024 + WINDOW_BYTES] for stream in _joined(module, "train")
                for i in range((len(stream) - 1) // 1024)}
    held = {(d.split(".")[0], int(d.split(":")[1]) - 1) for d in (*module.val_set.doc_ids, *module.test_set.doc_ids)}
    seen = set()
    for batch in batches(module.train_stream(), 12):
        assert batch.shape == (1, 8, WINDOW_BYTES) and batch.dtype == torch.uint8
        for window in batch[0].numpy():
            assert window.tobytes() in expected
            assert not window_owners(window.tobytes()) & held  # JSONL ids: "<file>:<line>", document n on line n + 1
            seen.add(window.tobytes())
    assert len(seen) == 96, "the shuffle buffer serves each window once per pass"


def test_eval_loaders_are_fixed(module):
    first = [w for w, _ in module.val_dataloader()[0]]
    again = [w for w, _ in module.val_dataloader()[0]]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    assert sum(len(w) for w in first) == 20 and first[0].shape == (5, WINDOW_BYTES)
    windows, index = next(iter(module.test_dataloader()))
    assert torch.equal(windows, torch.from_numpy(module.test_set.windows[:5])) and index.tolist() == [0, 1, 2, 3, 4]


def test_monolithic_decay_windows_are_every_window_of_the_held_out_training_split(module):
    """N = 1 is one expert: validation's second loader holds every window of the prepared dataset's
    expert-validation documents, cut as the training windows are."""
    expected = [stream[i * 1024 : i * 1024 + WINDOW_BYTES] for stream in _joined(module, "expert_val")
                for i in range((len(stream) - 1) // 1024)]
    loaded = [(w, v) for w, v in module.val_dataloader()[1]]
    assert all(w.shape[:2] == v.shape and w.shape[0] == 1 for w, v in loaded)
    rows = [bytes(row.numpy()) for w, v in loaded for row in w[0][v[0]]]
    assert rows == expected and len(rows) >= 1


def test_a_cap_keeps_the_first_windows_of_each_expert(small_config):
    capped = ByteDataModule(small_config, eval_batch_size=5, expert_val_windows=2)
    capped.prepare_data()
    capped.setup("fit")
    windows, valid = next(iter(capped.val_dataloader()[1]))
    assert windows.shape == (1, 2, WINDOW_BYTES) and valid.all()
    with pytest.raises(ConfigError, match="expert_val_windows=0"):
        ByteDataModule(small_config, expert_val_windows=0)


@pytest.mark.parametrize("count", [1, 4, 7, 11, 100])
def test_a_capped_split_spreads_its_windows_evenly_over_the_split(tmp_path, count):
    from soma_pl.data.corpus.documents import Document
    from soma_pl.data.formats.tar_shards import ShardWriter

    rng = np.random.default_rng(0)
    windows = [rng.integers(0, 256, WINDOW_BYTES, dtype=np.uint8).tobytes() for _ in range(11)]
    writer = ShardWriter(tmp_path, "val", max_bytes=3 * WINDOW_BYTES)
    for i, window in enumerate(windows):
        writer.write(Document(window, "test", f"0:{i}"))
    shards = [tmp_path / r.path.split("/")[-1] for r in writer.close()]
    assert len(shards) > 1
    got = [bytes(row.numpy()) for row in fixed_windows(shards, count)]
    picks = range(11) if count >= 11 else [0] if count == 1 else [round(i * 10 / (count - 1)) for i in range(count)]
    assert got == [windows[i] for i in picks]


def test_shard_windows_cut_documents_or_read_windows_and_take_a_seeded_subset(tmp_path):
    from soma_pl.data.corpus.documents import Document
    from soma_pl.data.formats.tar_shards import ShardWriter
    from soma_pl.data.sharding.assign import cut_sequences

    rng = np.random.default_rng(1)
    texts = [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in (300, 5000, 70, 20_000)]
    writer = ShardWriter(tmp_path, "docs", max_bytes=10**9)
    for i, text in enumerate(texts):
        writer.write(Document(text, "test", f"d{i}"))
    path = tmp_path / writer.close()[0].path.split("/")[-1]
    cut = shard_windows(path, joined=True)
    assert np.array_equal(cut, cut_sequences(texts)[0]) and len(cut) == (25_370 - 1) // 1024
    with pytest.raises(DataError, match="not one 1025-byte window"):
        shard_windows(path, joined=False)
    half = shard_windows(path, joined=True, subset=0.5)
    assert 0 < len(half) < len(cut) and {w.tobytes() for w in half} <= {w.tobytes() for w in cut}
    assert np.array_equal(half, shard_windows(path, joined=True, subset=0.5))
    with pytest.raises(ConfigError, match="train_subset"):
        ByteDataModule(train_subset=0.0)


def test_stream_is_deterministic_and_skips_exactly(module):
    stream = module.train_stream()
    reference = batches(stream, 7)
    assert all(torch.equal(a, b) for a, b in zip(reference, batches(module.train_stream(), 7), strict=False))
    resumed = batches(module.train_stream(skip_batches=4), 3)
    assert all(torch.equal(a, b) for a, b in zip(reference[4:], resumed, strict=False))


def test_skip_with_workers_matches_uninterrupted_stream(module):
    reference = batches(module.train_stream(), 7, workers=2)
    resumed = batches(module.train_stream(skip_batches=3), 4, workers=2)
    assert all(torch.equal(a, b) for a, b in zip(reference[3:], resumed, strict=False))


def test_ranks_and_workers_read_disjoint_windows(module):
    owners = []
    for rank in (0, 1):
        stream = WindowStream(module.shard_sets, 8, seed=0, shuffle_buffer=16, rank=rank, world_size=2, joined=True)
        owners.append({w.tobytes() for b in batches(stream, 10, workers=2) for w in b[0].numpy()})
    assert owners[0] and owners[1] and not owners[0] & owners[1]


def test_consumer_slice_deals_shards_then_documents():
    shards = [f"s{i}" for i in range(5)]
    assert consumer_slice(shards, 1, 2) == (["s1", "s3"], 1, 0)
    assert consumer_slice(shards[:1], 1, 4) == (["s0"], 4, 1)
    parts = [set(consumer_slice(shards, c, 3)[0]) for c in range(3)]
    assert set().union(*parts) == set(shards) and sum(map(len, parts)) == 5


def test_expert_blocks_come_only_from_their_own_shards(tmp_path, small_config, module):
    writer = ExpertShardWriter(tmp_path / "experts", num_experts=2, shard_max_bytes=60_000)
    from soma_pl.data.corpus.documents import Document
    from soma_pl.data.sharding.assign import cut_sequences

    for document in iter_corpus(small_config.corpus):
        for number, window in enumerate(cut_sequences([document.text])[0]):
            writer.write(0 if b"<alpha:" in document.text else 1, Document(window.tobytes(), "t", f"{number}"))
    write_experts_manifest(tmp_path / "experts", writer.close(),
                           {"dataset_fingerprint": read_manifest(module.root)["fingerprint"]})  # cut from this dataset
    dm = ByteDataModule(small_config, experts_dir=str(tmp_path / "experts"), batch_size=6, shuffle_buffer=16)
    dm.setup("fit")
    assert dm.num_experts == 2
    for batch in batches(dm.train_stream(), 5, workers=2):
        assert batch.shape == (2, 6, WINDOW_BYTES)
        assert {o[0] for w in batch[0].numpy() for o in window_owners(w.tobytes())} == {"alpha"}
        assert {o[0] for w in batch[1].numpy() for o in window_owners(w.tobytes())} == {"beta"}


def test_setup_refuses_a_missing_or_truncated_dataset(small_config, module, tmp_path):
    missing = ByteDataModule(replace(small_config, output_dir=str(tmp_path / "none")), auto_prepare=False)
    missing.prepare_data()
    with pytest.raises(DataError, match="not a prepared dataset"):
        missing.setup("fit")
    shard = module.shard_sets[0][0]
    shard.write_bytes(shard.read_bytes()[:-512])
    with pytest.raises(DataError, match=f"truncated or altered shard .*{shard.name}"):
        ByteDataModule(small_config, verify="size").setup("fit")
    with pytest.raises(DataError, match="not a sharded dataset"):
        ByteDataModule(small_config, experts_dir=str(tmp_path)).setup("fit")
