"""Sharding as the paper shards (§4, App. D): 1,024-byte sequences of the joined documents, the
tf–idf router's balanced clusters, each expert's own 1% held out; random sharding; determinism, CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.expert_sets import ROUTER_FILE, read_expert_shards, read_experts_manifest
from soma_pl.data.formats.manifest import read_manifest
from soma_pl.data.formats.tar_shards import ShardRecord, iter_shard_documents
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.sharding.assign import cut_sequences, held_out_thresholds, sequence_keys
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.router import Router

from .corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[2]
VOCABULARIES = {
    "alpha": "river stone maple quartz lantern harbor cedar violet ember meadow".split(),
    "beta": "kernel socket buffer thread compiler pointer mutex cache packet syntax".split(),
    "gamma": "statute verdict tribunal clause appeal counsel warrant treaty ruling decree".split(),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PrepareConfig:
    """Three sources with disjoint vocabularies, prepared once for the module."""
    folder = tmp_path_factory.mktemp("sharding")
    write_jsonl_corpus(folder / "corpus", {name: 40 for name in VOCABULARIES}, min_words=150, max_words=300,
                       vocabularies=VOCABULARIES)
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder / "corpus")]),
                           output_dir=str(folder / "prepared"), val_documents=3, val_windows=4, test_windows=3,
                           expert_val_fraction=0.05)
    prepare(config, progress=False)
    return config


def _config(dataset: PrepareConfig, output: Path, **changes) -> ShardConfig:
    settings = {"num_experts": 3, "kmeans_n_init": 2, **changes}
    return ShardConfig(prepared=dataset.output_dir, output_dir=str(output), **settings)


@pytest.fixture(scope="module")
def semantic(dataset, tmp_path_factory) -> Path:
    return shard(_config(dataset, tmp_path_factory.mktemp("semantic") / "experts"), progress=False)


def _expert_documents(folder: Path) -> list[dict[str, list]]:
    """Each expert's sequences per split, read back from its shards."""
    return [{split: [d for r in records for d in iter_shard_documents(folder / r.path)]
             for split, records in (("train", e.train), ("val", e.val))} for e in read_expert_shards(folder)]


def _prepared_files(dataset: PrepareConfig) -> list[list[bytes]]:
    """The documents of each prepared shard file, training files then expert-validation files."""
    root = Path(dataset.output_dir)
    manifest = read_manifest(root)
    records = [ShardRecord(**r) for split in ("train", "expert_val") for r in manifest[split]["shards"]]
    return [[d.text for d in iter_shard_documents(root / r.path)] for r in records]


def _source(document) -> str:
    return Path(document.source).stem


def test_every_sequence_of_the_joined_documents_lands_in_exactly_one_expert(dataset, semantic):
    """Each prepared file's documents joined end to end and cut every 1,024 bytes: each window (the
    sequence and the next byte) is in exactly one expert, and nothing else is."""
    placed = {d.doc_id: d.text for e in _expert_documents(semantic) for split in ("train", "val") for d in e[split]}
    expected = {}
    for file, texts in enumerate(_prepared_files(dataset)):
        stream = b"".join(texts)
        for number in range((len(stream) - 1) // 1024):
            expected[f"{file}:{number}"] = stream[number * 1024 : number * 1024 + WINDOW_BYTES]
    assert placed == expected
    assert sum(len(e["train"]) + len(e["val"]) for e in _expert_documents(semantic)) == len(expected)
    assert read_experts_manifest(semantic)["sequences"] == len(expected)


def test_cut_sequences_keeps_every_byte_but_the_last_partial_one():
    windows, first = cut_sequences([b"a" * 1000, b"b" * 100, b"c" * 2000])
    assert windows.shape == (3, WINDOW_BYTES) and first.tolist() == [0, 1, 2]
    stream = b"a" * 1000 + b"b" * 100 + b"c" * 2000
    assert [w.tobytes() for w in windows] == [stream[i * 1024 : i * 1024 + 1025] for i in range(3)]
    assert cut_sequences([b"x" * 1024])[0].shape == (0, WINDOW_BYTES)


def test_semantic_shards_are_balanced_and_recover_the_sources(semantic):
    experts = _expert_documents(semantic)
    sizes = [len(e["train"]) + len(e["val"]) for e in experts]
    assert max(sizes) / min(sizes) <= 1.05
    table = [Counter(_source(d) for d in e["train"]) for e in experts]  # by the source of the first byte
    purity = sum(max(row.values()) for row in table) / sum(sum(row.values()) for row in table)
    assert purity > 0.85 and {row.most_common(1)[0][0] for row in table} == set(VOCABULARIES)
    manifest = read_experts_manifest(semantic)
    assert manifest["purity"] == round(purity, 4) and manifest["num_experts"] == 3
    recorded = [Counter({Path(s).stem: n for s, n in row.items() if n}) for row in manifest["contingency"]]
    assert recorded == table
    assert [manifest["shard_sizes"][k] for k in ("min_sequences", "max_sequences")] == [min(sizes), max(sizes)]


def test_each_expert_holds_out_its_own_sequences_of_smallest_key(semantic):
    """Clustering first, then per expert max(1, round(1% of its sequences)) of smallest key."""
    experts = _expert_documents(semantic)
    for expert in experts:
        keys = {split: [int(sequence_keys(0, int(d.doc_id.split(":")[0]), int(d.doc_id.split(":")[1]) + 1)[-1])
                        for d in expert[split]] for split in ("train", "val")}
        count = len(keys["train"]) + len(keys["val"])
        assert len(keys["val"]) == max(1, round(0.01 * count))
        assert max(keys["val"]) < min(keys["train"])
    labels = np.array([0, 0, 0, 1, 1, 1, 1])
    keys = np.array([5, 3, 9, 8, 1, 7, 2], dtype=np.uint64)
    assert held_out_thresholds(labels, keys, 2, 0.5).tolist() == [5, 2]  # round(1.5) = 2 of 3, 2 of 4


def test_the_router_reads_256_bytes_and_mostly_picks_the_sequences_expert(semantic):
    router = Router.load(semantic / ROUTER_FILE)
    assert router.encoder.kind.value == "tfidf" and router.encoder.output_dim <= 128
    hits = total = 0
    for expert, split in enumerate(_expert_documents(semantic)):
        windows = torch.tensor(np.array([np.frombuffer(d.text, np.uint8) for d in split["train"]]))
        hits += int((router.top_k(windows[:, :ROUTE_BYTES], 1)[:, 0] == expert).sum())
        total += len(windows)
    agreement = read_experts_manifest(semantic)["router_agreement"]
    assert hits / total > 0.8 and agreement["whole_sequence"] >= agreement["first_256_bytes"] > 0.8


def test_random_sharding_mixes_sources(dataset, tmp_path):
    folder = shard(_config(dataset, tmp_path / "random", sharding="random"), progress=False)
    sizes = [len(e["train"]) + len(e["val"]) for e in _expert_documents(folder)]
    assert sum(sizes) == read_experts_manifest(folder)["sequences"] and min(sizes) >= 0.2 * sum(sizes)
    assert read_experts_manifest(folder)["purity"] < 0.6


def test_global_iid_sharding_gives_every_expert_every_sequence_and_the_same_held_out_ones(dataset, semantic,
                                                                                          tmp_path):
    """Fig. 9's global-IID condition: each expert's split is the whole corpus's (one 1% of smallest
    key held out of all sequences); the router is the semantic sharding's, for evaluation."""
    folder = shard(_config(dataset, tmp_path / "iid", sharding="global_iid"), progress=False)
    experts = _expert_documents(folder)
    whole = {d.doc_id: d.text for e in _expert_documents(semantic) for split in ("train", "val") for d in e[split]}
    for expert in experts:
        assert {d.doc_id: d.text for split in ("train", "val") for d in expert[split]} == whole
        assert len(expert["val"]) == max(1, round(0.01 * len(whole)))
    assert [d.doc_id for d in experts[0]["val"]] == [d.doc_id for d in experts[1]["val"]]
    assert read_experts_manifest(folder)["sequences"] == len(whole)
    router, semantic_router = Router.load(folder / ROUTER_FILE), Router.load(semantic / ROUTER_FILE)
    assert torch.equal(router.centroids, semantic_router.centroids)


def test_sharding_is_deterministic_and_an_identical_rerun_is_a_no_op(dataset, semantic, tmp_path):
    again = shard(_config(dataset, tmp_path / "again"), progress=False)
    first, second = read_experts_manifest(semantic), read_experts_manifest(again)
    assert first["experts"] == second["experts"]  # every shard's sha256, size and count
    before = (again / "experts.json").stat().st_mtime_ns
    assert shard(_config(dataset, tmp_path / "again"), progress=False) == again
    assert (again / "experts.json").stat().st_mtime_ns == before
    with pytest.warns(UserWarning, match="rebuilding"):
        shard(_config(dataset, tmp_path / "again", seed=1), progress=False)
    assert read_experts_manifest(again)["config"]["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "no temporary folder is left"


def _placement(folder: Path) -> dict[str, tuple[int, str]]:
    """sequence id -> (expert, split), read back from the shards."""
    return {d.doc_id: (expert, split) for expert, e in enumerate(_expert_documents(folder))
            for split in ("train", "val") for d in e[split]}


@pytest.mark.worker_pool
@pytest.mark.parametrize("sample", [10_000, 50])
def test_one_and_two_tasks_give_the_same_experts_splits_and_router(tmp_path, sample):
    """Any task count places every sequence in the same expert and split and fits the same router,
    with every sequence in the fitting sample and with a sample of 50 (the others going to their
    nearest centroid); only the tar files differ."""
    folder = tmp_path / "corpus"
    write_jsonl_corpus(folder, {name: 40 for name in VOCABULARIES}, min_words=150, max_words=300,
                       vocabularies=VOCABULARIES)
    dataset = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder)]), output_dir=str(tmp_path / "data"),
                            val_documents=3, val_windows=4, test_windows=3, shard_max_bytes=60_000,
                            expert_val_fraction=0.05)
    prepare(dataset, progress=False)
    assert len(read_manifest(tmp_path / "data")["train"]["shards"]) >= 4
    built = {}
    for tasks in (1, 2):
        config = _config(dataset, tmp_path / f"experts-{tasks}", kmeans_sample=sample)
        config.executor.tasks = tasks
        built[tasks] = shard(config, progress=False)
    one, two = (read_experts_manifest(built[t]) for t in (1, 2))
    assert (one["tasks"], two["tasks"]) == (1, 2) and one["kmeans_sample"] == min(sample, one["sequences"])
    assert _placement(built[1]) == _placement(built[2])
    assert one["contingency"] == two["contingency"] and one["purity"] == two["purity"] > 0.85
    centroids = [Router.load(built[t] / ROUTER_FILE).centroids for t in (1, 2)]
    assert torch.equal(centroids[0], centroids[1])


def test_datamodule_reads_the_expert_shards(dataset, semantic):
    module = ByteDataModule(dataset, experts_dir=str(semantic), batch_size=4, shuffle_buffer=8)
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert module.num_experts == 3 and batch.shape == (3, 4, WINDOW_BYTES) and batch.dtype == torch.uint8


def test_bad_settings_are_config_errors(dataset, tmp_path):
    for key, value in (("expert_val_fraction", 0.0), ("tfidf_min_df", 0), ("svd_dim", 0)):
        with pytest.raises(ConfigError, match=key):
            shard(_config(dataset, tmp_path / "x", **{key: value}), progress=False)
    with pytest.raises(ConfigError, match="output_dir"):
        shard(_config(dataset, Path(dataset.output_dir)), progress=False)
    with pytest.raises(DataError, match="num_experts=200"):
        shard(_config(dataset, tmp_path / "x", num_experts=200, kmeans_sample=400), progress=False)


@pytest.mark.parametrize("shard_config, data_config", [("demo_n1", "demo"), ("demo_n2", "demo"),
                                                       ("demo_n3", "demo"),
                                                       ("fineweb_n8", "fineweb_edu")])
def test_shard_configs_name_their_prepared_dataset_by_path_alone(shard_config, data_config):
    prepared = yaml.safe_load((ROOT / f"configs/data/{data_config}.yaml").read_text())["dataset"]
    section = yaml.safe_load((ROOT / f"configs/shard/{shard_config}.yaml").read_text())["shard"]
    assert "dataset" not in section and section["prepared"] == prepared["output_dir"]
    assert section.get("recipe") in (None, f"configs/data/{data_config}.yaml")


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "soma_pl.cli", "shard", *args], capture_output=True, text=True,
                          cwd=ROOT)


def test_cli_shards_and_prints_a_summary(dataset, tmp_path):
    config = {"shard": {"prepared": dataset.output_dir, "num_experts": 3,
                        "output_dir": str(tmp_path / "cli")}}
    (tmp_path / "shard.yaml").write_text(yaml.safe_dump(config))
    result = _run_cli("--config", str(tmp_path / "shard.yaml"), "--progress", "false")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout)
    assert summary["num_experts"] == 3 and summary["purity"] > 0.85 and len(summary["contingency"]) == 3
    assert summary["shard_sizes"]["largest_over_smallest"] <= 1.05 and (tmp_path / "cli" / "experts.json").is_file()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    result = _run_cli("--shard.svd_dim", "0", "--shard.output_dir", str(tmp_path / "out"), "--progress", "false")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "svd_dim" in result.stderr


def test_shard_reader_shows_each_tasks_progress_over_its_files(dataset, capsys):
    from soma_pl.data.sharding.steps import PreparedShardsReader

    root = Path(dataset.output_dir)
    paths = [root / ShardRecord(**r).path for r in read_manifest(root)["train"]["shards"]]
    task_files = [paths[rank::2] for rank in range(2)]
    assert all(task_files), "the corpus must give each task a shard file"
    for rank in range(2):
        reader = PreparedShardsReader(paths, progress=True, stage="assign")
        documents = list(reader.run(rank=rank, world_size=2))
        expected = [d.doc_id for path in task_files[rank] for d in iter_shard_documents(path)]
        assert [d.id for d in documents] == expected  # the bar changes nothing that is read
        err = capsys.readouterr().err
        done = len(task_files[rank])
        assert f"shard assign task {rank}" in err and f"{done}/{done}" in err
    quiet = PreparedShardsReader(paths, stage="assign")
    assert len(list(quiet.run(rank=0, world_size=2))) > 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("keep", [0, 3])
def test_keeping_no_experts_or_more_than_the_sharding_has_names_the_setting(keep, tmp_path):
    with pytest.raises(ConfigError) as refused:
        ShardConfig(num_experts=2, keep_experts=keep, output_dir=str(tmp_path / "out")).validate()
    assert "shard.keep_experts" in str(refused.value)


def test_keeping_every_expert_is_the_sharding_without_the_setting():
    manifest = {"fingerprint": "f", "train": {"shards": []}, "expert_val": {"shards": []}}
    assert ShardConfig(num_experts=2, keep_experts=2).fingerprint(manifest) == ShardConfig(num_experts=2).fingerprint(
        manifest) != ShardConfig(num_experts=2, keep_experts=1).fingerprint(manifest)
