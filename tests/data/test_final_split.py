"""The final test split (`final_test_windows`, `test_final.npz`): held out and screened like `test`,
drawn after it, leaving `test` as it is; served by `ByteDataModule(test_split="final")`."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.readers import CorpusConfig, corpus_fingerprint, iter_corpus
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import FORMAT_VERSION, read_manifest
from soma_pl.data.formats.tar_shards import iter_shard_documents
from soma_pl.data.preparation.heldout import document_rank
from soma_pl.data.preparation.prepare import prepare
from soma_pl.data.training.datamodule import ByteDataModule
from soma_pl.errors import ConfigError, DataError
from tests.lit.conftest import fit_args
from tests.robustness.cli import error_line

from .corpora import write_jsonl_corpus
from .test_prepare import _shingles, training_documents

FINAL = 8


def _with_copies(folder: Path, every: int) -> CorpusConfig:
    """A corpus where every `every`-th document reappears with a new opening: the screen must
    exclude the held-out one of each such pair whose twin is trained on."""
    texts = write_jsonl_corpus(folder, {"alpha": 60, "beta": 60}, min_words=150, max_words=400)
    with open(folder / "copies.jsonl", "w") as handle:
        for key, text in list(texts.items())[::every]:
            handle.write(json.dumps({"text": f"a fresh opening for {key}. " + text[40:]}) + "\n")
    return CorpusConfig(kind="jsonl", paths=[str(folder)])


def _expert_val_documents(folder: Path) -> list:
    manifest = read_manifest(folder)
    return [d for s in manifest["expert_val"]["shards"] for d in iter_shard_documents(folder / s["path"])]


def _same_windows(a: EvalSet, b: EvalSet) -> bool:
    return all(np.array_equal(getattr(a, name), getattr(b, name))
               for name in ("windows", "doc_ids", "sources", "offsets"))


def test_final_split_is_held_out_and_screened(tmp_path, small_config):
    config = replace(small_config, corpus=_with_copies(tmp_path / "corpus", every=2), test_oversample=3.0,
                     final_test_windows=FINAL)
    folder = prepare(config, progress=False)
    manifest = read_manifest(folder)
    final, test = EvalSet.load(folder / "test_final.npz"), EvalSet.load(folder / "test.npz")
    assert manifest["test"]["excluded"] > 0, "the corpus should make the screen exclude candidates"
    assert manifest["test"]["candidates"] == math.ceil(12 * 3.0)
    assert manifest["test_final"]["added_candidates"] == math.ceil((12 + FINAL) * 3.0) - math.ceil(12 * 3.0)
    assert len(final) == len(set(final.doc_ids)) == manifest["test_final"]["windows"] == FINAL and len(test) == 12
    assert manifest["test_final"]["sha256"] == hashlib.sha256((folder / "test_final.npz").read_bytes()).hexdigest()
    train, expert_val = training_documents(folder), _expert_val_documents(folder)
    final_ids = set(final.doc_ids)
    for others in (set(test.doc_ids), set(EvalSet.load(folder / "ensemble_val.npz").doc_ids),
                   {d.doc_id for d in train}, {d.doc_id for d in expert_val}):
        assert not final_ids & others
    trained = set().union(*(_shingles(d.text, config.shingle_bytes) for d in train + expert_val))
    assert all(not _shingles(w.tobytes(), config.shingle_bytes) & trained for w in final.windows)
    by_id = {(d.source, d.doc_id): d.text for d in iter_corpus(config.corpus)}
    for window, doc_id, source, offset in zip(final.windows, final.doc_ids, final.sources, final.offsets, strict=True):
        assert window.tobytes() == by_id[(str(source), str(doc_id))][offset : offset + WINDOW_BYTES]


def test_test_split_is_unchanged_by_a_final_split(small_config, tmp_path):
    without = prepare(small_config, progress=False)
    with_final = prepare(replace(small_config, output_dir=str(tmp_path / "final"), final_test_windows=FINAL),
                         progress=False)
    manifests = [read_manifest(f) for f in (without, with_final)]
    assert [m["test"]["excluded"] for m in manifests] == [0, 0], "the screen should exclude nothing here"
    assert "test_final" not in manifests[0] and not (without / "test_final.npz").exists()
    assert _same_windows(EvalSet.load(without / "test.npz"), EvalSet.load(with_final / "test.npz"))
    # Nothing excluded: the held-out rank order alone says which documents each split takes.
    ranked = sorted((document_rank(small_config.seed, d.doc_id), d.doc_id) for d in iter_corpus(small_config.corpus)
                    if len(d.text) >= WINDOW_BYTES)
    after_validation = [doc_id for _, doc_id in ranked[small_config.val_documents :]]
    assert list(EvalSet.load(with_final / "test.npz").doc_ids) == after_validation[:12]
    assert list(EvalSet.load(with_final / "test_final.npz").doc_ids) == after_validation[12 : 12 + FINAL]
    trained = {d.doc_id for d in training_documents(with_final) + _expert_val_documents(with_final)}
    assert not trained & set(after_validation[: math.ceil((12 + FINAL) * small_config.test_oversample)])


def test_test_split_is_unchanged_where_the_final_split_holds_out_its_overlaps(tmp_path, small_config):
    """Documents held out for the final split were training documents without it, and some overlap
    test candidates: `test` still excludes those candidates, so it keeps its documents."""
    config = replace(small_config, corpus=_with_copies(tmp_path / "corpus", every=2), test_oversample=3.0)
    without = prepare(config, progress=False)
    with_final = prepare(replace(config, output_dir=str(tmp_path / "final"), final_test_windows=FINAL), progress=False)
    manifest = read_manifest(with_final)
    assert manifest["test"]["excluded_by_final_only"] > 0, "the corpus should hold such overlaps"
    assert manifest["test"]["excluded"] == read_manifest(without)["test"]["excluded"] > 0
    assert _same_windows(EvalSet.load(without / "test.npz"), EvalSet.load(with_final / "test.npz"))


def test_too_few_clean_candidates_for_the_final_split_is_one_error(tmp_path, small_config):
    config = replace(small_config, corpus=_with_copies(tmp_path / "corpus", every=1), test_oversample=1.0,
                     final_test_windows=FINAL)
    with pytest.raises(DataError, match="too few clean test documents: .* raise dataset.test_oversample"):
        prepare(config, progress=False)
    assert not Path(config.output_dir).exists()


def test_the_final_split_is_part_of_the_fingerprint(small_config):
    corpus = corpus_fingerprint(small_config.corpus)
    settings = asdict(small_config)
    for key in ("output_dir", "executor"):
        settings.pop(key)
    identity = {"settings": settings, "corpus": corpus, "format": FORMAT_VERSION}
    assert small_config.fingerprint(corpus) == hashlib.sha256(
        json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()
    assert replace(small_config, final_test_windows=FINAL).fingerprint(corpus) != small_config.fingerprint(corpus)
    with pytest.raises(ConfigError, match="dataset.final_test_windows"):
        replace(small_config, final_test_windows=-1).validate()


def test_datamodule_serves_the_final_split(small_config):
    config = replace(small_config, final_test_windows=FINAL)
    module = ByteDataModule(config, eval_batch_size=5, test_split="final")
    module.prepare_data()
    module.setup("test")
    final = EvalSet.load(Path(config.output_dir) / "test_final.npz")
    assert _same_windows(module.test_set, final)
    served = [w for w, _ in module.test_dataloader()]
    assert np.array_equal(np.concatenate([w.numpy() for w in served]), final.windows)
    by_path = ByteDataModule(prepared=config.output_dir, test_split="test")
    by_path.setup("test")
    assert _same_windows(by_path.test_set, EvalSet.load(Path(config.output_dir) / "test.npz"))


def test_final_split_missing_or_misnamed_is_one_line(small_config, tmp_path, capsys):
    with pytest.raises(ConfigError, match="data.init_args.test_split=held_out must be one of: test, final"):
        ByteDataModule(small_config, test_split="held_out")
    prepare(small_config, progress=False)
    module = ByteDataModule(prepared=small_config.output_dir, test_split="final")
    with pytest.raises(DataError, match="no final test split .* prepare it again with dataset.final_test_windows"):
        module.setup("test")
    corpus = Path(small_config.corpus.paths[0])
    line = error_line(fit_args(corpus, tmp_path / "data", tmp_path / "run", "--data.init_args.test_split=bogus"),
                      capsys)
    assert line == "soma_pl: error: data.init_args.test_split=bogus must be one of: test, final"
