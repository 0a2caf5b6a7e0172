"""The gate decision: does the candidate beat its base and hold against the incumbent?

Pure: metric dicts and the gate policy in, a GateDecision out; no I/O. The evaluate job calls
`decide` on the metrics it computed; the promote task only reads the decision it left behind.
Each configured threshold gives one verdict with one human line, e.g.
    exact_match >= 0.8: 0.93 (pass)
    exact_match improvement over base >= 0.5: +0.93 (candidate 0.93, base 0) (pass)
    exact_match regression vs incumbent <= 0.02: +0.01 (candidate 0.93, incumbent 0.94) (pass)
A missing or NaN value fails its gate: a metric that could not be computed proves nothing.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from tuneproof.core.config import Gate
from tuneproof.core.summaries import GateDecision, GateKind, Verdict

Metrics = Mapping[str, Any]

# Metric arithmetic in floats: 0.85 - 0.35 is 0.4999999999999999, which must still meet 0.5.
TOLERANCE = 1e-9


def decide(candidate: Metrics, base: Metrics, incumbent: Metrics | None, policy: Mapping[str, Gate]) -> GateDecision:
    """Apply every threshold of every gate in `policy` (metric name -> config.Gate or alike).

    Passes only when every verdict passes; an empty policy passes with a line saying so.
    """
    verdicts = [
        v for metric, gate in policy.items() for v in _metric_verdicts(metric, gate, candidate, base, incumbent)
    ]
    if not verdicts:
        return GateDecision(passed=True, lines=["no gates configured: nothing to check"], verdicts=[])
    return GateDecision(passed=all(v.passed for v in verdicts), lines=[v.line for v in verdicts], verdicts=verdicts)


def _metric_verdicts(
    metric: str, gate: Gate, candidate: Metrics, base: Metrics, incumbent: Metrics | None
) -> list[Verdict]:
    verdicts = []
    if gate.min is not None:
        verdicts.append(_min_verdict(metric, gate, gate.min, candidate))
    if gate.min_improvement is not None:
        verdicts.append(_improvement_verdict(metric, gate, gate.min_improvement, candidate, base))
    if gate.max_regression is not None:
        verdicts.append(_regression_verdict(metric, gate, gate.max_regression, candidate, incumbent))
    return verdicts


def _min_verdict(metric: str, gate: Gate, threshold: float, candidate: Metrics) -> Verdict:
    op = ">=" if gate.higher_is_better else "<="
    head = f"{metric} {op} {fmt(threshold)}"
    value = _read(candidate, metric, "candidate")
    if isinstance(value, str):
        return _verdict(metric, "min", None, threshold, False, f"{head}: {value} (fail)")
    passed = value >= threshold - TOLERANCE if gate.higher_is_better else value <= threshold + TOLERANCE
    return _verdict(metric, "min", value, threshold, passed, f"{head}: {fmt(value)} ({_word(passed)})")


def _improvement_verdict(metric: str, gate: Gate, at_least: float, candidate: Metrics, base: Metrics) -> Verdict:
    head = f"{metric} improvement over base >= {fmt(at_least)}"
    gain = _gain(metric, gate, candidate, base, "base")
    if isinstance(gain, str):
        return _verdict(metric, "min_improvement", None, at_least, False, f"{head}: {gain} (fail)")
    value, detail = gain
    passed = value >= at_least - TOLERANCE
    return _verdict(
        metric,
        "min_improvement",
        value,
        at_least,
        passed,
        f"{head}: {fmt(value, signed=True)} ({detail}) ({_word(passed)})",
    )


def _regression_verdict(
    metric: str, gate: Gate, at_most: float, candidate: Metrics, incumbent: Metrics | None
) -> Verdict:
    head = f"{metric} regression vs incumbent <= {fmt(at_most)}"
    if incumbent is None:
        return _verdict(
            metric,
            "max_regression",
            None,
            at_most,
            True,
            f"{head}: no incumbent: first model, regression gate not applicable",
        )
    gain = _gain(metric, gate, candidate, incumbent, "incumbent")
    if isinstance(gain, str):
        return _verdict(metric, "max_regression", None, at_most, False, f"{head}: {gain} (fail)")
    value, detail = -gain[0], gain[1]  # the regression is the gain lost
    passed = value <= at_most + TOLERANCE
    return _verdict(
        metric,
        "max_regression",
        value,
        at_most,
        passed,
        f"{head}: {fmt(value, signed=True)} ({detail}) ({_word(passed)})",
    )


def _gain(metric: str, gate: Gate, candidate: Metrics, other: Metrics, other_role: str) -> tuple[float, str] | str:
    """(how much better the candidate is than `other`, 'candidate x, <role> y'), or why it cannot be said."""
    cand = _read(candidate, metric, "candidate")
    ref = _read(other, metric, other_role)
    if isinstance(cand, str):
        return cand
    if isinstance(ref, str):
        return ref
    gain = cand - ref if gate.higher_is_better else ref - cand
    return gain, f"candidate {fmt(cand)}, {other_role} {fmt(ref)}"


def _verdict(metric: str, gate: GateKind, value: float | None, threshold: float, passed: bool, line: str) -> Verdict:
    return Verdict(metric=metric, gate=gate, value=value, threshold=threshold, passed=passed, line=line)


def _read(metrics: Metrics, metric: str, role: str) -> float | str:
    """The value, or why it cannot be compared."""
    raw = metrics.get(metric)
    if raw is None:
        return f"{role} value missing (have: {', '.join(sorted(metrics)) or 'none'})"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return f"{role} value is not a number ({raw!r})"
    if math.isnan(value):
        return f"{role} value is NaN"
    return value


def _word(passed: bool) -> str:
    return "pass" if passed else "fail"


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
