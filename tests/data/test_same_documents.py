"""Same data for every side: every sharding of a prepared dataset (N = 1 for the monolithic side,
N = 2 semantic or random) holds exactly the same 1,024-byte sequences, each expert's own 1% of them
held out for its decay."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.expert_sets import read_expert_shards, read_experts_manifest
from soma_pl.data.formats.manifest import read_manifest
from soma_pl.data.formats.tar_shards import iter_shard_documents
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
    prepare(config, progress=False)
    return config


def _experts(folder: Path, split: str) -> list[dict[str, int]]:
    """Per expert: sequence id -> bytes of its `train` or `val` shards."""
    return [{d.doc_id: len(d.text) for r in getattr(e, split) for d in iter_shard_documents(folder / r.path)}
            for e in read_expert_shards(folder)]


def test_every_sharding_holds_the_same_sequences(prepared, tmp_path):
    root = Path(prepared.output_dir)
    everything = {}
    for name, experts, sharding in (("n1", 1, "semantic"), ("n2", 2, "semantic"), ("random", 2, "random")):
        folder = shard(ShardConfig(prepared=str(root), output_dir=str(tmp_path / name), num_experts=experts,
                                   sharding=sharding, kmeans_n_init=2), progress=False)
        train, val = _experts(folder, "train"), _experts(folder, "val")
        ids = Counter(i for e in [*train, *val] for i in e)
        assert max(ids.values()) == 1 and all(train) and all(val)
        everything[name] = set(ids)
        record = read_experts_manifest(folder)
        assert [s["train"] for s in record["expert_sizes"]] == [{"sequences": len(e), "bytes": sum(e.values())}
                                                               for e in train]
        assert record["train"]["sequences"] + record["expert_val"]["sequences"] == record["sequences"] == len(ids)
        sizes = [len(t) + len(v) for t, v in zip(train, val, strict=True)]
        assert [len(v) for v in val] == [max(1, round(0.01 * n)) for n in sizes]
    assert everything["n1"] == everything["n2"] == everything["random"]


def test_the_datamodule_gives_each_expert_its_own_expert_validation_windows(prepared, tmp_path):
    folder = shard(ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=2,
                               kmeans_n_init=2), progress=False)
    module = ByteDataModule(prepared=prepared.output_dir, experts_dir=str(folder), batch_size=2, shuffle_buffer=4)
    module.setup("fit")
    assert [len(w) for w in module.expert_val] == [len(v) for v in _experts(folder, "val")]
    batch = next(iter(module.train_dataloader()))
    assert batch.shape == (2, 2, 1025)


def test_the_fingerprint_covers_the_expert_validation_split(prepared, tmp_path):
    manifest = read_manifest(Path(prepared.output_dir))
    config = ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=2)
    changed = json.loads(json.dumps(manifest))
    changed["expert_val"]["shards"][0]["sha256"] = "0" * 64
    assert config.fingerprint(manifest) != config.fingerprint(changed)


def test_a_dataset_too_small_for_the_experts_is_one_line(prepared, tmp_path):
    with pytest.raises(DataError, match="num_experts=100000") as raised:
        shard(ShardConfig(prepared=prepared.output_dir, output_dir=str(tmp_path / "experts"), num_experts=100_000,
                          kmeans_sample=200_000), progress=False)
    assert "\n" not in str(raised.value)


def test_val_fraction_is_an_unknown_key(prepared, tmp_path):
    result = subprocess.run([sys.executable, "-m", "soma_pl.cli", "shard", f"--shard.prepared={prepared.output_dir}",
                             f"--shard.output_dir={tmp_path / 'experts'}", "--shard.val_fraction=0.05",
                             "--progress", "false"], capture_output=True, text=True, cwd=ROOT)
    assert result.returncode == 2 and result.stderr.strip().count("\n") == 0
    assert "shard.val_fraction" in result.stderr and not (tmp_path / "experts").exists()
