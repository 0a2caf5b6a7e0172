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
from typing import Any, Mapping

from tuneproof.core.summaries import GateDecision, Verdict

# Metric arithmetic in floats: 0.85 - 0.35 is 0.4999999999999999, which must still meet 0.5.
TOLERANCE = 1e-9


def decide(
    candidate: Mapping[str, Any],
    base: Mapping[str, Any],
    incumbent: Mapping[str, Any] | None,
    policy: Mapping[str, Any],
) -> GateDecision:
    """Apply every threshold of every gate in `policy` (metric name -> config.Gate or alike).

    Passes only when every verdict passes; an empty policy passes with a line saying so.
    """
    verdicts = [v for metric, gate in policy.items() for v in _metric_verdicts(metric, gate, candidate, base, incumbent)]
    if not verdicts:
        return GateDecision(passed=True, lines=["no gates configured: nothing to check"], verdicts=[])
    return GateDecision(passed=all(v.passed for v in verdicts), lines=[v.line for v in verdicts], verdicts=verdicts)


def _metric_verdicts(metric, gate, candidate, base, incumbent) -> list[Verdict]:
    verdicts = []
    if gate.min is not None:
        verdicts.append(_min_verdict(metric, gate, candidate))
    if gate.min_improvement is not None:
        verdicts.append(_improvement_verdict(metric, gate, candidate, base))
    if gate.max_regression is not None:
        verdicts.append(_regression_verdict(metric, gate, candidate, incumbent))
    return verdicts


def _min_verdict(metric, gate, candidate) -> Verdict:
    op = ">=" if gate.higher_is_better else "<="
    head = f"{metric} {op} {fmt(gate.min)}"
    value, missing = _read(candidate, metric, "candidate")
    if missing:
        return _verdict(metric, "min", None, gate.min, False, f"{head}: {missing} (fail)")
    passed = value >= gate.min - TOLERANCE if gate.higher_is_better else value <= gate.min + TOLERANCE
    return _verdict(metric, "min", value, gate.min, passed, f"{head}: {fmt(value)} ({_word(passed)})")


def _improvement_verdict(metric, gate, candidate, base) -> Verdict:
    head = f"{metric} improvement over base >= {fmt(gate.min_improvement)}"
    return _delta_verdict(metric, "min_improvement", head, gate, candidate, base, "base", at_least=gate.min_improvement)


def _regression_verdict(metric, gate, candidate, incumbent) -> Verdict:
    head = f"{metric} regression vs incumbent <= {fmt(gate.max_regression)}"
    if incumbent is None:
        return _verdict(metric, "max_regression", None, gate.max_regression, True,
                        f"{head}: no incumbent: first model, regression gate not applicable")
    return _delta_verdict(metric, "max_regression", head, gate, candidate, incumbent, "incumbent", at_most=gate.max_regression)


def _delta_verdict(metric, kind, head, gate, candidate, other, other_role, at_least=None, at_most=None) -> Verdict:
    threshold = at_least if at_least is not None else at_most
    cand, missing = _read(candidate, metric, "candidate")
    ref, ref_missing = _read(other, metric, other_role)
    if missing or ref_missing:
        return _verdict(metric, kind, None, threshold, False, f"{head}: {missing or ref_missing} (fail)")
    gain = cand - ref if gate.higher_is_better else ref - cand
    # Improvement is the gain itself; regression is the gain lost.
    value = gain if at_least is not None else -gain
    passed = value >= at_least - TOLERANCE if at_least is not None else value <= at_most + TOLERANCE
    line = f"{head}: {fmt(value, signed=True)} (candidate {fmt(cand)}, {other_role} {fmt(ref)}) ({_word(passed)})"
    return _verdict(metric, kind, value, threshold, passed, line)


def _verdict(metric, gate, value, threshold, passed, line) -> Verdict:
    return Verdict(metric=metric, gate=gate, value=value, threshold=threshold, passed=passed, line=line)


def _read(metrics: Mapping[str, Any], metric: str, role: str) -> tuple[float | None, str | None]:
    """(value, None) or (None, why it cannot be compared)."""
    raw = metrics.get(metric)
    if raw is None:
        return None, f"{role} value missing (have: {', '.join(sorted(metrics)) or 'none'})"
    try:
        value = float(raw)
    except (TypeError, ValueError):
        return None, f"{role} value is not a number ({raw!r})"
    if math.isnan(value):
        return None, f"{role} value is NaN"
    return value, None


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
