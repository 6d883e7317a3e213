"""Semantic and random sharding: partition, held-out exclusion, purity, determinism, CLI.
(That the experts hold exactly the prepared training and expert-validation splits, and what
happens when they cannot: tests/data/test_same_documents.py.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.expert_sets import ROUTER_FILE, read_expert_shards, read_experts_manifest
from soma_pl.data.formats.manifest import read_manifest
from soma_pl.data.formats.tar_shards import ShardRecord, iter_shard_documents
from soma_pl.data.preparation.config import PrepareConfig
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.sharding.assign import rebalance
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import ConfigError, DataError
from soma_pl.models.router import Router, prefix_batch

from .corpora import write_jsonl_corpus

ROOT = Path(__file__).resolve().parents[2]
VOCABULARIES = {
    "alpha": "river stone maple quartz lantern harbor cedar violet ember meadow".split(),
    "beta": "kernel socket buffer thread compiler pointer mutex cache packet syntax".split(),
    "gamma": "statute verdict tribunal clause appeal counsel warrant treaty ruling decree".split(),
}


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> PrepareConfig:
    """Three sources with disjoint vocabularies, prepared once for the module; 5% expert validation
    (1% of 114 documents could not give each of 3 experts one)."""
    folder = tmp_path_factory.mktemp("sharding")
    write_jsonl_corpus(folder / "corpus", {name: 40 for name in VOCABULARIES}, min_words=150, max_words=300,
                       vocabularies=VOCABULARIES)
    config = PrepareConfig(corpus=CorpusConfig(kind="jsonl", paths=[str(folder / "corpus")]),
                           output_dir=str(folder / "prepared"), val_documents=3, val_windows=4, test_windows=3,
                           expert_val_fraction=0.05)
    prepare(config, progress=False)
    return config


def _config(dataset: PrepareConfig, output: Path, **changes) -> ShardConfig:
    settings = {"num_experts": 3, "embed_batch_size": 16, **changes}
    return ShardConfig(prepared=dataset.output_dir, output_dir=str(output), **settings)


@pytest.fixture(scope="module")
def semantic(dataset, tmp_path_factory) -> Path:
    return shard(_config(dataset, tmp_path_factory.mktemp("semantic") / "experts"), progress=False)


def _expert_documents(folder: Path) -> list[dict[str, list]]:
    """Each expert's documents per split, read back from its shards."""
    return [{split: [d for r in records for d in iter_shard_documents(folder / r.path)]
             for split, records in (("train", e.train), ("val", e.val))} for e in read_expert_shards(folder)]


def _prepared_ids(dataset: PrepareConfig, split: str = "train") -> list[str]:
    """The document ids of a prepared split (`train` or `expert_val`)."""
    root = Path(dataset.output_dir)
    records = [ShardRecord(**r) for r in read_manifest(root)[split]["shards"]]
    return [d.doc_id for r in records for d in iter_shard_documents(root / r.path)]


def _source(document) -> str:
    return Path(document.source).stem


def test_every_training_document_lands_in_exactly_one_expert(dataset, semantic):
    experts = _expert_documents(semantic)
    placed = [d.doc_id for e in experts for split in ("train", "val") for d in e[split]]
    prepared = [*_prepared_ids(dataset, "train"), *_prepared_ids(dataset, "expert_val")]
    assert Counter(placed) == Counter(prepared) and len(placed) == len(set(placed))
    root = Path(dataset.output_dir)
    held_out = {str(i) for name in ("ensemble_val.npz", "test.npz") for i in EvalSet.load(root / name).doc_ids}
    assert held_out and not held_out & set(placed)
    assert all(e["train"] and len(e["val"]) >= 1 for e in experts)


def test_semantic_shards_recover_the_sources(semantic):
    experts = _expert_documents(semantic)
    table = [Counter(_source(d) for d in e["train"]) for e in experts]  # the contingency counts training documents
    purity = sum(max(row.values()) for row in table) / sum(sum(row.values()) for row in table)
    assert purity > 0.9 and {row.most_common(1)[0][0] for row in table} == set(VOCABULARIES)
    manifest = read_experts_manifest(semantic)
    assert manifest["purity"] > 0.9 and manifest["num_experts"] == 3
    recorded = [Counter({Path(s).stem: n for s, n in row.items() if n}) for row in manifest["contingency"]]
    assert recorded == table
    sizes = [len(e["train"]) for e in experts]
    assert [manifest["shard_sizes"][k] for k in ("min_documents", "max_documents")] == [min(sizes), max(sizes)]
    assert [e["train"]["documents"] for e in manifest["expert_sizes"]] == sizes


def test_router_sends_training_documents_to_their_shard(semantic):
    router = Router.load(semantic / ROUTER_FILE)
    experts = _expert_documents(semantic)
    hits = total = 0
    for expert, split in enumerate(experts):
        texts = [d.text for d in split["train"]]
        hits += int((router.top_k(prefix_batch(texts), 1)[:, 0] == expert).sum())
        total += len(texts)
    assert hits / total > 0.95


def test_random_sharding_is_balanced_and_mixes_sources(dataset, tmp_path):
    folder = shard(_config(dataset, tmp_path / "random", sharding="random"), progress=False)
    for split in ("train", "val"):  # each split is dealt round-robin
        sizes = [len(e[split]) for e in _expert_documents(folder)]
        assert max(sizes) - min(sizes) <= 1 and min(sizes) >= 1
    assert read_experts_manifest(folder)["purity"] < 0.6


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
    """document id -> (expert, split), read back from the shards."""
    return {d.doc_id: (expert, split) for expert, e in enumerate(_expert_documents(folder))
            for split in ("train", "val") for d in e[split]}


@pytest.mark.parametrize("sample", [10_000, 50])
def test_one_and_two_tasks_give_the_same_experts_splits_and_router(tmp_path, sample):
    """Any task count places every document in the same expert and split and fits the same router,
    with the whole corpus in the k-means sample and with a sample of 50 of the 120 documents (the
    others going to their nearest fitted centroid); only the tar files differ."""
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
    assert (one["tasks"], two["tasks"]) == (1, 2) and one["kmeans_sample"] == min(sample, one["documents"])
    assert _placement(built[1]) == _placement(built[2])
    assert one["contingency"] == two["contingency"] and one["purity"] == two["purity"] > 0.9
    assert [len({s for e, s in _placement(built[1]).values() if e == x} - {"train"}) for x in range(3)] == [1, 1, 1]
    centroids = [Router.load(built[t] / ROUTER_FILE).centroids for t in (1, 2)]
    assert torch.allclose(centroids[0], centroids[1], atol=1e-6)


def test_datamodule_reads_the_expert_shards(dataset, semantic):
    module = ByteDataModule(dataset, experts_dir=str(semantic), batch_size=4, shuffle_buffer=8)
    module.setup("fit")
    batch = next(iter(module.train_dataloader()))
    assert module.num_experts == 3 and batch.shape == (3, 4, WINDOW_BYTES) and batch.dtype == torch.uint8


def test_seed_embedder_shards_with_a_seed_checkpoint(dataset, tmp_path):
    from soma_pl.lit import BPTTModule, ModelShape

    torch.manual_seed(0)
    module = BPTTModule(shape=ModelShape(width=8, num_layers=1))
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, tmp_path / "seed.ckpt")
    folder = shard(_config(dataset, tmp_path / "seeded", embedder="seed", seed_checkpoint=str(tmp_path / "seed.ckpt")),
                   progress=False)
    router = Router.load(folder / ROUTER_FILE)
    assert router.encoder.kind.value == "seed" and tuple(router.centroids.shape) == (3, 32)
    assert sum(len(e["train"]) for e in _expert_documents(folder)) > 0


def test_bad_settings_are_config_errors(dataset, tmp_path):
    with pytest.raises(ConfigError, match="seed_checkpoint"):
        shard(_config(dataset, tmp_path / "x", embedder="seed"), progress=False)
    with pytest.raises(ConfigError, match="must differ"):
        shard(_config(dataset, Path(dataset.output_dir)), progress=False)
    with pytest.raises(DataError, match="training documents, fewer than shard.num_experts=200"):
        shard(_config(dataset, tmp_path / "x", num_experts=200), progress=False)


def test_rebalance_feeds_a_starving_expert_its_nearest_documents():
    labels = np.array([0, 0, 0, 0, 0, 1])
    distances = np.array([[0, 9, 5], [0, 9, 1], [0, 9, 3], [0, 9, 2], [0, 9, 4], [9, 0, 9]], dtype=float)
    new, moved = rebalance(labels, distances, minimum=2)
    # expert 1 takes document 0 (all equally far, lowest index first); expert 2 its two nearest, 1 and 3
    assert moved == 3 and new.tolist() == [1, 2, 0, 2, 0, 1]


@pytest.mark.parametrize("shard_config, data_config", [("demo_n2", "demo"), ("demo_n3", "demo"),
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
    assert summary["num_experts"] == 3 and summary["purity"] > 0.9 and len(summary["contingency"]) == 3
    assert summary["shard_sizes"]["min_documents"] >= 2 and (tmp_path / "cli" / "experts.json").is_file()


def test_cli_bad_input_is_one_line_and_exit_2(tmp_path):
    result = _run_cli("--shard.embedder", "seed", "--shard.output_dir", str(tmp_path / "out"), "--progress", "false")
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "seed_checkpoint" in result.stderr


def test_shard_reader_shows_each_tasks_progress_over_its_files(dataset, capsys):
    from soma_pl.data.sharding.steps import PreparedShardsReader

    root = Path(dataset.output_dir)
    paths = [root / ShardRecord(**r).path for r in read_manifest(root)["train"]["shards"]]
    task_files = [paths[rank::2] for rank in range(2)]
    assert all(task_files), "the corpus must give each task a shard file"
    for rank in range(2):
        reader = PreparedShardsReader(paths, progress=True, stage="embed")
        documents = list(reader.run(rank=rank, world_size=2))
        expected = [d.doc_id for path in task_files[rank] for d in iter_shard_documents(path)]
        assert [d.id for d in documents] == expected  # the bar changes nothing that is read
        err = capsys.readouterr().err
        done = len(task_files[rank])
        assert f"shard embed task {rank}" in err and f"{done}/{done}" in err
    quiet = PreparedShardsReader(paths, stage="embed")
    assert len(list(quiet.run(rank=0, world_size=2))) > 0 and capsys.readouterr().err == ""


@pytest.mark.parametrize("tasks, workers", [(1, None), (2, None), (4, None), (4, 1)])
def test_local_tasks_split_the_cores_between_them(tmp_path, tasks, workers):
    from soma_pl.data.runner.pipeline import ExecutorConfig
    from soma_pl.data.sharding.shard import _stages
    from soma_pl.data.sharding.steps import EmbedDocuments, WriteExperts

    config = ShardConfig(executor=ExecutorConfig(tasks=tasks, workers=workers))
    paths = [tmp_path / f"train-{i}.tar" for i in range(tasks)]
    stages = dict(_stages(config, {"train": paths, "expert_val": []}, tmp_path / "stage", "0" * 64, {}, 0.0))
    at_once = min(tasks, workers or tasks)
    for name, kind in (("embed", EmbedDocuments), ("write", WriteExperts)):
        step = stages[name].pipeline[-1]
        assert isinstance(step, kind) and step.threads == max(1, (os.cpu_count() or 1) // at_once)
    slurm = ShardConfig(executor=ExecutorConfig(kind="slurm", tasks=2, options={"partition": "cpu", "time": "1:00:00"}))
    embed = dict(_stages(slurm, {"train": paths[:1], "expert_val": paths[:1]}, tmp_path / "stage", "0" * 64, {},
                         0.0))["embed"]
    assert embed.pipeline[-1].threads is None, "a Slurm task has its own cores"
