"""eval/selftest.py: references that fit the budget, cut-off and empty answers per model and split, when a cut-off
answer is the apparatus's fault and when the model's own, and who the cap holds (pure); how a reference
is cut short, reversed, followed by another reference or replaced into a wrong answer (the metrics' self-test
itself: tests/test_evaluate_job.py)."""

from __future__ import annotations

from eval.selftest import (
    TASK,
    absent_character,
    count_lines,
    cut_short,
    followed,
    generation_problem,
    generations,
    reversed_words,
    sharing_nothing,
    unfitting_references,
)
from tuneproof.core.summaries_eval import Generations


def seen(answers: int, cut_off: int = 0, empty: int = 0) -> Generations:
    return Generations(answers=answers, cut_off=cut_off, empty=empty)


def test_answers_are_counted_cut_off_and_empty():
    assert generations(["2024-01-05", "", "20"], [False, False, True]) == seen(3, cut_off=1, empty=1)


def test_references_that_cannot_fit_the_budget_are_invalid_before_any_model_answers():
    """A reference fits when its tokens and the stop do: 15 tokens fit 16. Over the cap of a split's that do not,
    the cause names the split, the count and the setting the longest needs."""
    assert unfitting_references({TASK: [10] * 30, "add": [1, 2, 15]}, 16, 0.02) is None
    assert unfitting_references({TASK: [10] * 99 + [40]}, 16, 0.02) is None  # 1 of 100: within the cap
    problem = unfitting_references({TASK: [10] * 30, "add": [1, 2, 16]}, 16, 0.02)
    assert problem == (
        "suite add: 1 of 3 references need more than eval.max_new_tokens=16 tokens with the stop token (cap 0.02, "
        "eval.max_truncated_fraction): a model that answers them right is cut off and scores wrong; the longest is "
        "16 tokens: raise eval.max_new_tokens to at least 17"
    )
    assert unfitting_references({TASK: []}, 1, 0.0) is None  # nothing to answer, nothing to say


def test_cut_off_answers_are_invalid_only_where_no_model_stopped_within_the_cap():
    """Every model cut off on a split: the stop tokens end no answer there, whoever answers (the apparatus). The
    count, the setting and the other models' counts are named."""
    assert generation_problem({"candidate": {TASK: seen(300, cut_off=6)}}, 16, 0.02) is None  # 2 % exactly
    problem = generation_problem({"candidate": {TASK: seen(300, cut_off=7)}}, 16, 0.02)
    assert problem == (
        "candidate 7/300 answers cut off at eval.max_new_tokens=16 (cap 0.02, eval.max_truncated_fraction), and no "
        "model stopped within the cap on the task: the references fit, so the stop tokens end no answer there; check "
        "the stop tokens and the chat template"
    )
    never = {"candidate": {TASK: seen(30, cut_off=30)}, "base": {TASK: seen(30, cut_off=30)}}
    problem = generation_problem(never, 16, 0.02)
    assert problem is not None and problem.startswith("candidate 30/30 answers cut off at eval.max_new_tokens=16")
    assert "no model stopped within the cap on the task (base 30/30 cut off)" in problem
    empty = generation_problem({"incumbent": {TASK: seen(300, empty=30)}}, 16, 0.02)
    assert empty is not None and empty.startswith("incumbent 30/300 answers empty (cap 0.02")


def test_a_candidate_cut_off_where_the_base_stops_is_its_own_verdict_not_the_apparatus():
    """The forgetting demo: fine-tuned on dates alone, the candidate answers 'add 3 and 4' with '2024-05---------',
    cut off at 16 tokens, where the base (same tokenizer, template and stop tokens) stops on all 80 items. Its
    answers are scored as they are (wrong), counted and logged as its own; the gates say it forgot `add`."""
    forgot = {
        "candidate": {TASK: seen(300), "add": seen(80, cut_off=3)},
        "base": {TASK: seen(300, empty=20), "add": seen(80)},
    }
    assert generation_problem(forgot, 16, 0.02) is None
    assert count_lines(forgot, 0.02) == [
        "candidate on suite add: 3 of 80 answers end at max_new_tokens without a stop, 0 empty (the model's own: base "
        "stopped within the cap here; scored as answered)",
        "base: 0 of 300 answers end at max_new_tokens without a stop, 20 empty (not capped: the base has not learned "
        "the task)",
    ]
    # The base on the task is not held to the cap, but where it stops it shows the stop tokens work there.
    rambles = {"candidate": {TASK: seen(30, cut_off=30)}, "base": {TASK: seen(30)}}
    assert generation_problem(rambles, 16, 0.02) is None
    # An incumbent that stops vouches for the apparatus as well; so does a model that answers, for empty answers:
    # the forgetting demo's candidate ended its turn at once on 1 reverse item in 40 where the base answered all.
    assert (
        generation_problem({"candidate": {"add": seen(80, cut_off=80)}, "incumbent": {"add": seen(80)}}, 16, 0.02)
        is None
    )
    silent = {"candidate": {"reverse": seen(40, empty=1)}, "base": {"reverse": seen(40)}}
    assert generation_problem(silent, 16, 0.02) is None
    assert count_lines(silent, 0.02) == [
        "candidate on suite reverse: 0 of 40 answers end at max_new_tokens without a stop, 1 empty (the model's own: "
        "base answered within the cap here; scored as answered)"
    ]
    both = {"candidate": {"add": seen(80, empty=40)}, "base": {"add": seen(80, empty=80)}}
    empty = generation_problem(both, 16, 0.02)
    assert empty == (
        "candidate on suite add 40/80 answers empty (cap 0.02, eval.max_truncated_fraction), and no model answered "
        "within the cap on suite add (base 80/80 empty): an empty answer scores wrong whatever the model knows; check "
        "the stop tokens and the chat template"
    )


def test_the_base_is_not_held_to_the_cap_on_the_task_but_is_on_the_suites():
    """The demo's base leaves 20 of 300 date answers empty: it has not learned the task. On a suite of the
    skills it was pre-trained on, with no model stopping there, its cut-off answers are the apparatus's."""
    demo = {"candidate": {TASK: seen(300)}, "base": {TASK: seen(300, empty=20)}}
    assert generation_problem(demo, 16, 0.02) is None
    assert count_lines(demo, 0.02) == [
        "base: 0 of 300 answers end at max_new_tokens without a stop, 20 empty (not capped: the base has not "
        "learned the task)"
    ]
    on_suite = {**demo, "base": {TASK: seen(300, empty=20), "add": seen(80, cut_off=80)}}
    problem = generation_problem(on_suite, 4, 0.02)
    assert problem is not None and problem.startswith(
        "base on suite add 80/80 answers cut off at eval.max_new_tokens=4 (cap 0.02, eval.max_truncated_fraction), "
        "and no model stopped within the cap on suite add:"
    )
    # Cut off on the task with no other model stopping: the base is not held to it, so nothing is said.
    assert generation_problem({"candidate": {TASK: seen(30)}, "base": {TASK: seen(30, cut_off=30)}}, 16, 0.02) is None
    assert generation_problem({"base": {TASK: seen(30, cut_off=30)}}, 16, 0.02) is None
    assert generation_problem({"candidate": {"add": seen(0)}}, 16, 0.0) is None  # nothing answered, nothing to say


def test_a_reference_is_cut_at_a_letter_or_digit_on_its_first_line():
    assert [cut_short(r, 1) for r in ("19", "Paris.", "d n a b", "Yes\nbecause", "x", "---")] == [
        "1",
        "Pari",  # not 'Paris': the right answer to a metric that drops punctuation
        "d n a ",
        "Ye",
        "",
        "--",
    ]
    assert [cut_short(r, 2) for r in ("19", "Paris.", "2024-01-05", "Yes\nbecause")] == ["1", "Pa", "2024-", "Y"]


def test_wrong_answers_by_construction_reverse_words_and_append_another_reference():
    """Words reversed in place (a date's digit groups; one word's characters), and another item's reference after
    the reference on its first line (the reference again where every reference is one text)."""
    assert [reversed_words(r) for r in ("2024-01-13", "Paris", "a b\nmore", "- 5", "")] == [
        "13-01-2024",
        "siraP",
        "b a\nmore",
        "- 5",  # the reference again: check_wrong_answers skips such an item
        "",
    ]
    assert followed(["2024-01-13", "2024-01-13", "Yes\nbecause"]) == [
        "2024-01-13 Yes",
        "2024-01-13 Yes",
        "Yes 2024-01-13\nbecause",  # on the first line: accuracy reads only that one
    ]
    assert followed(["same", "same"]) == ["same same", "same same"]


def test_an_answer_sharing_nothing_uses_no_character_of_the_reference():
    assert absent_character("2024-01-05") == "x"
    assert absent_character("Xavier") == "q"  # not 'x' in another case
    answers = dict(sharing_nothing(["2024-01-05", ""]))
    assert answers["the empty answer"] == ["", ""]
    assert answers["each reference with every character replaced by one it does not contain"] == ["x" * 10, "x"]
