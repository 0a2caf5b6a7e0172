"""The evaluation's checks of itself: its metrics (scored item by item, right and wrong answers told apart)
and its answers (cut-off and empty generations, per model and split).

A broken scorer must never read as a model verdict. Each failed check is `invalid(...)`: the evaluate job ends
"evaluation invalid: ..." in the infrastructure class. `score` and `item_scores` are how every model is scored
(each item alone, under the module's own computation), and they refuse a local metric's item scores that
cannot be the ones its gates decide on; `check_references` asks each local metric, before any model answers,
to give the references full credit and wrong answers none; `unscored` asks each model's gated values for a
usable number.

An answer that stopped at eval.max_new_tokens without a stop token, or came back empty, is not the model's
answer as the metric needs it: cut off, a correct answer scores wrong, and a gate would judge the setting
instead of the model. So each model's answers on each split are counted (generate_checked says which were
cut), and over eval.max_truncated_fraction (default 2 %) of either the evaluation is invalid, naming the
model, the count and the setting; the evaluate job ends it in the self-test's class, never as a gate verdict.

Who is held to the cap: the candidate and the incumbent on every split, and the base on the regression
suites (what it was pre-trained to answer). Not the base on the task: a base that has not learned the task
rambles or falls silent on it (the demo's pre-trained base leaves 20 of 300 date answers empty; the tests'
random base runs every answer to max_new_tokens), and that is what its score of 0 says; its counts are
still recorded and shown. A too small max_new_tokens still shows, in the candidate's count: a candidate
that answers like the references is cut off with them.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Collection, Iterable, Mapping, Sequence

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


def generation_problem(counts: Mapping[str, Mapping[str, Generations]], max_new_tokens: int, cap: float) -> str | None:
    """The first model and split over the cap, in words ('candidate 30/30 answers cut off at
    eval.max_new_tokens=2 (cap 0.02) ...'), or None. `counts`: role -> split -> its Generations."""
    for role, splits in counts.items():
        for split, seen in splits.items():
            if not capped(role, split) or not seen.answers:
                continue
            who = role if split == TASK else f"{role} on suite {split}"
            if seen.cut_off / seen.answers > cap:
                return (
                    f"{who} {seen.cut_off}/{seen.answers} answers cut off at eval.max_new_tokens={max_new_tokens} "
                    f"(cap {cap:g}, eval.max_truncated_fraction): a cut-off answer scores wrong whatever the model "
                    "knows; raise eval.max_new_tokens (a model that never ends its turn is cut off at any setting)"
                )
            if seen.empty / seen.answers > cap:
                return (
                    f"{who} {seen.empty}/{seen.answers} answers empty (cap {cap:g}, eval.max_truncated_fraction): an "
                    "empty answer scores wrong whatever the model knows; check the stop tokens and the chat template"
                )
    return None


def count_lines(counts: Mapping[str, Mapping[str, Generations]]) -> list[str]:
    """One log line per model and split with cut-off or empty answers, saying whether the cap holds it."""
    return [
        f"{role}{'' if split == TASK else f' on suite {split}'}: {seen.cut_off} of {seen.answers} answers end at "
        f"max_new_tokens without a stop, {seen.empty} empty"
        + ("" if capped(role, split) else " (not capped: the base has not learned the task)")
        for role, splits in counts.items()
        for split, seen in splits.items()
        if seen.cut_off or seen.empty
    ]


# ---- the metrics -------------------------------------------------------------------------------


def score(metrics: dict, answers: list[str], references: list[str]) -> dict[str, float]:
    """Every numeric value each metric module reports, by its own key (a numpy scalar counts: np.mean gives one)."""
    values: dict[str, float] = {}
    for metric in metrics.values():
        for key, value in metric.compute(predictions=answers, references=references).items():
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
"""The share of items on which an answer wrong by construction (empty, the reference with one character changed,
or the reference cut short) may still score 1 before the self-test calls the metric blind. Full credit is what is
counted: partial credit for a wrong answer is a metric's design (rouge_l gives a cut answer the share of words it
kept), not blindness. exact_match, accuracy and rouge_l give such an answer less than 1 on (almost) every item; a
user's module may normalise a change away on an odd reference (rouge_l reads no letter outside a-z: 'café' cut to
'caf' scores 1), which is no bug. A metric that reads only part of the text (a date's year, any part of the
reference) or none of it gives it on most items."""


def check_references(metrics: dict, references: list[str]) -> None:
    """Each local metric (scores in [0, 1]) must tell a right answer from a wrong one, or its scores judge no model.

    Right: the references, as answers, score 1 on every item; a post-processing or extraction step that
    changes a correct answer would score correct models down, and a score above 1 is another scale than the
    [0, 1] the gates' intervals assume. Wrong: a metric that gives full credit to wrong answers (an extraction
    that finds nothing in either text and compares two empty strings; one that compares a date's year; a
    constant) would pass every model. Each item answered with the next item's reference (the references
    rotated by one) must score below 1 wherever that is another text, on at least one item (labels that differ
    in case alone may be one class); the empty answer and the reference with one character changed, wrong on
    every item, may score 1 on no more than WRONG_CREDIT_SHARE of the items (checked even where every reference
    is one text, which the rotation cannot test).
    """
    totals = score(metrics, references, references)
    for key, values in item_scores(metrics, references, references, totals, "the references as answers").items():
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
    check_wrong_answers(metrics, references, rotated, "each item answered with the next item's reference", None)
    for what, answers in wrong_by_construction(references):
        check_wrong_answers(metrics, references, answers, what, WRONG_CREDIT_SHARE)


def wrong_by_construction(references: list[str]) -> list[tuple[str, list[str]]]:
    """Answers wrong under any metric that reads the text, by what they are: the empty answer, the reference
    with one character changed at each end of its first line (accuracy reads the first line; a metric that
    compares only a prefix or only a suffix misses one of the two; rouge_l's tokens change with either), and the
    reference cut short: its first line without its last letter or digit, and the first half of that line (a
    metric that gives credit for any part of the reference, '1' for '19', 'Par' for 'Paris', passed the rest)."""

    def appended(reference: str) -> str:
        lines = reference.strip().splitlines() or [""]
        return "\n".join([lines[0] + "x", *lines[1:]])

    def first_changed(reference: str) -> str:
        text = reference.strip()
        return ("y" if text[:1].casefold() == "x" else "x") + text[1:]  # not its case alone: accuracy casefolds

    return [
        ("the empty answer", [""] * len(references)),
        ("each reference with 'x' appended to its first line", [appended(r) for r in references]),
        ("each reference with its first character changed", [first_changed(r) for r in references]),
        ("each reference's first line without its last letter or digit", [cut_short(r, 1) for r in references]),
        ("the first half of each reference's first line", [cut_short(r, 2) for r in references]),
    ]


def cut_short(reference: str, part: int) -> str:
    """The reference's first line up to its last letter or digit (part 1), or to half of that (part 2). Cut at a
    letter or digit, not at the last character: 'Paris.' less its full stop is the right answer to a metric that
    drops punctuation, 'Pari' is not. A first line with no letter or digit loses its last character."""
    line = (reference.strip().splitlines() or [""])[0].strip()
    end = max((i for i, ch in enumerate(line) if ch.isalnum()), default=len(line) - 1)
    return line[:end] if part == 1 else line[: (end + 1) // 2]


def check_wrong_answers(
    metrics: dict, references: list[str], answers: list[str], what: str, share: float | None
) -> None:
    """Invalid if a metric gives `answers` (wrong wherever they are another text than the reference) full credit
    on all those items (`share` None) or on more than `share` of them."""
    differ = [i for i, (answer, own) in enumerate(zip(answers, references)) if answer.strip() != own.strip()]
    if not differ:
        return
    totals = score(metrics, answers, references)
    where = f"the self-test's wrong answers ({what})"
    for key, values in item_scores(metrics, answers, references, totals, where).items():
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
