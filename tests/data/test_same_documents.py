"""Same data for every side: SOMA's experts train on exactly the prepared training split (SPSA's,
N = 1) and decay on exactly the prepared expert-validation split, cut between them by the rule that
assigns training documents; `shard` holds out nothing of its own."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.expert_sets import read_expert_shards, read_experts_manifest
from soma_pl.data.formats.manifest import MANIFEST, read_manifest
from soma_pl.data.formats.tar_shards import ShardRecord, iter_shard_documents
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import DataError

from .corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> PrepareConfig:
    """conftest's two-source corpus and settings (`jsonl_corpus`, `small_config`), prepared once
    for the module, with a 5% expert-validation split so that each of two experts gets several."""
    folder = tmp_path_factory.mktemp("same")
    write_jsonl_corpus(folder / "corpus", {"alpha": 120, "beta": 120})
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder / "corpus")]),
                           output_dir=str(folder / "prepared"), val_documents=6, val_windows=20, test_windows=12,
                           shard_max_bytes=150_000, expert_val_fraction=0.05)
    with pytest.warns(UserWarning, match="shorter than 1025 bytes"):
        prepare(config, progress=False)
    return config


def _split(root: Path, name: str) -> dict[str, int]:
    """doc id -> text bytes of the prepared split `name` (`train` or `expert_val`), read off its shards."""
    records = [ShardRecord(**r) for r in read_manifest(root)[name]["shards"]]
    return {d.doc_id: len(d.text) for r in records for d in iter_shard_documents(root / r.path)}


def _experts(folder: Path, split: str) -> list[dict[str, int]]:
    """Per expert: doc id -> text bytes of its `train` or `val` shards."""
    return [{d.doc_id: len(d.text) for r in getattr(e, split) for d in iter_shard_documents(folder / r.path)}
            for e in read_expert_shards(folder)]


@pytest.mark.parametrize("sharding", ["semantic", "random"])
def test_experts_hold_exactly_the_prepared_training_and_expert_validation_documents(prepared, tmp_path, sharding):
    root = Path(prepared.output_dir)
    folder = shard(ShardConfig(prepared=str(root), output_dir=str(tmp_path / "experts"), num_experts=2,
                               sharding=sharding, embed_batch_size=16), progress=False)
    manifest = read_manifest(root)
    train, expert_val = _split(root, "train"), _split(root, "expert_val")
    assert len(expert_val) >= 4 and len(train) > 100
    for split, prepared_split, entry in (("train", train, "train"), ("val", expert_val, "expert_val")):
        experts = _experts(folder, split)
        ids = Counter(doc_id for e in experts for doc_id in e)
        assert set(ids) == set(prepared_split), f"experts' {split} documents differ from the prepared {entry} split"
        assert max(ids.values()) == 1, f"a {split} document is in two experts"
        assert all(experts), f"an expert has no {split} document"
        total = sum(n for e in experts for n in e.values())
        assert total == sum(prepared_split.values()) == manifest[entry]["bytes"]
    record = read_experts_manifest(folder)
    for entry, split, documents in (("train", "train", train), ("expert_val", "val", expert_val)):
        experts = _experts(folder, split)
        assert [s[split] for s in record["expert_sizes"]] == [
            {"documents": len(e), "bytes": sum(e.values())} for e in experts]
        assert record[entry] == {"documents": len(documents), "bytes": sum(documents.values())}
    assert record["documents"] == len(train)


def test_the_datamodule_gives_each_expert_its_share_of_the_prepared_expert_validation_split(prepared, tmp_path):
    folder = shard(ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=2,
                               embed_batch_size=16), progress=False)
    module = ByteDataModule(prepared=prepared.output_dir, experts_dir=str(folder), batch_size=2, shuffle_buffer=4)
    module.setup("fit")
    windows = [len(w) for w in module.expert_val]
    assert len(windows) == 2 and min(windows) >= 1
    # every expert-validation window is from its expert's share: the windows of the whole split, dealt out
    whole = ByteDataModule(prepared=prepared.output_dir, batch_size=2, shuffle_buffer=4)
    whole.setup("fit")
    assert sum(windows) == len(whole.expert_val[0])


def test_the_fingerprint_covers_the_expert_validation_split(prepared, tmp_path):
    manifest = read_manifest(Path(prepared.output_dir))
    config = ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=2)
    changed = json.loads(json.dumps(manifest))
    changed["expert_val"]["shards"][0]["sha256"] = "0" * 64
    assert config.fingerprint(manifest) != config.fingerprint(changed)


def test_a_prepared_dataset_without_an_expert_validation_split_is_one_line(prepared, tmp_path):
    old = tmp_path / "old"
    shutil.copytree(prepared.output_dir, old)
    manifest = json.loads((old / MANIFEST).read_text())
    del manifest["expert_val"]
    (old / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="expert-validation split.*prepare again") as raised:
        shard(ShardConfig(prepared=str(old), output_dir=str(tmp_path / "experts"), num_experts=2), progress=False)
    assert "\n" not in str(raised.value)


def test_fewer_expert_validation_documents_than_experts_is_one_line(prepared, tmp_path):
    count = read_manifest(Path(prepared.output_dir))["expert_val"]["documents"]
    with pytest.raises(DataError, match=f"{count} expert-validation documents.*expert_val_fraction"):
        shard(ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=count + 1),
              progress=False)


def test_an_expert_that_no_expert_validation_document_is_nearest_takes_its_nearest_one():
    from soma_pl.data.sharding.assign import assign_expert_val

    config = ShardConfig(num_experts=3, min_expert_fraction=0.25)
    centroids = np.array([[0, 0], [10, 0], [0, 10]], dtype=np.float32)
    # four documents nearest expert 0, one nearest expert 1, none nearest expert 2
    embeddings = np.array([[0, 1], [1, 0], [0, 4], [0, 3], [9, 0]], dtype=np.float32)
    labels, moved = assign_expert_val(config, embeddings, np.arange(5, dtype=np.uint64), centroids)
    assert moved == 1 and labels.tolist() == [0, 0, 2, 0, 1]  # [0, 4] is the nearest to expert 2
    dealt, moved = assign_expert_val(replace(config, sharding="random"), embeddings,
                                     np.array([4, 3, 2, 1, 0], dtype=np.uint64), centroids)
    assert moved == 0 and dealt.tolist() == [1, 0, 2, 1, 0]  # round-robin in the order of the deal keys


def test_val_fraction_is_an_unknown_key(prepared, tmp_path):
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", "shard", f"--shard.prepared={prepared.output_dir}",
                             f"--shard.output_dir={tmp_path / 'experts'}", "--shard.val_fraction=0.05",
                             "--progress", "false"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "shard.val_fraction" in result.stderr and not (tmp_path / "experts").exists()
