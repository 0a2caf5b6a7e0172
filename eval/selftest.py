"""The evaluation's checks of itself: its metrics (scored item by item, right and wrong answers told apart)
and its answers (references that fit the generation budget; cut-off and empty generations, per model and split).

A broken scorer must never read as a model verdict. Each failed check is `invalid(...)`: the evaluate job ends
"evaluation invalid: ..." in the infrastructure class. `score` and `item_scores` are how every model is scored
(each item alone, under the module's own computation), and they refuse a local metric's item scores that
cannot be the ones its gates decide on; `check_references` asks each metric that scores items one at a time
(local or hub), before any model answers, to give the references full credit, an answer with nothing right about
0, and wrong answers none; `unscored` asks each model's gated values for a
usable number.

An answer that stopped at eval.max_new_tokens without a stop token is cut off: a correct answer cut off scores
wrong. Two faults of the apparatus cut answers off, and each is caught where it shows, not in one model's count:
(a) a budget too small for the answers: before any model answers, `unfitting_references` counts, per split (the
task's and each suite), the references whose tokens plus the stop exceed eval.max_new_tokens; over
eval.max_truncated_fraction (default 2 %) of a split's the evaluation is invalid, naming the split, the count and
the setting the longest needs. (b) stop tokens that do not end answers: then no model stops, so after generating
(`generation_problem`) a split on which a capped model is cut off over the cap is invalid only when no model, of
any role (the base on the task too), stopped within the cap there. When one did, the apparatus can end an answer
on that split, and the others' cut-off answers are their own: a fine-tuned candidate that forgot `add` and answers
'add 3 and 4' with '2024-05---------' is cut off at 16 tokens where the base stops on the same suite with the same
tokenizer, chat template and stop tokens; that is the verdict "forgot add" for the gates to give, scored as it
answered (wrong under exact match) and counted and logged (`count_lines`), not an evaluation to re-run with a
larger budget. Empty answers are read the same way: over the cap of a capped model's answers on a split empty, the
evaluation is invalid only when no model gave non-empty answers within the cap there (the template or the stop
tokens leave nothing to answer: the tests' random models, whose 16 special tokens decode to nothing); where the
base answers the suite, a candidate that ends its turn at once on one reverse item in 40 has answered wrong.

Who is held to the caps: the candidate and the incumbent on every split, and the base on the regression
suites (what it was pre-trained to answer). Not the base on the task: a base that has not learned the task
rambles or falls silent on it (the demo's pre-trained base leaves 20 of 300 date answers empty; the tests'
random base runs every answer to max_new_tokens), and that is what its score of 0 says; its counts are
still recorded and shown, and where it stopped it still shows that the apparatus can end an answer.
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import Literal

from eval.metrics_loader import case_insensitive
from training import jobkit
from tuneproof.core.metric_names import FRACTIONS, LOSS_METRICS
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_eval import EvaluateSummary, Generations

TASK = "task"
"""The split key of the task's own eval split in ModelScore.generations (suites go by their names)."""


def generations(answers: Sequence[str], cut: Sequence[bool]) -> Generations:
    return Generations(answers=len(answers), cut_off=sum(cut), empty=sum(1 for a in answers if not a))


def capped(role: str, split: str) -> bool:
    """Whether `role`'s answers on `split` are held to the cap (see the module docstring)."""
    return not (role == "base" and split == TASK)


def where_on(split: str) -> str:
    """'the task' or 'suite add': a split as the self-test's causes name it."""
    return "the task" if split == TASK else f"suite {split}"


def unfitting_references(lengths: Mapping[str, Sequence[int]], max_new_tokens: int, cap: float) -> str | None:
    """The first split over the cap whose references cannot fit eval.max_new_tokens, in words, or None.

    `lengths`: split -> each reference's token count as the answer would be generated (the job's tokenizer, no
    special tokens). A reference fits when its tokens and the stop token do: a model that answers it right within
    the budget ends its turn. Over the cap of a split's that do not, right answers are cut off and score wrong, so
    the setting, not a model, would decide. Counted on the references, before any model answers, a too small
    setting never reads as a model's verdict, nor a model's rambling as a too small setting."""
    for split, counts in lengths.items():
        over = [n for n in counts if n + 1 > max_new_tokens]
        if counts and len(over) / len(counts) > cap:
            longest = max(counts)
            return (
                f"{where_on(split)}: {len(over)} of {len(counts)} references need more than "
                f"eval.max_new_tokens={max_new_tokens} tokens with the stop token (cap {cap:g}, "
                "eval.max_truncated_fraction): a model that answers them right is cut off and scores wrong; the "
                f"longest is {longest} tokens: raise eval.max_new_tokens to at least {longest + 1}"
            )
    return None


Fault = Literal["cut_off", "empty"]


def within_cap(seen: Generations, cap: float, fault: Fault = "cut_off") -> bool:
    """Whether a model's answers on a split were cut off (or empty) at most `cap` of the time (and it answered)."""
    return bool(seen.answers) and getattr(seen, fault) / seen.answers <= cap


def stopped(
    counts: Mapping[str, Mapping[str, Generations]], split: str, cap: float, fault: Fault = "cut_off"
) -> list[str]:
    """The models, of any role (the base on the task too), within the cap on `split` for `fault`: each shows that
    the apparatus (tokenizer, chat template, stop tokens, all shared) ends an answer there, and gives one, so another
    model's cut-off or empty answers are that model's own."""
    return [role for role, splits in counts.items() if split in splits and within_cap(splits[split], cap, fault)]


def generation_problem(counts: Mapping[str, Mapping[str, Generations]], max_new_tokens: int, cap: float) -> str | None:
    """Where the answers show a fault of the apparatus, in words ('candidate 30/30 answers cut off at
    eval.max_new_tokens=16 (cap 0.02, ...) and no model stopped within the cap on the task ...'), or None.
    `counts`: role -> split -> its Generations.

    A split on which a capped model is over the cap of cut-off (or empty) answers and no model stayed within it:
    the stop tokens end no answer there (or the template leaves nothing to answer). See the module docstring."""
    splits = list(dict.fromkeys(split for by_split in counts.values() for split in by_split))
    faults: tuple[Fault, ...] = ("cut_off", "empty")
    for fault in faults:
        for split in splits:
            answered = {role: seen[split] for role, seen in counts.items() if split in seen and seen[split].answers}
            over = [r for r, seen in answered.items() if capped(r, split) and not within_cap(seen, cap, fault)]
            if not over or stopped(counts, split, cap, fault):
                continue
            first, seen = over[0], answered[over[0]]
            others = ", ".join(f"{r} {getattr(s, fault)}/{s.answers}" for r, s in answered.items() if r != first)
            if fault == "cut_off":
                return (
                    f"{_who(first, split)} {seen.cut_off}/{seen.answers} answers cut off at eval.max_new_tokens="
                    f"{max_new_tokens} (cap {cap:g}, eval.max_truncated_fraction), and no model stopped within the cap "
                    f"on {where_on(split)}{f' ({others} cut off)' if others else ''}: the references fit, so the stop "
                    "tokens end no answer there; check the stop tokens and the chat template"
                )
            return (
                f"{_who(first, split)} {seen.empty}/{seen.answers} answers empty (cap {cap:g}, "
                f"eval.max_truncated_fraction), and no model answered within the cap on {where_on(split)}"
                f"{f' ({others} empty)' if others else ''}: an empty answer scores wrong whatever the model knows; "
                "check the stop tokens and the chat template"
            )
    return None


def _who(role: str, split: str) -> str:
    return role if split == TASK else f"{role} on suite {split}"


def count_lines(counts: Mapping[str, Mapping[str, Generations]], cap: float) -> list[str]:
    """One log line per model and split with cut-off or empty answers, saying how the self-test reads them."""
    return [
        f"{_who(role, split)}: {seen.cut_off} of {seen.answers} answers end at max_new_tokens without a stop, "
        f"{seen.empty} empty{_reading(counts, role, split, cap)}"
        for role, by_split in counts.items()
        for split, seen in by_split.items()
        if seen.cut_off or seen.empty
    ]


def _reading(counts: Mapping[str, Mapping[str, Generations]], role: str, split: str, cap: float) -> str:
    if not capped(role, split):
        return " (not capped: the base has not learned the task)"
    seen = counts[role][split]
    readings: tuple[tuple[Fault, str], ...] = (("cut_off", "stopped"), ("empty", "answered"))
    for fault, did in readings:
        witnesses = [r for r in stopped(counts, split, cap, fault) if r != role]
        if not within_cap(seen, cap, fault) and witnesses:
            return f" (the model's own: {' and '.join(witnesses)} {did} within the cap here; scored as answered)"
    return ""


# ---- the metrics -------------------------------------------------------------------------------


def score(metrics: dict, answers: list[str], references: list[str], where: str) -> dict[str, float]:
    """Every numeric value each metric module reports, by its own key (a numpy scalar counts: np.mean gives one).

    A metric module that raises on `where`'s answers (an IndexError on an empty answer, a ZeroDivisionError) is a
    broken scorer, invalid: any text is an answer a model may give, and the metric's failure is no verdict on it."""
    values: dict[str, float] = {}
    for name, metric in metrics.items():
        try:
            reported = metric.compute(predictions=answers, references=references)
        except Exception as e:
            raise invalid(
                f"{where}: {name} raised {type(e).__name__} ({e}) scoring {len(answers)} answers: a metric must "
                "score any answer (the empty one too), so the scorer failed, not the model; fix the metric module"
            ) from e
        for key, value in reported.items():
            if isinstance(value, numbers.Real):
                values[key] = float(value)
    return values


def unscored(values: dict[str, float], items: dict[str, list[float]], gated: Iterable[str]) -> str | None:
    """Why the metric modules gave no usable number for a gated value (none reported, NaN, infinite, a fraction
    or an item scored outside [0, 1]), or None.

    The scorer failed there, not the model: a gate reading it would fail the model (a modeling failure, the
    wrong class) or, worse, pass it; the gates' intervals read a score in [0, 1] per item, and a fraction's
    threshold is in [0, 1] (a percentage, 50, passes exact_match >= 0.8). eval_loss and perplexity are computed
    from the model itself, and are not asked here: their NaN is a diverged model's, which their gates judge."""
    for name in gated:
        if name in LOSS_METRICS:
            continue
        value = values.get(name)
        if value is None:
            have = ", ".join(sorted(values)) or "nothing"
            return f"the metrics report no {name} (they report {have}): a gate on it cannot judge any model"
        if not math.isfinite(value):
            return f"{name} is {value}: the metric module computed no number, so its gates cannot judge the model"
        if off := [(i, v) for i, v in enumerate(items.get(name, [])) if not 0.0 <= v <= 1.0]:
            i, v = off[0]
            return (
                f"{name} scores {len(off)} items outside [0, 1] (first: item {i}, {v:.4g}): the gates' intervals read "
                "a score in [0, 1] per item"
            )
        if name in FRACTIONS and not 0.0 <= value <= 1.0:
            return f"{name} is {value:.4g}, outside [0, 1]: a fraction on another scale, which no gate on it can read"
    return None


def item_scores(
    metrics: dict,
    answers: list[str],
    references: list[str],
    totals: dict[str, float],
    where: str,
    hub: Collection[str] = (),
) -> dict[str, list[float]]:
    """Each item's score under each metric, by the metric module's own computation on that one item.

    A local module's (eval/metrics/, every suite's) values are means over its items, and its gates are decided
    on those items: one that cannot score an item alone, reports none of its values for one, or whose items do
    not average to the value it reported over the whole set (a `return` inside its loop, a wrong denominator) is
    a broken scorer, and the evaluation of `where` (a model and split) is invalid. A metric in `hub` may be
    corpus-level (BLEU-like), not a mean over items: such a key keeps no item scores, and its gates compare points.
    `_compute` is the method every `evaluate` module implements; calling it per item skips the public
    compute's per-call Arrow cache (17 ms an item, 15 s for 300 items and three models on the demo).
    """
    items: dict[str, list[float]] = {}
    for name, metric in metrics.items():
        try:
            per_item = [metric._compute(predictions=[a], references=[r]) for a, r in zip(answers, references)]
        except Exception as e:
            if name not in hub:
                raise invalid(
                    f"{where}: {name} cannot score an item alone ({type(e).__name__}: {e}): a local metric's gates "
                    "are decided on its items' scores"
                ) from e
            jobkit.log(f"{name}: no per-item scores ({type(e).__name__}: {e}); its gates compare points")
            continue
        keys = [k for k in (per_item[0] if per_item else {}) if k in totals]
        if per_item and not keys and name not in hub:
            raise invalid(
                f"{where}: {name} reports {', '.join(sorted(per_item[0])) or 'nothing'} for an item alone, none of "
                f"the values reported over the set ({', '.join(sorted(totals))}): a local metric's gates are decided "
                "on its items' scores"
            )
        for key in keys:
            if math.isnan(totals[key]):  # no number to pair items with: unscored says so where it is gated
                continue
            values = [float(row[key]) for row in per_item]
            mean = sum(values) / len(values)
            if math.isclose(mean, totals[key], abs_tol=1e-9):
                items[key] = values
            elif name not in hub:
                raise invalid(
                    f"{where}: {key}'s item scores average {mean:.4g}, but {name} reports {totals[key]:.4g} over the "
                    f"same {len(values)} items: a local metric's value must be the mean of its items' scores, which "
                    "its gates are decided on"
                )
            else:
                jobkit.log(
                    f"{name}: {key} is not a mean over items ({mean:.4g} vs {totals[key]:.4g}); its gates compare points"
                )
    return items


def invalid(cause: str, summary: EvaluateSummary | None = None) -> StageFailure:
    """A failed self-test: the evaluation cannot judge any model, so it is not a modeling failure."""
    return StageFailure(FailureClass.infrastructure, f"evaluation invalid: {cause}", summary)


WRONG_CREDIT_SHARE = 0.1
"""The share of items on which an answer wrong by construction (the reference with one character changed, cut
short, its words in reverse order, followed by another item's reference, or in swapped case) may still score 1
before the self-test calls the metric blind. Full credit is what is counted: partial credit for a wrong answer is
a metric's design (rouge_l gives a cut answer the share of words it kept, a reversed one the share its longest
common subsequence keeps), not blindness. exact_match, accuracy and rouge_l give such an answer less than 1 on
(almost) every item; a user's module may normalise a change away on an odd reference (rouge_l reads no letter
outside a-z: 'café' cut to 'caf' scores 1; 'a a' reversed is 'a a'), which is no bug. A metric that reads only
part of the text (a date's year, any part of the reference), reads its words as a set (a date's day and month
swapped), looks for the reference anywhere in the answer (a hedge that lists three dates) or reads none of it,
gives it on most items."""

WRONG_FLOOR = 0.05
"""The most an answer that shares nothing with the reference (the empty answer; the reference with every character
replaced by one it does not contain) may score on any item. Partial credit is allowed for a partly right answer,
not for one with nothing right: the gates read 0 as the worst answer, so a metric whose floor is far above it
(1 - edit distance / 100 scores the empty answer 0.9) passes a candidate that answers every item wrong at
`min: 0.8`. exact_match, accuracy and rouge_l score such an answer 0."""


def check_references(metrics: dict, references: list[str], hub: Collection[str] = ()) -> None:
    """Each metric that scores items one at a time (scores in [0, 1]) must tell a right answer from a wrong one,
    or its scores judge no model. A metric in `hub` that cannot score an item alone (corpus-level, BLEU-like), or
    whose items do not average to its value, is not checked here: its gates compare points (item_scores).

    Right: the references, as answers, score 1 on every item; a post-processing or extraction step that
    changes a correct answer would score correct models down, and a score above 1 is another scale than the
    [0, 1] the gates' intervals assume. Nothing right: an answer that shares nothing with the reference scores at
    most WRONG_FLOOR on every item (the gates read 0 as the worst). Wrong: a metric that gives full credit to
    wrong answers (an extraction that finds nothing in either text and compares two empty strings; one that
    compares a date's year; a constant) would pass every model. Each item answered with the next item's reference
    (the references rotated by one) must score below 1 wherever that is another text, on at least one item (labels
    that differ in case alone may be one class); the answers of wrong_by_construction may score 1 on no more than
    WRONG_CREDIT_SHARE of the items (checked even where every reference is one text, which the rotation cannot
    test), and so may the references in swapped case, under each metric that does not declare case meaningless
    (eval/metrics_loader.py case_insensitive).
    """
    where = "the references as answers"
    totals = score(metrics, references, references, where)
    for key, values in item_scores(metrics, references, references, totals, where, hub).items():
        if above := [i for i, v in enumerate(values) if v > 1.0 + 1e-9]:
            raise invalid(
                f"{key} scores the references as answers {totals[key]:.4g}, above 1 on {len(above)} of {len(values)} "
                "items: the gates' intervals read a score in [0, 1] per item, 1 for a right answer; scale the metric"
            )
        wrong = [i for i, v in enumerate(values) if v < 1.0 - 1e-9]
        if wrong:
            first = wrong[0]
            raise invalid(
                f"{key} scores the references as answers {totals[key]:.4g}, below 1 on {len(wrong)} of "
                f"{len(values)} items (first: item {first}, reference {references[first][:80]!r} scores "
                f"{values[first]:.4g}): the metric's post-processing changes a correct answer"
            )
    rotated = references[1:] + references[:1]
    check_wrong_answers(metrics, references, rotated, "each item answered with the next item's reference", None, hub)
    for what, answers in sharing_nothing(references):
        check_floor(metrics, references, answers, what, hub)
    for what, answers in wrong_by_construction(references):
        check_wrong_answers(metrics, references, answers, what, WRONG_CREDIT_SHARE, hub)
    case_sensitive = {name: metric for name, metric in metrics.items() if not case_insensitive(name, metric)}
    swapped = [r.swapcase() for r in references]
    check_wrong_answers(case_sensitive, references, swapped, "each reference in swapped case", WRONG_CREDIT_SHARE, hub)


def sharing_nothing(references: list[str]) -> list[tuple[str, list[str]]]:
    """Answers with nothing of the reference in them: the empty answer, and the reference with every character
    replaced by one it does not contain (as long as the reference: a metric that reads only the answer's length or
    shape gives it credit)."""
    return [
        ("the empty answer", [""] * len(references)),
        (
            "each reference with every character replaced by one it does not contain",
            [absent_character(r) * max(len(r.strip()), 1) for r in references],
        ),
    ]


def absent_character(reference: str) -> str:
    """A letter (else a digit, else a sign) that the reference does not contain in either case."""
    seen = set(reference.casefold())
    return next((ch for ch in "xqzjkvwbfghmpy0123456789#~^" if ch not in seen), "\u00a4")


def wrong_by_construction(references: list[str]) -> list[tuple[str, list[str]]]:
    """Answers wrong under any metric that reads the text, by what they are: the reference with one character
    changed at each end of its first line (accuracy reads the first line; a metric that compares only a prefix or
    only a suffix misses one of the two; rouge_l's tokens change with either), the reference cut short (its first
    line without its last letter or digit, and the first half of that line: a metric that gives credit for any part
    of the reference, '1' for '19', 'Par' for 'Paris', passed the rest), its first line's words in reverse order (a
    metric that reads words as a set gives '2024-13-01' for '2024-01-13' full credit) and its first line followed by
    another item's reference (a metric that finds the reference anywhere in the answer credits a hedge). Where such
    an answer is the reference again ('a a' reversed), check_wrong_answers skips the item."""

    def appended(reference: str) -> str:
        lines = reference.strip().splitlines() or [""]
        return "\n".join([lines[0] + "x", *lines[1:]])

    def first_changed(reference: str) -> str:
        text = reference.strip()
        return ("y" if text[:1].casefold() == "x" else "x") + text[1:]  # not its case alone: accuracy casefolds

    return [
        ("each reference with 'x' appended to its first line", [appended(r) for r in references]),
        ("each reference with its first character changed", [first_changed(r) for r in references]),
        ("each reference's first line without its last letter or digit", [cut_short(r, 1) for r in references]),
        ("the first half of each reference's first line", [cut_short(r, 2) for r in references]),
        ("each reference with its first line's words in reverse order", [reversed_words(r) for r in references]),
        ("each reference with another item's reference after it on its first line", followed(references)),
    ]


_WORD = re.compile(r"[^\W_]+")
"""A run of letters or digits: a word, or a date's digit group."""


def reversed_words(reference: str) -> str:
    """The reference with its first line's words in reverse order, the separators left in place ('2024-01-13' ->
    '13-01-2024'); a first line of one word has its characters reversed ('Paris' -> 'siraP')."""
    lines = reference.strip().splitlines() or [""]
    words = _WORD.findall(lines[0])
    if len(words) == 1:
        first = _WORD.sub(lambda m: m.group()[::-1], lines[0])
    else:
        backwards = iter(reversed(words))
        first = _WORD.sub(lambda m: next(backwards), lines[0])
    return "\n".join([first, *lines[1:]])


def followed(references: list[str]) -> list[str]:
    """Each reference's first line followed, on that line, by the next item's reference that is another text (the
    reference itself where every reference is one text): right, then wrong. On the first line, since accuracy reads
    only that one."""
    answers = []
    for i, reference in enumerate(references):
        others = [r for r in references[i + 1 :] + references[:i] if r.strip() != reference.strip()]
        other = (others[0] if others else reference).strip().splitlines() or [""]
        lines = reference.strip().splitlines() or [""]
        answers.append("\n".join([f"{lines[0]} {other[0]}", *lines[1:]]))
    return answers


def cut_short(reference: str, part: int) -> str:
    """The reference's first line up to its last letter or digit (part 1), or to half of that (part 2). Cut at a
    letter or digit, not at the last character: 'Paris.' less its full stop is the right answer to a metric that
    drops punctuation, 'Pari' is not. A first line with no letter or digit loses its last character."""
    line = (reference.strip().splitlines() or [""])[0].strip()
    end = max((i for i, ch in enumerate(line) if ch.isalnum()), default=len(line) - 1)
    return line[:end] if part == 1 else line[: (end + 1) // 2]


def check_wrong_answers(
    metrics: dict, references: list[str], answers: list[str], what: str, share: float | None, hub: Collection[str] = ()
) -> None:
    """Invalid if a metric gives `answers` (wrong wherever they are another text than the reference) full credit
    on all those items (`share` None) or on more than `share` of them."""
    differ = differing(answers, references)
    if not differ or not metrics:
        return
    where = f"the self-test's wrong answers ({what})"
    totals = score(metrics, answers, references, where)
    for key, values in item_scores(metrics, answers, references, totals, where, hub).items():
        full = [i for i in differ if values[i] >= 1.0 - 1e-9]
        fooled = len(full) == len(differ) if share is None else len(full) > share * len(differ)
        if not fooled:
            continue
        first = full[0]
        count = (
            f"all {len(differ)} items where that is another text"
            if share is None
            else f"{len(full)} of {len(differ)} items, more than WRONG_CREDIT_SHARE={share:g} of them"
        )
        raise invalid(
            f"{key} gives full credit to wrong answers: {what} scores 1 on {count} (first: item {first}, reference "
            f"{references[first][:80]!r}, answer {answers[first][:80]!r}): the metric cannot tell a right answer "
            "from a wrong one"
        )


def check_floor(metrics: dict, references: list[str], answers: list[str], what: str, hub: Collection[str] = ()) -> None:
    """Invalid if a metric scores `answers`, which share nothing with their references, above WRONG_FLOOR on any
    item where they are another text."""
    differ = differing(answers, references)
    if not differ:
        return
    where = f"the self-test's wrong answers ({what})"
    totals = score(metrics, answers, references, where)
    for key, values in item_scores(metrics, answers, references, totals, where, hub).items():
        if not (above := [i for i in differ if values[i] > WRONG_FLOOR]):
            continue
        first = above[0]
        raise invalid(
            f"{key} gives credit to answers with nothing right: {what} scores above WRONG_FLOOR={WRONG_FLOOR:g} on "
            f"{len(above)} of {len(differ)} items (first: item {first}, reference {references[first][:80]!r}, "
            f"answer {answers[first][:80]!r}, score {values[first]:.4g}): the gates read 0 as the worst answer, so "
            "a model that answers every item wrong would score near this floor; rescale the metric so that such "
            "an answer scores 0"
        )


def differing(answers: list[str], references: list[str]) -> list[int]:
    """The items whose answer is another text than the reference (surrounding whitespace aside)."""
    return [i for i, (answer, own) in enumerate(zip(answers, references)) if answer.strip() != own.strip()]
