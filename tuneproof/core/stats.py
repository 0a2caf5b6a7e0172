"""How sure a verdict is: intervals on per-item scores, their p-values, Holm, and items needed (pure).

Every function here is pure arithmetic over per-item outcomes; eval/gates.py (inside the evaluate job)
and tuneproof/control/comparison.py import it. The unit is the item, and models are compared on paired
differences (the same items, both models), never on two independent means.

Each `Evidence` answers the same three questions about one quantity (a candidate's mean, or the mean
paired difference candidate - other) at a one-sided level alpha:
  bounds(alpha)      the one-sided lower and upper confidence bounds, each at 1 - alpha;
  p_value(t)         the smallest alpha at which the lower bound reaches t (H0: quantity < t);
  items_needed(t, a) how many items, at the rates observed, would put t outside the bounds.
A gate passes when the lower bound reaches its threshold, fails when the upper bound is below it, and
otherwise has insufficient evidence (`outcome`).

Methods, chosen to be right at the edges where a plain bootstrap claims a certainty it does not have
(15 identical outcomes bootstrap to [0, 0]):
  binary scores, one model   Wilson score bounds;
  binary scores, paired      Newcombe's hybrid score interval for paired proportions (Newcombe 1998,
                             method 10): Wilson bounds of each model's proportion, combined with the
                             observed correlation. With no disagreeing pair (b = c = 0) it still has
                             width ~ z^2 / n, so a small perfect set cannot resolve a 0.02 margin;
  continuous scores          a seeded percentile bootstrap of the per-item (differences') mean,
                             10,000 resamples; with no spread at all (values within TOLERANCE of each
                             other), the Wilson bound on the share of items that could differ, over the
                             metric's range ([0, 1]); with spread on fewer than 20 items, bounds at least
                             that wide; under 20 items no bootstrap is trusted (insufficient evidence).
Score intervals hold their level only approximately: the exact rate at which a model sitting on a threshold
passes oscillates around alpha, above it at small n and near 0 or 1 (3 of 3 against 0 of 3 passes a 0.2 gain
21.6 % of the time at alpha 0.025). Under MIN_PASS_ITEMS items no gate passes (eval/gates.py).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from statistics import NormalDist
from typing import Literal, Protocol

import numpy as np

Outcome = Literal["pass", "fail", "insufficient"]

TOLERANCE = 1e-9
"""Metric arithmetic in floats: 0.85 - 0.35 is 0.4999999999999999, which must still meet 0.5."""
MIN_BOOTSTRAP_ITEMS = 20
"""Below this a percentile bootstrap undercovers badly; such a set is 'insufficient evidence'."""
MIN_VARYING_ITEMS = 20
"""A bootstrap only reshuffles the items that vary: with fewer than this many away from the most common value (for
paired differences, the items on which the two models differ) its bounds are widened at least to the no-spread
bound of n identical items. 19 equal differences and one 0.01 lower bootstrapped to [-0.0015, 0] at 95 % and passed
a 0.02 margin on 20 items; with 2-10 of 20-100 items differing, a model exactly on the margin passed 8-10 % of the
time, not 2.5 %. 20, the count below which no bootstrap is trusted at all, applied to the items that carry the
spread: from 30 % of 100 items differing (30) the rate is back near its level."""
MIN_PASS_ITEMS = 5
"""Below this no gate passes (its interval is still shown, and a whole interval on the wrong side still fails:
refusing is the safe side). At alpha 0.025 the exact rate at which a model sitting on the threshold passes is 10-25 %
on 1-4 items (3 of 3 against 0 of 3 passes a 0.2 gain 21.6 % of the time; Wilson, 1 of 1 passes a 0.2 floor 20 %),
at most 12 % on 5-11 and 4-8 % from 12 to 25 (the worst over thresholds 0.05-0.95 and gains -0.1-0.5). 5 removes the
worst and keeps a 5-item smoke evaluation judgeable; a real split is hundreds of items (eval.max_examples: 300)."""
RESAMPLES = 10_000
BOOTSTRAP_SEED = 25
"""Fixed: a verdict replays exactly from the same per-item scores."""
MAX_ITEMS = 10_000_000
"""items_needed looks no further (the config's own ceiling on eval.max_examples)."""


def z_for(alpha: float) -> float:
    """The one-sided standard-normal quantile: z with P(Z > z) = alpha."""
    return NormalDist().inv_cdf(1.0 - alpha)


def outcome(lo: float, hi: float, threshold: float) -> Outcome:
    """pass: the lower bound reaches the threshold; fail: the upper bound is below it; else insufficient."""
    if lo >= threshold - TOLERANCE:
        return "pass"
    if hi < threshold - TOLERANCE:
        return "fail"
    return "insufficient"


class Evidence(Protocol):
    method: str
    n: int
    point: float

    def bounds(self, alpha: float) -> tuple[float, float]: ...

    def p_value(self, threshold: float) -> float: ...

    def items_needed(self, threshold: float, alpha: float) -> int | None: ...

    def resolves(self, alpha: float) -> bool:
        """False where the method itself cannot give a bound at alpha, however many items there are."""
        ...


# ---- binary outcomes ---------------------------------------------------------------------------------


def wilson(k: float, n: float, z: float) -> tuple[float, float]:
    """Wilson score bounds of a proportion k/n at z (counts may be fractional: scaled rates)."""
    if n <= 0:
        return 0.0, 1.0
    p = k / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z / denom * math.sqrt(max(p * (1 - p) / n + z * z / (4 * n * n), 0.0))
    return max(0.0, center - half), min(1.0, center + half)


@dataclass(frozen=True)
class PairedCounts:
    """Paired binary outcomes: a both right, b only the candidate right, c only the other right, d neither."""

    a: float
    b: float
    c: float
    d: float

    @classmethod
    def of(cls, candidate: Sequence[float], other: Sequence[float]) -> PairedCounts:
        if len(candidate) != len(other):
            raise ValueError(f"paired scores need the same items: {len(candidate)} candidate vs {len(other)} other")
        pairs = list(zip((bool(x) for x in candidate), (bool(y) for y in other)))
        return cls(
            a=sum(x and y for x, y in pairs),
            b=sum(x and not y for x, y in pairs),
            c=sum(y and not x for x, y in pairs),
            d=sum(not x and not y for x, y in pairs),
        )

    @property
    def n(self) -> float:
        return self.a + self.b + self.c + self.d

    def scaled(self, n: float) -> PairedCounts:
        f = n / self.n
        return PairedCounts(self.a * f, self.b * f, self.c * f, self.d * f)


def newcombe_paired(counts: PairedCounts, z: float) -> tuple[float, float]:
    """Newcombe's hybrid score bounds for p(candidate) - p(other) on paired binary outcomes."""
    a, b, c, d, n = counts.a, counts.b, counts.c, counts.d, counts.n
    p1, p2 = (a + b) / n, (a + c) / n
    l1, u1 = wilson(a + b, n, z)
    l2, u2 = wilson(a + c, n, z)
    margins = (a + b) * (c + d) * (a + c) * (b + d)
    cross = a * d - b * c
    # Newcombe's correlation estimate, with his continuity correction of a positive one (method 10 as published).
    if margins <= 0 or 0 <= cross <= n / 2:
        phi = 0.0
    else:
        phi = (cross - n / 2 if cross > 0 else cross) / math.sqrt(margins)
    delta = p1 - p2
    lo = delta - math.sqrt(max((p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2, 0.0))
    hi = delta + math.sqrt(max((u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2, 0.0))
    return max(-1.0, lo), min(1.0, hi)


class _ScoreInterval:
    """Shared by the score-type intervals: p-value by bisection, items needed by scaling the rates."""

    n: int

    def bounds(self, alpha: float) -> tuple[float, float]:
        return self._bounds_at(self.n, z_for(alpha))

    def _bounds_at(self, n: float, z: float) -> tuple[float, float]:
        raise NotImplementedError

    def p_value(self, threshold: float) -> float:
        """Smallest one-sided alpha whose lower bound reaches `threshold`; 1.0 when even the point does not."""
        if self._bounds_at(self.n, 0.0)[0] < threshold - TOLERANCE:
            return 1.0
        lo_z, hi_z = 0.0, 40.0  # the lower bound falls as z grows; find where it crosses the threshold
        if self._bounds_at(self.n, hi_z)[0] >= threshold - TOLERANCE:
            return 0.0
        for _ in range(60):
            mid = (lo_z + hi_z) / 2
            lo_z, hi_z = (mid, hi_z) if self._bounds_at(self.n, mid)[0] >= threshold - TOLERANCE else (lo_z, mid)
        return 1.0 - NormalDist().cdf(lo_z)

    def resolves(self, alpha: float) -> bool:
        return True

    def items_needed(self, threshold: float, alpha: float) -> int | None:
        """Fewest items, at the observed rates, whose bounds leave `threshold` outside; None if none up to MAX_ITEMS."""
        z = z_for(alpha)

        def resolved(n: float) -> bool:
            return outcome(*self._bounds_at(n, z), threshold) != "insufficient"

        if not resolved(MAX_ITEMS):
            return None
        lo, hi = 1, MAX_ITEMS
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if resolved(mid) else (mid + 1, hi)
        return lo


class PairedBinary(_ScoreInterval):
    """Mean of candidate - other over paired 0/1 outcomes (Newcombe's hybrid score interval)."""

    method = "Newcombe paired score"

    def __init__(self, candidate: Sequence[float], other: Sequence[float]):
        self.counts = PairedCounts.of(candidate, other)
        self.n = len(candidate)
        self.point = (self.counts.b - self.counts.c) / self.n

    def _bounds_at(self, n: float, z: float) -> tuple[float, float]:
        return newcombe_paired(self.counts.scaled(n), z)


class SingleBinary(_ScoreInterval):
    """One model's share of correct items (Wilson score interval)."""

    method = "Wilson score"

    def __init__(self, scores: Sequence[float]):
        self.n = len(scores)
        self.hits = sum(bool(s) for s in scores)
        self.point = self.hits / self.n

    def _bounds_at(self, n: float, z: float) -> tuple[float, float]:
        return wilson(self.hits * n / self.n, n, z)


# ---- continuous outcomes ------------------------------------------------------------------------------


class Bootstrap:
    """Mean of per-item values (scores, or paired differences) by a seeded percentile bootstrap.

    `span` is the range each value can take ((0, 1) for a score in [0, 1], (-1, 1) for a difference of
    two): with no spread at all (every value within TOLERANCE of the others: 0.7 - 0.4 and 0.6 - 0.3 are one
    value), the bounds are the Wilson bound on the share of items that could differ from the observed value,
    stretched over that range, instead of the bootstrap's false [v, v]. With spread on fewer than
    MIN_VARYING_ITEMS items, the bootstrap's bounds are widened at least to that no-spread bound (`floored`):
    a few varying items cannot promise more than none would. `paired` only names the method.
    """

    def __init__(
        self, values: Sequence[float], span: tuple[float, float], seed: int = BOOTSTRAP_SEED, paired: bool = False
    ):
        self.values = np.asarray(values, dtype=float)
        self.n = len(self.values)
        self.point = float(self.values.mean()) if self.n else math.nan
        self.span = span
        self.varying = varying_items(self.values)
        self.constant = self.n > 0 and self.varying == 0
        self.floored = not self.constant and self.varying < MIN_VARYING_ITEMS
        name = "paired bootstrap" if paired else "bootstrap"
        if self.constant:
            self.method = "no-spread Wilson bound"
        elif self.floored and self.n >= MIN_BOOTSTRAP_ITEMS:
            self.method = f"{name} floored at the no-spread bound ({self.varying} of {self.n} items vary)"
        else:
            self.method = name
        self.means = np.empty(0) if self.constant or self.n < MIN_BOOTSTRAP_ITEMS else self._resample(seed)

    def _resample(self, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        means = np.empty(RESAMPLES)
        for start in range(0, RESAMPLES, 1000):  # 1000 resamples at a time: memory stays n * 1000 floats
            idx = rng.integers(0, self.n, size=(min(1000, RESAMPLES - start), self.n))
            means[start : start + len(idx)] = self.values[idx].mean(axis=1)
        return np.sort(means)

    def bounds(self, alpha: float) -> tuple[float, float]:
        if self.constant:
            return self._no_spread_bounds(self.n, z_for(alpha))
        if self.n < MIN_BOOTSTRAP_ITEMS or not self.resolves(alpha):
            return self.span
        # The (R + 1) * alpha-th smallest of R resampled means (Davison & Hinkley 1997, 5.2), which agrees with
        # p_value: the bound reaches a threshold exactly when p <= alpha.
        k = _tail_rank(alpha)
        lo, hi = float(self.means[k]), float(self.means[RESAMPLES - 1 - k])
        if self.floored:
            floor_lo, floor_hi = self._no_spread_bounds(self.n, z_for(alpha))
            lo, hi = min(lo, floor_lo), max(hi, floor_hi)
        return lo, hi

    def resolves(self, alpha: float) -> bool:
        """Whether RESAMPLES resamples reach a bound at alpha: below 1 / (R + 1) the bound would be the smallest
        resampled mean whatever alpha is (a 99.999 % bound equal to a 99.99 % one), a certainty never shown."""
        return self.constant or _tail_rank(alpha) >= 0

    def _no_spread_bounds(self, n: float, z: float) -> tuple[float, float]:
        share = wilson(0, n, z)[1]
        low, high = self.span
        return self.point - share * (self.point - low), self.point + share * (high - self.point)

    def p_value(self, threshold: float) -> float:
        """Share of resampled means below the threshold: pass at alpha exactly when p <= alpha. Floored, the larger
        of that and the no-spread bound's p-value: the lower bound is the smaller of the two bounds."""
        if self.constant:
            return _ScoreIntervalOf(self).p_value(threshold)
        if self.n < MIN_BOOTSTRAP_ITEMS:
            return 1.0
        # (below + 1) / (R + 1): a Monte Carlo p-value is never 0, since the observed sample is one of the resamples
        p = (int(np.searchsorted(self.means, threshold - TOLERANCE, side="left")) + 1) / (RESAMPLES + 1)
        return max(p, _ScoreIntervalOf(self).p_value(threshold)) if self.floored else p

    def items_needed(self, threshold: float, alpha: float) -> int | None:
        """Normal approximation at the observed spread: n = (z * sd / |mean - threshold|)^2, at least 20; floored,
        at least the items the no-spread bound needs too."""
        if self.constant:
            return _ScoreIntervalOf(self).items_needed(threshold, alpha)
        if not self.resolves(alpha):
            return None
        gap = abs(self.point - threshold)
        if gap <= TOLERANCE:
            return None
        sd = float(self.values.std(ddof=1))
        needed = max(MIN_BOOTSTRAP_ITEMS, math.ceil((z_for(alpha) * sd / gap) ** 2))
        if self.floored:
            floor = _ScoreIntervalOf(self).items_needed(threshold, alpha)
            needed = MAX_ITEMS + 1 if floor is None else max(needed, floor)
        return needed if needed <= MAX_ITEMS else None


def _tail_rank(alpha: float) -> int:
    """The 0-based rank of the resampled mean that bounds a one-sided interval at alpha; -1 where none does."""
    return min(math.floor(alpha * (RESAMPLES + 1)) - 1, RESAMPLES - 1)


class _ScoreIntervalOf(_ScoreInterval):
    """A constant bootstrap's Wilson-type bounds, with the score-interval p-value and items needed."""

    def __init__(self, source: Bootstrap):
        self.source, self.n = source, source.n

    def _bounds_at(self, n: float, z: float) -> tuple[float, float]:
        return self.source._no_spread_bounds(n, z)


def varying_items(values: np.ndarray) -> int:
    """How many values lie away from the most common one, values within TOLERANCE of a neighbour counting as one
    (float noise: 0.7 - 0.4 is 0.29999999999999993, 0.6 - 0.3 is 0.3)."""
    if len(values) == 0:
        return 0
    ordered = np.sort(values)
    group = np.concatenate(([0], np.cumsum(np.diff(ordered) > TOLERANCE)))
    return len(values) - int(np.bincount(group).max())


def is_binary(*score_lists: Sequence[float]) -> bool:
    """True when every score is 0 or 1 (exact match, accuracy): the paired-proportion methods apply."""
    return all(s in (0.0, 1.0) for scores in score_lists for s in scores)


def paired(candidate: Sequence[float], other: Sequence[float]) -> Evidence:
    """Evidence on mean(candidate - other), paired by item; binary or continuous by the scores."""
    if len(candidate) != len(other):
        raise ValueError(f"paired scores need the same items: {len(candidate)} candidate vs {len(other)} other")
    _require_finite(candidate, "candidate")
    _require_finite(other, "other")
    if is_binary(candidate, other):
        return PairedBinary(candidate, other)
    return Bootstrap([x - y for x, y in zip(candidate, other)], span=(-1.0, 1.0), paired=True)


def single(scores: Sequence[float]) -> Evidence:
    """Evidence on one model's mean score."""
    _require_finite(scores, "scores")
    return SingleBinary(scores) if is_binary(scores) else Bootstrap(scores, span=(0.0, 1.0))


def _require_finite(scores: Sequence[float], whose: str) -> None:
    """A NaN or infinite score makes every bound NaN or infinite, which a gate could read as a pass: refuse it."""
    bad = [(i, s) for i, s in enumerate(scores) if not math.isfinite(s)]
    if bad:
        raise ValueError(f"{whose} has {len(bad)} non-finite item scores (first: item {bad[0][0]}, {bad[0][1]})")


# ---- several verdicts at once ------------------------------------------------------------------------


def holm_levels(p_values: Sequence[float], alpha: float) -> list[float]:
    """Holm's step-down: the one-sided level at which each hypothesis is tested, in the input's order.

    The i-th smallest p-value (0-based) is tested at alpha / (k - i) while every smaller one was
    rejected; from the first that is not, the rest keep that level (none of them can pass). A verdict
    that reads its bounds at its level therefore agrees with Holm's decisions exactly.
    """
    k = len(p_values)
    order = sorted(range(k), key=lambda i: p_values[i])
    levels = [alpha] * k
    level, stopped = alpha / k if k else alpha, False
    for rank, i in enumerate(order):
        if not stopped:
            level = alpha / (k - rank)
            stopped = p_values[i] > level
        levels[i] = level
    return levels


# ---- repeated measurements (compare, canary) ----------------------------------------------------------


def t_cdf(t: float, df: float) -> float:
    """Student's t distribution function, by Simpson's rule over its density (no scipy in the job image)."""
    if math.isinf(df):
        return NormalDist().cdf(t)
    log_c = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)

    def density(x: float) -> float:
        return math.exp(log_c - (df + 1) / 2 * math.log1p(x * x / df))

    steps, x = 200, abs(t)
    h = x / steps
    area = density(0) + density(x) + sum((4 if i % 2 else 2) * density(i * h) for i in range(1, steps))
    half = area * h / 3
    return 0.5 + half if t >= 0 else 0.5 - half


@functools.lru_cache(maxsize=1024)
def t_quantile(p: float, df: float) -> float:
    """The t with t_cdf(t, df) = p, for p in (0.5, 1), by bisection."""
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2
    for _ in range(40):  # to ~1e-12 of the bracket: far finer than any interval is printed
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if t_cdf(mid, df) < p else (lo, mid)
    return (lo + hi) / 2


@dataclass(frozen=True)
class RatioInterval:
    """B/A as a ratio of geometric means, with a Student t interval on the log scale: valid at 2 repeats an
    arm when log values are roughly normal with a common spread (timings and throughputs, whose noise is
    multiplicative). Pooled rather than Welch: at 2-3 repeats Welch's own degrees of freedom are noise."""

    ratio: float
    lo: float
    hi: float
    df: int
    log_sd: float
    """The pooled standard deviation of one repeat's log value: what repeats_needed scales."""


def log_ratio_interval(a: Sequence[float], b: Sequence[float], confidence: float = 0.95) -> RatioInterval | None:
    """None when an arm has fewer than 2 values or a value <= 0 (no logarithm)."""
    if len(a) < 2 or len(b) < 2 or min(*a, *b) <= 0:
        return None
    la, lb = [math.log(x) for x in a], [math.log(x) for x in b]
    df = len(la) + len(lb) - 2
    pooled = math.sqrt((_variance(la) * (len(la) - 1) + _variance(lb) * (len(lb) - 1)) / df)
    d = sum(lb) / len(lb) - sum(la) / len(la)
    half = t_quantile(0.5 + confidence / 2, df) * pooled * math.sqrt(1 / len(la) + 1 / len(lb))
    return RatioInterval(math.exp(d), math.exp(d - half), math.exp(d + half), df, pooled)


def repeats_needed(ratio: float, log_sd: float, threshold: float, confidence: float = 0.95) -> int | None:
    """Repeats an arm at which the interval, at a ratio and a repeat's log spread like those seen, would either
    exclude 1 or fit inside 1 +/- threshold: whichever is nearer. None when that is more than 1,000 repeats."""
    d, band = abs(math.log(ratio)), math.log1p(threshold)
    target = max(d, band - d)

    def resolves(n: int) -> bool:
        return t_quantile(0.5 + confidence / 2, 2 * n - 2) * log_sd * math.sqrt(2 / n) <= target

    if not resolves(1000):
        return None
    lo, hi = 2, 1000  # the half-width shrinks as n grows: bisect for the first n that resolves
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if resolves(mid) else (mid + 1, hi)
    return lo


def log_sd(values: Sequence[float]) -> float | None:
    """The standard deviation of the values' logarithms; None below 2 values or with a value <= 0."""
    if len(values) < 2 or min(values) <= 0:
        return None
    return math.sqrt(_variance([math.log(x) for x in values]))


def _variance(xs: Sequence[float]) -> float:
    mean = sum(xs) / len(xs)
    return sum((x - mean) ** 2 for x in xs) / (len(xs) - 1)
