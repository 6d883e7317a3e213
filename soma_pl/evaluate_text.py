"""`evaluate`: frozen next-byte loss of a checkpoint on external text (Table 9, WikiText-103 style).

The text (one file, or every `*.txt`/`*.md`/`*.text` file under a folder) is read as bytes and
split into documents: each file is one document, or with `--documents wikitext` each article of a
WikiText file (an article starts at a top-level heading line ` = Title = `). Every document is cut
into 1,025-byte windows advancing 768 bytes (offsets 0, 768, 1536, ...: App. L.1's WikiText-103
protocol), so that the windows' scored targets, bytes 257 to 1,024 of each, follow one another and
every byte of a document after its first 256 is scored once; the incomplete last window is dropped,
and a document shorter than one window is not scored (their counts are reported). Each window
is scored as in Table 1: a SOMA model routes on the first 256 bytes and averages its top-k experts'
next-byte probabilities (only the k selected experts run), the loss scores the next 768 targets in
nats/byte, and a 95% interval resamples whole documents (`soma_pl.eval.bootstrap`). The module
class comes from the checkpoint's `_class_path` hyperparameter (written by LightningCLI) or from
`--config`, a fit YAML whose `model:` section names it; SOMA checkpoints carry their router. A folder
`export` wrote is scored as it is (it carries its settings and router).
"""

from __future__ import annotations

import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.data.corpus.documents import Document
from soma_pl.data.corpus.readers import CorpusKind, corpus_files, iter_text
from soma_pl.errors import DataError
from soma_pl.eval.bootstrap import RESAMPLES, document_bootstrap
from soma_pl.eval.checks import check_counts, check_finite
from soma_pl.eval.ensemble import score_top_k
from soma_pl.io import check_apart, emit_json
from soma_pl.models.devices import resolve_device

WIKITEXT_TITLE = re.compile(rb"^ ?= [^=\n][^\n]*[^=\n] = ?\r?$", re.MULTILINE)
"""A WikiText top-level heading line (` = Title = `); ` = = Section = = ` lines do not match."""


class DocumentSplit(str, Enum):
    """What one bootstrap document is."""

    file = "file"
    """Each file is one document."""
    wikitext = "wikitext"
    """Each WikiText article (from one top-level heading to the next) is one document."""


@dataclass
class ExternalWindows:
    """Windows cut from external text.

    Attributes:
        windows: ``[n, 1025] uint8``.
        doc_ids: ``[n]`` the document each window comes from.
        documents: documents read; short_documents: those shorter than one window.
        files: files read; bytes: bytes read.
    """

    windows: np.ndarray
    doc_ids: np.ndarray
    documents: int
    short_documents: int
    files: int
    bytes: int


def split_documents(document: Document, split: DocumentSplit) -> list[Document]:
    """One file's document, or its WikiText articles (text before the first heading is its own).

    Document ids are the file's path (plus ``#<byte offset>`` for an article): file names alone
    repeat across folders.
    """
    if split is DocumentSplit.file:
        return [Document(document.text, document.source, document.source)]
    starts = sorted({0, *(match.start() for match in WIKITEXT_TITLE.finditer(document.text))})
    bounds = zip(starts, [*starts[1:], len(document.text)], strict=False)
    return [Document(document.text[a:b], document.source, f"{document.source}#{a}") for a, b in bounds if b > a]


WINDOW_STRIDE = WINDOW_BYTES - 1 - ROUTE_BYTES
"""768: how far each window starts after the one before, its scored targets' count (App. L.1)."""


def cut_windows(documents: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
    """1,025-byte windows of every document advancing 768 bytes: ``[n, 1025] uint8`` and ``[n]`` ids."""
    rows, ids = [], []
    for document in documents:
        data = np.frombuffer(document.text, dtype=np.uint8)
        if len(data) < WINDOW_BYTES:
            continue
        windows = np.lib.stride_tricks.sliding_window_view(data, WINDOW_BYTES)[::WINDOW_STRIDE]
        rows.append(windows)
        ids.extend([document.doc_id] * len(windows))
    windows = np.concatenate(rows) if rows else np.empty((0, WINDOW_BYTES), dtype=np.uint8)
    return windows, np.array(ids, dtype=np.str_)


def read_windows(path: str | Path, split: DocumentSplit = DocumentSplit.file,
                 max_windows: int | None = None) -> ExternalWindows:
    """Read a text file or folder and cut it into evaluation windows.

    Raises:
        DataError: the path is missing, holds no text file, is empty, not UTF-8, or has no
            document of at least 1,025 bytes.
    """
    if not Path(path).expanduser().exists():
        raise DataError(f"text not found: {path}")
    files = corpus_files(CorpusKind.text, [path])
    documents = [part for document in iter_text(files) for part in split_documents(document, DocumentSplit(split))]
    total = sum(len(document.text) for document in documents)
    if not total:
        raise DataError(f"empty text: {path} ({len(files)} file(s), 0 bytes)")
    windows, doc_ids = cut_windows(documents)
    if not len(windows):
        raise DataError(f"no document under {path} has the {WINDOW_BYTES} bytes of one window")
    if max_windows is not None:
        windows, doc_ids = windows[:max_windows], doc_ids[:max_windows]
    short = sum(len(document.text) < WINDOW_BYTES for document in documents)
    return ExternalWindows(windows, doc_ids, len(documents), short, len(files), total)


@torch.no_grad()
def window_losses(module: torch.nn.Module, windows: np.ndarray, k: int, batch_size: int,
                  device: torch.device, progress: bool = False) -> np.ndarray:
    """Scored nats/byte of the top-k average on every window: ``[n, 1025]`` → ``[n]`` float64
    (`module`: what `load_source` gives, a checkpoint's module or an exported model; `progress`: a
    bar of batches on stderr)."""
    from soma_pl.lit.loading import routed_experts

    module.to(device)
    losses = []
    parts = torch.from_numpy(np.ascontiguousarray(windows)).split(batch_size)
    for part in tqdm(parts, desc="evaluate", unit="batch", disable=not progress):
        part = part.to(device)
        scores = score_top_k(module.model, routed_experts(module, part, k), part, module.score_from)
        losses.append(scores.loss.cpu())  # float64 already (the mixture's precision)
    return torch.cat(losses).numpy()


def evaluate(checkpoint: str, text: str, config: str | None = None, router: str | None = None,
             documents: DocumentSplit = DocumentSplit.file, top_k: int | None = None, batch_size: int = 32,
             max_windows: int | None = None, resamples: int = RESAMPLES, device: str = "cpu",
             progress: bool = False) -> dict:
    """Evaluate a checkpoint on a text file or folder; returns the JSON report (see module doc)."""
    check_counts("evaluate", batch_size=batch_size, resamples=resamples, max_windows=max_windows)
    target = resolve_device(device, "--device")
    from soma_pl.lit.loading import ensemble_size, load_source

    module = load_source(checkpoint, config, router)
    experts = module.model.num_experts
    k = ensemble_size(module, top_k)
    data = read_windows(text, documents, max_windows)
    started = time.perf_counter()
    losses = window_losses(module, data.windows, k, batch_size, target, progress)
    check_finite("the window losses", losses, f"checkpoint {checkpoint}")
    interval = document_bootstrap(losses, data.doc_ids, resamples=resamples)
    if interval.documents < 2:
        warnings.warn(f"{text}: all windows come from one document, so the document-bootstrap interval has "
                      "zero width; pass a folder of files or --documents wikitext", stacklevel=2)
    return {
        "evaluation": "external", "checkpoint": str(checkpoint), "module": type(module).__name__,
        "experts": experts, "k": k, "text": str(text), "document_split": DocumentSplit(documents).value,
        "files": data.files, "bytes": data.bytes, "documents": data.documents,
        "short_documents": data.short_documents, "documents_scored": interval.documents,
        "windows": interval.windows, "window_bytes": WINDOW_BYTES, "window_stride": WINDOW_STRIDE,
        "route_bytes": ROUTE_BYTES, "score_from": module.score_from,
        "scored_targets_per_window": WINDOW_BYTES - 1 - module.score_from,
        "loss": interval.mean, "bootstrap_95": [interval.low, interval.high], "resamples": resamples,
        "loss_std": float(losses.std()), "seconds": round(time.perf_counter() - started, 3),
        # per window, so that two checkpoints on one text can be compared by a paired document bootstrap
        "window_index": list(range(len(losses))), "window_losses": losses.tolist(),
        "doc_ids": np.asarray(data.doc_ids).tolist(),
    }


def main(checkpoint: str, text: str, config: str | None = None, router: str | None = None,
         documents: DocumentSplit = DocumentSplit.file, top_k: int | None = None, batch_size: int = 32,
         max_windows: int | None = None, resamples: int = RESAMPLES, device: str = "cpu", out: str = "evaluate.json",
         progress: bool = True) -> None:
    """Frozen next-byte loss (nats/byte) of a checkpoint on a text file or folder.

    Args:
        checkpoint: a Lightning checkpoint (.ckpt), or a folder `export` wrote.
        text: a text file, or a folder of *.txt/*.md/*.text.
        config: the fit YAML naming the module; None: the checkpoint's own hyperparameters.
        router: router.pt for a SOMA checkpoint.
        documents: the bootstrap unit: each file, or each WikiText article.
        top_k: experts averaged; None: the module's own.
        batch_size: windows per forward.
        max_windows: score only the first windows; None: all of them.
        resamples: document-bootstrap resamples.
        device: cpu, cuda, cuda:1, ...
        out: where to write the JSON.
        progress: show a progress bar on stderr.
    """
    check_apart(out, "--out", [checkpoint, text, config, router])
    emit_json(evaluate(checkpoint, text, config, router, documents, top_k, batch_size, max_windows, resamples, device,
                       progress), out)
