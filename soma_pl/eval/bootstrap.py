"""Document-bootstrap confidence intervals for a mean per-window loss (Fig. 15's 95% bars).

Windows of one document are not independent, so documents are resampled with replacement and the
window-weighted mean loss is recomputed for each resample: 10,000 draws (App. L), in blocks so that
4,096 documents need 33 MB at a time, not 330.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

RESAMPLES = 10_000
"""Document-bootstrap draws of every interval (App. L: 10,000 paired draws)."""
BLOCK = 1_000
"""Draws formed at a time."""


@dataclass(frozen=True)
class Interval:
    mean: float
    low: float
    high: float
    documents: int
    windows: int
    p_zero: float
    """Two-sided bootstrap p-value of a zero mean: twice the smaller share of resampled means on
    either side of zero (at most 1); below 1 − level exactly when zero lies outside the interval,
    up to the quantiles' interpolation."""


def document_bootstrap(losses: np.ndarray, doc_ids: np.ndarray, resamples: int = RESAMPLES, level: float = 0.95,
                       seed: int = 0) -> Interval:
    """Percentile interval of the mean of `losses: [n]` resampling whole documents `doc_ids: [n]`."""
    losses = np.asarray(losses, dtype=np.float64)
    _, document = np.unique(np.asarray(doc_ids), return_inverse=True)
    sums = np.bincount(document, weights=losses)
    counts = np.bincount(document).astype(np.float64)
    rng = np.random.default_rng(seed)
    means = np.empty(resamples)
    for start in range(0, resamples, BLOCK):
        picks = rng.integers(0, len(sums), size=(min(BLOCK, resamples - start), len(sums)))
        means[start : start + len(picks)] = sums[picks].sum(1) / counts[picks].sum(1)
    tail = (1.0 - level) / 2
    low, high = np.quantile(means, [tail, 1.0 - tail])
    p_zero = min(1.0, 2.0 * min(np.mean(means <= 0.0), np.mean(means >= 0.0)))
    return Interval(float(losses.mean()), float(low), float(high), len(sums), len(losses), float(p_zero))


def paired_document_interval(worse: list[dict], better: list[dict], level: float = 0.95) -> Interval | None:
    """The document bootstrap (interval at `level`) of the seed-mean paired difference `worse −
    better`, from each seed's `*_scores.json` records (`window_index`, `window_losses`, `doc_ids`) of
    the two sides on one split; None when a record lacks per-window losses or the sides scored
    different windows."""
    if not worse or len(worse) != len(better):
        return None
    differences, documents = [], None
    for first, second in zip(worse, better, strict=True):
        if not all("window_losses" in r for r in (first, second)) or first["window_index"] != second["window_index"]:
            return None
        if list(second["doc_ids"]) != list(first["doc_ids"]) or (documents is not None
                                                                  and list(first["doc_ids"]) != documents):
            return None
        documents = list(first["doc_ids"])
        differences.append(np.asarray(first["window_losses"]) - np.asarray(second["window_losses"]))
    return document_bootstrap(np.mean(differences, axis=0), np.asarray(documents), level=level)
