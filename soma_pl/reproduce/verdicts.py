"""A paper's claim checked on measured numbers: holds, does not hold, or inconclusive.

A claim says that one quantity is lower than another (SOMA's test loss below SPSA's), so it is
checked on their difference, `worse − better`, which the claim says is positive. Two kinds of
uncertainty decide it, and the verdict needs both:

- **Seeds** (optimization noise): the per-seed differences' mean, its two-sided 95% Student-t
  interval (n − 1 degrees of freedom) and the t-test's p-value. At least :data:`MIN_SEEDS` seeds.
- **Documents** (test-set sampling): the 95% document-bootstrap interval of the seed-mean
  difference, resampling whole documents of the scored split, the same windows for both sides
  (`soma_pl.eval.bootstrap.document_bootstrap` on the per-window paired differences), and its
  bootstrap p-value.

A claim **holds** when both intervals lie above zero, **does not hold** when both lie below zero,
and is **inconclusive** otherwise: an interval that reaches zero, the two disagreeing, fewer than
three seeds, or no document interval (scores without per-window losses). Its p-value is the larger
of the two tests' (both must reject). The claims of one experiment are one family
(:func:`family`): Holm's step-down adjustment of their p-values keeps the chance of any false
verdict among them at 5%, and a claim whose adjusted p-value reaches 0.05 is inconclusive.

Claims of another kind are checked by rules of their own: a quantity measured over independent
draws at fixed weights and windows (:func:`estimate`: its Student-t interval over the draws of
directions or timing rounds, no document interval; :func:`agrees`: its agreement with a closed-form
prediction within a relative margin, an equivalence outside Holm's family) and an exact count
(:func:`count`: equal to the paper's at the paper's significant figures).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import asdict, dataclass
from enum import Enum

from scipy import stats as scipy_stats

from soma_pl.eval.bootstrap import Interval, paired_document_interval

LEVEL = 0.95
MIN_SEEDS = 3
"""Seeds a claim needs before a verdict other than inconclusive."""


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
    p: float | None = None
    """Two-sided p-value of no difference on the family's 5% scale: the larger of the seeds' t-test
    and the document bootstrap, times the Bonferroni factor of a ``level`` above 95%; None where
    undecided for want of seeds or documents."""
    holm_p: float | None = None
    """``p`` after Holm's adjustment over the experiment's claims (:func:`family`)."""
    over: str = "seeds"
    """What `seeds` counts and `seed_interval` is over: seeds, direction draws, or an exact count."""

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


def seed_p(differences: list[float]) -> float:
    """The two-sided one-sample t-test's p-value of a zero mean (where every difference is the same:
    0 if it is not zero, else 1)."""
    sd = statistics.stdev(differences)
    if sd == 0:
        return 0.0 if statistics.fmean(differences) != 0 else 1.0
    t = statistics.fmean(differences) / (sd / len(differences) ** 0.5)
    return float(2 * scipy_stats.t.sf(abs(t), len(differences) - 1))


def paired_seeds(worse: list[float | None], better: list[float | None], worse_windows: list[dict | None],
                 better_windows: list[dict | None], level: float = LEVEL) -> tuple[list[float], Interval | None]:
    """Seed by seed `worse − better` where both sides have a value, and the document bootstrap (at
    `level`) of their mean difference from those seeds' per-window scores records (None unless
    every one of them has its records)."""
    kept = [i for i, (w, b) in enumerate(zip(worse, better, strict=True)) if w is not None and b is not None]
    windows = [[side[i] for i in kept] for side in (worse_windows, better_windows)]
    whole = kept and all(record is not None for side in windows for record in side)
    return [worse[i] - better[i] for i in kept], paired_document_interval(*windows, level=level) if whole else None


def _side(interval: tuple[float, float]) -> int:
    """+1 above zero, −1 below, 0 reaching it."""
    return 1 if interval[0] > 0 else -1 if interval[1] < 0 else 0


def decide(claim: str, differences: list[float], document: Interval | None = None, level: float = LEVEL) -> Check:
    """The verdict on `claim` from per-seed differences `worse − better` (positive: the claim's way)
    and the paired document bootstrap of their mean; `level` for the seeds' interval (above 0.95
    where one claim is decided by several comparisons, Bonferroni)."""
    mean = statistics.fmean(differences) if differences else None
    interval = seed_interval(differences, level)
    bounds = None if document is None else (document.low, document.high)
    if len(differences) < MIN_SEEDS:
        return Check(claim, Verdict.inconclusive, f"{len(differences)} seed(s): at least {MIN_SEEDS} needed", mean,
                     len(differences), interval, bounds)
    shown = f"seeds {interval[0]:+.4f} … {interval[1]:+.4f}"
    if document is None:
        return Check(claim, Verdict.inconclusive, f"no per-window losses for a document interval ({shown})", mean,
                     len(differences), interval, None)
    shown += f", documents {document.low:+.4f} … {document.high:+.4f}"
    p = min(1.0, max(seed_p(differences), document.p_zero) * (1 - LEVEL) / (1 - level))
    sides = {_side(interval), _side(bounds)}
    if sides == {1}:
        verdict, why = Verdict.holds, f"both intervals above zero ({shown})"
    elif sides == {-1}:
        verdict, why = Verdict.does_not_hold, f"the opposite holds: both intervals below zero ({shown})"
    else:
        verdict, why = Verdict.inconclusive, f"an interval reaches zero or they disagree ({shown})"
    return Check(claim, verdict, why, mean, len(differences), interval, bounds, p)


def estimate(claim: str, value: float, stderr: float, reference: float, draws: int, over: str = "direction draws",
             level: float = LEVEL) -> Check:
    """The verdict on a claim that a quantity measured as a mean over `draws` independent draws (a
    ratio of gradient errors at fixed weights and windows over direction draws, of throughputs over
    timing rounds) exceeds `reference`: the Student-t interval (`draws` − 1 degrees of freedom) of
    `value − reference` from its standard error holds above zero, does not hold below it; the p-value
    is the two-sided t-test's."""
    difference = value - reference
    if not (math.isfinite(stderr) and stderr > 0 and draws >= 2):
        return Check(claim, Verdict.inconclusive, f"no spread over {draws} {over} to decide on (standard error "
                     f"{stderr})", difference, draws, None, None, over=over)
    interval = _t_interval(difference, stderr, draws, level)
    p = float(2 * scipy_stats.t.sf(abs(difference) / stderr, draws - 1))
    shown = f"measured {value:.4g} against {reference:g}; {draws} {over}: {interval[0]:+.4g} … {interval[1]:+.4g}"
    verdict, why = {1: (Verdict.holds, f"the interval lies above zero ({shown})"),
                    -1: (Verdict.does_not_hold, f"the opposite holds: the interval lies below zero ({shown})"),
                    0: (Verdict.inconclusive, f"the interval reaches zero ({shown})")}[_side(interval)]
    return Check(claim, verdict, why, difference, draws, interval, None, p, over=over)


def _t_interval(mean: float, stderr: float, draws: int, level: float) -> tuple[float, float]:
    half = float(scipy_stats.t.ppf(0.5 + level / 2, draws - 1)) * stderr
    return mean - half, mean + half


def agrees(claim: str, value: float, stderr: float, predicted: float, draws: int, margin: float,
           over: str = "direction draws", level: float = LEVEL) -> Check:
    """The verdict on a measurement matching its closed-form prediction within a relative `margin`
    (an equivalence): holds when the Student-t interval of `value / predicted − 1` lies inside
    ±margin, does not hold when it lies wholly outside, inconclusive otherwise. Judged by its own
    rule (no p-value, outside Holm's family)."""
    relative = value / predicted - 1
    if not (math.isfinite(stderr) and stderr > 0 and draws >= 2):
        return Check(claim, Verdict.inconclusive, f"no spread over {draws} {over} to decide on", relative, draws,
                     None, None, over=over)
    low, high = _t_interval(relative, stderr / abs(predicted), draws, level)
    shown = f"measured {value:.4g}, predicted {predicted:.4g}: {low:+.1%} … {high:+.1%}, margin ±{margin:.0%}"
    if -margin < low and high < margin:
        verdict, why = Verdict.holds, f"the interval lies inside the margin ({shown})"
    elif low >= margin or high <= -margin:
        verdict, why = Verdict.does_not_hold, f"the interval lies wholly outside the margin ({shown})"
    else:
        verdict, why = Verdict.inconclusive, f"the interval reaches past the margin ({shown})"
    return Check(claim, verdict, why, relative, draws, (low, high), None, over=over)


def count(claim: str, ours: int, paper: float, digits: int = 3) -> Check:
    """The verdict on an exact count (a parameter count) against the paper's, given to `digits`
    significant figures: holds when ours rounds to it."""
    rounded = float(f"{ours:.{digits}g}")
    same = math.isclose(rounded, float(f"{paper:.{digits}g}"), rel_tol=1e-9)
    why = f"{ours:,} is {rounded:.{digits}g} to {digits} significant figures; the paper gives {paper:.{digits}g}"
    return Check(claim, Verdict.holds if same else Verdict.does_not_hold, why, ours - paper, 1, None, None,
                 over="exact count")


def family(checks: list[dict], alpha: float = 1 - LEVEL) -> list[dict]:
    """One experiment's checks with Holm's step-down adjustment of their p-values (`holm_p`): the
    i-th smallest of m is multiplied by m − i + 1, made non-decreasing and capped at 1. A decided
    claim whose adjusted p-value is not below `alpha` becomes inconclusive. Checks without a p-value
    (undecided, or judged by their own rule) are not in the family and are returned unchanged."""
    tested = sorted((check["p"], index) for index, check in enumerate(checks) if check.get("p") is not None)
    adjusted, running = {}, 0.0
    for rank, (p, index) in enumerate(tested):
        running = max(running, min(1.0, (len(tested) - rank) * p))
        adjusted[index] = running
    out = []
    for index, check in enumerate(checks):
        if index not in adjusted:
            out.append(check)
            continue
        check = {**check, "holm_p": adjusted[index]}
        if check["verdict"] != Verdict.inconclusive.value and adjusted[index] >= alpha:
            check["why"] += f"; not after Holm's adjustment over {len(tested)} claims (p {adjusted[index]:.3g})"
            check["verdict"] = Verdict.inconclusive.value
        out.append(check)
    return out
