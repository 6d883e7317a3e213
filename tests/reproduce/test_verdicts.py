"""Verdicts on hand-made results: the claim holds only when the seeds and the documents agree."""

from __future__ import annotations

import numpy as np
import pytest

from soma_pl.reproduce.verdicts import Verdict, decide, paired_document_interval, seed_interval


def test_the_seed_interval_is_students_t_with_n_minus_one_degrees_of_freedom():
    # mean 0.04, sd 0.005, n = 3: half width t(0.975, 2) · sd / √3 = 4.302653 · 0.005 / 1.732051
    low, high = seed_interval([0.035, 0.04, 0.045])
    half = 4.302652729911275 * 0.005 / 3 ** 0.5
    assert (low, high) == pytest.approx((0.04 - half, 0.04 + half), abs=1e-12)
    assert seed_interval([0.04]) is None


def test_a_clear_gain_on_every_seed_and_document_holds():
    check = decide("SOMA below SPSA", [0.0368, 0.0462, 0.0358], (0.02, 0.06))  # the paper's Table 7 differences
    assert check.verdict is Verdict.holds and check.seeds == 3
    assert check.mean == pytest.approx(0.0396, abs=1e-4)


def test_the_opposite_is_does_not_hold_and_a_straddle_is_inconclusive():
    assert decide("c", [-0.03, -0.04, -0.035], (-0.06, -0.01)).verdict is Verdict.does_not_hold
    assert decide("c", [0.01, -0.01, 0.02], (-0.01, 0.03)).verdict is Verdict.inconclusive
    # seeds agree but the test documents cannot tell: inconclusive, not holds
    assert decide("c", [0.040, 0.041, 0.042], (-0.002, 0.08)).verdict is Verdict.inconclusive
    # one seed decides nothing
    assert decide("c", [0.5], (0.1, 0.9)).verdict is Verdict.inconclusive


def test_without_per_window_losses_the_seeds_decide_and_the_reason_says_so():
    check = decide("c", [0.040, 0.041, 0.042])
    assert check.verdict is Verdict.holds and "seeds alone" in check.why and check.document_interval is None


def _scores(losses: list[float], documents: list[str]) -> dict:
    return {"window_index": list(range(len(losses))), "window_losses": losses, "doc_ids": documents}


def test_the_paired_document_interval_resamples_documents_of_the_seed_mean_difference():
    documents = ["a", "a", "b", "c"]
    worse = [_scores([3.0, 3.2, 2.9, 3.1], documents), _scores([3.1, 3.1, 3.0, 3.0], documents)]
    better = [_scores([2.9, 3.1, 2.8, 3.0], documents), _scores([3.0, 3.0, 2.9, 2.9], documents)]
    low, high = paired_document_interval(worse, better)
    assert low == pytest.approx(0.1) and high == pytest.approx(0.1)  # every window improves by exactly 0.1
    # unequal gains: the interval spans the per-document mean gains, in resampled proportions
    better[1] = _scores([2.8, 3.1, 3.0, 2.5], documents)
    gain = np.mean([np.subtract(w["window_losses"], b["window_losses"]) for w, b in zip(worse, better, strict=True)],
                   axis=0)
    low, high = paired_document_interval(worse, better)
    assert min(gain) <= low < high <= max(gain)


def test_no_document_interval_from_scores_without_windows_or_on_other_windows():
    documents = ["a", "b"]
    assert paired_document_interval([{"loss": 3.0}], [{"loss": 2.9}]) is None
    shifted = {**_scores([3.0, 3.0], documents), "window_index": [1, 2]}
    assert paired_document_interval([_scores([3.0, 3.0], documents)], [shifted]) is None
