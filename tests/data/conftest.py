"""Fixtures: a small generated JSONL corpus and a prepare config for it."""

from __future__ import annotations

from pathlib import Path

import pytest

from soma_pl.data.corpus.readers import CorpusConfig
from soma_pl.data.preparation.config import PrepareConfig

from .corpora import write_jsonl_corpus


@pytest.fixture
def jsonl_corpus(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    folder = tmp_path / "corpus"
    return folder, write_jsonl_corpus(folder, {"alpha": 120, "beta": 120})


@pytest.fixture
def small_config(jsonl_corpus, tmp_path: Path) -> PrepareConfig:
    folder, _ = jsonl_corpus
    return PrepareConfig(
        corpus=CorpusConfig(kind="jsonl", paths=[str(folder)]),
        output_dir=str(tmp_path / "prepared"),
        val_documents=6,
        val_windows=20,
        test_windows=12,
        shard_max_bytes=150_000,
    )
