"""models: stacked byte-level LSTM experts and their parameter counts (plain nn.Modules)."""

from soma_pl.models.counts import TABLE2_SHAPES, EnsembleShape, count_parameters, table2_rows
from soma_pl.models.stacked import HeadMode, StackedExperts

__all__ = [
    "TABLE2_SHAPES",
    "EnsembleShape",
    "HeadMode",
    "StackedExperts",
    "count_parameters",
    "table2_rows",
]
