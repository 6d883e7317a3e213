"""Checkpoints of tiny SPSA and SOMA fits (tests/lit/tiny_*.yaml through the real CLI), made once per
test session and shared by the generate and export tests; and module checkpoints of the other methods."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path

import lightning
import torch

from soma_pl.cli import main
from soma_pl.data.sharding.config import ShardConfig
from soma_pl.data.sharding.shard import shard
from soma_pl.lit import BPTTModule, EGGROLLArgs, ModelShape, ZOModule
from soma_pl.models.router import HashedNgramEncoder, Router
from tests.data.corpora import WORDS
from tests.robustness.cli import tiny_dataset

LIT = Path(__file__).resolve().parent / "lit"
SHARPEN = 30.0
"""The head is scaled by this in the checkpoints tests read: a tiny model's initial head (std 0.02) gives
near-uniform next-byte distributions; a sharp head makes the experts' distributions differ from each other
and from byte to byte, so that a comparison can fail."""
WIDTH = 12
"""The body is wider than the head (8), so the model has projections: with d_t = d_E the tied head scores
the current byte's own embedding highest, and greedy decoding repeats one byte whatever the context."""
SHAPE = ModelShape(width=WIDTH, num_layers=1, embed_dim=8)
PROMPT = " ".join(f"{WORDS[i % len(WORDS)]}{(7 * i) % 100}" for i in range(40)).encode()
"""A prompt of the tiny corpus's words, longer than the 256 bytes the router reads."""


@dataclass(frozen=True)
class TinyCheckpoints:
    """Where the fits left their files."""

    spsa: Path
    """A monolithic SPSA checkpoint, its head sharpened."""
    soma: Path
    """A SOMA checkpoint of 2 experts (top_k 2) carrying its router, its heads sharpened."""
    router: Path
    """The sharding's router.pt (the one the SOMA checkpoint carries)."""


def sharpened(checkpoint: Path, target: Path) -> Path:
    """A copy of a Lightning checkpoint whose `model.head` is scaled by `SHARPEN`."""
    payload = torch.load(checkpoint, map_location="cpu", weights_only=False)
    payload["state_dict"]["model.head"] = payload["state_dict"]["model.head"] * SHARPEN
    torch.save(payload, target)
    return target


@functools.cache
def tiny_checkpoints(root: Path) -> TinyCheckpoints:
    """Fit tiny SPSA and SOMA models under `root` (once per session and root)."""
    root.mkdir(parents=True, exist_ok=True)
    corpus, data = tiny_dataset(root)
    experts = shard(ShardConfig(prepared=str(data), num_experts=2, output_dir=str(root / "experts"),
                                shard_max_bytes=40000), progress=False)
    common = [f"--data.init_args.dataset.corpus.paths=[{corpus}]", f"--data.init_args.dataset.output_dir={data}",
              f"--model.init_args.shape.width={WIDTH}", "--trainer.logger=false"]
    # seed 4: a model whose greedy continuation of PROMPT varies (about half of the tiny models repeat one byte)
    main(["fit", "--config", str(LIT / "tiny_spsa.yaml"), *common, "--model.init_args.seed=4",
          f"--trainer.default_root_dir={root / 'spsa'}"])
    main(["fit", "--config", str(LIT / "tiny_soma.yaml"), *common, f"--data.init_args.experts_dir={experts}",
          f"--trainer.default_root_dir={root / 'soma'}"])
    return TinyCheckpoints(sharpened(root / "spsa" / "checkpoints" / "last.ckpt", root / "spsa.ckpt"),
                           sharpened(root / "soma" / "checkpoints" / "last.ckpt", root / "soma.ckpt"),
                           experts / "router.pt")


def module_checkpoint(module: lightning.LightningModule, path: Path, sharpen: bool = True) -> Path:
    """A checkpoint of `module` laid out as LightningCLI writes one (`sharpen`: its head sharpened first)."""
    if sharpen:
        with torch.no_grad():
            module.model.head.mul_(SHARPEN)
    checkpoint = {"state_dict": module.state_dict(), "pytorch-lightning_version": lightning.__version__,
                  "hyper_parameters": {**dict(module.hparams), "_class_path": f"soma_pl.lit.{type(module).__name__}"}}
    module.on_save_checkpoint(checkpoint)
    torch.save(checkpoint, path)
    return path


def _with_router(module: lightning.LightningModule) -> lightning.LightningModule:
    """`module` with a router of its own (hashed encoder, random centroids), as a fit's checkpoint carries."""
    centroids = torch.randn(module.model.num_experts, 16, generator=torch.Generator().manual_seed(0))
    module.routing.router = Router(HashedNgramEncoder(dim=16), centroids)
    return module


OTHER_METHODS = {
    "eggroll": lambda: ZOModule(shape=SHAPE, eggroll=EGGROLLArgs(rank=2, population=24, group_size=6),
                                head_training="trainable"),
    "ddpp": lambda: ZOModule(shape=SHAPE, spsa={"exchange": "scalars"}),
    "bptt": lambda: BPTTModule(shape=SHAPE),
    "bptt_n3": lambda: _with_router(BPTTModule(num_experts=3, shape=SHAPE, top_k=2)),
    "soma_shared_head": lambda: _with_router(ZOModule(num_experts=3, shape=SHAPE, init="random", top_k=2,
                                                        head_training="frozen_random")),
}
"""Untrained modules of the methods the fits above leave out (their weights load as a fit's do), a BPTT
ensemble of 3 experts, and a SOMA ensemble whose experts share one head."""
ROUTED = {"bptt_n3", "soma_shared_head"}
"""Which of `OTHER_METHODS` are routed ensembles (top_k 2)."""
