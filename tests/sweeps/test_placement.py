"""Where each paper-scale run's experts go, which decides its compute accounting (App. H.1, I.1, K):
every SOMA expert on a device of its own, the monolithic SPSA rows of Table 4 under DDPP on 4, 16 and
32 devices, and Table 5's BPTT runs on 4, 2 and 1 devices per expert."""

from __future__ import annotations

import pytest

from soma_pl.sweeps.space import load_sweep
from tests.sweeps.test_fair_starts import ROOT, _get, sweep_sides

PAPER_SWEEPS = sorted(p for p in (ROOT / "sweeps").glob("*.yaml"))


def placement(config: dict) -> tuple[str, int, int]:
    """(module, experts, devices in all) of a composed fit config."""
    devices = _get(config, "trainer.devices", 1) * _get(config, "trainer.num_nodes", 1)
    experts = _get(config, "model.init_args.num_experts", 1)
    return config["model"]["class_path"].rpartition(".")[2], experts, devices


@pytest.mark.parametrize("path", PAPER_SWEEPS, ids=lambda p: p.name)
def test_every_soma_expert_has_a_device_of_its_own_at_paper_scale(path, monkeypatch):
    """Except in Fig. 4's comparison, whose summed loss needs its experts in one process: there every
    arm runs on one device, so the arms are placed alike (its basis is updates, not time)."""
    monkeypatch.chdir(ROOT)
    sides = sweep_sides(load_sweep(path))
    summed = any(_get(config, "model.init_args.spsa.loss_grouping", 1) > 1 for config in sides.values())
    for side, config in sides.items():
        module, experts, devices = placement(config)
        if module == "ZOModule" and _get(config, "model.init_args.spsa.exchange") is None:
            assert devices == (1 if summed else experts), (path.name, side)
    assert not summed or path.name == "fig4.yaml"


def test_the_paper_placements_of_tables_4_and_5(monkeypatch):
    monkeypatch.chdir(ROOT)
    table4 = {side: placement(config)[1:] for side, config in sweep_sides(load_sweep("sweeps/table4.yaml")).items()}
    assert table4 == {"{'row': 'soma_n2'}": (2, 2), "{'row': 'spsa_64'}": (1, 4), "{'row': 'spsa_256'}": (1, 16),
                      "{'row': 'spsa_1024'}": (1, 32), "{'row': 'eggroll'}": (1, 8)}
    table5 = {side: placement(config) for side, config in sweep_sides(load_sweep("sweeps/table5.yaml")).items()}
    bptt = {side[len("{'run': '"):-2]: devices // experts for side, (module, experts, devices) in table5.items()
            if module == "BPTTModule"}
    assert bptt == {"bptt_n1": 4, "bptt_n2": 2, "bptt_n8": 1}  # devices per expert (App. I.1)
