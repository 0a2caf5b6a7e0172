"""eval/selftest.py: cut-off and empty answers per model and split, and who the cap holds (pure); how a reference
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
)
from tuneproof.core.summaries_eval import Generations


def seen(answers: int, cut_off: int = 0, empty: int = 0) -> Generations:
    return Generations(answers=answers, cut_off=cut_off, empty=empty)


def test_answers_are_counted_cut_off_and_empty():
    assert generations(["2024-01-05", "", "20"], [False, False, True]) == seen(3, cut_off=1, empty=1)


def test_within_the_cap_is_no_problem_and_over_it_names_the_model_the_count_and_the_setting():
    assert generation_problem({"candidate": {TASK: seen(300, cut_off=6)}}, 16, 0.02) is None  # 2 % exactly
    problem = generation_problem({"candidate": {TASK: seen(300, cut_off=7)}}, 16, 0.02)
    assert problem is not None and problem.startswith(
        "candidate 7/300 answers cut off at eval.max_new_tokens=16 (cap 0.02, eval.max_truncated_fraction)"
    )
    empty = generation_problem({"incumbent": {TASK: seen(300, empty=30)}}, 16, 0.02)
    assert empty is not None and empty.startswith("incumbent 30/300 answers empty (cap 0.02")


def test_the_base_is_not_held_to_the_cap_on_the_task_but_is_on_the_suites():
    """The demo's base leaves 20 of 300 date answers empty: it has not learned the task. On a suite of the
    skills it was pre-trained on, its cut-off answers say the setting is too small."""
    demo = {"candidate": {TASK: seen(300)}, "base": {TASK: seen(300, empty=20)}}
    assert generation_problem(demo, 16, 0.02) is None
    assert count_lines(demo) == [
        "base: 0 of 300 answers end at max_new_tokens without a stop, 20 empty (not capped: the base has not "
        "learned the task)"
    ]
    on_suite = {**demo, "base": {TASK: seen(300, empty=20), "add": seen(80, cut_off=80)}}
    problem = generation_problem(on_suite, 4, 0.02)
    assert problem is not None and problem.startswith(
        "base on suite add 80/80 answers cut off at eval.max_new_tokens=4"
    )
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
