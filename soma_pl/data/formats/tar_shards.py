"""WebDataset tar shards of documents: writing cut by size, verifying, and reading.

A sample is one document: `<key>.txt` holds its UTF-8 bytes and `<key>.json` its provenance
(`doc_id`, `source`, `title`). Shards are plain tar files, readable by `tar -tf` and by the stock
`webdataset.WebDataset`.

A tar cut short can still parse as a shorter valid archive, so a shard is only trusted when its size
(always) and optionally its sha256 match what `manifest.json` recorded when it was written.
"""

from __future__ import annotations

import hashlib
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


def _member_template() -> tuple[bytes, int]:
    """The ustar header `tarfile` writes for a shard member (mode 0444, owner `bigdata`, time 0),
    with its name, size and checksum fields blank; and the checksum of the rest of it."""
    member = tarfile.TarInfo("")
    member.size, member.mtime, member.mode = 0, 0, 0o444
    member.uname = member.gname = "bigdata"
    header = bytearray(member.tobuf(tarfile.USTAR_FORMAT, "utf-8", "surrogateescape"))
    header[0:100] = bytes(100)
    header[124:136] = bytes(12)
    header[148:156] = b" " * 8  # the checksum is summed over its own field as spaces
    return bytes(header), sum(header)


_TEMPLATE, _TEMPLATE_SUM = _member_template()


def member_header(name: bytes, size: int) -> bytes:
    """`tarfile.TarInfo(name).tobuf(USTAR_FORMAT)` for a shard member of `size` bytes, byte for byte,
    from a template: a shard of 10,000 documents takes 20,000 of these."""
    if len(name) > 100 or size >= 8**11:
        raise ValueError(f"a shard member needs a name of at most 100 bytes and under 8 GiB: {name!r}, {size}")
    size_field = b"%011o\0" % size
    header = bytearray(_TEMPLATE)
    header[0 : len(name)] = name
    header[124:136] = size_field
    header[148:155] = b"%06o\0" % (_TEMPLATE_SUM + sum(name) + sum(size_field))
    return bytes(header)


class ShardWriter:
    """Write documents into `<folder>/<prefix>-NNNNNN.tar`, starting a new shard past `max_bytes`.

    Each sample is laid out as `webdataset.TarWriter` lays it out (`<key>.json`, `<key>.txt`, mode
    0444, owner `bigdata`) with a fixed member time, so the same documents give byte-identical
    shards. Members are written as `tarfile` writes them (header, payload padded to 512 bytes, and
    two zero blocks and padding to a 10,240-byte record at the end), with headers from a template
    (`member_header`): the same bytes as `tarfile`, without building a `TarInfo` per member (no
    per-member pax header, and no torch import on the `prepare` path). `close()` returns the
    records of every shard written.
    """

    def __init__(self, folder: Path, prefix: str, max_bytes: int, max_documents: int = 100_000):
        folder.mkdir(parents=True, exist_ok=True)
        self.folder = folder
        self.prefix = prefix
        self.max_bytes, self.max_documents = max_bytes, max_documents
        self._file = None
        self._offset = 0
        self._index = -1
        self._bytes = self._documents = 0
        self._counts: dict[str, int] = {}
        self._next_key = 0

    def _next_shard(self) -> None:
        self._close_shard()
        self._index += 1
        name = f"{self.prefix}-{self._index:06d}.tar"
        self._file = open(self.folder / name, "wb", buffering=1 << 20)  # noqa: SIM115 (closed in _close_shard)
        self._offset = 0
        self._bytes = self._documents = 0
        self._counts[name] = 0

    def _close_shard(self) -> None:
        if self._file is not None:
            handle, self._file = self._file, None
            try:  # the end of archive, as `tarfile` closes it
                end = self._offset + 2 * tarfile.BLOCKSIZE
                handle.write(bytes(2 * tarfile.BLOCKSIZE + (-end) % tarfile.RECORDSIZE))
            finally:
                handle.close()

    def write(self, document: Document) -> None:
        if self._file is None or self._documents >= self.max_documents or self._bytes >= self.max_bytes:
            self._next_shard()
        meta = json.dumps({"doc_id": document.doc_id, "source": document.source, "title": document.title})
        key = b"%09d" % self._next_key
        for extension, payload in ((b".json", meta.encode()), (b".txt", document.text)):
            padding = (-len(payload)) % tarfile.BLOCKSIZE
            self._file.write(member_header(key + extension, len(payload)))
            self._file.write(payload)
            self._file.write(bytes(padding))
            self._offset += tarfile.BLOCKSIZE + len(payload) + padding
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
