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
88c8372efaf9813ea4ff71756726344fa520d44c (torch 2.13.0+cpu, lightning 2.6.6, x86-64 CPU). Two runs in
fresh processes agreed to the last bit; running the LSTM sublayers with the PyTorch reference loop
instead of the library and native kernels (`SOMA_PL_LSTM_KERNEL=python`) moved them by at most
1.9e-6 relative, so `TOLERANCE` (1e-5 relative) leaves room for another CPU's rounding and none for
a change of the arithmetic. The zero-order runs perturb by ε = 0.05: Adam steps every coordinate by
about lr, so a loss difference's rounding, divided by 2ε, reaches the weights (at ε = 0.01 the two
kernels parted by 1e-4).
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.pinned.runs import RUNS, fit, fit_on_processes, one_thread, untrained_val_loss

TOLERANCE = 1e-5
"""Relative tolerance of every pinned loss."""
LEARNED = 0.05
"""Nats/byte the final `val/loss` must lie below the untrained model's (the least measured: 0.148, EGGROLL)."""


@dataclass(frozen=True)
class Pinned:
    """One run's logged losses."""

    train: list[float]
    """`train/loss` after each update."""
    val: list[dict[str, float]]
    """`val/loss` and `expert/<e>/val_loss` at each validation."""


PINNED = {
    "spsa": Pinned(
        train=[5.5617943, 5.4925342, 5.2511673, 5.0184155, 4.7477679, 4.4659600],
        val=[{"expert/0/val_loss": 4.9782534, "val/loss": 4.9830823},
             {"expert/0/val_loss": 4.1328993, "val/loss": 4.1402812}]),
    "soma_n2": Pinned(
        train=[5.5494008, 5.5279846, 5.4640417, 5.3717675, 5.2446632, 5.1225977],
        val=[{"expert/0/val_loss": 5.3616405, "expert/1/val_loss": 5.3402405, "val/loss": 5.3529654},
             {"expert/0/val_loss": 4.9285197, "expert/1/val_loss": 4.7253232, "val/loss": 4.8213720}]),
    "eggroll": Pinned(
        train=[5.5611763, 5.5556121, 5.5377665, 5.4930563, 5.4794750, 5.4342651],
        val=[{"expert/0/val_loss": 5.4681273, "val/loss": 5.4724083},
             {"expert/0/val_loss": 5.4078302, "val/loss": 5.4110441}]),
    "ddpp": Pinned(
        train=[5.5628037, 5.4503088, 5.2329440, 4.9328833, 4.6129918, 4.2894430],
        val=[{"expert/0/val_loss": 4.9429731, "val/loss": 4.9455423},
             {"expert/0/val_loss": 4.0346651, "val/loss": 4.0416532}]),
    "bptt_n1": Pinned(
        train=[5.5627394, 5.5809488, 5.3374004, 5.0241184, 4.7334390, 4.3563375],
        val=[{"expert/0/val_loss": 5.0337148, "val/loss": 5.0391831},
             {"expert/0/val_loss": 3.9882045, "val/loss": 3.9914305}]),
    "bptt_n2": Pinned(
        train=[5.5498772, 5.5292082, 5.5006943, 5.4344473, 5.3629131, 5.2114658],
        val=[{"expert/0/val_loss": 5.4307566, "expert/1/val_loss": 5.4608612, "val/loss": 5.4453077},
             {"expert/0/val_loss": 4.8979983, "expert/1/val_loss": 4.9532099, "val/loss": 4.9153433}]),
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
