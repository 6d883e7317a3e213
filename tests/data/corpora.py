"""Small generated corpora whose every window names the document it came from."""

from __future__ import annotations

import io
import json
import random
import re
import tarfile
from pathlib import Path

WORDS = "river stone maple quartz lantern harbor cedar violet ember meadow falcon copper tundra orchid".split()
MARKER = re.compile(rb"<([a-z]+):(\d{5})>")


def synthetic_text(source: str, number: int, words: int, rng: random.Random,
                   vocabulary: list[str] | None = None) -> str:
    """A document whose marker `<source:number>` recurs every ~10 words, so any window names it."""
    parts = []
    for i in range(words):
        if i % 10 == 0:
            parts.append(f"<{source}:{number:05d}>")
        parts.append(f"{rng.choice(vocabulary or WORDS)}{rng.randint(0, 99)}")
    return " ".join(parts)


def window_owners(window: bytes) -> set[tuple[str, int]]:
    """The (source, number) of every document a window reads, off its markers (a window cut from
    documents joined end to end may span two)."""
    return {(m.group(1).decode(), int(m.group(2))) for m in MARKER.finditer(window)}


def write_jsonl_corpus(folder: Path, sources: dict[str, int], seed: int = 0, min_words: int = 60,
                       max_words: int = 900, vocabularies: dict[str, list[str]] | None = None) -> dict[str, str]:
    """One JSONL file per source with `sources[name]` documents; returns marker key -> text.

    `vocabularies` gives a source its own word list (default: the shared `WORDS`).
    """
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    texts = {}
    for source, count in sources.items():
        with open(folder / f"{source}.jsonl", "w") as handle:
            for number in range(count):
                vocabulary = (vocabularies or {}).get(source)
                text = synthetic_text(source, number, rng.randint(min_words, max_words), rng, vocabulary)
                texts[f"{source}:{number:05d}"] = text
                handle.write(json.dumps({"text": text, "id": number}) + "\n")
    return texts


def npm_tarball(records: dict[str, object]) -> bytes:
    """An npm package tarball: each name holds its record as JSON, or a readme where the record is None."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, record in records.items():
            data = b"# readme" if record is None else json.dumps(record).encode("utf-8")
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()
