"""The gate decision (eval/gates.py): pure, so every case is a plain call."""

from __future__ import annotations

import math

from eval.gates import decide, fmt
from tuneproof.core.config import Gate

EM = {"exact_match": Gate(min=0.8, min_improvement=0.5, max_regression=0.02)}


def test_passes_when_every_threshold_is_met():
    d = decide({"exact_match": 0.93}, {"exact_match": 0.0}, {"exact_match": 0.94}, EM)
    assert d.passed
    assert d.lines == [
        "exact_match >= 0.8: 0.93 (pass)",
        "exact_match improvement over base >= 0.5: +0.93 (candidate 0.93, base 0) (pass)",
        "exact_match regression vs incumbent <= 0.02: +0.01 (candidate 0.93, incumbent 0.94) (pass)",
    ]
    assert [(v.gate, v.passed) for v in d.verdicts] == [
        ("min", True),
        ("min_improvement", True),
        ("max_regression", True),
    ]
    assert d.failure_cause() == ""


def test_min_fails_alone():
    d = decide({"exact_match": 0.79}, {"exact_match": 0.0}, None, EM)
    assert not d.passed
    assert d.failure_cause() == "exact_match >= 0.8: 0.79 (fail)"
    assert [v.passed for v in d.verdicts] == [False, True, True]


def test_min_improvement_fails_alone():
    d = decide({"exact_match": 0.9}, {"exact_match": 0.5}, None, EM)
    assert not d.passed
    assert d.failure_cause() == "exact_match improvement over base >= 0.5: +0.4 (candidate 0.9, base 0.5) (fail)"
    failed = [v for v in d.verdicts if not v.passed]
    assert len(failed) == 1 and math.isclose(failed[0].value, 0.4) and failed[0].threshold == 0.5


def test_regression_vs_incumbent_fails_alone():
    d = decide({"exact_match": 0.9}, {"exact_match": 0.1}, {"exact_match": 0.95}, EM)
    assert not d.passed
    assert (
        d.failure_cause() == "exact_match regression vs incumbent <= 0.02: +0.05 (candidate 0.9, incumbent 0.95) (fail)"
    )


def test_no_incumbent_makes_regression_not_applicable():
    d = decide({"exact_match": 0.9}, {"exact_match": 0.1}, None, EM)
    assert d.passed
    verdict = d.verdicts[-1]
    assert verdict.gate == "max_regression" and verdict.passed and verdict.value is None
    assert verdict.line.endswith("no incumbent: first model, regression gate not applicable")


def test_every_failure_counted_in_the_cause():
    d = decide({"exact_match": 0.1}, {"exact_match": 0.1}, {"exact_match": 0.9}, EM)
    assert not d.passed
    assert d.failure_cause() == "exact_match >= 0.8: 0.1 (fail) (+2 more)"


def test_nan_and_missing_values_fail_their_gates():
    nan = decide({"exact_match": float("nan")}, {"exact_match": 0.0}, None, EM)
    assert [v.passed for v in nan.verdicts] == [False, False, True]
    assert nan.lines[0] == "exact_match >= 0.8: candidate value is NaN (fail)"
    missing_base = decide({"exact_match": 0.9}, {}, {"exact_match": 0.9}, EM)
    assert [v.passed for v in missing_base.verdicts] == [True, False, True]
    assert "base value missing (have: none)" in missing_base.lines[1]
    missing_incumbent = decide({"exact_match": 0.9}, {"exact_match": 0.0}, {"rouge_l": 0.5}, EM)
    assert not missing_incumbent.passed
    assert "incumbent value missing (have: rouge_l)" in missing_incumbent.lines[2]


def test_lower_is_better_flips_every_comparison():
    policy = {"eval_loss": Gate(min=1.0, min_improvement=0.5, max_regression=0.1, higher_is_better=False)}
    good = decide({"eval_loss": 0.4}, {"eval_loss": 2.0}, {"eval_loss": 0.45}, policy)
    assert good.passed
    assert good.lines == [
        "eval_loss <= 1: 0.4 (pass)",
        "eval_loss improvement over base >= 0.5: +1.6 (candidate 0.4, base 2) (pass)",
        "eval_loss regression vs incumbent <= 0.1: -0.05 (candidate 0.4, incumbent 0.45) (pass)",
    ]
    bad = decide({"eval_loss": 1.2}, {"eval_loss": 1.5}, {"eval_loss": 0.9}, policy)
    assert [v.passed for v in bad.verdicts] == [False, False, False]


def test_float_rounding_does_not_fail_an_exact_threshold():
    # 0.85 - 0.35 == 0.49999999999999994 in floats; the gate is about the metric, not the arithmetic.
    d = decide({"exact_match": 0.85}, {"exact_match": 0.35}, None, {"exact_match": Gate(min_improvement=0.5)})
    assert d.passed


def test_several_metrics_and_an_empty_policy():
    policy = {"exact_match": Gate(min=0.5), "rouge_l": Gate(min=0.9)}
    d = decide({"exact_match": 0.6, "rouge_l": 0.8}, {}, None, policy)
    assert [v.metric for v in d.verdicts] == ["exact_match", "rouge_l"] and not d.passed
    empty = decide({}, {}, None, {})
    assert empty.passed and empty.lines == ["no gates configured: nothing to check"]


def test_the_decision_is_the_summary_shape():
    out = decide({"exact_match": 0.93}, {"exact_match": 0.0}, None, EM).to_json()
    assert set(out) == {"passed", "lines", "verdicts"}
    assert set(out["verdicts"][0]) == {"metric", "gate", "value", "threshold", "passed", "line"}


def test_number_format():
    assert fmt(0.93) == "0.93" and fmt(0.123456) == "0.1235" and fmt(12345.6) == "12346"
    assert (
        fmt(-0.0, signed=True) == "+0"
        and fmt(0.01, signed=True) == "+0.01"
        and fmt(-0.05, signed=True) == "-0.05"
        and fmt(float("inf")) == "inf"
    )
