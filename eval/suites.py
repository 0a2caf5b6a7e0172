"""Regression suites (eval.suites): "must not regress" item files scored beside the task's own eval split.

A suite is a JSONL file of items {"input", "output"} (an "id" optional): the bundled general skills the
tiny base was pre-trained on (data/skills/suites/), or a user's own file. The data stage reads each one to
hash it and check it against the training split (training/data_prep.py); the evaluate job reads it again,
refuses one whose bytes are not the ones the data stage measured (`unmeasured`), asks every model each item as
one user turn, and decides the suite's gates (SuiteConfig.gates: at most
`margin` below the base and below the incumbent) with eval/gates.py, one Holm family per suite. A fine-tune
that wins its task but forgets a skill fails here, with a line that names the suite.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

from eval.gates import Scores, decide
from training.contamination import words
from training.modeling import SPECIAL_TOKEN
from tuneproof.core.config_eval import SuiteConfig
from tuneproof.core.files import DuplicateJSONKey, parse_json
from tuneproof.core.hashing import sha256_bytes
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import SuiteFile
from tuneproof.core.summaries_eval import GateDecision, SuiteScore

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True)
class Suite:
    """One suite file as read: its name, where it came from, its bytes' hash and its items in file order."""

    name: str
    source: str
    sha256: str
    ids: list[str]
    inputs: list[str]
    references: list[str]
    config: SuiteConfig
    metrics: dict[str, Any] = field(default_factory=dict)
    """The loaded metric modules (evaluate job only; `with_metrics`)."""

    def with_metrics(self, load: Callable[[str, bool], Any]) -> Suite:
        """This suite with its metric modules loaded (local modules only: preflight checked the names)."""
        return replace(self, metrics={name: load(name, False) for name in self.config.metrics})

    def special_token(self, find: Callable[[str], re.Match[str] | None]) -> str | None:
        """The first item whose input or output holds a special token of the model's tokenizer, as a data failure's
        cause: the tokenizer reads it as a control token, so the item would not ask or answer what its text says."""
        for item_id, pair in zip(self.ids, zip(self.inputs, self.references)):
            for what, text in zip(("input", "output"), pair):
                if hit := find(text):
                    return f"suite {self.name}: item {item_id}'s {what} holds {hit.group()!r}, {SPECIAL_TOKEN}"
        return None

    def texts(self) -> list[tuple[str, str]]:
        """(item id, input and answer): what the contamination check compares with the training split."""
        return [(i, f"{x} \n {y}") for i, x, y in zip(self.ids, self.inputs, self.references)]


def read_suite(name: str, config: SuiteConfig, endpoint_url: str | None) -> Suite:
    """The suite's items; an unreadable file, bytes that are not UTF-8, a row that is not {"input": str, "output":
    str}, a text holding a lone surrogate or longer than MAX_ITEM_CHARS (20,000 characters), an empty input or output, an item twice (`same_item`: its input and output up to case, punctuation and
    spacing) or an id twice, or an empty file is a data failure naming the suite, the file and both lines. (An item
    twice would count twice in the suite gate's n, its interval narrower than the evidence: three questions written
    five ways passed as 15 items where the three alone are insufficient evidence; an id names one item in the
    overlap report.)"""
    try:
        raw = Storage(config.source, endpoint_url).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise StageFailure(FailureClass.data, f"suite {name}: {config.source} is unreadable: {e}") from e
    ids, inputs, outputs = [], [], []
    lines: dict[object, int] = {}  # an item's id, and its (input, output), -> the line that first held it
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:  # replaced, an answer would hold U+FFFD that no model can match
        at = raw[: e.start].count(b"\n") + 1
        raise StageFailure(
            FailureClass.data,
            f"suite {name}: {config.source} line {at} is not UTF-8 text ({e.reason} at byte {e.start})",
        ) from None
    # "\n" alone ends a line, as parse_jsonl reads data: splitlines() also split at U+2028, U+2029 and U+0085, which
    # JSON allows raw inside a string, and failed an item holding one as "not an item".
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            row = _item(line)
        except DuplicateJSONKey as e:
            raise StageFailure(FailureClass.data, f"suite {name}: {config.source} line {number} {e}") from None
        if row is None:
            raise StageFailure(
                FailureClass.data,
                f'suite {name}: {config.source} line {number} is not an item {{"input": text, "output": text}}: {line[:80]!r}',
            )
        if problem := _text_problem(row):
            raise StageFailure(FailureClass.data, f"suite {name}: {config.source} line {number} {problem}")
        if empty := [key for key in ("input", "output") if not row[key].strip()]:
            # An empty answer matches an empty output: the item would pass a model that says nothing.
            raise StageFailure(
                FailureClass.data,
                f"suite {name}: {config.source} line {number} has an empty {' and '.join(empty)}: an item asks "
                "something and has an answer",
            )
        item_id = str(row.get("id", f"{name}:{number}"))
        same = same_item(row["input"], row["output"])
        what_same = "the same input and output (up to case, punctuation and spacing)"
        for key, what in ((same, what_same), (item_id, f"id {item_id!r}")):
            if (first := lines.setdefault(key, number)) != number:
                raise StageFailure(
                    FailureClass.data,
                    f"suite {name}: {config.source} line {number} has {what} as line {first}: an item counts once "
                    "in the suite's gate; remove or rename the repeat",
                )
        ids.append(item_id)
        inputs.append(row["input"])
        outputs.append(row["output"])
    if not ids:
        raise StageFailure(FailureClass.data, f"suite {name}: {config.source} has no items")
    return Suite(name, config.source, sha256_bytes(raw), ids, inputs, outputs, config)


def same_item(question: str, answer: str) -> tuple[tuple[str, ...] | str, ...]:
    """What makes two suite items one: their input and output as the contamination check reads text (its `words`:
    NFKC, case folded, punctuation to spaces), so 'capital of France' and 'Capital of France?' are one question.
    The output is part of it: punctuation that changes the answer ('7-2' -> '5', '7+2' -> '9') makes another item.
    A side with no words at all ('?') is compared as written, stripped, so '+' and '-' stay two."""
    return tuple(tuple(words(text)) or text.strip() for text in (question, answer))


def unmeasured(suites: Sequence[Suite], measured: Sequence[SuiteFile], run_id: str) -> str | None:
    """Why a suite read now is not the one the data stage of run `run_id` measured against the training split
    (`measured`, its DataSummary.suites), as a data failure's cause; None when every suite's bytes hash as measured.

    The contamination check is the data stage's, on the bytes it read: a file edited since (replaced by training
    rows) or a suite added to eval.suites since (`--only evaluate`) would be scored as retention while no one
    checked it for recall of the training split, and its verdicts would name a hash no check stands behind."""
    recorded = {s.name: s for s in measured}
    remedy = (
        f"re-run data for this run: `tuneproof run --run-id {run_id}` continues it, and a suite file's content is "
        "part of the data stage's inputs, so data and every stage after it run again (the fine-tune included)"
    )
    for suite in suites:
        seen = recorded.get(suite.name)
        if seen is None:
            names = f"suites {', '.join(sorted(recorded))}" if recorded else "no suite"
            return (
                f"suite {suite.name}: {suite.source} (sha256 {suite.sha256[:12]}) was never measured against the "
                f"training split: the data stage of run {run_id} measured {names}; its items could be training "
                f"rows, so its gates would measure recall, not retention; {remedy}"
            )
        if seen.sha256 != suite.sha256:
            overlap = f"{seen.contamination.overlapping} of {seen.items} items overlapping"
            return (
                f"suite {suite.name}: {suite.source} is sha256 {suite.sha256[:12]} now, not the {seen.sha256[:12]} the "
                f"data stage of run {run_id} measured against the training split ({overlap}): the file changed "
                f"since, and items no one checked against the training split would be scored; {remedy}"
            )
    return None


MAX_ITEM_CHARS = 20_000
"""An item's input or output, in characters: about 5,000 tokens, 100 times the bundled suites' longest item and
past any question a regression suite asks. Task rows past data.max_seq_len are dropped, but suite items are never
tokenized before the evaluate job, which left-pads a whole generation batch to its longest prompt: a 4 MB item
(a million tokens) reached it, after the fine-tune."""


def _text_problem(row: dict) -> str | None:
    """Why an item's input, output or id is no text a tokenizer can take, or None: a lone UTF-16 surrogate
    ("\\ud800" is valid JSON, as data rows' undecodable check says) crashed the evaluate job's tokenizer as
    infrastructure; a text over MAX_ITEM_CHARS is refused by its length."""
    for key in ("input", "output", "id"):
        text = row.get(key)
        if not isinstance(text, str):
            continue
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            return f"is not text: its {key} holds a lone UTF-16 surrogate ({text[e.start]!r} at character {e.start})"
        if key != "id" and len(text) > MAX_ITEM_CHARS:
            return (
                f"has an {key} of {len(text):,} characters, more than the {MAX_ITEM_CHARS:,} a suite item may hold: "
                "an item asks a question and has a short answer"
            )
    return None


def _item(line: str) -> dict | None:
    try:
        row = parse_json(line)
    except DuplicateJSONKey:
        raise  # read_suite names it: json.loads would keep the last value
    except (ValueError, RecursionError):  # not JSON, nested past the parser, or an integer past 4,300 digits
        return None
    ok = isinstance(row, dict) and isinstance(row.get("input"), str) and isinstance(row.get("output"), str)
    return row if ok else None


def chat_prompts(tokenizer: PreTrainedTokenizerBase, inputs: list[str]) -> list[str]:
    """Each input as one user turn, ready for the answer: how the base learned its skills (no system prompt)."""
    # cast: with tokenize=False the template's rendered text comes back (transformers types every return form).
    return [
        cast(
            str,
            tokenizer.apply_chat_template([{"role": "user", "content": x}], tokenize=False, add_generation_prompt=True),
        )
        for x in inputs
    ]


def suite_score(suite: Suite, scores: Mapping[str, Scores], confidence: float) -> SuiteScore:
    """The suite's metrics per model and its gate decision (candidate vs base and incumbent, paired by item),
    every line starting 'suite <name>: ' so a refusal names the suite."""
    decision = decide(
        scores["candidate"], scores["base"], scores.get("incumbent"), suite.config.gates(), confidence, suite.sha256
    )
    return SuiteScore(
        name=suite.name,
        source=suite.source,
        sha256=suite.sha256,
        items=len(suite.ids),
        metrics={role: dict(s.metrics) if s else None for role, s in _roles(scores).items()},
        gates=named(decision, suite.name),
    )


def _roles(scores: Mapping[str, Scores]) -> dict:
    return {role: scores.get(role) for role in ("candidate", "base", "incumbent")}


def named(decision: GateDecision, suite: str) -> GateDecision:
    prefix = f"suite {suite}: "
    verdicts = [v.model_copy(update={"line": prefix + v.line}) for v in decision.verdicts]
    return GateDecision(passed=decision.passed, lines=[prefix + line for line in decision.lines], verdicts=verdicts)


def overall(task: GateDecision, suites: list[SuiteScore]) -> GateDecision:
    """The task's gates and every suite's as one decision: passed only when all passed (for the failure cause)."""
    decisions = [task, *(s.gates for s in suites)]
    return GateDecision(
        passed=all(d.passed for d in decisions),
        lines=[line for d in decisions for line in d.lines],
        verdicts=[v for d in decisions for v in d.verdicts],
    )
