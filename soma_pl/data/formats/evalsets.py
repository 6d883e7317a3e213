"""Fixed evaluation windows (ensemble validation, test, final test) stored as one `.npz` each.

The arrays are plain numpy (no pickle): `windows: [n, 1025] uint8`, `offsets: [n] int64`, and per
window its document's id and source (unicode arrays) so that bootstrap intervals can resample
documents and results can be broken down by source.
"""

from __future__ import annotations

import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from soma_pl import WINDOW_BYTES
from soma_pl.data.corpus.documents import Document
from soma_pl.errors import DataError


@dataclass
class EvalSet:
    """Fixed windows with their provenance.

    Attributes:
        windows: `[n, 1025] uint8`.
        doc_ids: `[n]` the document each window was cut from.
        sources: `[n]` that document's source.
        offsets: `[n]` the window's byte offset within its document.
    """

    windows: np.ndarray
    doc_ids: np.ndarray
    sources: np.ndarray
    offsets: np.ndarray

    def __len__(self) -> int:
        return len(self.windows)

    @classmethod
    def from_picks(cls, documents: list[Document], picks: list[tuple[int, int]]) -> EvalSet:
        """Cut `(document index, offset)` windows out of `documents`."""
        rows = [np.frombuffer(documents[i].text[o : o + WINDOW_BYTES], dtype=np.uint8) for i, o in picks]
        windows = np.stack(rows) if rows else np.empty((0, WINDOW_BYTES), dtype=np.uint8)
        return cls(
            windows=windows,
            doc_ids=np.array([documents[i].doc_id for i, _ in picks], dtype=np.str_),
            sources=np.array([documents[i].source for i, _ in picks], dtype=np.str_),
            offsets=np.array([o for _, o in picks], dtype=np.int64),
        )

    def select(self, rows: list[int]) -> EvalSet:
        """The windows at `rows`, in that order, with their provenance."""
        return EvalSet(self.windows[rows], self.doc_ids[rows], self.sources[rows], self.offsets[rows])

    def save(self, path: Path) -> None:
        temporary = path.with_name(f".{path.name}.tmp-{os.getpid()}.npz")
        np.savez(temporary, windows=self.windows, doc_ids=self.doc_ids, sources=self.sources, offsets=self.offsets)
        os.replace(temporary, path)

    @classmethod
    def load(cls, path: Path) -> EvalSet:
        """Raises DataError naming the file when it is missing or corrupt."""
        try:
            with np.load(path, allow_pickle=False) as arrays:
                loaded = cls(**{name: arrays[name] for name in ("windows", "doc_ids", "sources", "offsets")})
        except FileNotFoundError as error:
            raise DataError(f"missing evaluation set {path}") from error
        except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as error:
            raise DataError(f"corrupt evaluation set {path}: {error}") from error
        if loaded.windows.ndim != 2 or loaded.windows.shape[1] != WINDOW_BYTES:
            raise DataError(f"{path}: windows of shape {tuple(loaded.windows.shape)}, expected [n, {WINDOW_BYTES}]")
        return loaded
