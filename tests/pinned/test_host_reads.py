"""A zero-order update reads the device from the host once (the finiteness check) and copies no
weight: the per-expert learning-rate multiplier scales plain SGD's gradient in place."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.overrides import TorchFunctionMode

from soma_pl.contracts import UpdateClock
from soma_pl.lit import EGGROLLArgs, EpsSchedule, HeadTraining, Init, ZOModule
from tests.pinned.data import PinnedData, pinned_router
from tests.pinned.runs import sgd
from tests.pinned.test_step import SETTINGS, _one_step

HOST_READS = {"item", "tolist", "numpy", "__bool__", "__float__", "__int__", "__index__"}


class Reads(TorchFunctionMode):
    """Counts the tensor → host reads (each a device synchronisation on a GPU) and the copies
    (`clone`) of tensors with more than one element (a logged scalar is copied by Lightning) made
    under it."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []
        self.clones = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in HOST_READS:
            self.reads.append(name)
        elif name == "clone" and args[0].numel() > 1:
            self.clones += 1
        return func(*args, **(kwargs or {}))


def _counted(module) -> Reads:
    counter, step = Reads(), module.training_step

    def training_step(*args, **kwargs):
        with counter:
            return step(*args, **kwargs)

    module.training_step = training_step
    return counter


def _soma(tmp_path, decayed: bool = True, **extra) -> ZOModule:
    module = ZOModule(num_experts=2, init=Init.random, seed_checkpoint=None, head_training=HeadTraining.trainable,
                      router_path=pinned_router(tmp_path), top_k=1, **{**SETTINGS, **extra})
    if decayed:
        module.plateau.step(torch.tensor([1.0, 1.0]), 0)
        module.plateau.step(torch.tensor([0.5, 2.0]), 1)  # expert 1's multiplier decays to 0.25
    return module


@pytest.mark.parametrize("method", ["spsa", "soma", "eggroll"])
def test_an_update_reads_the_host_once_and_copies_no_weight(method, tmp_path):
    torch.manual_seed(0)
    if method == "spsa":
        module = ZOModule(num_experts=1, head_training=HeadTraining.trainable, seed_checkpoint=None, **SETTINGS)
    elif method == "soma":
        module = _soma(tmp_path)
    else:
        settings = {key: value for key, value in SETTINGS.items() if key != "spsa"}
        module = ZOModule(num_experts=1, head_training=HeadTraining.trainable, seed_checkpoint=None,
                          eggroll=EGGROLLArgs(sigma=0.01, rank=1, population=8, group_size=2), **settings)
    experts = module.model.num_experts
    counter = _counted(module)
    _one_step(module, PinnedData(experts=experts, batch_size=4, steps=1))
    assert counter.reads == ["tolist"]  # check_finite's one [2, E] read
    assert counter.clones == 0


def test_under_momentum_each_experts_update_is_scaled_by_its_multiplier(tmp_path):
    """SGD with momentum: scaling the gradient would not scale the step, so each expert's update is
    interpolated from a copy of the weights (`scale_updates`): with multipliers [1, 0.25] (ε kept
    constant, so both runs estimate the same ĝ) expert 0 moves as with [1, 1], expert 1 a quarter."""
    moves = []
    for decayed in (False, True):
        torch.manual_seed(0)
        module = _soma(tmp_path, optimizer=sgd(SETTINGS["optimizer"].keywords["lr"], momentum=0.9),
                       spsa=replace(SETTINGS["spsa"], eps_schedule=EpsSchedule.constant), decayed=decayed)
        start = copy.deepcopy(module.model)
        _one_step(module, PinnedData(experts=2, batch_size=4, steps=1))
        moves.append({name: param.detach().double() - start.get_parameter(name).detach().double()
                      for name, param in module.model.expert_parameters().items()})
    full, scaled = moves
    for name in full:
        largest = torch.finfo(torch.float32).eps * full[name].abs().max().item() * 64
        assert full[name][1].abs().max() > 1e-5, name
        torch.testing.assert_close(scaled[name][0], full[name][0], rtol=0, atol=largest, msg=name)
        torch.testing.assert_close(scaled[name][1], 0.25 * full[name][1], rtol=1e-4, atol=largest, msg=name)


def test_the_kernel_is_warmed_before_the_first_clock_starts(monkeypatch):
    """The first update's clock starts after one forward of the grouped kernel (two weight sets per
    expert: the native kernel's path, built on first use), so its build is not an update's time."""
    events = []
    monkeypatch.setattr(UpdateClock, "start", lambda self: events.append("clock"))
    torch.manual_seed(0)
    module = ZOModule(num_experts=1, head_training=HeadTraining.trainable, seed_checkpoint=None, **SETTINGS)
    loss_fn = module.loss_fn

    def recorded(params, tokens):
        events.append(("forward", params["w_hh"].shape[0], tokens.shape[1]))
        return loss_fn(params, tokens)

    module.loss_fn = recorded
    _one_step(module, PinnedData(experts=1, batch_size=4, steps=1))
    assert events[:2] == [("forward", 2, 1), "clock"]
    assert all(event != ("forward", 2, 1) for event in events[2:])  # once per process
