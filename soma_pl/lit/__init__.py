"""The LightningModules: `ZOModule` (zero-order: SPSA, SOMA, DDPP, EGGROLL), `GRUModule` (EGGROLL's own
GRU recipe) and `BPTTModule`; their argument groups."""

from soma_pl.lit.args import ModelShape
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.bptt import BPTTModule
from soma_pl.lit.ddpp import Exchange
from soma_pl.lit.estimators import EGGROLLArgs, EpsSchedule, Estimator, SPSAArgs
from soma_pl.lit.gru import GRUModule, GRURecipe, GRUShape
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.starts import HeadTraining, Init
from soma_pl.lit.zo import ZOModule

__all__ = ["BPTTModule", "ByteLMModule", "EGGROLLArgs", "EpsSchedule", "Estimator", "Exchange", "GRUModule",
           "GRURecipe", "GRUShape", "HeadTraining", "Init", "ModelShape", "PlateauConfig", "SPSAArgs", "ZOModule"]
