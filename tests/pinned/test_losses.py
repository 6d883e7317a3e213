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
317c1ec16ba947abd64385de8574489d47a3867e (torch 2.13.0+cpu, lightning 2.6.6, x86-64 CPU). Two runs in
fresh processes agreed to the last bit; running the LSTM sublayers with the PyTorch reference loop
instead of the library and native kernels (`SOMA_PL_LSTM_KERNEL=python`) moved them by at most
5.7e-7 relative, so `TOLERANCE` (1e-5 relative) leaves room for another CPU's rounding and none for
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
"""Nats/byte the final `val/loss` must lie below the untrained model's (the least measured: 0.103, EGGROLL)."""


@dataclass(frozen=True)
class Pinned:
    """One run's logged losses."""

    train: list[float]
    """`train/loss` after each update."""
    val: list[dict[str, float]]
    """`val/loss` and `expert/<e>/val_loss` at each validation."""


PINNED = {
    "spsa": Pinned(
        train=[5.5406280, 5.4632473, 5.2459154, 5.0476952, 4.7194767, 4.4119563],
        val=[{"expert/0/val_loss": 5.0069809, "val/loss": 5.0184221},
             {"expert/0/val_loss": 4.0443110, "val/loss": 4.0618114}]),
    "soma_n2": Pinned(
        train=[5.5492048, 5.4277840, 5.3143892, 5.1019335, 4.8786249, 4.6100588],
        val=[{"expert/0/val_loss": 5.0399375, "expert/1/val_loss": 5.1342263, "val/loss": 5.0946336},
             {"expert/0/val_loss": 4.2548957, "expert/1/val_loss": 4.1898508, "val/loss": 4.2231045}]),
    "eggroll": Pinned(
        train=[5.5487943, 5.5300221, 5.5208106, 5.5115175, 5.4723220, 5.4956331],
        val=[{"expert/0/val_loss": 5.4952745, "val/loss": 5.4978437},
             {"expert/0/val_loss": 5.4338284, "val/loss": 5.4391379}]),
    "ddpp": Pinned(
        train=[5.5384736, 5.4389277, 5.2772007, 5.0296130, 4.7195878, 4.4079828],
        val=[{"expert/0/val_loss": 5.0190921, "val/loss": 5.0324135},
             {"expert/0/val_loss": 4.1733451, "val/loss": 4.1929684}]),
    "bptt_n1": Pinned(
        train=[5.5385776, 5.5812578, 5.2542324, 4.9810352, 4.6692696, 4.3348894],
        val=[{"expert/0/val_loss": 4.9883866, "val/loss": 4.9962435},
             {"expert/0/val_loss": 3.9837523, "val/loss": 3.9924018}]),
    "bptt_n2": Pinned(
        train=[5.5493321, 5.5061321, 5.4535084, 5.3259745, 5.1600318, 4.9072118],
        val=[{"expert/0/val_loss": 5.2562146, "expert/1/val_loss": 5.4370022, "val/loss": 5.3490844},
             {"expert/0/val_loss": 4.4196277, "expert/1/val_loss": 4.6588302, "val/loss": 4.5497336}]),
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
