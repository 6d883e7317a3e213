"""Verdicts on hand-made results: the claim holds only when the seeds and the documents agree, on
three seeds or more, and after Holm's adjustment over the experiment's claims."""

from __future__ import annotations

import numpy as np
import pytest

from soma_pl.eval.bootstrap import Interval, document_bootstrap, paired_document_interval
from soma_pl.reproduce.verdicts import Verdict, agrees, count, decide, estimate, family, seed_interval, seed_p


def test_the_seed_interval_is_students_t_with_n_minus_one_degrees_of_freedom():
    # mean 0.04, sd 0.005, n = 3: half width t(0.975, 2) · sd / √3 = 4.302653 · 0.005 / 1.732051
    low, high = seed_interval([0.035, 0.04, 0.045])
    half = 4.302652729911275 * 0.005 / 3 ** 0.5
    assert (low, high) == pytest.approx((0.04 - half, 0.04 + half), abs=1e-12)
    assert seed_interval([0.04]) is None


def _documents(low: float, high: float, p: float = 0.001) -> Interval:
    return Interval((low + high) / 2, low, high, 10, 40, p)


def test_a_clear_gain_on_every_seed_and_document_holds():
    check = decide("SOMA below SPSA", [0.0368, 0.0462, 0.0358], _documents(0.02, 0.06))  # the paper's Table 7
    assert check.verdict is Verdict.holds and check.seeds == 3
    assert check.mean == pytest.approx(0.0396, abs=1e-4)
    assert check.document_interval == (0.02, 0.06)


def test_the_opposite_is_does_not_hold_and_a_straddle_is_inconclusive():
    assert decide("c", [-0.03, -0.04, -0.035], _documents(-0.06, -0.01)).verdict is Verdict.does_not_hold
    assert decide("c", [0.01, -0.01, 0.02], _documents(-0.01, 0.03, 0.4)).verdict is Verdict.inconclusive
    # seeds agree but the test documents cannot tell: inconclusive, not holds
    assert decide("c", [0.040, 0.041, 0.042], _documents(-0.002, 0.08, 0.1)).verdict is Verdict.inconclusive


def test_fewer_than_three_seeds_or_no_document_interval_decide_nothing():
    for check in (decide("c", [0.5], _documents(0.1, 0.9)), decide("c", [0.5, 0.52], _documents(0.1, 0.9)),
                  decide("c", [0.040, 0.041, 0.042])):
        assert check.verdict is Verdict.inconclusive and check.p is None
    assert decide("c", [0.5, 0.52], _documents(0.1, 0.9)).seeds == 2
    assert decide("c", [0.040, 0.041, 0.042]).document_interval is None


def test_the_seed_p_value_is_the_two_sided_t_test():
    # n = 3 (2 degrees of freedom): the t distribution's two-sided tail is 1 − |t| / √(2 + t²)
    differences = [0.01, 0.03, 0.08]
    mean, sd = np.mean(differences), np.std(differences, ddof=1)
    t = mean / (sd / 3 ** 0.5)
    assert seed_p(differences) == pytest.approx(1 - abs(t) / (2 + t * t) ** 0.5, rel=1e-9)
    # the claim's p is the larger of the two tests' (both must reject)
    assert decide("c", differences, _documents(0.001, 0.09, 0.001)).p == pytest.approx(seed_p(differences))
    assert decide("c", [0.040, 0.041, 0.042], _documents(0.001, 0.09, 0.02)).p == 0.02


def test_the_bootstrap_p_value_counts_resampled_means_past_zero():
    # two documents of one window each, -1 and +3: a resample of both is the mean -1 with chance 1/4,
    # so P(mean <= 0) = 1/4 and the two-sided p-value is 1/2
    interval = document_bootstrap(np.array([-1.0, 3.0]), np.array(["a", "b"]))
    assert interval.p_zero == pytest.approx(0.5, abs=0.03)
    assert document_bootstrap(np.array([0.1, 0.2, 0.3]), np.array(["a", "b", "c"])).p_zero == 0.0


def test_holm_adjusts_the_experiments_claims_together():
    # p = 0.01, 0.04, 0.03 over m = 3: sorted 0.01, 0.03, 0.04 -> 3·0.01, max(0.03, 2·0.03), max(0.06, 0.04)
    checks = [{"claim": name, "verdict": Verdict.holds.value, "why": "both", "p": p}
              for name, p in (("a", 0.01), ("b", 0.04), ("c", 0.03))]
    undecided = {"claim": "d", "verdict": Verdict.inconclusive.value, "why": "one seed", "p": None}
    adjusted = family([*checks, undecided])
    assert [c.get("holm_p") for c in adjusted] == pytest.approx([0.03, 0.06, 0.06, None])
    assert [c["verdict"] for c in adjusted] == ["holds", "inconclusive", "inconclusive", "inconclusive"]
    assert adjusted[3] == undecided
    # one claim alone keeps its p-value and its verdict
    assert family(checks[1:2])[0]["verdict"] == "holds" and family(checks[1:2])[0]["holm_p"] == 0.04


def test_a_bonferroni_level_puts_the_p_value_on_the_familys_scale():
    differences = [0.01, 0.03, 0.08]
    plain = decide("c", differences, _documents(0.001, 0.09, 0.001))
    wide = decide("c", differences, _documents(0.001, 0.09, 0.001), level=1 - 0.05 / 4)
    assert wide.p == pytest.approx(min(1.0, 4 * plain.p))


def _scores(losses: list[float], documents: list[str]) -> dict:
    return {"window_index": list(range(len(losses))), "window_losses": losses, "doc_ids": documents}


def test_the_paired_document_interval_resamples_documents_of_the_seed_mean_difference():
    documents = ["a", "a", "b", "c"]
    worse = [_scores([3.0, 3.2, 2.9, 3.1], documents), _scores([3.1, 3.1, 3.0, 3.0], documents)]
    better = [_scores([2.9, 3.1, 2.8, 3.0], documents), _scores([3.0, 3.0, 2.9, 2.9], documents)]
    interval = paired_document_interval(worse, better)
    assert interval.low == pytest.approx(0.1) and interval.high == pytest.approx(0.1)  # every window gains 0.1
    assert interval.p_zero == 0.0
    # unequal gains: the interval spans the per-document mean gains, in resampled proportions
    better[1] = _scores([2.8, 3.1, 3.0, 2.5], documents)
    gain = np.mean([np.subtract(w["window_losses"], b["window_losses"]) for w, b in zip(worse, better, strict=True)],
                   axis=0)
    interval = paired_document_interval(worse, better)
    assert min(gain) <= interval.low < interval.high <= max(gain)


def test_no_document_interval_from_scores_without_windows_or_on_other_windows():
    documents = ["a", "b"]
    assert paired_document_interval([{"loss": 3.0}], [{"loss": 2.9}]) is None
    shifted = {**_scores([3.0, 3.0], documents), "window_index": [1, 2]}
    assert paired_document_interval([_scores([3.0, 3.0], documents)], [shifted]) is None


def test_the_document_interval_is_at_the_level_asked_for():
    """A Bonferroni level (Fig. 8's comparisons) widens the document interval as it widens the seeds'."""
    documents = [f"d{i // 2}" for i in range(40)]
    gains = np.random.default_rng(0).normal(0.05, 0.1, 40)
    worse = [_scores(list(3.0 + gains), documents)]
    better = [_scores([3.0] * 40, documents)]
    plain, wide = paired_document_interval(worse, better), paired_document_interval(worse, better, level=0.99)
    assert wide.low < plain.low < plain.high < wide.high
    assert wide.p_zero == plain.p_zero  # the p-value does not depend on the interval's level


def test_an_estimate_over_draws_is_decided_by_its_student_t_interval():
    # 4.02 ± 0.3 against 1 over 32 draws: 3.02 ± t(0.975, 31) · 0.3 = 3.02 ± 2.039513 · 0.3 (the paper's Fig. 11 ratio)
    check = estimate("separate below summed", 4.02, 0.3, 1.0, 32)
    assert check.verdict is Verdict.holds and check.over == "direction draws" and check.seeds == 32
    assert check.seed_interval == pytest.approx((3.02 - 2.039513 * 0.3, 3.02 + 2.039513 * 0.3), abs=1e-5)
    assert check.document_interval is None
    # three timing rounds: t(0.975, 2) = 4.302653; 1.5 ± 0.1 → 0.5 ± 0.43 holds, and t = 5 gives p 0.0377
    rounds = estimate("faster", 1.5, 0.1, 1.0, 3, over="timing rounds")
    assert rounds.verdict is Verdict.holds and rounds.seed_interval[0] == pytest.approx(0.5 - 0.4302653, abs=1e-6)
    assert rounds.p == pytest.approx(0.03775, abs=1e-4) and rounds.over == "timing rounds"
    assert estimate("x", 1.3, 0.2, 1.0, 32).verdict is Verdict.inconclusive  # 0.3 ± 0.408 reaches zero
    assert estimate("x", 0.5, 0.1, 1.0, 32).verdict is Verdict.does_not_hold
    assert family([rounds.as_dict()] * 3)[0]["holm_p"] == pytest.approx(3 * rounds.p, rel=1e-9)
    for stderr in (0.0, float("nan")):  # no spread: nothing decided, no p-value
        flat = estimate("x", 2.0, stderr, 1.0, 3)
        assert flat.verdict is Verdict.inconclusive and flat.p is None


def test_a_measurement_agrees_with_its_prediction_within_the_margin():
    # 4.02 ± 0.05 over 32 draws against 4.00: +0.5% ± 2.04·1.25% lies inside ±10%
    close = agrees("x", 4.02, 0.05, 4.0, 32, 0.1)
    assert close.verdict is Verdict.holds and close.mean == pytest.approx(0.005) and close.p is None
    assert close.seed_interval == pytest.approx((0.005 - 2.039513 * 0.0125, 0.005 + 2.039513 * 0.0125), abs=1e-6)
    assert agrees("x", 4.02, 0.5, 4.0, 32, 0.1).verdict is Verdict.inconclusive  # ± 25%
    assert agrees("x", 6.0, 0.05, 4.0, 32, 0.1).verdict is Verdict.does_not_hold


def test_a_count_holds_when_it_rounds_to_the_papers_figures():
    assert count("N = 1", 8_333_905, 8_330_000).verdict is Verdict.holds  # 8.33M
    assert count("N = 256 body", 32_928, 32_900).verdict is Verdict.holds  # 32.9k
    assert count("N = 1", 8_333_905, 8_334_000).verdict is Verdict.holds  # the paper's value rounded alike
    wrong = count("N = 1", 8_346_000, 8_330_000)  # 8.35M
    assert wrong.verdict is Verdict.does_not_hold and wrong.p is None and wrong.mean == 16_000
