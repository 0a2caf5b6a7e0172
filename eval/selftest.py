"""The evaluation's check of its own answers: cut-off and empty generations, per model and split (pure).

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

from collections.abc import Mapping, Sequence

from tuneproof.core.summaries_eval import Generations

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
