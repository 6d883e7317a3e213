"""The modules' typed argument groups: dicts and dataclasses alike, plain hyperparameters, checks naming
the full key, and a save → load round trip through a weights-only checkpoint."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import lightning
import pytest
import torch

from soma_pl.errors import ConfigError
from soma_pl.estimators.directions import DirectionKind
from soma_pl.lit import BPTTModule, EGGROLLArgs, EpsSchedule, ModelShape, PlateauConfig, SPSAArgs, ZOModule
from soma_pl.lit.loading import load_module
from soma_pl.models.checkpoints import load_checkpoint

SHAPE = ModelShape(width=8, num_layers=1, embed_dim=8, time_chunk=32)
PLATEAU = PlateauConfig(factor=0.25, patience_updates=100, min_lr=1e-4)
SPSA = SPSAArgs(eps=0.02, n_pert=3, micro_batch=2, direction=DirectionKind.gaussian, max_rows=12,
                eps_schedule=EpsSchedule.constant)
BUILDS = {
    "SPSA": lambda: ZOModule(shape=SHAPE, spsa=SPSA, plateau=PLATEAU, seed=4),
    "DDPP": lambda: ZOModule(shape=SHAPE, spsa=replace(SPSA, exchange="estimates"), plateau=PLATEAU),
    "SOMA": lambda: ZOModule(num_experts=2, shape=SHAPE, init="random", spsa=SPSA, plateau=PLATEAU, top_k=2),
    "EGGROLL": lambda: ZOModule(shape=SHAPE, eggroll=EGGROLLArgs(sigma=0.05, rank=2, population=24,
                                                                     group_size=6, fitness="group_own_std",
                                                                     sigma_schedule="proportional"),
                                head_training="trainable"),
    "BPTT": lambda: BPTTModule(num_experts=2, shape=SHAPE, plateau=PLATEAU, top_k=2),
}
GROUPS = ("shape", "estimator", "plateau_config")


def _groups(module) -> dict:
    return {name: getattr(module, name) for name in GROUPS if hasattr(module, name)}


def _save(module, path: Path) -> Path:
    hparams = {**dict(module.hparams), "_class_path": f"soma_pl.lit.{type(module).__name__}"}
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": hparams,
                "pytorch-lightning_version": lightning.__version__}, path)
    return path


def test_a_group_given_as_a_dict_is_the_dataclass():
    module = ZOModule(shape={"width": 8, "num_layers": 1, "embed_dim": 8, "time_chunk": 32},
                        spsa={"eps": 0.02, "n_pert": 3, "micro_batch": 2, "direction": "gaussian", "max_rows": 12,
                              "eps_schedule": "constant"},
                        plateau={"factor": 0.25, "patience_updates": 100, "min_lr": 1e-4})
    assert (module.shape, module.estimator, module.plateau_config) == (SHAPE, SPSA, PLATEAU)
    assert module.estimator.direction is DirectionKind.gaussian
    assert module.estimator.eps_schedule is EpsSchedule.constant


def test_hyperparameters_hold_every_field_as_plain_values():
    module = ZOModule(shape={"width": 8, "num_layers": 1, "embed_dim": 8}, spsa={"eps": 0.02})
    assert module.hparams["shape"] == {"width": 8, "num_layers": 1, "embed_dim": 8, "time_chunk": 64}
    assert module.hparams["spsa"] == {"eps": 0.02, "n_pert": 64, "micro_batch": 64, "direction": "sparse",
                                      "loss_grouping": 1, "max_rows": None, "eps_schedule": "proportional",
                                      "exchange": None}
    assert module.hparams["plateau"] == {"factor": 0.5, "patience_updates": 1000, "threshold": 1e-8, "min_lr": 1e-5,
                                         "every": None}
    assert type(module.hparams["spsa"]["direction"]) is str


@pytest.mark.parametrize(("build", "message"), [
    (lambda: ZOModule(spsa={"eps": 0.0}), "model.init_args.spsa.eps=0.0 must be a positive finite number"),
    (lambda: ZOModule(spsa={"loss_grouping": 2}), "model.init_args.spsa.loss_grouping=2"),  # 1 expert
    (lambda: ZOModule(shape={"time_chunk": 0}), "model.init_args.shape.time_chunk=0 must be >= 1"),
    (lambda: ZOModule(spsa={"epsilon": 0.1}), "model.init_args.spsa.epsilon is not a setting"),
    (lambda: BPTTModule(plateau={"patience_updates": -1}), "model.init_args.plateau.patience_updates=-1 must be >= 0"),
    (lambda: ZOModule(eggroll={"population": 25, "group_size": 5}), "model.init_args.eggroll.group_size=5"),
    (lambda: ZOModule(eggroll={"population": 24, "group_size": 10}), "model.init_args.eggroll.population=24"),
])
def test_a_bad_group_setting_names_its_full_key(build, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        build()


@pytest.mark.parametrize("name", list(BUILDS))
def test_save_then_load_round_trips_the_groups(name, tmp_path):
    module = BUILDS[name]()
    path = _save(module, tmp_path / f"{name}.ckpt")
    assert load_checkpoint(path)["hyper_parameters"]["shape"] == module.hparams["shape"]  # weights only
    for loaded in (type(module).load_from_checkpoint(path, map_location="cpu", weights_only=True), load_module(path)):
        assert type(loaded) is type(module) and _groups(loaded) == _groups(module)
        for key, value in module.state_dict().items():
            assert torch.equal(loaded.state_dict()[key], value), key
