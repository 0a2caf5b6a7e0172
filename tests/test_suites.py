"""Regression suites (eval/suites.py): each suite's gates, the suites x models table in the summary, the card
and `runs diff`, and reading a suite file. Pure but for the files written here."""

from __future__ import annotations

import json

import pytest

from eval.gates import Scores, decide
from eval.suites import overall, read_suite, suite_score
from tuneproof.control.registry import suite_table
from tuneproof.core.config_eval import EvalConfig, Gate, SuiteConfig
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_eval import EvaluateSummary, ModelScore


def scores(right: int, n: int) -> Scores:
    items = [1.0] * right + [0.0] * (n - right)
    return Scores({"exact_match": right / n}, {"exact_match": items})


def suite_file(tmp_path, name: str, n: int, margin: float = 0.25) -> SuiteConfig:
    path = tmp_path / f"{name}.jsonl"
    path.write_text(
        "".join(json.dumps({"id": f"{name}-{i}", "input": f"q{i}", "output": f"a{i}"}) + "\n" for i in range(n))
    )
    return SuiteConfig(source=str(path), margin=margin)


def summary_with(suites) -> EvaluateSummary:
    task = decide(scores(30, 30), scores(0, 30), None, EvalConfig().gates, 0.95, "split")
    model = ModelScore(path="m", metrics={"exact_match": 1.0}, seconds=1.0)
    base = ModelScore(path="b", metrics={"exact_match": 0.0}, seconds=1.0)
    return EvaluateSummary(
        models={"candidate": model, "base": base, "incumbent": None}, gates=task, examples=30, suites=suites
    )


def test_a_suite_the_candidate_forgot_fails_naming_the_suite_and_its_interval(tmp_path):
    suite = read_suite("add", suite_file(tmp_path, "add", 40), None)
    forgot = suite_score(suite, {"candidate": scores(10, 40), "base": scores(36, 40)}, 0.95)
    assert not forgot.gates.passed and forgot.items == 40 and forgot.sha256 == suite.sha256
    vs_base = forgot.gates.verdicts[0]
    assert vs_base.gate == "max_regression_vs_base" and vs_base.outcome == "fail"
    assert vs_base.split_sha256 == suite.sha256
    assert vs_base.line.startswith("suite add: exact_match regression vs base <= 0.25: +0.65 [+0.4")
    assert vs_base.line.endswith("(fail)")
    assert forgot.gates.lines[1] == (
        "suite add: exact_match regression vs incumbent <= 0.25: no incumbent: first model, regression gate not applicable"
    )
    summary = summary_with([forgot])
    decision = overall(summary.gates, summary.suites)
    assert not decision.passed and decision.failure_cause() == vs_base.line


def test_a_healthy_candidate_passes_every_suite_and_the_table_has_the_task_first(tmp_path):
    kept = suite_score(
        read_suite("capital", suite_file(tmp_path, "capital", 32), None),
        {"candidate": scores(31, 32), "base": scores(32, 32), "incumbent": scores(32, 32)},
        0.95,
    )
    assert kept.gates.passed, kept.gates.lines
    assert "Holm over 2" in kept.gates.lines[0]
    rows = summary_with([kept]).suite_rows()
    assert [(r.suite, r.metric, r.candidate, r.base, r.incumbent) for r in rows] == [
        ("task", "exact_match", 1.0, 0.0, None),
        ("capital", "exact_match", 31 / 32, 1.0, 1.0),
    ]
    assert rows[1].verdict.startswith("vs base: pass [") and "; vs incumbent: pass [" in rows[1].verdict
    table = suite_table(rows)
    assert table[:2] == ["| suite | metric | candidate | base | incumbent | verdict |", "|---|---|---|---|---|---|"]
    assert table[3].startswith("| capital | exact_match | 0.9688 | 1 | 1 | vs base: pass [")


def test_runs_diff_shows_the_suites_by_model_for_both_runs(tmp_path):
    from tuneproof.app.rundiff import render_diff, suite_pairs

    suite = read_suite("add", suite_file(tmp_path, "add", 40), None)
    healthy = suite_score(suite, {"candidate": scores(36, 40), "base": scores(36, 40)}, 0.95)
    forgot = suite_score(suite, {"candidate": scores(10, 40), "base": scores(36, 40)}, 0.95)

    class Record:  # the one thing suite_pairs reads of a run record
        def __init__(self, summary):
            self._summary = summary

        def summary(self, stage, model):
            return self._summary

    pairs = suite_pairs(Record(summary_with([healthy])), Record(summary_with([forgot])))  # type: ignore[arg-type]
    assert pairs[1] == {
        "suite": "add exact_match",
        "candidate": [0.9, 0.25],
        "base": [0.9, 0.9],
        "incumbent": [None, None],
    }
    text = render_diff({"a": "a", "b": "b", "changed": False, "changes": [], "metrics": [], "suites": pairs})
    assert "  add exact_match: candidate 0.9 -> 0.25, base 0.9 -> 0.9, incumbent - -> -" in text.splitlines()


def test_a_suite_file_that_is_not_items_is_a_data_failure_naming_the_line(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n{"question": "c"}\n')
    with pytest.raises(StageFailure) as info:
        read_suite("mine", SuiteConfig(source=str(path)), None)
    assert info.value.failure_class is FailureClass.data
    assert info.value.cause.startswith(f"suite mine: {path} line 2 is not an item")
    # An item naming a key twice: json kept the last answer.
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": "d", "output": "e"}\n')
    with pytest.raises(StageFailure, match=f'suite mine: {path} line 2 names key "output" more than once'):
        read_suite("mine", SuiteConfig(source=str(path)), None)
    with pytest.raises(StageFailure, match="is unreadable"):
        read_suite("gone", SuiteConfig(source=str(tmp_path / "gone.jsonl")), None)
    # Bytes that are not UTF-8 were replaced by U+FFFD, an answer no model gives: now the line is named.
    path.write_bytes(b'{"input": "a", "output": "b"}\n{"input": "c", "output": "M\xe4rz"}\n')
    with pytest.raises(StageFailure, match=f"suite mine: {path} line 2 is not UTF-8 text \\(invalid continuation"):
        read_suite("mine", SuiteConfig(source=str(path)), None)
    # An empty output is matched by an empty answer: the item passed a model that said nothing.
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": " "}\n')
    with pytest.raises(StageFailure, match=f"suite mine: {path} line 2 has an empty output: an item asks something"):
        read_suite("mine", SuiteConfig(source=str(path)), None)
    # A byte-order mark (Notepad, Excel) is not part of the first item: it failed line 1 as "not an item".
    path.write_bytes(b'\xef\xbb\xbf{"input": "a", "output": "b"}\n')
    assert read_suite("mine", SuiteConfig(source=str(path)), None).inputs == ["a"]


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_a_suite_item_holding_a_unicode_line_separator_is_one_item(tmp_path, separator):
    # JSON allows these raw inside a string (json.dumps(ensure_ascii=False) writes them so); splitlines() cut the
    # item at one and failed its line as "not an item".
    path = tmp_path / "mine.jsonl"
    items = [{"input": f"Copy:{separator}second line", "output": "ok"}, {"input": "Say hi", "output": "hi"}]
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\r\n" for item in items), encoding="utf-8")
    suite = read_suite("mine", SuiteConfig(source=str(path)), None)
    assert suite.inputs == [f"Copy:{separator}second line", "Say hi"] and suite.ids == ["mine:1", "mine:2"]


@pytest.mark.parametrize(
    "second, says",
    [
        ('{"input": "a", "output": "b", "id": "x2"}', "line 3 has the same input and output as line 1"),
        ('{"input": "c", "output": "d", "id": "x1"}', "line 3 has id 'x1' as line 1"),
        # Only surrounding whitespace differs: the same item, counted twice in n.
        ('{"input": " a\\n", "output": "b ", "id": "x2"}', "line 3 has the same input and output as line 1"),
    ],
)
def test_a_suite_item_or_id_twice_is_a_data_failure_naming_both_lines(tmp_path, second, says):
    # Twice counted as two items in the suite gate's n: an interval narrower than the evidence.
    path = tmp_path / "mine.jsonl"
    path.write_text(f'{{"input": "a", "output": "b", "id": "x1"}}\n\n{second}\n')
    with pytest.raises(StageFailure) as info:
        read_suite("mine", SuiteConfig(source=str(path)), None)
    assert info.value.failure_class is FailureClass.data and f"suite mine: {path} {says}: an item counts once" in (
        info.value.cause
    )
    # The same input with another answer, or the same answer to another input, are other items.
    path.write_text('{"input": "a", "output": "b"}\n{"input": "a", "output": "c"}\n{"input": "z", "output": "b"}\n')
    assert read_suite("mine", SuiteConfig(source=str(path)), None).ids == ["mine:1", "mine:2", "mine:3"]


def test_a_gate_with_only_a_base_margin_is_a_gate():
    assert Gate(max_regression_vs_base=0.1).max_regression_vs_base == 0.1
