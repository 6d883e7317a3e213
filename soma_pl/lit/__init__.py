"""LightningModules, one per file: SPSA, BPTT, SOMA, EGGROLL, DDPP; their argument groups."""

from soma_pl.lit.args import ModelShape
from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.bptt import BPTTModule
from soma_pl.lit.ddpp import DDPPModule
from soma_pl.lit.eggroll import EGGROLLArgs, EGGROLLModule
from soma_pl.lit.plateau import PlateauConfig
from soma_pl.lit.soma import HeadTraining, Init, SOMAModule
from soma_pl.lit.spsa import EpsSchedule, SPSAArgs, SPSAModule
from soma_pl.lit.zo import ZOModule

__all__ = ["BPTTModule", "ByteLMModule", "DDPPModule", "EGGROLLArgs", "EGGROLLModule", "EpsSchedule", "HeadTraining",
           "Init", "ModelShape", "PlateauConfig", "SOMAModule", "SPSAArgs", "SPSAModule", "ZOModule"]
