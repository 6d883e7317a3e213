"""The unit every corpus reader yields: one document as UTF-8 bytes with its provenance."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Document:
    """One document of a corpus.

    Attributes:
        text: the document's UTF-8 bytes; the vocabulary is the 256 byte values.
        source: where it came from: a demo source name ("wikipedia", "sotu", "python_docs") or the
            file it was read from.
        doc_id: an identifier unique and stable within the corpus (same corpus, same ids).
        title: a human-readable title when the source has one.
    """

    text: bytes
    source: str
    doc_id: str
    title: str = ""
