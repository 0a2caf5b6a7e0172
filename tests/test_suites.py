"""Regression suites (eval/suites.py): each suite's gates, the suites x models table in the summary, the card
and `runs diff`, and reading a suite file. Pure but for the files written here."""

from __future__ import annotations

import json
import re

import pytest

from eval.gates import Scores, decide
from eval.suites import overall, read_suite, suite_score, unmeasured
from tuneproof.control.registry import suite_table
from tuneproof.core.config_eval import EvalConfig, Gate, SuiteConfig
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_data import Contamination, SuiteFile
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


@pytest.mark.parametrize(
    ("line", "says"),
    [
        # Valid JSON, no text: it passed, and the evaluate job's tokenizer crashed on it as infrastructure.
        ('{"input": "1 Jan \\ud800", "output": "b"}', "line 2 is not text: its input holds a lone UTF-16 surrogate"),
        ('{"input": "c", "output": "d", "id": "\\udfff"}', "line 2 is not text: its id holds a lone UTF-16 surrogate"),
        # Never tokenized before evaluate, which left-pads a whole batch to it: 4 MB reached the job.
        (json.dumps({"input": "x" * 20_001, "output": "d"}), "line 2 has an input of 20,001 characters, more than"),
    ],
    ids=["surrogate-input", "surrogate-id", "item-too-long"],
)
def test_a_suite_item_no_tokenizer_should_get_is_a_data_failure_naming_the_line(tmp_path, line, says):
    path = tmp_path / "mine.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n' + line + "\n")
    with pytest.raises(StageFailure) as info:
        read_suite("mine", SuiteConfig(source=str(path)), None)
    assert info.value.failure_class is FailureClass.data
    assert info.value.cause.startswith(f"suite mine: {path} {says}"), info.value.cause
    # A pair (an emoji) is text, and an item at the bound is an item.
    path.write_text(json.dumps({"input": "\U0001f600 " + "x" * 19_998, "output": "b"}) + "\n")
    assert len(read_suite("mine", SuiteConfig(source=str(path)), None).inputs[0]) == 20_000


@pytest.mark.parametrize("separator", ["\u2028", "\u2029", "\u0085"])
def test_a_suite_item_holding_a_unicode_line_separator_is_one_item(tmp_path, separator):
    # JSON allows these raw inside a string (json.dumps(ensure_ascii=False) writes them so); splitlines() cut the
    # item at one and failed its line as "not an item".
    path = tmp_path / "mine.jsonl"
    items = [{"input": f"Copy:{separator}second line", "output": "ok"}, {"input": "Say hi", "output": "hi"}]
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\r\n" for item in items), encoding="utf-8")
    suite = read_suite("mine", SuiteConfig(source=str(path)), None)
    assert suite.inputs == [f"Copy:{separator}second line", "Say hi"] and suite.ids == ["mine:1", "mine:2"]


SAME = "the same input and output (up to case, punctuation and spacing)"


@pytest.mark.parametrize(
    "second, says",
    [
        ('{"input": "a", "output": "b", "id": "x2"}', f"line 3 has {SAME} as line 1"),
        ('{"input": "c", "output": "d", "id": "x1"}', "line 3 has id 'x1' as line 1"),
        # Only surrounding whitespace differs: the same item, counted twice in n.
        ('{"input": " a\\n", "output": "b ", "id": "x2"}', f"line 3 has {SAME} as line 1"),
        # The same question written another way (case, inner spacing, punctuation, full-width forms), same answer.
        ('{"input": "A?", "output": "b.", "id": "x2"}', f"line 3 has {SAME} as line 1"),
        ('{"input": "\uff21", "output": "  B", "id": "x2"}', f"line 3 has {SAME} as line 1"),
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


def test_one_question_written_five_ways_counts_once(tmp_path):
    # Three questions written five ways each passed a suite gate as n=15; the three alone are insufficient evidence.
    path = tmp_path / "cap.jsonl"
    variants = ["capital of France", "CAPITAL OF FRANCE", "capital  of France", "capital of France?"]
    path.write_text("".join(json.dumps({"input": v, "output": "Paris"}) + "\n" for v in variants))
    with pytest.raises(StageFailure, match=re.escape(f"line 2 has {SAME} as line 1")):
        read_suite("cap", SuiteConfig(source=str(path)), None)
    # Punctuation that changes the answer makes another item; so do inputs with no words that differ as written.
    items = [("7-2", "5"), ("7+2", "9"), ("+", "a sign"), ("-", "a sign"), ("capital of France", "Paris")]
    path.write_text("".join(json.dumps({"input": x, "output": y}) + "\n" for x, y in items))
    assert len(read_suite("cap", SuiteConfig(source=str(path)), None).ids) == 5


def test_a_gate_with_only_a_base_margin_is_a_gate():
    assert Gate(max_regression_vs_base=0.1).max_regression_vs_base == 0.1


def as_measured(name: str, config: SuiteConfig, overlapping: int = 0) -> SuiteFile:
    """The suite as the data stage leaves it in DataSummary.suites, from its file as it reads now."""
    suite = read_suite(name, config, None)
    n = len(suite.ids)
    found = Contamination(ngram=13, eval_items=n, exact_matches=0, overlapping=overlapping, fraction=overlapping / n)
    return SuiteFile(name=name, source=suite.source, sha256=suite.sha256, items=n, contamination=found)


def test_a_suite_is_scored_only_on_the_bytes_the_data_stage_measured(tmp_path):
    config = suite_file(tmp_path, "mine", 40)
    recorded = [as_measured("mine", config)]
    assert unmeasured([read_suite("mine", config, None)], recorded, "r1") is None
    # Replaced after the data stage by rows it would have refused (the training rows themselves).
    before = recorded[0].sha256
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"input": f"add {i} and 1", "output": str(i + 1)}) + "\n" for i in range(40)))
    now = read_suite("mine", config, None)
    assert unmeasured([now], recorded, "r1") == (
        f"suite mine: {path} is sha256 {now.sha256[:12]} now, not the {before[:12]} the data stage of run r1 measured "
        "against the training split (0 of 40 items overlapping): the file changed since, and items no one checked "
        "against the training split would be scored; re-run data for this run: `tuneproof run --run-id r1` continues "
        "it, and a suite file's content is part of the data stage's inputs, so data and every stage after it run "
        "again (the fine-tune included)"
    )
    # Added to eval.suites after the data stage ran (`--only evaluate`): never checked at all.
    other = suite_file(tmp_path, "other", 5)
    cause = unmeasured([read_suite("other", other, None)], recorded, "r1")
    assert cause is not None and cause.startswith(
        f"suite other: {other.source} (sha256 {read_suite('other', other, None).sha256[:12]}) was never measured "
        "against the training split: the data stage of run r1 measured suites mine; its items could be training rows"
    )
    assert "`tuneproof run --run-id r1`" in cause


def test_a_suite_item_whose_id_python_cannot_read_is_a_data_failure_naming_the_line(tmp_path):
    # json reads an integer past 4,300 digits as a ValueError, not a JSONDecodeError: it crashed the evaluate job.
    path = tmp_path / "mine.jsonl"
    path.write_text('{"input": "a", "output": "b"}\n{"input": "c", "output": "d", "id": ' + "9" * 5000 + "}\n")
    with pytest.raises(StageFailure, match=f"suite mine: {path} line 2 is not an item") as info:
        read_suite("mine", SuiteConfig(source=str(path)), None)
    assert info.value.failure_class is FailureClass.data
