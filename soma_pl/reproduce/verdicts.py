"""A paper's claim checked on measured numbers: holds, does not hold, or inconclusive.

A claim says that one quantity is lower than another (SOMA's test loss below SPSA's), so it is
checked on their difference, `worse − better`, which the claim says is positive. Two kinds of
uncertainty decide it, and the verdict needs both:

- **Seeds** (optimization noise): the per-seed differences' mean and its two-sided 95% Student-t
  interval (n − 1 degrees of freedom). One seed gives no interval.
- **Documents** (test-set sampling): the 95% document-bootstrap interval of the seed-mean
  difference, resampling whole documents of the scored split, the same windows for both sides
  (`soma_pl.eval.bootstrap.document_bootstrap` on the per-window paired differences).

The claim **holds** when both intervals lie above zero, **does not hold** when both lie below zero,
and is **inconclusive** otherwise (an interval that reaches zero, the two disagreeing, or too few
seeds); a missing document interval leaves the seed interval to decide alone, and says so.
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from enum import Enum

import numpy as np
from scipy import stats as scipy_stats

from soma_pl.eval.bootstrap import document_bootstrap

LEVEL = 0.95


class Verdict(str, Enum):
    holds = "holds"
    does_not_hold = "does not hold"
    inconclusive = "inconclusive"


@dataclass(frozen=True)
class Check:
    """One claim's verdict and the numbers that decided it (all differences `worse − better`)."""

    claim: str
    verdict: Verdict
    why: str
    mean: float | None
    seeds: int
    seed_interval: tuple[float, float] | None
    document_interval: tuple[float, float] | None

    def as_dict(self) -> dict:
        return {**asdict(self), "verdict": self.verdict.value}


def mean_sd(values: list[float]) -> dict:
    """`mean` and sample `sd` of per-seed values (None where there are too few)."""
    return {"mean": statistics.fmean(values) if values else None,
            "sd": statistics.stdev(values) if len(values) > 1 else None}


def seed_interval(differences: list[float], level: float = LEVEL) -> tuple[float, float] | None:
    """The two-sided Student-t interval of the mean of `differences` (None below two values)."""
    if len(differences) < 2:
        return None
    mean, sd = statistics.fmean(differences), statistics.stdev(differences)
    half = float(scipy_stats.t.ppf(0.5 + level / 2, len(differences) - 1)) * sd / len(differences) ** 0.5
    return mean - half, mean + half


def paired_document_interval(worse: list[dict], better: list[dict]) -> tuple[float, float] | None:
    """The document-bootstrap interval of the seed-mean paired difference `worse − better`, from each
    seed's `*_scores.json` records (`window_index`, `window_losses`, `doc_ids`) of the two sides on
    one split; None when a record lacks per-window losses or the sides scored different windows."""
    if not worse or len(worse) != len(better):
        return None
    differences, documents = [], None
    for first, second in zip(worse, better, strict=True):
        if not all("window_losses" in r for r in (first, second)) or first["window_index"] != second["window_index"]:
            return None
        if documents is not None and list(first["doc_ids"]) != documents:
            return None
        documents = list(first["doc_ids"])
        differences.append(np.asarray(first["window_losses"]) - np.asarray(second["window_losses"]))
    interval = document_bootstrap(np.mean(differences, axis=0), np.asarray(documents), level=LEVEL)
    return interval.low, interval.high


def _side(interval: tuple[float, float]) -> int:
    """+1 above zero, −1 below, 0 reaching it."""
    return 1 if interval[0] > 0 else -1 if interval[1] < 0 else 0


def decide(claim: str, differences: list[float], document: tuple[float, float] | None = None,
           level: float = LEVEL) -> Check:
    """The verdict on `claim` from per-seed differences `worse − better` (positive: the claim's way)
    and the paired document-bootstrap interval of their mean; `level` for the seeds' interval (above
    0.95 where one claim is decided by several comparisons)."""
    seeds = seed_interval(differences, level)
    mean = statistics.fmean(differences) if differences else None
    if seeds is None:
        return Check(claim, Verdict.inconclusive, f"{len(differences)} seed(s): no interval over seeds", mean,
                     len(differences), None, document)
    sides = [_side(seeds)] + ([_side(document)] if document is not None else [])
    shown = f"seeds {seeds[0]:+.4f} … {seeds[1]:+.4f}" + (
        f", documents {document[0]:+.4f} … {document[1]:+.4f}" if document is not None else
        ", no per-window losses for a document interval")
    if all(side == 1 for side in sides):
        verdict, why = Verdict.holds, f"both 95% intervals above zero ({shown})"
    elif all(side == -1 for side in sides):
        verdict, why = Verdict.does_not_hold, f"the opposite holds: 95% intervals below zero ({shown})"
    else:
        verdict, why = Verdict.inconclusive, f"a 95% interval reaches zero or they disagree ({shown})"
    if document is None and verdict is not Verdict.inconclusive:
        why += "; decided by the seeds alone"
    return Check(claim, verdict, why, mean, len(differences), seeds, document)
