"""Local `evaluate` metric modules load offline and score correctly; bad names are config errors."""

from __future__ import annotations

import os

import pytest

from eval.metrics_loader import load_metric
from tuneproof.core.config_eval import COPY_CHECK_EXAMPLES, EvalConfig, Gate
from tuneproof.core.metric_names import (
    METRICS_DIR,
    MetricNotFound,
    check_eval_config,
    check_gate_names,
    check_gate_ranges,
    check_metric_names,
    local_metrics,
    resolve_metric,
)


def test_the_hub_is_off_in_tests():
    assert os.environ["HF_EVALUATE_OFFLINE"] == "1"


def test_shipped_modules_follow_evaluates_local_layout():
    assert local_metrics() == ["accuracy", "exact_match", "rouge_l"]
    for name in local_metrics():
        assert (METRICS_DIR / name / f"{name}.py").is_file()
        assert resolve_metric(name) == str(METRICS_DIR / name)


def test_exact_match_strips_whitespace_only():
    m = load_metric("exact_match")
    assert m.compute(predictions=[" 2024-01-05\n", "2024-1-5", "A"], references=["2024-01-05", "2024-01-05", "a"]) == {
        "exact_match": pytest.approx(1 / 3)
    }
    assert m.compute(predictions=[], references=[]) == {"exact_match": 0.0}


def test_accuracy_compares_first_line_labels():
    m = load_metric("accuracy")
    assert m.compute(
        predictions=["Positive\nbecause", "negative", "neutral"], references=["positive", "positive", " Neutral "]
    ) == {"accuracy": pytest.approx(2 / 3)}
    weighted = m.compute(predictions=["a", "b"], references=["a", "a"], sample_weight=[3, 1])
    assert weighted == {"accuracy": pytest.approx(0.75)}
    assert m.compute(predictions=["a", "b"], references=["a", "a"], normalize=False) == {"accuracy": 1.0}


def test_rouge_l_is_lcs_f1():
    m = load_metric("rouge_l")
    # LCS("the cat sat", "the cat sat down") = 3: P = 1, R = 3/4, F1 = 6/7.
    assert m.compute(predictions=["the cat sat"], references=["the cat sat down"]) == {"rouge_l": pytest.approx(6 / 7)}
    # Punctuation separates tokens; case is ignored: 2024-01-05 vs 2024/01/06 share 2 of 3.
    assert m.compute(predictions=["2024-01-05", ""], references=["2024/01/06", "x"]) == {
        "rouge_l": pytest.approx((2 / 3) / 2)
    }
    assert m.compute(predictions=["A B C D"], references=["a x c y d"])["rouge_l"] == pytest.approx(
        2 * (3 / 4) * (3 / 5) / (3 / 4 + 3 / 5)
    )


def test_unknown_metric_is_a_problem_naming_it():
    problems = check_metric_names(["exact_match", "bleu_typo"])
    assert len(problems) == 1
    assert "'bleu_typo'" in problems[0] and "eval/metrics/bleu_typo/bleu_typo.py" in problems[0]
    with pytest.raises(MetricNotFound, match="bleu_typo"):
        load_metric("bleu_typo")


def test_loss_metrics_are_not_evaluate_modules():
    assert check_metric_names(["perplexity"]) == [
        "metric 'perplexity' is computed for every model already (eval_loss, perplexity); remove it from the list"
    ]


def test_hub_names_pass_through_only_when_allowed():
    assert resolve_metric("sacrebleu", allow_hub=True) == "sacrebleu"
    assert resolve_metric("exact_match", allow_hub=True) == str(METRICS_DIR / "exact_match")  # local first
    with pytest.raises(MetricNotFound):
        resolve_metric("../exact_match")


def test_gates_on_values_no_metric_produces():
    assert check_gate_names(["exact_match"], ["exact_match", "eval_loss", "perplexity"]) == []
    assert check_gate_names(["exact_match"], ["rouge_l"]) == [
        "eval.gates.rouge_l: no configured metric produces 'rouge_l' (computed: exact_match, eval_loss, perplexity)"
    ]
    # A hub metric may report keys other than its name, so its gates are not second-guessed.
    assert check_gate_names(["exact_match", "rouge"], ["rougeL"]) == []


def test_check_eval_config_reports_every_field():
    cfg = EvalConfig(metrics=["exact_match", "nope"], gates={"exact_match": Gate(min=0.5)})
    assert [p.split(":")[0] for p in check_eval_config(cfg)] == ["eval.metrics"]
    cfg = EvalConfig(metrics=["exact_match"], gates={"rouge_l": Gate(min=0.5)})
    assert [p.split(":")[0] for p in check_eval_config(cfg)] == ["eval.gates.rouge_l"]
    assert check_eval_config(EvalConfig()) == []


def test_a_gate_no_fraction_can_meet_is_a_config_error_not_a_verdict():
    # exact_match >= 1.01 failed every model as a modeling failure: a verdict about no model in particular.
    assert check_gate_ranges({"exact_match": Gate(min=1.01)}) == [
        "eval.gates.exact_match.min: 1.01 cannot be met (exact_match is a fraction, 0..1, a difference of two lies "
        "in -1..1, and an interval over items never reaches an end): every model would fail it, a verdict about none "
        "of them"
    ]
    wrong = {
        "rouge_l": Gate(min_improvement=1.5, max_regression=-2.0),
        "accuracy": Gate(max_regression_vs_base=-1.5),
        "eval_loss": Gate(min=-0.5, higher_is_better=False),  # "at most -0.5"
        "perplexity": Gate(min=0.9, higher_is_better=False),
    }
    assert [p.split(":")[0] for p in check_gate_ranges(wrong)] == [
        "eval.gates.rouge_l.min_improvement",
        "eval.gates.rouge_l.max_regression",
        "eval.gates.accuracy.max_regression_vs_base",
        "eval.gates.eval_loss.min",
        "eval.gates.perplexity.min",
    ]
    # The ends of a fraction cannot be met either: its gates stand on an interval over the items, and a perfect
    # candidate on 100,000 items was "insufficient evidence" against min 1 (no number of items resolves it).
    ends = {"exact_match": Gate(min=1.0, min_improvement=1.0, max_regression=-1.0, max_regression_vs_base=-1.0)}
    assert [p.split(":")[0] for p in check_gate_ranges(ends)] == [
        "eval.gates.exact_match.min",
        "eval.gates.exact_match.min_improvement",
        "eval.gates.exact_match.max_regression",
        "eval.gates.exact_match.max_regression_vs_base",
    ]
    # Just inside the ends can be met; a loss, compared on its point value, can meet its floor; a threshold every
    # model meets judges nothing but is no false verdict (the image canary's gates, -1e300, only ask that the
    # metric was computed).
    meetable = {
        "exact_match": Gate(min=0.999, min_improvement=0.999, max_regression=-0.999),
        "eval_loss": Gate(min=0.0, higher_is_better=False),
        "perplexity": Gate(min=1.0, higher_is_better=False),
    }
    assert check_gate_ranges(meetable) == []
    assert check_gate_ranges({"exact_match": Gate(min=-1e300), "rouge_l": Gate(max_regression=3.0)}) == []
    cfg = EvalConfig(metrics=["exact_match"], gates={"exact_match": Gate(min=2.0)})
    assert [p.split(":")[0] for p in check_eval_config(cfg)] == ["eval.gates.exact_match.min"]


def test_a_gate_pointing_the_wrong_way_for_a_known_metric_is_a_config_error():
    # eval_loss with the default higher_is_better passed a candidate whose loss rose from 0.4 to 2.5 ("regression
    # -2.1") and failed one whose loss fell; exact_match with higher_is_better false passed a model that learned
    # nothing ("exact_match <= 0.8").
    wrong = {
        "eval_loss": Gate(max_regression=0.05),
        "perplexity": Gate(min=20.0),
        "exact_match": Gate(min=0.8, higher_is_better=False),
    }
    assert check_gate_ranges(wrong) == [
        "eval.gates.eval_loss.higher_is_better: true, but a lower eval_loss is better: set higher_is_better: false "
        "(as given, the gate would pass worse models and fail better ones)",
        "eval.gates.perplexity.higher_is_better: true, but a lower perplexity is better: set higher_is_better: false "
        "(as given, the gate would pass worse models and fail better ones)",
        "eval.gates.exact_match.higher_is_better: false, but a higher exact_match is better: set higher_is_better: "
        "true (as given, the gate would pass worse models and fail better ones)",
    ]
    # A metric tuneproof does not know (a hub metric, a user's module) keeps the direction it is given.
    assert check_gate_ranges({"bleu_err": Gate(min=0.1, higher_is_better=False)}) == []


def test_a_gate_without_thresholds_is_invalid_config():
    with pytest.raises(ValueError, match="at least one of min, min_improvement, max_regression"):
        Gate(higher_is_better=False)


def test_predictions_are_saved_for_at_least_the_copy_check():
    # predictions_cap 0 saved no answers, and promotion's check of the registry's copy was skipped without a word.
    with pytest.raises(ValueError, match="predictions_cap"):
        EvalConfig(predictions_cap=0)
    assert EvalConfig(predictions_cap=COPY_CHECK_EXAMPLES).predictions_cap == 32
