"""Corpus readers: round trips on FineWeb-Edu-schema parquet, JSONL (plain and gzip) and text."""

from __future__ import annotations

import gzip
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from soma_pl.data.corpus.readers import CorpusConfig, corpus_files, iter_corpus
from soma_pl.errors import DataError

TEXTS = ["Photosynthesis converts light — énergie — into sugar.", "Ωmega and ασπίδα", "plain ascii text", "x"]
SCORES = [3, 1, 4, 2]


def fineweb_table(texts, scores):
    """A table with every column of FineWeb-Edu's schema."""
    n = len(texts)
    return pa.table({
        "text": texts,
        "id": [f"<urn:uuid:{i}>" for i in range(n)],
        "dump": ["CC-MAIN-2024-10"] * n,
        "url": [f"https://example.org/{i}" for i in range(n)],
        "file_path": ["s3://bucket/x.warc.gz"] * n,
        "language": ["en"] * n,
        "language_score": [0.97] * n,
        "token_count": [len(t.split()) for t in texts],
        "score": [s + 0.25 for s in scores],
        "int_score": scores,
    })


def test_parquet_round_trip_and_score_filter(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    pq.write_table(fineweb_table(TEXTS[:2], SCORES[:2]), tmp_path / "a" / "000.parquet")
    pq.write_table(fineweb_table(TEXTS[2:], SCORES[2:]), tmp_path / "a" / "b" / "001.parquet", row_group_size=1)
    config = CorpusConfig(kind="parquet", paths=[str(tmp_path)], parquet_batch_rows=1)
    documents = list(iter_corpus(config))
    assert [d.text for d in documents] == [t.encode("utf-8") for t in TEXTS]
    assert len({d.doc_id for d in documents}) == len(TEXTS)
    config.min_int_score = 3
    assert [d.text.decode() for d in iter_corpus(config)] == [TEXTS[0], TEXTS[2]]


def test_parquet_reads_only_needed_columns(tmp_path, monkeypatch):
    pq.write_table(fineweb_table(TEXTS, SCORES), tmp_path / "x.parquet")
    requested = []
    original = pq.ParquetFile.iter_batches

    def spy(self, *args, **kwargs):
        requested.append(kwargs.get("columns"))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(pq.ParquetFile, "iter_batches", spy)
    list(iter_corpus(CorpusConfig(kind="parquet", paths=[str(tmp_path)])))
    list(iter_corpus(CorpusConfig(kind="parquet", paths=[str(tmp_path)], min_int_score=2)))
    assert requested == [["text"], ["text", "int_score"]]


def test_jsonl_plain_and_gzip_round_trip(tmp_path):
    lines = [json.dumps({"text": t, "meta": i}) for i, t in enumerate(TEXTS)]
    (tmp_path / "a.jsonl").write_text("\n".join(lines[:2]) + "\n\n")
    with gzip.open(tmp_path / "b.jsonl.gz", "wt", encoding="utf-8") as handle:
        handle.write("\n".join(lines[2:]) + "\n")
    documents = list(iter_corpus(CorpusConfig(kind="jsonl", paths=[str(tmp_path)])))
    assert [d.text for d in documents] == [t.encode("utf-8") for t in TEXTS]
    assert documents[0].source.endswith("a.jsonl") and documents[3].source.endswith("b.jsonl.gz")


def test_text_files_and_folders_round_trip(tmp_path):
    (tmp_path / "d").mkdir()
    for i, text in enumerate(TEXTS):
        (tmp_path / "d" / f"{i}.txt").write_text(text, encoding="utf-8")
    single = tmp_path / "single.txt"
    single.write_text("one file", encoding="utf-8")
    documents = list(iter_corpus(CorpusConfig(kind="text", paths=[str(tmp_path / "d"), str(single)])))
    assert [d.text.decode() for d in documents] == [*TEXTS, "one file"]


def test_missing_path_names_it(tmp_path):
    missing = tmp_path / "nowhere"
    with pytest.raises(DataError, match="corpus path not found: .*nowhere"):
        corpus_files("jsonl", [missing])


def test_corrupt_parquet_names_the_file(tmp_path):
    bad = tmp_path / "broken.parquet"
    bad.write_bytes(b"PAR1" + b"\x00garbage" * 50)
    with pytest.raises(DataError, match="corrupt parquet file .*broken.parquet"):
        list(iter_corpus(CorpusConfig(kind="parquet", paths=[str(tmp_path)])))


def test_jsonl_without_text_field_names_line(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"a.jsonl:2: no string field 'text'"):
        list(iter_corpus(CorpusConfig(kind="jsonl", paths=[str(tmp_path)])))


def test_folder_without_matching_files(tmp_path):
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(DataError, match="no parquet files under"):
        list(iter_corpus(CorpusConfig(kind="parquet", paths=[str(tmp_path)])))
