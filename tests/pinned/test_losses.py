"""Pinned losses: every method, a few updates on the pinned corpus, its logged losses to a tolerance.

Each run (`tests.pinned.runs`: SPSA, SOMA N = 2, EGGROLL, DDPP, BPTT N = 1 and N = 2) sets every
estimator, optimizer and model setting itself, starts from `torch.manual_seed(0)`, trains on one CPU
thread for 6 updates with a validation after updates 3 and 6, and is compared with the numbers
below: `train/loss` of every update, and `val/loss` and each `expert/<e>/val_loss` of both
validations. DDPP runs on one process and, behind the `slow` marker, on two (gloo). A change to the
training arithmetic moves them; a refactor that changes none leaves them passing. Each run's final
`val/loss` is also at least `LEARNED` below that of its untrained model (measured here), so the pins
are of models that learned something.

The numbers were printed by `python -m tests.pinned.runs` on a clean checkout of commit
d58aca7d242665ea92de6c84d074df109627765d (torch 2.13.0+cpu, lightning 2.6.6, x86-64 CPU). Two runs in
fresh processes agreed to the last bit; running the LSTM layers with the PyTorch reference loop
instead of the library and native kernels (`SOMA_PL_LSTM_KERNEL=python`) moved them by at most
1.1e-6 relative, and two threads instead of one not at all, so `TOLERANCE` (1e-5 relative) leaves
room for another CPU's rounding and none for a change of the arithmetic (a 1% larger EGGROLL step
fails it).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.pinned.runs import RUNS, fit, fit_on_processes, one_thread, untrained_val_loss

TOLERANCE = 1e-5
"""Relative tolerance of every pinned loss."""
LEARNED = 0.05
"""Nats/byte the final `val/loss` must lie below the untrained model's (the least measured: 0.072, DDPP)."""


@dataclass(frozen=True)
class Pinned:
    """One run's logged losses."""

    train: list[float]
    """`train/loss` after each update."""
    val: list[dict[str, float]]
    """`val/loss` and `expert/<e>/val_loss` at each validation."""


PINNED = {
    "spsa": Pinned(
        train=[5.5556469, 5.5425606, 5.5186276, 5.5158834, 5.5024400, 5.4552107],
        val=[{"expert/0/val_loss": 5.5115652, "val/loss": 5.5115399},
             {"expert/0/val_loss": 5.3991828, "val/loss": 5.4025774}]),
    "soma_n2": Pinned(
        train=[5.5524988, 5.5320253, 5.5097599, 5.4717941, 5.4107361, 5.3506994],
        val=[{"expert/0/val_loss": 5.4626474, "expert/1/val_loss": 5.4729414, "val/loss": 5.4693813},
             {"expert/0/val_loss": 5.2288785, "expert/1/val_loss": 5.2531838, "val/loss": 5.2350574}]),
    "eggroll": Pinned(
        train=[5.5557508, 5.5475035, 5.5338125, 5.5140085, 5.4971800, 5.4789486],
        val=[{"expert/0/val_loss": 5.5090113, "val/loss": 5.5090990},
             {"expert/0/val_loss": 5.4611664, "val/loss": 5.4657173}]),
    "ddpp": Pinned(
        train=[5.5530114, 5.5350885, 5.5365987, 5.5197525, 5.5147009, 5.4985218],
        val=[{"expert/0/val_loss": 5.5235491, "val/loss": 5.5280704},
             {"expert/0/val_loss": 5.4752789, "val/loss": 5.4768548}]),
    "bptt_n1": Pinned(
        train=[5.5551605, 5.5967236, 5.4078960, 5.1947532, 4.9860873, 4.6569986],
        val=[{"expert/0/val_loss": 5.2168651, "val/loss": 5.2268310},
             {"expert/0/val_loss": 4.2971044, "val/loss": 4.3081412}]),
    "bptt_n2": Pinned(
        train=[5.5527396, 5.5185714, 5.4515219, 5.3384256, 5.1431565, 4.8329849],
        val=[{"expert/0/val_loss": 5.2998209, "expert/1/val_loss": 5.3614950, "val/loss": 5.3299112},
             {"expert/0/val_loss": 4.2682600, "expert/1/val_loss": 4.5049319, "val/loss": 4.3902249}]),
}


@pytest.fixture(autouse=True)
def single_thread():
    """One torch thread, as the numbers were made; the count before is restored afterwards."""
    before = one_thread()
    yield
    torch.set_num_threads(before)


def _check(name: str, logged: dict, folder) -> None:
    pinned = PINNED[name]
    assert logged["train"] == pytest.approx(pinned.train, rel=TOLERANCE, abs=0)
    assert len(logged["val"]) == len(pinned.val)
    for got, expected in zip(logged["val"], pinned.val, strict=True):
        assert got == pytest.approx(expected, rel=TOLERANCE, abs=0)
    assert logged["val"][-1]["val/loss"] < untrained_val_loss(name, folder) - LEARNED


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_of_a_few_updates_on_one_process_are_the_pinned_ones(name, tmp_path):
    """DDPP too: on one process it evaluates every direction itself, and its training losses are those
    of two processes bit for bit (its validation losses sum the same windows in another order)."""
    _check(name, fit(name, tmp_path), tmp_path)


@pytest.mark.slow
def test_ddpp_losses_on_two_processes_are_the_pinned_ones(tmp_path):
    assert RUNS["ddpp"].processes == 2
    _check("ddpp", fit_on_processes("ddpp", tmp_path), tmp_path)


def test_every_method_has_a_pinned_run():
    assert set(PINNED) == set(RUNS) == {"spsa", "soma_n2", "eggroll", "ddpp", "bptt_n1", "bptt_n2"}
