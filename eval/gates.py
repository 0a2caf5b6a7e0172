"""The gate decision: does the candidate beat its base and hold against the incumbent, and how sure is that?

Pure: each model's metrics and per-item scores plus the gate policy in, a GateDecision out; no I/O. The
evaluate job calls `decide` on what it scored; the promote task only reads the decision it left behind.

Each threshold is decided on an interval over the items (tuneproof/core/stats.py), paired by item when
two models are compared: a two-sided interval at `eval.confidence` (so a model exactly at a threshold
passes approximately (1 - confidence) / 2 of the time: score intervals, exceeded at very small n, so no gate passes
on fewer than stats.MIN_PASS_ITEMS items, nor a bootstrap on fewer than stats.MIN_BOOTSTRAP_ITEMS), widened by Holm's
step-down across the gates decided at once:
  min              the candidate's own lower bound must reach the threshold (a lower bound, not the point:
                   an absolute floor is met only when the items show it);
  min_improvement  the lower bound of candidate - base must reach the threshold;
  max_regression   non-inferiority: the lower bound of candidate - incumbent must stay above -margin
                   (shown as a regression, incumbent - candidate, whose upper bound must stay within it);
  max_regression_vs_base  the same against the base (a regression suite: the fine-tune must not forget).
Three outcomes: pass; fail (the whole interval is on the wrong side); insufficient evidence (it straddles
the threshold: promotion is refused, with the number of items that would resolve it). A metric's gates that a
candidate scoring the worst on every item (0; 1 when lower is better) would all pass cannot tell a candidate that
lost what it measures: its comparisons with base and incumbent read insufficient evidence, saying why (a base
that scores 0.15 on a suite with margin 0.25 passes a candidate that answers nothing right). A floor alone (`min`)
keeps its verdict: it is the policy's own choice (the canary's gates only ask that a metric was computed).
Lines look like
    exact_match >= 0.8: 0.98 [0.957, 0.9908] (n=300, Wilson score, 98.33% interval: 95% with Holm over 3, p<0.0001) (pass)
A metric without per-item scores for every model compared (eval_loss, perplexity: token-weighted over the split;
a hub metric that is corpus-level) is compared on its point value, and the line says so. A missing, NaN or infinite
value fails its gate: it proves nothing (a diverged model's loss is its own). Per-item scores that one model has and
another lacks, an empty list, or an item score that is NaN or infinite make the gate insufficient evidence, naming
the model: half the evidence is no reason to fall back to the points.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from tuneproof.core import stats
from tuneproof.core.config_eval import Gate
from tuneproof.core.stats import TOLERANCE, Evidence
from tuneproof.core.summaries_eval import GateDecision, GateKind, GateOutcome, Verdict, p_text

Metrics = Mapping[str, Any]
POINT = "point (no per-item scores)"
"""The method of a verdict on a metric's value alone (eval_loss, perplexity: token-weighted over the split)."""


@dataclass(frozen=True)
class Scores:
    """One model's evaluation: each metric's value, and, for metrics scored item by item, each item's score
    (the same items in the same order for every model)."""

    metrics: Metrics
    items: Mapping[str, Sequence[float]] = field(default_factory=dict)


@dataclass(frozen=True)
class Check:
    """One threshold before the decision: its quantity is `sign * value` must reach `sign * threshold`."""

    metric: str
    gate: GateKind
    head: str
    threshold: float
    detail: str = ""
    evidence: Evidence | None = None
    point: float | None = None
    """The quantity as shown (a regression is shown as incumbent - candidate)."""
    shown_sign: float = 1.0
    """-1 for a regression: shown value = -(candidate - incumbent)."""
    shown_offset: float = 0.0
    """1 for a lower-is-better score, tested as 1 - score: shown value = shown_offset + shown_sign * tested."""
    target: float = 0.0
    """The threshold on the tested quantity (candidate, or candidate - other)."""
    settled: tuple[GateOutcome, str] | None = None
    """(outcome, words) when no interval is involved: a missing value, no incumbent, a point comparison, or per-item
    scores that cannot carry one (insufficient: the words end with why)."""
    worst: float | None = None
    """The tested quantity a candidate would have that scores the worst on every item (0, or 1 when lower is
    better: 0 once tested as 1 - score); None without per-item scores. A check it meets cannot show a loss."""
    blind_words: str = ""
    """Why a comparison that `meets_worst` is no evidence, with the numbers (`blind_metrics`)."""

    def meets_worst(self) -> bool:
        """Whether a candidate that scores the worst on every item would meet this threshold too."""
        return self.worst is not None and self.worst >= self.target - TOLERANCE


def decide(
    candidate: Scores,
    base: Scores,
    incumbent: Scores | None,
    policy: Mapping[str, Gate],
    confidence: float = 0.95,
    split_sha256: str | None = None,
) -> GateDecision:
    """Apply every threshold of every gate in `policy` (metric name -> config.Gate).

    Passes only when every verdict passes; an empty policy passes with a line saying so.
    """
    checks = [c for metric, gate in policy.items() for c in _checks(metric, gate, candidate, base, incumbent)]
    if not checks:
        return GateDecision(passed=True, lines=["no gates configured: nothing to check"], verdicts=[])
    tested = [c for c in checks if c.evidence is not None]
    blind = blind_metrics(tested)
    alpha = (1.0 - confidence) / 2  # each bound of a two-sided interval at `confidence`
    p_values = [c.evidence.p_value(c.target) for c in tested if c.evidence is not None]
    levels = dict(zip(map(id, tested), stats.holm_levels(p_values, alpha)))
    family = f"{fmt(100 * confidence)}% with Holm over {len(tested)}" if len(tested) > 1 else None
    verdicts = [
        _verdict(c, levels.get(id(c), alpha), p, family, split_sha256, c.metric in blind and c.gate != "min")
        for c, p in zip(checks, _p_values_in_order(checks, tested, p_values))
    ]
    return GateDecision(passed=all(v.passed for v in verdicts), lines=[v.line for v in verdicts], verdicts=verdicts)


def blind_metrics(tested: Sequence[Check]) -> set[str]:
    """The metrics with a comparison whose every interval-decided gate a candidate scoring the worst on every item
    would pass. Such gates cannot show a loss: a base at 0.15 and a margin of 0.25 pass a candidate that forgot all
    of a skill. Judged per metric, not per gate: a comparison the other model cannot lose to (an incumbent that
    scores 0) is no evidence, but it is no doubt either while another gate on the metric (vs base, a floor) can
    tell; only when none can is the comparison insufficient evidence."""
    metrics = {c.metric for c in tested if c.gate != "min"}
    return {m for m in metrics if all(c.meets_worst() for c in tested if c.metric == m)}


def _p_values_in_order(checks: list[Check], tested: list[Check], p_values: list[float]) -> list[float | None]:
    by_check = dict(zip(map(id, tested), p_values))
    return [by_check.get(id(c)) for c in checks]


# ---- the checks each gate asks for --------------------------------------------------------------------


def _checks(metric: str, gate: Gate, candidate: Scores, base: Scores, incumbent: Scores | None) -> list[Check]:
    checks = []
    if gate.min is not None:
        checks.append(_min_check(metric, gate, gate.min, candidate))
    if gate.min_improvement is not None:
        head = f"{metric} improvement over base >= {fmt(gate.min_improvement)}"
        checks.append(
            _paired_check(metric, gate, "min_improvement", head, gate.min_improvement, candidate, base, "base")
        )
    if gate.max_regression_vs_base is not None:
        head = f"{metric} regression vs base <= {fmt(gate.max_regression_vs_base)}"
        threshold = gate.max_regression_vs_base
        checks.append(_paired_check(metric, gate, "max_regression_vs_base", head, threshold, candidate, base, "base"))
    if gate.max_regression is not None:
        head = f"{metric} regression vs incumbent <= {fmt(gate.max_regression)}"
        if incumbent is None:
            settled: tuple[GateOutcome, str] = ("pass", "no incumbent: first model, regression gate not applicable")
            checks.append(Check(metric, "max_regression", head, gate.max_regression, settled=settled))
        else:
            checks.append(
                _paired_check(
                    metric, gate, "max_regression", head, gate.max_regression, candidate, incumbent, "incumbent"
                )
            )
    return checks


def _min_check(metric: str, gate: Gate, threshold: float, candidate: Scores) -> Check:
    head = f"{metric} {'>=' if gate.higher_is_better else '<='} {fmt(threshold)}"
    value = _read(candidate.metrics, metric, "candidate")
    if isinstance(value, str):
        return Check(metric, "min", head, threshold, settled=("fail", value))
    sign = 1.0 if gate.higher_is_better else -1.0
    items = candidate.items.get(metric)
    if items is None:
        passed = sign * value >= sign * threshold - TOLERANCE
        words = f"{fmt(value)} (point: no per-item scores)"
        return Check(metric, "min", head, threshold, point=value, settled=(_word(passed), words))
    if problem := _items_problem(metric, [("candidate", items)]):
        words = f"{fmt(value)} (insufficient evidence: {problem})"
        return Check(metric, "min", head, threshold, point=value, settled=("insufficient", words))
    if sign > 0:
        evidence = stats.single(items)
        return Check(metric, "min", head, threshold, evidence=evidence, point=value, target=threshold, worst=0.0)
    # Lower is better: tested as 1 - score, so 0/1 items keep the score interval (a bootstrap of 58 of 60 claims a
    # certainty that Wilson does not) and the verdict is the one the same items give read the other way round.
    evidence = stats.single([1.0 - x for x in items])
    return Check(
        metric,
        "min",
        head,
        threshold,
        evidence=evidence,
        point=value,
        shown_sign=-1.0,
        shown_offset=1.0,
        target=1.0 - threshold,
        worst=0.0,
    )


def _paired_check(
    metric: str,
    gate: Gate,
    kind: GateKind,
    head: str,
    threshold: float,
    candidate: Scores,
    other: Scores,
    role: str,
) -> Check:
    """Gain = candidate - other (other - candidate when lower is better); improvement shows the gain, a
    regression shows its negative. The tested quantity is always the gain."""
    cand, ref = _read(candidate.metrics, metric, "candidate"), _read(other.metrics, metric, role)
    if isinstance(cand, str) or isinstance(ref, str):
        return Check(metric, kind, head, threshold, settled=("fail", cand if isinstance(cand, str) else str(ref)))
    sign = 1.0 if gate.higher_is_better else -1.0
    gain = sign * (cand - ref)
    shown_sign = 1.0 if kind == "min_improvement" else -1.0
    target = threshold if kind == "min_improvement" else -threshold
    detail = f"candidate {fmt(cand)}, {role} {fmt(ref)}"
    ours, theirs = candidate.items.get(metric), other.items.get(metric)
    if ours is None and theirs is None:  # a metric no model scores item by item (eval_loss): only points exist
        passed = gain >= target - TOLERANCE
        words = f"{fmt(shown_sign * gain, signed=True)} ({detail}; point: no per-item scores)"
        return Check(metric, kind, head, threshold, point=shown_sign * gain, settled=(_word(passed), words))
    if problem := _items_problem(metric, [("candidate", ours), (role, theirs)]):
        words = f"{fmt(shown_sign * gain, signed=True)} ({detail}) (insufficient evidence: {problem})"
        return Check(metric, kind, head, threshold, point=shown_sign * gain, settled=("insufficient", words))
    assert ours is not None and theirs is not None  # _items_problem names a missing list
    if len(ours) != len(theirs):
        raise ValueError(
            f"{metric}: candidate has {len(ours)} item scores, {role} {len(theirs)}; a paired gate needs the same items"
        )
    if sign < 0:  # (1 - candidate) - (1 - other) is the gain, with the paired score interval for 0/1 items
        ours, theirs = [1.0 - x for x in ours], [1.0 - y for y in theirs]
    evidence = stats.paired(ours, theirs)
    worst = -sum(theirs) / len(theirs)  # a candidate at 0 on every tested item, less the other model's mean
    blind = _blind_words(metric, kind, threshold, (role, ref, -worst), 0.0 if sign > 0 else 1.0)
    return Check(
        metric,
        kind,
        head,
        threshold,
        detail,
        evidence,
        shown_sign * gain,
        shown_sign,
        target=target,
        worst=worst,
        blind_words=blind,
    )


# ---- the verdict -----------------------------------------------------------------------------------------


def _verdict(
    check: Check, alpha: float, p: float | None, family: str | None, split: str | None, blind: bool = False
) -> Verdict:
    common = {"metric": check.metric, "gate": check.gate, "threshold": check.threshold, "split_sha256": split}
    if check.evidence is None:
        word, words = check.settled or ("fail", "nothing to decide on")
        # Insufficient words already end with why; "not applicable" is neither a pass nor a fail to show.
        said = word == "insufficient" or "not applicable" in words
        line = f"{check.head}: {words}" + ("" if said else f" ({word})")
        # A point comparison names its method, so that no table reads its verdict as "n/a (no incumbent)".
        method = POINT if check.point is not None and word != "insufficient" else None
        passed = word == "pass"
        return Verdict(**common, value=check.point, passed=passed, outcome=word, line=line, method=method)
    evidence = check.evidence
    lo, hi = evidence.bounds(alpha)
    result: GateOutcome = "insufficient" if blind else stats.outcome(lo, hi, check.target)
    too_few = result == "pass" and evidence.n < stats.MIN_PASS_ITEMS  # the interval errs well above its level there
    result = "insufficient" if too_few else result
    needed = evidence.items_needed(check.target, alpha) if result == "insufficient" and not blind else None
    needed = max(needed or 0, stats.MIN_PASS_ITEMS) if too_few else needed
    unresolvable = not evidence.resolves(alpha)
    shown = sorted((check.shown_offset + check.shown_sign * lo, check.shown_offset + check.shown_sign * hi))
    interval = (shown[0], shown[1])
    level = 1.0 - 2 * alpha
    signed = check.gate != "min"
    text = f"{fmt(check.point or 0.0, signed)} [{fmt(interval[0], signed)}, {fmt(interval[1], signed)}]"
    how = f"n={evidence.n}, {evidence.method}, {fmt(100 * level)}% interval"
    how += f": {family}" if family else ""
    how += f", {p_text(p)}" if p is not None else ""
    context = f"{check.detail}; {how}" if check.detail else how
    words = _outcome_words(result, needed, check.threshold, check.gate)
    if unresolvable and result == "insufficient":  # the method, not the items, is what cannot tell
        words = (
            f"insufficient evidence: {stats.RESAMPLES:,} bootstrap resamples cannot give a {100 * (1 - alpha):.6g}% one-sided "
            "bound: lower eval.confidence, or gate fewer metrics at once (Holm divides the level among them)"
        )
    if too_few:
        words = (
            f"insufficient evidence: {evidence.n} items are too few for a pass, whatever the interval: on fewer than "
            f"{stats.MIN_PASS_ITEMS} a score interval passes a model on the threshold several times more often "
            "than its level"
        )
    if blind:  # no number of items helps: the threshold itself lets the worst candidate through
        words = f"insufficient evidence: {check.blind_words}"
    line = f"{check.head}: {text} ({context}) ({words})"
    return Verdict(
        **common,
        value=check.point,
        passed=result == "pass",
        outcome=result,
        line=line,
        n=evidence.n,
        method=evidence.method,
        interval=interval,
        level=level,
        p_value=p,
        items_needed=needed,
    )


def _outcome_words(result: GateOutcome, needed: int | None, threshold: float, gate: GateKind) -> str:
    """'pass', 'fail', or why the items cannot tell, never that the model is worse."""
    if result != "insufficient":
        return result
    head = f"insufficient evidence: the interval straddles {fmt(threshold)}"
    if needed is None:
        return f"{head}, and no number of items resolves a value this close to it"
    rates = "score" if gate == "min" else "disagreement"
    return f"{head}; about {needed:,} items at the observed {rates} would resolve it"


def _blind_words(metric: str, kind: GateKind, threshold: float, other: tuple[str, float, float], worst: float) -> str:
    """'the base scores 0.15, so a candidate that scored 0 on every item would pass this gate (0.25) and every other
    on exact_match: these items cannot show a loss at this margin; lower the margin below 0.15 or use items the base
    answers'. `other`: the role compared with, its value, and its mean as tested (1 - value when lower is better)."""
    role, value, tested = other
    what = "threshold" if kind == "min_improvement" else "margin"
    if kind == "min_improvement":
        remedy = f"raise the threshold above {fmt(-tested)} or "
    elif tested > TOLERANCE:
        remedy = f"lower the margin below {fmt(tested)} or "
    else:  # no margin above 0 can show the loss of what the other model never had
        remedy = ""
    return (
        f"the {role} scores {fmt(value)}, so a candidate that scored {fmt(worst)} on every item would pass this gate "
        f"({fmt(threshold)}) and every other on {metric}: these items cannot show a loss at this {what}; {remedy}"
        f"use items the {role} answers"
    )


def _word(passed: bool) -> GateOutcome:
    return "pass" if passed else "fail"


def _items_problem(metric: str, sides: Sequence[tuple[str, Sequence[float] | None]]) -> str | None:
    """Why these models' per-item scores cannot carry an interval, naming the model and the value: one model has
    none while another has some, an empty list (n=0), or a score that is NaN or infinite (its bounds would be too,
    and a NaN bound compares as a pass). None when every list can be used."""
    for role, items in sides:
        if items is None:
            have = ", ".join(f"the {r} has {len(i)}" for r, i in sides if i is not None)
            return f"the {role} has no per-item scores on {metric} ({have}): an interval needs every model's items"
        if not items:
            return f"the {role}'s per-item scores on {metric} are an empty list: n=0"
        bad = [(i, x) for i, x in enumerate(items) if not math.isfinite(x)]
        if bad:
            i, x = bad[0]
            return (
                f"the {role}'s item {i} on {metric} scores {x} ({len(bad)} of {len(items)} items not a finite number): "
                "no interval stands on it"
            )
    return None


def _read(metrics: Metrics, metric: str, role: str) -> float | str:
    """The value, or why it cannot be compared: missing, not a number, NaN or infinite."""
    raw = metrics.get(metric)
    if raw is None:
        return f"{role} value missing (have: {', '.join(sorted(metrics)) or 'none'})"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return f"{role} value is not a number ({raw!r})"
    if math.isnan(value):
        return f"{role} value is NaN"
    if math.isinf(value):  # an infinite base loss made "improvement over base ... +inf (pass)"
        return f"{role} value is {fmt(value)}: not a finite number"
    return value


def fmt(x: float, signed: bool = False) -> str:
    """Short, stable number text: 4 significant digits, whole numbers from 1000 (perplexities)."""
    x = x + 0.0  # -0.0 (a zero regression) prints as 0
    if math.isinf(x):
        text = "inf" if x > 0 else "-inf"
    elif 1000 <= abs(x) < 1e6:
        text = f"{x:.0f}"
    else:
        text = f"{x:.4g}"
    return "+" + text if signed and x >= 0 else text
