"""Tiny checkpoints and prepared-data folders for the analysis tools."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch

from soma_pl import WINDOW_BYTES
from soma_pl.data.formats.evalsets import EvalSet
from soma_pl.data.formats.manifest import FORMAT_VERSION, MANIFEST
from soma_pl.data.formats.tar_shards import sha256_file
from soma_pl.models.router import HashedNgramEncoder, Router
from soma_pl.models.stacked import StackedExperts

TINY = {"width": 6, "embed_dim": 4, "num_layers": 1}


def tiny_experts(experts: int, seed: int = 0) -> StackedExperts:
    """Random experts with confident, distinct heads (so averaging and routing matter)."""
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = StackedExperts(experts, time_chunk=128, **TINY)
        with torch.no_grad():
            model.head.mul_(100)
    return model.requires_grad_(False)


def save_checkpoint(path: Path, model: StackedExperts, router: Router | None) -> Path:
    """A minimal Lightning-style checkpoint: `model.*` weights and, like ZOModule, router bytes."""
    checkpoint = {"state_dict": {f"model.{k}": v for k, v in model.state_dict().items()}}
    if router is not None:
        buffer = io.BytesIO()
        router.save_to(buffer)
        checkpoint["router"] = buffer.getvalue()
    torch.save(checkpoint, path)
    return path


def random_router(experts: int, seed: int = 0) -> Router:
    generator = torch.Generator().manual_seed(seed)
    return Router(HashedNgramEncoder(dim=32), torch.randn(experts, 32, generator=generator))


@pytest.fixture(autouse=True)
def one_thread():
    """These tensors are tiny: one thread avoids the OpenMP spin-waits that make an oversubscribed
    machine run them orders of magnitude slower (measured 0.6 s vs 51 s for one forward pass)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def prepared(tmp_path) -> Path:
    """A prepared-dataset folder of 6 ensemble-validation windows from 3 documents (`write_manifest`)."""
    rng = np.random.default_rng(0)
    windows = rng.integers(0, 256, (6, WINDOW_BYTES), dtype=np.uint8)
    folder = tmp_path / "prepared"
    folder.mkdir()
    EvalSet(windows, np.array(["a", "a", "b", "b", "c", "c"]), np.array(["x"] * 6),
            np.zeros(6, dtype=np.int64)).save(folder / "ensemble_val.npz")
    write_manifest(folder)
    return folder


def write_manifest(folder: Path) -> None:
    """The manifest of a prepared folder holding only its ensemble_val.npz (named with its sha256):
    no training shards, test windows stated but not written."""
    entry = {"file": "ensemble_val.npz", "sha256": sha256_file(folder / "ensemble_val.npz")}
    (folder / MANIFEST).write_text(json.dumps({"format": FORMAT_VERSION, "fingerprint": "analysis-tests",
                                               "train": {"shards": []}, "ensemble_val": entry,
                                               "test": {"file": "test.npz", "sha256": "not written"}}))
