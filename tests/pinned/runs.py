"""The pinned runs: each method's module with every setting written out, fitted for a few updates on
the pinned corpus (`tests.pinned.data`) by a plain `lightning.Trainer` on one CPU thread, and what it
logged: `train/loss` after every update, `val/loss` and each `expert/<e>/val_loss` at every validation.

`python -m tests.pinned.runs [name ...]` prints every run's (or the named ones') figures as JSON: what
the pinned numbers in `test_losses.py` were copied from. DDPP runs on two processes
(`tests.pinned.ddpp`).
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import lightning as L
import torch

from soma_pl.estimators.directions import DirectionKind
from soma_pl.estimators.eggroll import FitnessShaping, StepConvention
from soma_pl.lit import (
    BPTTModule,
    EGGROLLArgs,
    EpsSchedule,
    Exchange,
    HeadTraining,
    Init,
    ModelShape,
    PlateauConfig,
    SPSAArgs,
    ZOModule,
)
from soma_pl.lit.optim import ZOAdam
from tests.pinned.data import PinnedData, pinned_router

REPO = Path(__file__).resolve().parents[2]
STEPS = 6
"""Updates per run; validation after update 3 and update 6."""
VALIDATE_EVERY = 3
SHAPE = ModelShape(width=12, num_layers=1, embed_dim=8, time_chunk=16)
"""d_t ≠ d_E: the input and output projections are trained too."""
PLATEAU = PlateauConfig(factor=0.5, patience_updates=VALIDATE_EVERY, min_lr=0.0)
COMMON = {"shape": SHAPE, "plateau": PLATEAU, "train_context": 64, "score_from": 256}
# ε = 0.05: Adam moves every coordinate by about lr whatever the estimate's size, so a loss difference's
# float32 rounding (divided by 2ε) reaches the weights; at ε = 0.01 the reference loop and the native
# kernel parted by 1e-4 after three updates, at 0.05 by under 4e-7.
SPSA = SPSAArgs(eps=0.05, n_pert=8, micro_batch=2, direction=DirectionKind.sparse, loss_grouping=1,
                max_rows=None, eps_schedule=EpsSchedule.proportional)
ADAM = functools.partial(torch.optim.Adam, lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, amsgrad=False)
ZO_ADAM = functools.partial(ZOAdam, lr=0.02, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-4)
"""The paper's zero-order update (Eq. 8, App. E): Adam moments with coupled weight decay."""


def sgd(lr: float, momentum: float) -> Callable:
    """The optimizer factory of SGD at `lr` and `momentum`, every other setting written out."""
    return functools.partial(torch.optim.SGD, lr=lr, momentum=momentum, dampening=0.0, weight_decay=0.0,
                             nesterov=False)


@dataclass(frozen=True)
class Run:
    """One pinned run: its module (built after `torch.manual_seed(0)`) and its data."""

    experts: int
    """E: experts of the module, expert streams of the data."""
    batch_size: int
    """B: training windows per expert per update."""
    module: Callable[[str | None], L.LightningModule]
    """The module, given the path of a two-expert router (None for one expert)."""
    processes: int = 1
    """CPU processes the run is fitted on (DDP strategy when more than one)."""


def spsa(router: str | None) -> ZOModule:
    """The paper's wide control: sparse probes, Adam, the head by the decoder-path delta rule."""
    return ZOModule(num_experts=1, spsa=SPSA, head_training=HeadTraining.decoder_only, init=Init.random,
                    seed_checkpoint=None, optimizer=ZO_ADAM, seed=3, **COMMON)


def soma_n2(router: str | None) -> ZOModule:
    spsa = SPSAArgs(eps=0.05, n_pert=8, micro_batch=2, direction=DirectionKind.sparse, loss_grouping=1,
                    max_rows=16, eps_schedule=EpsSchedule.proportional)  # 2 directions per loss call
    return ZOModule(num_experts=2, init=Init.random, seed_checkpoint=None, head_training=HeadTraining.decoder_only,
                    router_path=router, top_k=1, spsa=spsa, optimizer=ZO_ADAM, seed=3, **COMMON)


def eggroll(router: str | None) -> ZOModule:
    settings = EGGROLLArgs(sigma=0.02, rank=2, population=32, group_size=8, fitness=FitnessShaping.group,
                           max_members=16, step_convention=StepConvention.reference, step_sigma=None,
                           sigma_schedule=EpsSchedule.constant)
    return ZOModule(num_experts=1, eggroll=settings, optimizer=sgd(1.0, 0.0), seed=3, init=Init.random,
                    seed_checkpoint=None, head_training=HeadTraining.trainable, **COMMON)


def ddpp(router: str | None) -> ZOModule:
    spsa = SPSAArgs(eps=0.01, n_pert=3, micro_batch=2, direction=DirectionKind.sparse, loss_grouping=1,
                    max_rows=None, eps_schedule=EpsSchedule.proportional,
                    exchange=Exchange.scalars)  # 9 directions: 5 on rank 0, 4 on rank 1
    return ZOModule(num_experts=1, spsa=spsa, optimizer=ZO_ADAM, seed=3, init=Init.random,
                    seed_checkpoint=None, head_training=HeadTraining.decoder_only, **COMMON)


def bptt_n1(router: str | None) -> BPTTModule:
    return BPTTModule(num_experts=1, optimizer=ADAM, router_path=None, top_k=1, **COMMON)


def bptt_n2(router: str | None) -> BPTTModule:
    """SGD, not Adam: a change of scale of the experts' gradients moves SGD's step, never Adam's."""
    return BPTTModule(num_experts=2, optimizer=sgd(0.1, 0.9), router_path=router, top_k=1,
                      **COMMON)


RUNS = {
    "spsa": Run(1, 4, spsa),
    "soma_n2": Run(2, 4, soma_n2),
    "eggroll": Run(1, 4, eggroll),  # population 32 in groups of 8: 4 windows
    "ddpp": Run(1, 6, ddpp, processes=2),
    "bptt_n1": Run(1, 4, bptt_n1),
    "bptt_n2": Run(2, 4, bptt_n2),
}


class RecordLosses(L.Callback):
    """`train/loss` after every update; `val/loss` and each `expert/<e>/val_loss` after every validation."""

    def __init__(self) -> None:
        self.train: list[float] = []
        self.val: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.train.append(trainer.callback_metrics["train/loss"].item())

    def on_validation_end(self, trainer, pl_module) -> None:
        metrics = trainer.callback_metrics
        self.val.append({name: metrics[name].item() for name in sorted(metrics)
                         if name == "val/loss" or name.endswith("/val_loss")})


def trainer(callbacks: list[L.Callback], processes: int = 1) -> L.Trainer:
    """A plain Trainer: `STEPS` updates, a validation every `VALIDATE_EVERY`, nothing written."""
    distributed = {"devices": processes, "strategy": "ddp"} if processes > 1 else {"devices": 1}
    return L.Trainer(accelerator="cpu", precision="32-true", max_steps=STEPS, val_check_interval=VALIDATE_EVERY,
                     check_val_every_n_epoch=None, num_sanity_val_steps=0, log_every_n_steps=1, logger=False,
                     enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                     callbacks=callbacks, **distributed)


def build(name: str, folder: Path) -> tuple[L.LightningModule, PinnedData]:
    """Run `name`'s module, seeded, and its data (a router written into `folder` for two experts)."""
    run = RUNS[name]
    router = pinned_router(folder) if run.experts == 2 else None
    torch.manual_seed(0)
    return run.module(router), PinnedData(run.experts, run.batch_size, STEPS)


def fit(name: str, folder: Path) -> dict:
    """Fit run `name` in this process (one process only): `{"train": [...], "val": [...]}`."""
    module, data = build(name, folder)
    record = RecordLosses()
    trainer([record]).fit(module, data)
    return {"train": record.train, "val": record.val}


def untrained_val_loss(name: str, folder: Path) -> float:
    """`val/loss` of run `name`'s module as it starts (the same seed), never trained."""
    module, data = build(name, folder)
    return trainer([]).validate(module, data, verbose=False)[0]["val/loss"]


def fit_on_processes(name: str, folder: Path, timeout: float = 300) -> dict:
    """Fit run `name` on its `processes` CPU processes (`tests.pinned.ddpp`): rank 0's record."""
    out = Path(folder) / "record.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_PORT", "MASTER_ADDR", "LOCAL_RANK", "RANK")}
    result = subprocess.run([sys.executable, "-m", "tests.pinned.ddpp", name, str(folder), str(out)], cwd=REPO,
                            env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def one_thread() -> int:
    """Run torch on one thread (GEMM results do not depend on a thread count); the count before."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    return before


if __name__ == "__main__":
    one_thread()
    figures = {}
    for name in sys.argv[1:] or RUNS:
        with tempfile.TemporaryDirectory() as folder:
            run = fit_on_processes if RUNS[name].processes > 1 else fit
            figures[name] = {**run(name, Path(folder)), "untrained_val_loss": untrained_val_loss(name, Path(folder))}
    print(json.dumps(figures, indent=1))
