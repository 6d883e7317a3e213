"""WebDataset tar shards of documents: writing cut by size, verifying, and reading.

A sample is one document: `<key>.txt` holds its UTF-8 bytes and `<key>.json` its provenance
(`doc_id`, `source`, `title`). Shards are plain tar files, readable by `tar -tf` and by the stock
`webdataset.WebDataset`.

A tar cut short can still parse as a shorter valid archive, so a shard is only trusted when its size
(always) and optionally its sha256 match what `manifest.json` recorded when it was written.
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from enum import Enum
from pathlib import Path

from soma_pl.data.corpus.documents import Document
from soma_pl.errors import DataError


class Verify(str, Enum):
    """How much of a shard to check against its manifest record before reading it."""

    size = "size"
    sha256 = "sha256"


@dataclass(frozen=True)
class ShardRecord:
    """A written shard as the manifest records it (`path` relative to the dataset folder)."""

    path: str
    sha256: str
    bytes: int
    documents: int

    def to_json(self) -> dict:
        return asdict(self)


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


class ShardWriter:
    """Write documents into `<folder>/<prefix>-NNNNNN.tar`, starting a new shard past `max_bytes`.

    Each sample is laid out as `webdataset.TarWriter` lays it out (`<key>.json`, `<key>.txt`, mode
    0444, owner `bigdata`) with a fixed member time, so the same documents give byte-identical
    shards; the archive is written with the standard library's `tarfile` in the ustar format (no
    per-member pax header, and no torch import on the `prepare` path). `close()` returns the
    records of every shard written.
    """

    def __init__(self, folder: Path, prefix: str, max_bytes: int, max_documents: int = 100_000):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.prefix = prefix
        self.max_bytes, self.max_documents = max_bytes, max_documents
        self._tar: tarfile.TarFile | None = None
        self._file = None
        self._index = -1
        self._bytes = self._documents = 0
        self._counts: dict[str, int] = {}
        self._next_key = 0

    def _next_shard(self) -> None:
        self._close_shard()
        self._index += 1
        name = f"{self.prefix}-{self._index:06d}.tar"
        self._file = open(self.folder / name, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in _close_shard)
        self._tar = tarfile.open(fileobj=self._file, mode="w", format=tarfile.USTAR_FORMAT)
        self._bytes = self._documents = 0
        self._counts[name] = 0

    def _close_shard(self) -> None:
        if self._tar is not None:
            tar, handle, self._tar, self._file = self._tar, self._file, None, None
            try:
                tar.close()
            finally:
                handle.close()

    def write(self, document: Document) -> None:
        if self._tar is None or self._documents >= self.max_documents or self._bytes >= self.max_bytes:
            self._next_shard()
        meta = json.dumps({"doc_id": document.doc_id, "source": document.source, "title": document.title})
        key = f"{self._next_key:09d}"
        for extension, payload in (("json", meta.encode()), ("txt", document.text)):
            member = tarfile.TarInfo(f"{key}.{extension}")
            member.size, member.mtime, member.mode = len(payload), 0, 0o444
            member.uname = member.gname = "bigdata"
            self._tar.addfile(member, io.BytesIO(payload))
            self._bytes += len(payload)
        self._next_key += 1
        self._documents += 1
        self._counts[f"{self.prefix}-{self._index:06d}.tar"] += 1

    def close(self) -> list[ShardRecord]:
        self._close_shard()
        records = []
        for name, count in sorted(self._counts.items()):
            path = self.folder / name
            relative = f"{self.folder.name}/{name}"
            records.append(ShardRecord(relative, sha256_file(path), path.stat().st_size, count))
        return records


def verify_shards(root: Path, records: Iterable[ShardRecord], verify: Verify = Verify.sha256) -> list[Path]:
    """Check every shard against its record; return their paths.

    Raises:
        DataError: a shard is missing, has another size (truncated) or another sha256.
    """
    paths = []
    for record in records:
        path = root / record.path
        if not path.is_file():
            raise DataError(f"missing shard {path}")
        size = path.stat().st_size
        if size != record.bytes:
            raise DataError(f"truncated or altered shard {path}: {size} bytes, manifest says {record.bytes}")
        if Verify(verify) is Verify.sha256 and sha256_file(path) != record.sha256:
            raise DataError(f"corrupt shard {path}: sha256 differs from the manifest")
        paths.append(path)
    return paths


def iter_shard_documents(path: Path) -> Iterator[Document]:
    """Yield the documents of one shard in stored order (stock webdataset tar reading).

    Raises:
        DataError: the tar cannot be parsed or a sample lacks its `.txt` or `.json` member.
    """
    import webdataset as wds  # imports torch: only where shards are read

    try:
        for sample in wds.tariterators.tarfile_samples([{"url": str(path)}], handler=wds.reraise_exception):
            if "txt" not in sample or "json" not in sample:
                raise DataError(f"corrupt shard {path}: sample {sample.get('__key__')} lacks .txt or .json")
            meta = json.loads(sample["json"])
            yield Document(sample["txt"], meta["source"], meta["doc_id"], meta.get("title", ""))
    except (tarfile.TarError, OSError, EOFError, ValueError, KeyError) as error:
        raise DataError(f"corrupt shard {path}: {error}") from error
