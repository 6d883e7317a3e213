"""Callbacks every `fit` runs: compute accounting, compute budgets, the run summary."""

from soma_pl.callbacks.compute import ComputeAccounting, ComputeBudget, ComputeReport
from soma_pl.callbacks.summary import RunSummary

__all__ = ["ComputeAccounting", "ComputeBudget", "ComputeReport", "RunSummary"]
