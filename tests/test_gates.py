"""The gate decision (eval/gates.py): pure, so every case, simulated evaluations included, is a plain call."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import pytest

from eval.gates import POINT, Scores, decide, fmt
from tests.reading import present
from tuneproof.core.config_eval import Gate
from tuneproof.core.results import FailureClass

EM = {"exact_match": Gate(min=0.8, min_improvement=0.5, max_regression=0.02)}
SPLIT = "ab" * 32


def scores(items: Sequence[float], metric: str = "exact_match") -> Scores:
    return Scores({metric: sum(items) / len(items)}, {metric: items})


def points(**metrics: float) -> Scores:
    return Scores(metrics)


def test_a_clear_candidate_passes_every_gate_with_its_interval():
    candidate = [1] * 294 + [0] * 6
    incumbent = [1] * 293 + [0] + [1] + [0] * 5  # disagrees with the candidate on 2 items, 1 each way
    d = decide(scores(candidate), scores([0] * 300), scores(incumbent), EM, split_sha256=SPLIT)
    assert d.passed, d.lines
    assert [(v.gate, v.outcome, v.n, v.method) for v in d.verdicts] == [
        ("min", "pass", 300, "Wilson score"),
        ("min_improvement", "pass", 300, "Newcombe paired score"),
        ("max_regression", "pass", 300, "Newcombe paired score"),
    ]
    assert d.lines[1] == (
        "exact_match improvement over base >= 0.5: +0.98 [+0.9445, +0.9922] (candidate 0.98, base 0; n=300, "
        "Newcombe paired score, 98.33% interval: 95% with Holm over 3, p<0.0001) (pass)"
    )
    regression = d.verdicts[2]
    assert regression.value == 0 and regression.interval is not None
    assert regression.interval[0] < 0 < regression.interval[1] <= 0.02  # shown as incumbent - candidate
    assert all(v.split_sha256 == SPLIT and v.p_value is not None and present(v.level) >= 0.95 for v in d.verdicts)
    assert d.failure_cause() == ""
    six = [1] * 291 + [0] * 3 + [1] * 3 + [0] * 3  # 6 disagreements on 300 items cannot resolve 0.02
    unsure = decide(scores(candidate), scores([0] * 300), scores(six), EM).verdicts[2]
    assert unsure.outcome == "insufficient" and 300 < present(unsure.items_needed) < 400


def test_both_perfect_on_a_small_set_is_insufficient_evidence_for_a_small_margin():
    d = decide(scores([1] * 15), scores([0] * 15), scores([1] * 15), {"exact_match": Gate(max_regression=0.02)})
    assert not d.passed
    regression = d.verdicts[0]
    assert regression.outcome == "insufficient" and not regression.passed
    assert regression.items_needed is not None and regression.items_needed > 15
    assert f"about {regression.items_needed:,} items at the observed disagreement would resolve it" in regression.line
    assert "(fail)" not in regression.line and "worse" not in regression.line
    assert d.failure_cause() == regression.line
    assert d.failure_class() is FailureClass.data  # the items cannot tell: no verdict on the model, exit 5


def test_all_wrong_base_against_all_right_candidate_passes_half_a_point_on_a_small_set():
    gate = {"exact_match": Gate(min_improvement=0.5)}
    d = decide(scores([1] * 10), scores([0] * 10), None, gate)
    assert d.passed and d.verdicts[0].outcome == "pass" and d.verdicts[0].n == 10
    assert present(d.verdicts[0].interval)[0] >= 0.5
    assert decide(scores([1] * 20), scores([0] * 20), None, EM).passed  # the demo's gates, Holm over 2, 20 items


def test_a_clear_regression_fails_and_a_failure_leads_the_cause():
    candidate = [1] * 200 + [0] * 100
    incumbent = [1] * 290 + [0] * 10
    d = decide(scores(candidate), scores([0] * 300), scores(incumbent), EM)
    assert [v.outcome for v in d.verdicts] == ["fail", "pass", "fail"]
    assert d.failure_cause().startswith("exact_match >= 0.8: 0.6667 [") and d.failure_cause().endswith("(+1 more)")
    mixed = decide(
        scores([1] * 15), scores([0] * 15), scores([1] * 15), {"exact_match": Gate(min=0.99, max_regression=0.02)}
    )
    assert [v.outcome for v in mixed.verdicts] == ["insufficient", "insufficient"]


def test_failed_before_insufficient_in_the_cause():
    policy = {"exact_match": Gate(max_regression=0.02), "rouge_l": Gate(min=0.9)}
    cand = Scores({"exact_match": 1.0, "rouge_l": 0.1}, {"exact_match": [1] * 15})
    d = decide(cand, cand, scores([1] * 15), policy)
    assert [v.outcome for v in d.verdicts] == ["insufficient", "fail"]
    assert d.failure_cause().startswith("rouge_l >= 0.9: 0.1 (point: no per-item scores) (fail)")
    assert d.failure_class() is FailureClass.modeling  # one gate failed outright


def test_no_incumbent_makes_regression_not_applicable():
    d = decide(scores([1] * 50), scores([0] * 50), None, EM)
    assert d.passed
    verdict = d.verdicts[-1]
    assert verdict.gate == "max_regression" and verdict.passed and verdict.value is None
    assert verdict.line.endswith("no incumbent: first model, regression gate not applicable")


def test_continuous_metric_uses_a_seeded_paired_bootstrap():
    rng = random.Random(7)
    base = [rng.random() * 0.4 for _ in range(200)]
    cand = [min(1.0, b + 0.3 + rng.gauss(0, 0.05)) for b in base]
    policy = {"rouge_l": Gate(min_improvement=0.2)}
    one = decide(scores(cand, "rouge_l"), scores(base, "rouge_l"), None, policy)
    two = decide(scores(cand, "rouge_l"), scores(base, "rouge_l"), None, policy)
    assert one.passed and one.verdicts[0].method == "paired bootstrap" and one.lines == two.lines
    few = decide(scores(cand[:8], "rouge_l"), scores(base[:8], "rouge_l"), None, policy)
    assert few.verdicts[0].outcome == "insufficient" and present(few.verdicts[0].items_needed) >= 20


def test_metrics_without_item_scores_compare_points_and_say_so():
    policy = {"eval_loss": Gate(min=1.0, min_improvement=0.5, max_regression=0.1, higher_is_better=False)}
    good = decide(points(eval_loss=0.4), points(eval_loss=2.0), points(eval_loss=0.45), policy)
    assert good.passed
    assert good.lines == [
        "eval_loss <= 1: 0.4 (point: no per-item scores) (pass)",
        "eval_loss improvement over base >= 0.5: +1.6 (candidate 0.4, base 2; point: no per-item scores) (pass)",
        "eval_loss regression vs incumbent <= 0.1: -0.05 (candidate 0.4, incumbent 0.45; point: no per-item scores) (pass)",
    ]
    # The verdicts keep the compared value and their method: a table showed each as "n/a (no incumbent)".
    assert [(v.value, v.method, v.interval) for v in good.verdicts] == [
        (0.4, POINT, None),
        (pytest.approx(1.6), POINT, None),
        (pytest.approx(-0.05), POINT, None),
    ]
    assert [v.brief() for v in good.verdicts] == ["pass, point (no per-item scores)"] * 3
    bad = decide(points(eval_loss=1.2), points(eval_loss=1.5), points(eval_loss=0.9), policy)
    assert [v.outcome for v in bad.verdicts] == ["fail", "fail", "fail"]


def test_nan_and_missing_values_fail_their_gates():
    nan = decide(points(exact_match=float("nan")), points(exact_match=0.0), None, EM)
    assert [v.passed for v in nan.verdicts] == [False, False, True]
    assert nan.lines[0] == "exact_match >= 0.8: candidate value is NaN (fail)"
    missing_base = decide(points(exact_match=0.9), points(), points(exact_match=0.9), EM)
    assert [v.passed for v in missing_base.verdicts] == [True, False, True]
    assert "base value missing (have: none)" in missing_base.lines[1]
    missing_incumbent = decide(points(exact_match=0.9), points(exact_match=0.0), points(rouge_l=0.5), EM)
    assert "incumbent value missing (have: rouge_l)" in missing_incumbent.lines[2]


def test_float_rounding_does_not_fail_an_exact_threshold():
    d = decide(points(exact_match=0.85), points(exact_match=0.35), None, {"exact_match": Gate(min_improvement=0.5)})
    assert d.passed


def test_several_metrics_and_an_empty_policy():
    policy = {"exact_match": Gate(min=0.5), "rouge_l": Gate(min=0.9)}
    d = decide(points(exact_match=0.6, rouge_l=0.8), points(), None, policy)
    assert [v.metric for v in d.verdicts] == ["exact_match", "rouge_l"] and not d.passed
    empty = decide(points(), points(), None, {})
    assert empty.passed and empty.lines == ["no gates configured: nothing to check"]


def test_the_decision_is_the_summary_shape():
    out = decide(scores([1] * 20), scores([0] * 20), None, EM).to_json()
    assert set(out) == {"passed", "lines", "verdicts"}
    assert set(out["verdicts"][0]) >= {"metric", "gate", "value", "threshold", "passed", "line", "outcome", "n"}
    assert set(out["verdicts"][0]) >= {"method", "interval", "level", "p_value", "items_needed", "split_sha256"}


def test_number_format():
    assert fmt(0.93) == "0.93" and fmt(0.123456) == "0.1235" and fmt(12345.6) == "12346"
    assert (
        fmt(-0.0, signed=True) == "+0"
        and fmt(0.01, signed=True) == "+0.01"
        and fmt(-0.05, signed=True) == "-0.05"
        and fmt(float("inf")) == "inf"
    )


# ---- simulated evaluations (the "must show") -----------------------------------------------------


def simulate(rng: random.Random, n: int, p_other: float, p_gain: float, p_loss: float) -> tuple[list, list]:
    """Paired outcomes: the other model right with p_other; the candidate gains a wrong item with p_gain
    and loses a right one with p_loss (true difference (1 - p_other) * p_gain - p_other * p_loss)."""
    cand, other = [], []
    for _ in range(n):
        right = rng.random() < p_other
        flip = rng.random() < (p_loss if right else p_gain)
        other.append(int(right))
        cand.append(int(right != flip))
    return cand, other


def share_passing(policy, *, role: str, n: int, p_other: float, p_gain: float, p_loss: float, runs: int = 1000):
    rng = random.Random(2026)
    passed = 0
    for _ in range(runs):
        cand, other = simulate(rng, n, p_other, p_gain, p_loss)
        base, incumbent = (scores(other), None) if role == "base" else (scores([0] * n), scores(other))
        passed += decide(scores(cand), base, incumbent, policy).passed
    return passed / runs


def test_no_true_difference_at_margin_zero_promotes_at_most_five_percent():
    # The candidate is the incumbent with a tenth of its items flipped each way: true difference 0.
    rate = share_passing(
        {"exact_match": Gate(max_regression=0.0)},
        role="incumbent",
        n=300,
        p_other=0.85,
        p_gain=0.5,
        p_loss=0.5 * 0.15 / 0.85,
    )
    assert rate <= 0.05, rate
    rate = share_passing(
        {"exact_match": Gate(min_improvement=0.0)}, role="base", n=300, p_other=0.7, p_gain=0.2, p_loss=0.2 * 0.3 / 0.7
    )
    assert rate <= 0.05, rate


def test_a_true_ten_point_improvement_on_300_items_passes_at_least_95_percent():
    # base right on 75 %; the candidate fixes 55 % of its misses and breaks 5 % of its hits: +10 points.
    rate = share_passing(
        {"exact_match": Gate(min_improvement=0.0)}, role="base", n=300, p_other=0.75, p_gain=0.55, p_loss=0.05
    )
    assert rate >= 0.95, rate
    assert math.isclose(0.25 * 0.55 - 0.75 * 0.05, 0.1)


def test_the_same_items_give_the_same_verdict_whichever_way_the_metric_points():
    # A lower-is-better metric scored 0/1 per item (an error rate) was decided by a percentile bootstrap, which
    # passed "err <= 0.1" on 2 errors in 60 where "acc >= 0.9" on the same items is insufficient evidence.
    right = [1.0] * 58 + [0.0] * 2
    errors = [1.0 - x for x in right]
    acc = decide(scores(right, "acc"), scores(right, "acc"), None, {"acc": Gate(min=0.9)})
    err = decide(scores(errors, "err"), scores(errors, "err"), None, {"err": Gate(min=0.1, higher_is_better=False)})
    assert [v.outcome for v in acc.verdicts] == [v.outcome for v in err.verdicts] == ["insufficient"]
    assert err.verdicts[0].method == acc.verdicts[0].method == "Wilson score"
    lo, hi = present(acc.verdicts[0].interval)
    assert present(err.verdicts[0].interval) == (pytest.approx(1.0 - hi), pytest.approx(1.0 - lo))
    assert err.lines[0].startswith("err <= 0.1: 0.03333 [")
    # Paired: one item lost in 300 against the incumbent, read as accuracy and as errors.
    cand, inc = [1.0] * 299 + [0.0], [1.0] * 300
    policy_acc, policy_err = (
        {"acc": Gate(max_regression=0.01)},
        {"err": Gate(max_regression=0.01, higher_is_better=False)},
    )
    acc = decide(scores(cand, "acc"), scores(cand, "acc"), scores(inc, "acc"), policy_acc)
    err = decide(
        scores([1 - x for x in cand], "err"),
        scores([1 - x for x in cand], "err"),
        scores([1 - x for x in inc], "err"),
        policy_err,
    )
    assert [v.outcome for v in acc.verdicts] == [v.outcome for v in err.verdicts]
    assert err.verdicts[0].method == "Newcombe paired score" and err.verdicts[0].interval == acc.verdicts[0].interval


def test_a_level_the_bootstrap_cannot_reach_says_so():
    rng = random.Random(1)
    values = [min(1.0, max(0.0, rng.gauss(0.6, 0.25))) for _ in range(25)]
    d = decide(scores(values, "rouge_l"), scores(values, "rouge_l"), None, {"rouge_l": Gate(min=0.455)}, 0.99999)
    assert d.verdicts[0].outcome == "insufficient"
    assert d.lines[0].endswith(
        "(insufficient evidence: 10,000 bootstrap resamples cannot give a 99.9995% one-sided bound: lower eval.confidence, or gate "
        "fewer metrics at once (Holm divides the level among them))"
    )


FORGETTING = {"exact_match": Gate(max_regression_vs_base=0.25, max_regression=0.25)}
"""A regression suite's gates (SuiteConfig.gates) at margin 0.25."""


def test_gates_a_candidate_that_answers_nothing_right_would_pass_are_insufficient_evidence():
    # Base and incumbent answer 30 of 200 (0.15): within the margin of 0, so losing all 30 passed both gates.
    known = [1.0] * 30 + [0.0] * 170
    d = decide(scores([0.0] * 200), scores(known), scores(known), FORGETTING)
    assert [v.outcome for v in d.verdicts] == ["insufficient", "insufficient"] and not d.passed
    assert all(v.items_needed is None for v in d.verdicts)  # more items would not help: the margin is the problem
    assert d.lines[0].endswith(
        "(candidate 0, base 0.15; n=200, Newcombe paired score, 97.5% interval: 95% with Holm over 2, p=0.00055) "
        "(insufficient evidence: the base scores 0.15, so a candidate that scored 0 on every item would pass this "
        "gate (0.25) and every other on exact_match: these items cannot show a loss at this margin; lower the margin "
        "below 0.15 or use items the base answers)"
    )
    assert d.failure_class() is FailureClass.data  # no verdict on the model either way
    # A base that knows nothing: no margin above 0 can show a loss, so only other items are offered.
    nothing = decide(scores([0.0] * 200), scores([0.0] * 200), None, FORGETTING)
    assert nothing.verdicts[0].outcome == "insufficient"
    assert nothing.lines[0].endswith("cannot show a loss at this margin; use items the base answers)")
    assert nothing.verdicts[1].line.endswith("no incumbent: first model, regression gate not applicable")


def test_a_margin_below_what_the_base_scores_still_decides():
    known = [1.0] * 60 + [0.0] * 140  # 0.3: losing it all is more than the margin, and these items can show it
    d = decide(scores([0.0] * 200), scores(known), None, FORGETTING)
    assert d.verdicts[0].outcome == "insufficient" and "would resolve it" in d.lines[0]  # 200 items: not yet
    d = decide(scores([0.0] * 400), scores(known * 2), None, FORGETTING)
    assert d.verdicts[0].outcome == "fail" and d.failure_class() is FailureClass.modeling
    kept = decide(scores(known), scores(known), None, FORGETTING)
    assert kept.verdicts[0].outcome == "pass"


def test_one_gate_that_can_tell_keeps_the_others_verdicts():
    # An incumbent that lost the skill cannot be regressed from, but the base still shows a loss: the suite judges.
    base, lost = [1.0] * 180 + [0.0] * 20, [0.0] * 200
    kept = decide(scores(base), scores(base), scores(lost), FORGETTING)
    assert [v.outcome for v in kept.verdicts] == ["pass", "pass"]
    forgot = decide(scores(lost), scores(base), scores(lost), FORGETTING)
    assert [v.outcome for v in forgot.verdicts] == ["fail", "pass"]
    # A floor the worst candidate fails is evidence too: the regression keeps its verdict.
    floor = {"exact_match": Gate(min=0.5, max_regression=0.25)}
    incumbent = [1.0] * 10 + [0.0] * 190
    assert [v.outcome for v in decide(scores(base), scores(base), scores(incumbent), floor).verdicts] == ["pass"] * 2


def test_a_floor_any_value_passes_keeps_its_verdict():
    # The canary's gates only ask that a metric was computed (flows/canary.py computed_gate): no comparison, no doubt.
    d = decide(scores([0.0] * 50), scores([0.0] * 50), None, {"exact_match": Gate(min=-1e300)})
    assert d.passed and d.verdicts[0].outcome == "pass"


def test_the_worst_candidate_of_a_lower_is_better_metric_scores_1_on_every_item():
    errors = [0.0] * 20 + [1.0] * 180  # the base is wrong on 0.9 of the items: right on 0.1, within 0.25
    policy = {"err": Gate(max_regression_vs_base=0.25, higher_is_better=False)}
    d = decide(scores([1.0] * 200, "err"), scores(errors, "err"), None, policy)
    assert d.verdicts[0].outcome == "insufficient"
    assert "the base scores 0.9, so a candidate that scored 1 on every item would pass" in d.lines[0]
    assert "lower the margin below 0.1 or use items the base answers" in d.lines[0]


def test_one_continuous_item_off_on_20_is_insufficient_evidence():
    # Identical rouge_l on 20 items is insufficient for a 0.02 margin; one item 0.01 lower passed with [+0, +0.0015].
    policy = {"rouge_l": Gate(max_regression=0.02)}
    same = decide(scores([0.5] * 20, "rouge_l"), scores([0.1] * 20, "rouge_l"), scores([0.5] * 20, "rouge_l"), policy)
    lower = [0.5] * 19 + [0.49]
    off = decide(scores(lower, "rouge_l"), scores([0.1] * 20, "rouge_l"), scores([0.5] * 20, "rouge_l"), policy)
    assert same.verdicts[0].outcome == off.verdicts[0].outcome == "insufficient" and not off.passed
    assert "n=20, paired bootstrap floored at the no-spread bound (1 of 20 items vary)" in off.lines[0]
    assert present(off.verdicts[0].interval)[1] > 0.15


def test_a_min_gate_on_one_models_bootstrap_says_bootstrap():
    rng = random.Random(4)
    d = decide(
        scores([0.6 + 0.3 * rng.random() for _ in range(100)], "rouge_l"), points(), None, {"rouge_l": Gate(min=0.5)}
    )
    assert d.verdicts[0].method == "bootstrap" and "n=100, bootstrap, 95% interval" in d.lines[0]


@pytest.mark.parametrize(
    "candidate, base, words",
    [
        (points(eval_loss=3.0), points(eval_loss=math.inf), "base value is inf: not a finite number (fail)"),
        (points(eval_loss=math.inf), points(eval_loss=3.0), "candidate value is inf: not a finite number (fail)"),
    ],
    ids=["base inf", "candidate inf"],
)
def test_an_infinite_value_fails_its_gate(candidate, base, words):
    # An infinite base loss read "improvement over base >= 0.5: +inf (pass)".
    policy = {"eval_loss": Gate(min_improvement=0.5, higher_is_better=False)}
    d = decide(candidate, base, None, policy)
    assert not d.passed and d.lines == [f"eval_loss improvement over base >= 0.5: {words}"]
    floor = decide(points(rouge_l=math.inf), points(), None, {"rouge_l": Gate(min=0.85)})
    assert floor.lines == ["rouge_l >= 0.85: candidate value is inf: not a finite number (fail)"]


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
def test_a_non_finite_item_score_is_insufficient_evidence(bad):
    items = [0.9] * 50 + [0.95] * 49 + [bad]
    cand = Scores({"rouge_l": 0.925}, {"rouge_l": items})
    floor = decide(cand, points(), None, {"rouge_l": Gate(min=0.85)})
    assert [v.outcome for v in floor.verdicts] == ["insufficient"] and not floor.passed
    assert floor.lines[0] == (
        f"rouge_l >= 0.85: 0.925 (insufficient evidence: the candidate's item 99 on rouge_l scores {bad} (1 of 100 "
        "items not a finite number): no interval stands on it)"
    )
    gain = decide(scores([0.9] * 100, "rouge_l"), cand, None, {"rouge_l": Gate(min_improvement=0.0)})
    assert gain.verdicts[0].outcome == "insufficient" and "the base's item 99 on rouge_l scores" in gain.lines[0]


def test_per_item_scores_on_one_side_only_are_insufficient_evidence():
    # The candidate's 5 items against a base without any were compared on points and passed.
    policy = {"rouge_l": Gate(min_improvement=0.05)}
    d = decide(scores([0.6] * 5, "rouge_l"), points(rouge_l=0.5), None, policy)
    assert d.verdicts[0].outcome == "insufficient" and d.verdicts[0].method is None and not d.passed
    assert d.lines[0] == (
        "rouge_l improvement over base >= 0.05: +0.1 (candidate 0.6, base 0.5) (insufficient evidence: the base has no "
        "per-item scores on rouge_l (the candidate has 5): an interval needs every model's items)"
    )
    reverse = decide(points(rouge_l=0.6), scores([0.5] * 30, "rouge_l"), None, policy)
    assert "the candidate has no per-item scores on rouge_l (the base has 30)" in reverse.lines[0]
    empty = Scores({"rouge_l": 0.9}, {"rouge_l": []})
    both_empty = decide(
        empty, Scores({"rouge_l": 0.5}, {"rouge_l": []}), None, {"rouge_l": Gate(min=0.85, min_improvement=0.3)}
    )
    assert [v.outcome for v in both_empty.verdicts] == ["insufficient", "insufficient"]
    assert both_empty.lines[0] == (
        "rouge_l >= 0.85: 0.9 (insufficient evidence: the candidate's per-item scores on rouge_l are an empty list: n=0)"
    )
    assert both_empty.failure_class() is FailureClass.data


def test_fewer_than_five_items_never_pass():
    # 3 of 3 against 0 of 3 passed a 0.2 gain; at the threshold that happens 21.6 % of the time, not 2.5 %.
    d = decide(scores([1, 1, 1]), scores([0, 0, 0]), None, {"exact_match": Gate(min_improvement=0.2)})
    verdict = d.verdicts[0]
    assert verdict.outcome == "insufficient" and verdict.n == 3 and verdict.items_needed == 5
    assert d.lines[0].endswith(
        "(insufficient evidence: 3 items are too few for a pass, whatever the interval: on fewer than 5 a score "
        "interval passes a model on the threshold several times more often than its level)"
    )
    assert decide(scores([1] * 4), points(), None, {"exact_match": Gate(min=0.5)}).verdicts[0].outcome == "insufficient"
    assert decide(scores([1] * 5), points(), None, {"exact_match": Gate(min=0.3)}).passed
    assert decide(scores([0] * 3), points(), None, {"exact_match": Gate(min=0.8)}).verdicts[0].outcome == "fail"
