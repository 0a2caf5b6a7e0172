"""tuneproof/core/stats.py: intervals that are right at the edges, p-values that agree with them, Holm."""

from __future__ import annotations

import random

import pytest

from tests.reading import present
from tuneproof.core import stats


def paired_lists(a: int, b: int, c: int, d: int) -> tuple[list[int], list[int]]:
    """Candidate and other outcomes for a both-right, b candidate-only, c other-only, d neither."""
    return [1] * a + [1] * b + [0] * c + [0] * d, [1] * a + [0] * b + [1] * c + [0] * d


def test_newcombe_matches_the_published_reference():
    # Cavo et al. 2012 as worked in Fagerland, Lydersen & Laake, "Statistical Analysis of Contingency
    # Tables", ch. 8: Newcombe square-and-add, estimate -0.0621, 95% CI -0.1186 to -0.0046.
    evidence = stats.paired(*paired_lists(59, 6, 16, 80))
    lo, hi = evidence.bounds(0.025)  # two-sided 95% = each bound one-sided at 97.5%
    assert evidence.method == "Newcombe paired score"
    assert round(evidence.point, 4) == -0.0621 and round(lo, 4) == -0.1186 and round(hi, 4) == -0.0046


def test_wilson_matches_a_hand_computation():
    lo, hi = stats.wilson(8, 10, 1.959964)
    assert round(lo, 4) == 0.4902 and round(hi, 4) == 0.9433


@pytest.mark.parametrize(
    "counts",
    [(15, 0, 0, 0), (0, 0, 0, 15), (7, 0, 0, 8), (1, 0, 0, 0), (0, 0, 0, 1)],
    ids=["all-correct", "all-wrong", "b=c=0 mixed", "one item right", "one item wrong"],
)
def test_no_disagreement_still_has_width(counts):
    """A plain bootstrap of identical outcomes returns [0, 0]; n items cannot promise that."""
    evidence = stats.paired(*paired_lists(*counts))
    lo, hi = evidence.bounds(0.05)
    assert evidence.point == 0 and lo < -0.1 and hi > 0.1 and lo == pytest.approx(-hi)
    assert stats.outcome(lo, hi, -0.02) == "insufficient"
    needed = evidence.items_needed(-0.02, 0.05)
    assert needed is not None and needed > sum(counts)
    assert isinstance(evidence, stats.PairedBinary)  # two binary lists: counts of each outcome pair
    lo_then, _ = stats.newcombe_paired(evidence.counts.scaled(needed), stats.z_for(0.05))
    assert lo_then >= -0.02  # that many items at the same rates do resolve it


def test_interval_narrows_with_items_and_stays_in_range():
    widths = []
    for n in (5, 20, 100, 1000):
        lo, hi = stats.paired(*paired_lists(n // 2, n // 4, n // 8, n - n // 2 - n // 4 - n // 8)).bounds(0.05)
        assert -1 <= lo < hi <= 1
        widths.append(hi - lo)
    assert widths == sorted(widths, reverse=True)
    assert stats.paired(*paired_lists(0, 3, 0, 0)).bounds(0.05)[1] == 1.0


def test_p_value_agrees_with_the_bounds():
    """pass at level alpha exactly when p <= alpha: the Holm levels and the printed bounds agree."""
    evidence = stats.paired(*paired_lists(200, 30, 10, 60))
    for threshold in (-0.05, 0.0, 0.02, 0.05, 0.1):
        p = evidence.p_value(threshold)
        for alpha in (0.01, 0.025, 0.05, 0.2):
            lo, _ = evidence.bounds(alpha)
            if abs(p - alpha) > 1e-6:
                assert (lo >= threshold - stats.TOLERANCE) == (p <= alpha), (threshold, alpha, p, lo)
    assert evidence.p_value(0.5) == 1.0  # the point itself is below: not even at 50 %


def test_single_binary_is_a_wilson_interval():
    evidence = stats.single([1] * 294 + [0] * 6)
    assert evidence.method == "Wilson score" and evidence.point == 0.98
    lo, hi = evidence.bounds(0.05)
    assert 0.96 < lo < 0.98 < hi < 0.99
    assert evidence.p_value(0.8) < 1e-9


def test_bootstrap_is_seeded_and_covers_a_known_mean():
    rng = random.Random(3)
    diffs = [rng.gauss(0.05, 0.2) for _ in range(400)]
    one, two = stats.paired([d + 0.5 for d in diffs], [0.5] * 400), stats.paired([d + 0.5 for d in diffs], [0.5] * 400)
    assert one.method == "paired bootstrap" and one.bounds(0.05) == two.bounds(0.05)
    lo, hi = one.bounds(0.05)
    se = 0.2 / 400**0.5
    assert lo == pytest.approx(one.point - 1.645 * se, abs=0.004) and hi == pytest.approx(
        one.point + 1.645 * se, abs=0.004
    )
    p = one.p_value(0.0)
    assert (lo >= 0) == (p <= 0.05)


def test_bootstrap_without_spread_or_items_refuses_certainty():
    flat = stats.paired([0.7] * 40, [0.7] * 40)
    lo, hi = flat.bounds(0.05)
    assert flat.method == "no-spread Wilson bound" and lo < -0.05 and hi > 0.05
    assert present(flat.items_needed(-0.02, 0.05)) > 40
    few = stats.paired([0.9, 0.8, 0.7], [0.1, 0.2, 0.3])
    assert few.bounds(0.05) == (-1.0, 1.0) and few.p_value(0.5) == 1.0
    assert present(few.items_needed(0.5, 0.05)) >= stats.MIN_BOOTSTRAP_ITEMS


def test_items_needed_resolves_and_is_none_at_the_threshold():
    evidence = stats.paired(*paired_lists(10, 2, 1, 2))
    needed = evidence.items_needed(-0.02, 0.05)
    assert needed is not None and needed > 15
    assert stats.paired(*paired_lists(10, 2, 2, 1)).items_needed(0.0, 0.05) is None  # difference is exactly 0


def test_holm_levels():
    assert stats.holm_levels([0.01, 0.2, 0.001], 0.05) == pytest.approx([0.025, 0.05, 0.05 / 3])
    # 0.03 fails its 0.025, so the larger 0.04 keeps that level and cannot pass either
    assert stats.holm_levels([0.001, 0.03, 0.04], 0.05) == pytest.approx([0.05 / 3, 0.025, 0.025])
    assert stats.holm_levels([0.2], 0.05) == [0.05] and stats.holm_levels([], 0.05) == []


def test_paired_scores_need_the_same_items():
    with pytest.raises(ValueError, match="same items: 2 candidate vs 3 other"):
        stats.paired([1, 0], [1, 0, 1])


def test_a_bootstrap_bound_finer_than_its_resamples_is_insufficient_not_the_smallest_mean():
    # At alpha below 1 / (RESAMPLES + 1) the bound was the smallest of 10,000 resampled means whatever alpha was:
    # a rouge_l >= 0.455 gate on 25 items passed at "100% interval" where a million resamples put it below.
    rng = random.Random(1)
    values = [min(1.0, max(0.0, rng.gauss(0.6, 0.25))) for _ in range(25)]
    boot = stats.Bootstrap(values, span=(0.0, 1.0))
    assert boot.resolves(1e-3) and boot.bounds(1e-3)[0] > 0.0
    assert not boot.resolves(5e-6) and boot.bounds(5e-6) == (0.0, 1.0)
    assert boot.items_needed(0.455, 5e-6) is None
    # The p-value is never 0 (the sample is one of its resamples), and a bound reaches t exactly when p <= alpha.
    assert boot.p_value(0.0) == pytest.approx(1 / (stats.RESAMPLES + 1))
    for threshold in (0.45, 0.5, 0.55):
        p = boot.p_value(threshold)
        for alpha in (0.001, 0.01, 0.025):
            assert (boot.bounds(alpha)[0] >= threshold - stats.TOLERANCE) == (p <= alpha)


def test_a_few_varying_items_do_not_narrow_the_bootstrap_below_no_spread():
    # 19 equal rouge_l differences and one 0.01 lower bootstrapped to [-0.0015, 0] and passed a 0.02 margin on 20 items.
    flat = stats.paired([0.5] * 20, [0.5] * 20)
    one_off = stats.paired([0.5] * 19 + [0.49], [0.5] * 20)
    assert one_off.method == "paired bootstrap floored at the no-spread bound (1 of 20 items vary)"
    flat_lo, flat_hi = flat.bounds(0.025)
    lo, hi = one_off.bounds(0.025)
    assert lo <= flat_lo + 0.001 and hi >= flat_hi - 0.001 and stats.outcome(lo, hi, -0.02) == "insufficient"
    p = one_off.p_value(-0.02)
    assert p >= flat.p_value(-0.02) and (lo >= -0.02) == (p <= 0.025)
    assert present(one_off.items_needed(-0.02, 0.025)) > 20
    # Many small differences resolve as before: the plain bootstrap, its figures unchanged.
    rng = random.Random(3)
    many = stats.paired([0.5 + rng.gauss(0.01, 0.005) for _ in range(300)], [0.5] * 300)
    assert many.method == "paired bootstrap" and stats.outcome(*many.bounds(0.025), -0.02) == "pass"


def test_float_noise_is_no_spread():
    noise = [0.7 - 0.4] * 10 + [0.6 - 0.3] * 10  # 0.29999999999999993 and 0.3
    boot = stats.Bootstrap(noise, span=(-1.0, 1.0))
    assert boot.method == "no-spread Wilson bound"
    assert boot.bounds(0.025) == pytest.approx(stats.Bootstrap([0.3] * 20, span=(-1.0, 1.0)).bounds(0.025))


def test_one_models_bootstrap_is_not_called_paired():
    rng = random.Random(5)
    assert stats.single([rng.random() for _ in range(50)]).method == "bootstrap"
    assert stats.paired([rng.random() for _ in range(50)], [0.5] * 50).method == "paired bootstrap"


def test_non_finite_scores_are_refused():
    with pytest.raises(ValueError, match=r"candidate has 1 non-finite item scores \(first: item 2, nan\)"):
        stats.paired([0.5, 0.4, float("nan")], [0.5, 0.5, 0.5])
    with pytest.raises(ValueError, match="scores has 1 non-finite"):
        stats.single([0.5, float("inf")])
