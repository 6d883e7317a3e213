"""Streaming corpus readers: FineWeb-Edu parquet, JSONL (optionally gzipped), plain-text files.

Every reader yields `Document`s one at a time and never holds a corpus in memory: parquet is read a
record batch at a time (only the columns needed), JSONL and text a line or a file at a time.
"""

from __future__ import annotations

import gzip
import io
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path

from soma_pl.data.corpus.documents import Document
from soma_pl.errors import DataError


class CorpusKind(str, Enum):
    """Which reader a corpus needs (member names are lowercase: configs write them)."""

    demo = "demo"
    parquet = "parquet"
    jsonl = "jsonl"
    text = "text"


_PATTERNS = {
    CorpusKind.parquet: ("**/*.parquet",),
    CorpusKind.jsonl: ("**/*.jsonl", "**/*.jsonl.gz", "**/*.json.gz"),
    CorpusKind.text: ("**/*.txt", "**/*.md", "**/*.text"),
}


@dataclass
class CorpusConfig:
    """Where the documents come from.

    Attributes:
        kind: `demo` (the built-in three-genre corpus), `parquet` (FineWeb-Edu), `jsonl` or `text`.
        paths: files or folders (folders are searched recursively: `**/*.parquet`, `**/*.jsonl[.gz]`,
            `**/*.txt`); ignored for `demo`.
        text_field: the column (parquet) or key (JSONL) holding the document text.
        id_field: the column (parquet) or key (JSONL) holding a corpus-wide unique document id
            (FineWeb-Edu: `id`); it decides the held-out choice. None: `<file name>:<row>`.
        min_int_score: keep only parquet rows whose `int_score` is at least this (FineWeb-Edu's
            educational score); ignored when the file has no `int_score` column.
        demo_sources: which demo sources to use.
        parquet_batch_rows: rows per parquet record batch (bounds memory while streaming).
    """

    kind: CorpusKind = CorpusKind.demo
    paths: list[str] = field(default_factory=list)
    text_field: str = "text"
    id_field: str | None = None
    min_int_score: int | None = None
    demo_sources: list[str] = field(default_factory=lambda: ["wikipedia", "sotu", "python_docs"])
    parquet_batch_rows: int = 1024


def corpus_files(kind: CorpusKind, paths: Sequence[str | Path]) -> list[Path]:
    """Resolve `paths` to the sorted list of files a reader of `kind` reads.

    Raises:
        DataError: a path does not exist, or no file matches.
    """
    if not paths:
        raise DataError(f"corpus of kind '{kind.value}' needs at least one path (corpus.paths)")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted({f for pattern in _PATTERNS[kind] for f in path.glob(pattern) if f.is_file()})
            files.extend(found)
        else:
            raise DataError(f"corpus path not found: {path}")
    if not files:
        raise DataError(f"no {kind.value} files under: {', '.join(str(p) for p in paths)}")
    return files


def iter_parquet(
    files: Sequence[Path], text_field: str = "text", min_int_score: int | None = None, batch_rows: int = 1024,
    id_field: str | None = None,
) -> Iterator[Document]:
    """Yield the documents of FineWeb-Edu-style parquet files, reading only the needed columns."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for path in files:
        try:
            parquet = pq.ParquetFile(path)
            names = set(parquet.schema_arrow.names)
            for needed in (text_field, id_field):
                if needed is not None and needed not in names:
                    raise DataError(f"{path}: no '{needed}' column (columns: {', '.join(sorted(names))})")
            use_score = min_int_score is not None and "int_score" in names
            columns = [text_field] + ([id_field] if id_field else []) + (["int_score"] if use_score else [])
            row = 0
            for batch in parquet.iter_batches(batch_size=batch_rows, columns=columns):
                column = batch.column(text_field)
                if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                    column = column.cast(pa.large_binary() if pa.types.is_large_string(column.type) else pa.binary())
                texts = column.to_pylist()  # UTF-8 bytes as stored: no decode and re-encode
                scores = batch.column("int_score").to_pylist() if use_score else None
                ids = batch.column(id_field).to_pylist() if id_field else None
                for i, text in enumerate(texts):
                    keep = text is not None and (scores is None
                                                 or (scores[i] is not None and scores[i] >= min_int_score))
                    if keep:
                        doc_id = str(ids[i]) if ids is not None else f"{path.name}:{row + i}"
                        yield Document(text if isinstance(text, bytes) else str(text).encode("utf-8"), str(path),
                                       doc_id)
                row += len(texts)
        except (pa.ArrowException, OSError) as error:
            raise DataError(f"corrupt parquet file {path}: {_first_line(error)}") from error


def iter_jsonl(files: Sequence[Path], text_field: str = "text", id_field: str | None = None) -> Iterator[Document]:
    """Yield one document per JSON line with a `text_field` string; `.gz` files are decompressed."""
    for path in files:
        opener = gzip.open if path.suffix == ".gz" else open
        try:
            with opener(path, "rb") as raw, io.TextIOWrapper(raw, encoding="utf-8") as lines:
                for number, line in enumerate(lines, start=1):
                    if not line.strip():
                        continue
                    try:
                        record = json.loads(line)
                    except json.JSONDecodeError as error:
                        raise DataError(f"{path}:{number}: invalid JSON ({error.msg})") from error
                    text = record.get(text_field) if isinstance(record, dict) else None
                    if not isinstance(text, str):
                        raise DataError(f"{path}:{number}: no string field '{text_field}'")
                    if id_field is None:
                        doc_id = f"{path.name}:{number}"
                    elif isinstance(record.get(id_field), (str, int)):
                        doc_id = str(record[id_field])
                    else:
                        raise DataError(f"{path}:{number}: no string or integer field '{id_field}' (corpus.id_field)")
                    yield Document(_utf8(text, path, number), str(path), doc_id)
        except (OSError, EOFError, UnicodeDecodeError) as error:
            raise DataError(f"unreadable JSONL file {path}: {_first_line(error)}") from error


def _utf8(text: str, path: Path, line: int) -> bytes:
    """A JSON string's UTF-8 bytes; a lone surrogate (`"\\ud800"`) has none."""
    try:
        return text.encode("utf-8")
    except UnicodeEncodeError as error:
        raise DataError(f"{path}:{line}: invalid Unicode in the text (a lone surrogate "
                        f"{text[error.start]!r} at character {error.start}): fix or drop that line") from error


def iter_text(files: Sequence[Path]) -> Iterator[Document]:
    """Yield each text file as one document (its bytes as stored; invalid UTF-8 is an error)."""
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as error:
            raise DataError(f"unreadable text file {path}: {_first_line(error)}") from error
        try:
            data.decode("utf-8")
        except UnicodeDecodeError as error:
            raise DataError(f"{path}: not UTF-8 text (byte {error.start})") from error
        yield Document(data, str(path), path.name)


def iter_corpus(config: CorpusConfig) -> Iterator[Document]:
    """Yield every document of the configured corpus, in a deterministic order."""
    kind = CorpusKind(config.kind)
    if kind is CorpusKind.demo:
        from soma_pl.data.corpus.demo import iter_demo_documents

        yield from iter_demo_documents(tuple(config.demo_sources))
        return
    for path in corpus_files(kind, config.paths):
        yield from iter_file(config, path)


def iter_file(config: CorpusConfig, path: Path) -> Iterator[Document]:
    """Yield the documents of one file of a (non-demo) corpus: the unit a prepare task reads."""
    kind = CorpusKind(config.kind)
    if kind is CorpusKind.parquet:
        yield from iter_parquet([path], config.text_field, config.min_int_score, config.parquet_batch_rows,
                                config.id_field)
    elif kind is CorpusKind.jsonl:
        yield from iter_jsonl([path], config.text_field, config.id_field)
    else:
        yield from iter_text([path])


def corpus_fingerprint(config: CorpusConfig) -> dict:
    """What identifies the corpus's content: files with size and mtime, or the demo sources' pins.

    A prepared dataset records this; a change means the prepared output is stale.
    """
    kind = CorpusKind(config.kind)
    if kind is CorpusKind.demo:
        from soma_pl.data.corpus.demo import demo_fingerprint

        return {"kind": kind.value, "demo": demo_fingerprint(tuple(config.demo_sources))}
    files = corpus_files(kind, config.paths)
    listing = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    options = {"text_field": config.text_field, "id_field": config.id_field, "min_int_score": config.min_int_score}
    return {"kind": kind.value, "files": listing, **options}


def corpus_change(before: dict, after: dict) -> str | None:
    """How a corpus changed between two `corpus_fingerprint`s, in words; None when it did not."""
    old = {path: (size, mtime) for path, size, mtime in before.get("files", [])}
    new = {path: (size, mtime) for path, size, mtime in after.get("files", [])}
    for path, (size, mtime) in old.items():
        if path not in new:
            return f"{path} disappeared"
        if new[path][0] != size:
            return f"{path} changed size ({size} -> {new[path][0]} bytes)"
        if new[path][1] != mtime:
            return f"{path} was modified"
    added = [path for path in new if path not in old]
    if added:
        return f"{added[0]} appeared"
    return None if before == after else "its identity changed"


def corpus_changed(change: str) -> DataError:
    """The one line that stops a prepare whose corpus changed while it read it (`change`: from
    `corpus_change`)."""
    return DataError(f"the corpus changed while prepare read it: {change}; nothing was written: "
                     "run prepare again once the corpus is complete")


def _first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]


def corpus_inputs(corpus: CorpusConfig) -> list[str]:
    """The paths a corpus is read from (none for the demo corpus): no output may hold them."""
    return [] if CorpusKind(corpus.kind) is CorpusKind.demo else list(corpus.paths)
