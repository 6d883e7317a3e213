"""`evaluate`: frozen next-byte loss of a checkpoint on external text (Table 9, WikiText-103 style).

The text (one file, or every `*.txt`/`*.md`/`*.text` file under a folder) is read as bytes and
split into documents: each file is one document, or with `--documents wikitext` each article of a
WikiText file (an article starts at a top-level heading line ` = Title = `). Every document is cut
into non-overlapping 1,025-byte windows at offsets 0, 1025, 2050, ...; the tail shorter than a
window, and any document shorter than one, is not scored (their counts are reported). Each window
is scored as in Table 1: a SOMA model routes on the first 256 bytes and averages its top-k experts'
next-byte probabilities (only the k selected experts run), the loss scores the next 768 targets in
nats/byte, and a 95% interval resamples whole documents (`soma_pl.eval.bootstrap`). The module
class comes from the checkpoint's `_class_path` hyperparameter (written by LightningCLI) or from
`--config`, a fit YAML whose `model:` section names it; SOMA checkpoints carry their router.
"""

from __future__ import annotations

import importlib
import inspect
import re
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import numpy as np
import torch
import yaml
from torch import Tensor
from tqdm import tqdm

from soma_pl import ROUTE_BYTES, WINDOW_BYTES
from soma_pl.data.documents import Document
from soma_pl.data.readers import CorpusKind, corpus_files, iter_text
from soma_pl.errors import ConfigError, DataError
from soma_pl.eval.bootstrap import document_bootstrap
from soma_pl.eval.checks import check_counts, check_finite
from soma_pl.eval.ensemble import score_top_k
from soma_pl.io import emit_json
from soma_pl.lit.base import ByteLMModule
from soma_pl.models.checkpoints import load_checkpoint
from soma_pl.models.devices import resolve_device
from soma_pl.models.router import Router

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


def cut_windows(documents: Sequence[Document]) -> tuple[np.ndarray, np.ndarray]:
    """Non-overlapping 1,025-byte windows of every document: ``[n, 1025] uint8`` and ``[n]`` ids."""
    rows, ids = [], []
    for document in documents:
        count = len(document.text) // WINDOW_BYTES
        data = np.frombuffer(document.text, dtype=np.uint8, count=count * WINDOW_BYTES)
        rows.append(data.reshape(count, WINDOW_BYTES))
        ids.extend([document.doc_id] * count)
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


def _model_section(config: Path) -> tuple[str, dict]:
    """`(class_path, init_args)` of a fit YAML's `model:` section (or of a bare class_path YAML)."""
    if not config.is_file():
        raise DataError(f"config not found: {config}")
    try:
        loaded = yaml.safe_load(config.read_text()) or {}
    except yaml.YAMLError as error:
        raise ConfigError(f"unreadable YAML {config}: {str(error).splitlines()[0]}") from error
    section = loaded.get("model", loaded) if isinstance(loaded, dict) else None
    if not isinstance(section, dict) or "class_path" not in section:
        raise ConfigError(f"{config}: no model.class_path")
    return section["class_path"], dict(section.get("init_args") or {})


def _soma_modules() -> dict[str, type[ByteLMModule]]:
    """soma_pl's LightningModules under each class path that names them (`soma_pl.lit.SPSAModule`,
    `soma_pl.lit.spsa.SPSAModule`)."""
    lit = importlib.import_module("soma_pl.lit")
    classes = [value for value in vars(lit).values() if isinstance(value, type) and issubclass(value, ByteLMModule)]
    return {path: cls for cls in classes
            for path in (f"{lit.__name__}.{cls.__name__}", f"{cls.__module__}.{cls.__qualname__}")}


def _module_class(class_path: object, source: Path) -> type[ByteLMModule]:
    """The soma_pl module `class_path` (read from `source`) names. A checkpoint may be crafted: the
    path is looked up among soma_pl's own modules, and nothing it names is ever imported."""
    modules = _soma_modules()
    if not isinstance(class_path, str) or class_path not in modules:
        names = ", ".join(sorted({f"soma_pl.lit.{cls.__name__}" for cls in modules.values()}))
        raise ConfigError(f"{source}: model class {class_path!r} is not one of soma_pl's modules ({names})")
    return modules[class_path]


def load_module(checkpoint: str | Path, config: str | Path | None = None,
                router: str | Path | None = None) -> ByteLMModule:
    """The LightningModule of a checkpoint, in eval mode on the CPU.

    Args:
        checkpoint: a Lightning checkpoint of any soma_pl module.
        config: a fit YAML naming the module (`model.class_path`, `model.init_args`); None: the
            checkpoint's own hyperparameters and `_class_path`.
        router: a `router.pt` replacing (or supplying) a SOMA checkpoint's router.
    """
    from lightning.pytorch.cli import instantiate_module

    path = Path(checkpoint).expanduser()
    payload = load_checkpoint(path)
    state, hparams = payload["state_dict"], dict(payload.get("hyper_parameters") or {})
    if config is not None:
        source = Path(config).expanduser()
        class_path, init_args = _model_section(source)
    elif "_class_path" in hparams:
        source, class_path = path, hparams["_class_path"]
        # A subclass's hyperparameters also hold what it passed to its parent's __init__ (SOMA's
        # `head`): keep what this class accepts, as Lightning's own loading does. The optimizer
        # is left out: evaluation steps none, and building it would import the class it names.
        accepted = inspect.signature(_module_class(class_path, source).__init__).parameters
        init_args = {key: value for key, value in hparams.items()
                     if key in accepted and key not in ("self", "optimizer")}
    else:
        raise ConfigError(f"checkpoint {path} does not name its module class: pass --config with the fit YAML")
    try:
        module = instantiate_module(_module_class(class_path, source), init_args)
    except ConfigError:
        raise
    except Exception as error:  # jsonargparse reports a bad key as one of several types
        raise ConfigError(f"cannot build {class_path} from {config or path}: {str(error).splitlines()[0]}") from error
    module.on_load_checkpoint(payload)
    try:
        module.load_state_dict(state)
    except RuntimeError as error:
        lines = [line.strip() for line in str(error).splitlines() if line.strip()]
        raise ConfigError(f"checkpoint {path} does not fit {class_path}: {lines[-1]}") from error
    _attach_router(module, router)
    return module.eval()


def _attach_router(module: ByteLMModule, router: str | Path | None) -> None:
    """Give an ensemble module the router named on the command line, or its configured `router_path`
    when the checkpoint carries none (the weights are loaded first: a checkpoint's own router
    buffers would otherwise overwrite the replacement)."""
    if not getattr(module, "routed", False):
        if router is not None:
            raise ConfigError(f"--router given, but a {type(module).__name__} has no router")
        return
    path = router or (module.router_path if module.router is None else None)
    if path is not None:
        module.router = Router.load(path)
        module.check_router(f"--router {router}" if router else f"router {path}")


def routed_experts(module: ByteLMModule, windows: Tensor, k: int) -> Tensor:
    """The k experts each window goes to, best first: ``[b, 1025]`` → ``[b, k]``."""
    if getattr(module, "routed", False) and module.router is None:
        raise ConfigError(f"this {type(module).__name__} checkpoint carries no router: pass --router <router.pt>")
    return module.ranking(windows)[:, :k]


@torch.no_grad()
def window_losses(module: ByteLMModule, windows: np.ndarray, k: int, batch_size: int,
                  device: torch.device, progress: bool = False) -> np.ndarray:
    """Scored nats/byte of the top-k average on every window: ``[n, 1025]`` → ``[n]`` float64
    (`progress`: a bar of batches on stderr)."""
    module.to(device)
    losses = []
    parts = torch.from_numpy(np.ascontiguousarray(windows)).split(batch_size)
    for part in tqdm(parts, desc="evaluate", unit="batch", disable=not progress):
        part = part.to(device)
        scores = score_top_k(module.model, routed_experts(module, part, k), part, module.score_from)
        losses.append(scores.loss.double().cpu())
    return torch.cat(losses).numpy()


def evaluate(checkpoint: str, text: str, config: str | None = None, router: str | None = None,
             documents: DocumentSplit = DocumentSplit.file, top_k: int | None = None, batch_size: int = 32,
             max_windows: int | None = None, resamples: int = 1000, device: str = "cpu",
             progress: bool = False) -> dict:
    """Evaluate a checkpoint on a text file or folder; returns the JSON report (see module doc)."""
    check_counts("evaluate", batch_size=batch_size, resamples=resamples, max_windows=max_windows)
    target = resolve_device(device, "--device")
    module = load_module(checkpoint, config, router)
    experts = module.model.num_experts
    k = module.eval_k if top_k is None else top_k
    largest = experts if getattr(module, "routed", False) else 1  # only a routed module averages experts
    if not 1 <= k <= largest:
        raise ConfigError(f"top_k={k}: this {type(module).__name__} averages 1..{largest} experts")
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
        "windows": interval.windows, "window_bytes": WINDOW_BYTES, "window_stride": WINDOW_BYTES,
        "route_bytes": ROUTE_BYTES, "score_from": module.score_from,
        "scored_targets_per_window": WINDOW_BYTES - 1 - module.score_from,
        "loss": interval.mean, "bootstrap_95": [interval.low, interval.high], "resamples": resamples,
        "loss_std": float(losses.std()), "seconds": round(time.perf_counter() - started, 3),
    }


def main(checkpoint: str, text: str, config: str | None = None, router: str | None = None,
         documents: DocumentSplit = DocumentSplit.file, top_k: int | None = None, batch_size: int = 32,
         max_windows: int | None = None, resamples: int = 1000, device: str = "cpu", out: str = "evaluate.json",
         progress: bool = True) -> None:
    """Frozen next-byte loss (nats/byte) of a checkpoint on a text file or folder.

    Args:
        checkpoint: a Lightning checkpoint (.ckpt).
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
    emit_json(evaluate(checkpoint, text, config, router, documents, top_k, batch_size, max_windows, resamples, device,
                       progress), out)
