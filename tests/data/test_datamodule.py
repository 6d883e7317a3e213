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
from soma_pl.data.training.stream import WindowStream, consumer_slice, document_windows
from soma_pl.errors import ConfigError, DataError

from .corpora import window_owner


def batches(stream, count: int, workers: int = 0) -> list[torch.Tensor]:
    loader = DataLoader(stream, batch_size=None, num_workers=workers)
    return list(itertools.islice(iter(loader), count))


@pytest.fixture
def module(small_config) -> ByteDataModule:
    dm = ByteDataModule(small_config, batch_size=8, eval_batch_size=5, shuffle_buffer=32)
    dm.prepare_data()  # the dataset does not exist yet: prepare_data builds it
    dm.setup("fit")
    return dm


def test_training_windows_are_substrings_of_their_documents(module, jsonl_corpus):
    _, texts = jsonl_corpus
    held = set(module.val_set.doc_ids) | set(module.test_set.doc_ids)
    seen = set()
    for batch in batches(module.train_stream(), 12):
        assert batch.shape == (1, 8, WINDOW_BYTES) and batch.dtype == torch.uint8
        for window in batch[0].numpy():
            source, number = window_owner(window.tobytes())
            key = f"{source}:{number:05d}"
            assert window.tobytes() in texts[key].encode()
            seen.add(key)
    assert len(seen) > 20, "the shuffle buffer should mix many documents"
    # JSONL doc ids are "<file>:<line>"; the generator writes document n on line n + 1.
    held_keys = {f"{d.split('.')[0]}:{int(d.split(':')[1]) - 1:05d}" for d in held}
    assert len(held_keys) == len(held) and not seen & held_keys


def test_eval_loaders_are_fixed(module):
    first = [w for w, _ in module.val_dataloader()[0]]
    again = [w for w, _ in module.val_dataloader()[0]]
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=False))
    assert sum(len(w) for w in first) == 20 and first[0].shape == (5, WINDOW_BYTES)
    windows, index = next(iter(module.test_dataloader()))
    assert torch.equal(windows, torch.from_numpy(module.test_set.windows[:5])) and index.tolist() == [0, 1, 2, 3, 4]


def test_monolithic_decay_windows_are_every_window_of_the_held_out_training_split(module):
    """N = 1 is one expert: validation's second loader holds every window of the prepared
    dataset's expert-validation documents, cut from each document's start, none of them trained on."""
    from soma_pl.data.formats.manifest import read_manifest
    from soma_pl.data.formats.tar_shards import iter_shard_documents

    manifest = read_manifest(module.root)
    documents = [d for s in manifest["expert_val"]["shards"] for d in iter_shard_documents(module.root / s["path"])]
    expected = [d.text[o : o + WINDOW_BYTES] for d in documents
                for o in range(0, len(d.text) - WINDOW_BYTES + 1, WINDOW_BYTES)]
    loaded = [(w, v) for w, v in module.val_dataloader()[1]]
    assert all(w.shape[:2] == v.shape and w.shape[0] == 1 for w, v in loaded)
    rows = [bytes(row.numpy()) for w, v in loaded for row in w[0][v[0]]]
    assert rows == expected and len(rows) >= 1
    train_ids = {d.doc_id for s in manifest["train"]["shards"] for d in iter_shard_documents(module.root / s["path"])}
    assert not train_ids & {d.doc_id for d in documents}


def test_a_cap_keeps_the_first_windows_of_each_expert(small_config):
    capped = ByteDataModule(small_config, eval_batch_size=5, expert_val_windows=2)
    capped.prepare_data()
    capped.setup("fit")
    windows, valid = next(iter(capped.val_dataloader()[1]))
    assert windows.shape == (1, 2, WINDOW_BYTES) and valid.all()
    with pytest.raises(ConfigError, match="expert_val_windows=0"):
        ByteDataModule(small_config, expert_val_windows=0)


@pytest.mark.parametrize("count", [1, 4, 7, 10, 100])
def test_a_capped_split_spreads_its_windows_over_every_document(tmp_path, count):
    """A cap takes windows from every document in turn (documents of 1, 5, 2 and 3 windows), not the
    first document's: checked against a round-robin over the documents' consecutive windows."""
    from soma_pl.data.corpus.documents import Document
    from soma_pl.data.formats.tar_shards import ShardWriter
    from soma_pl.data.training.stream import fixed_windows

    rng = np.random.default_rng(0)
    sizes = [1, 5, 2, 3]
    texts = [rng.integers(0, 256, n * WINDOW_BYTES + 17, dtype=np.uint8).tobytes() for n in sizes]
    writer = ShardWriter(tmp_path, "val", max_bytes=3 * WINDOW_BYTES)
    for i, text in enumerate(texts):
        writer.write(Document(text, "test", f"doc-{i}"))
    shards = [tmp_path / r.path.split("/")[-1] for r in writer.close()]
    assert len(shards) > 1
    windows = {(d, k): texts[d][k * WINDOW_BYTES : (k + 1) * WINDOW_BYTES]
               for d, n in enumerate(sizes) for k in range(n)}
    turns = [(d, k) for k in range(max(sizes)) for d, n in enumerate(sizes) if k < n]  # round-robin
    expected = sorted(turns[:count])  # document order, then window order
    got = [bytes(row.numpy()) for row in fixed_windows(shards, count)]
    assert got == [windows[key] for key in expected]
    assert len({d for d, _ in expected}) == min(count, len(sizes))


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


def test_ranks_and_workers_read_disjoint_documents(module):
    owners = []
    for rank in (0, 1):
        stream = WindowStream(module.shard_sets, 8, seed=0, shuffle_buffer=16, rank=rank, world_size=2)
        owners.append({window_owner(w.tobytes()) for b in batches(stream, 10, workers=2) for w in b[0].numpy()})
    assert owners[0] and owners[1] and not owners[0] & owners[1]


def test_consumer_slice_deals_shards_then_documents():
    shards = [f"s{i}" for i in range(5)]
    assert consumer_slice(shards, 1, 2) == (["s1", "s3"], 1, 0)
    assert consumer_slice(shards[:1], 1, 4) == (["s0"], 4, 1)
    parts = [set(consumer_slice(shards, c, 3)[0]) for c in range(3)]
    assert set().union(*parts) == set(shards) and sum(map(len, parts)) == 5


def test_document_windows_cover_without_overlap():
    rng = np.random.default_rng(0)
    text = rng.integers(0, 256, 20 * 256, dtype=np.uint8).tobytes()
    windows = document_windows(text, rng)
    starts = [text.index(w.tobytes()) for w in windows]
    assert starts[0] < WINDOW_BYTES and all(b - a == WINDOW_BYTES for a, b in zip(starts, starts[1:], strict=False))
    assert len(text) - (starts[-1] + WINDOW_BYTES) < WINDOW_BYTES
    assert document_windows(b"x" * (WINDOW_BYTES - 1), rng) == []


def test_expert_blocks_come_only_from_their_own_shards(tmp_path, small_config, module):
    writer = ExpertShardWriter(tmp_path / "experts", num_experts=2, shard_max_bytes=60_000)
    for document in iter_corpus(small_config.corpus):
        if len(document.text) >= WINDOW_BYTES:
            writer.write(0 if b"<alpha:" in document.text else 1, document)
    write_experts_manifest(tmp_path / "experts", writer.close(),
                           {"dataset_fingerprint": read_manifest(module.root)["fingerprint"]})  # cut from this dataset
    dm = ByteDataModule(small_config, experts_dir=str(tmp_path / "experts"), batch_size=6, shuffle_buffer=16)
    dm.setup("fit")
    assert dm.num_experts == 2
    for batch in batches(dm.train_stream(), 5, workers=2):
        assert batch.shape == (2, 6, WINDOW_BYTES)
        assert {window_owner(w.tobytes())[0] for w in batch[0].numpy()} == {"alpha"}
        assert {window_owner(w.tobytes())[0] for w in batch[1].numpy()} == {"beta"}


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
