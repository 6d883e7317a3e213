"""LightningModules, one per file: SPSA, BPTT, SOMA, EGGROLL, DDPP."""

from soma_pl.lit.base import ByteLMModule
from soma_pl.lit.bptt import BPTTModule
from soma_pl.lit.ddpp import DDPPModule
from soma_pl.lit.eggroll import EGGROLLModule
from soma_pl.lit.soma import HeadTraining, Init, SOMAModule
from soma_pl.lit.spsa import EpsSchedule, SPSAModule

__all__ = ["BPTTModule", "ByteLMModule", "DDPPModule", "EGGROLLModule", "EpsSchedule", "HeadTraining", "Init",
           "SOMAModule", "SPSAModule"]
