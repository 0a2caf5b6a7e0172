"""tasks/artifacts.py's pure pieces: what the evaluation artifact shows of the self-test's answer counts."""

from __future__ import annotations

from tasks.artifacts import generation_rows
from tuneproof.core.summaries_eval import EvaluateSummary, GateDecision, Generations, ModelScore


def test_the_evaluation_artifact_shows_each_models_cut_off_and_empty_answers_per_split():
    def model(**splits: tuple[int, int, int]) -> ModelScore:
        counts = {name: Generations(answers=n, cut_off=c, empty=e) for name, (n, c, e) in splits.items()}
        return ModelScore(path="p", metrics={}, seconds=1.0, generations=counts)

    summary = EvaluateSummary(
        models={"candidate": model(task=(300, 0, 1), add=(80, 0, 0)), "base": model(task=(300, 0, 20), add=(80, 2, 0))},
        gates=GateDecision(passed=True, lines=[], verdicts=[]),
        examples=300,
    )
    rows = generation_rows(summary)
    assert [r["metric"] for r in rows] == ["answers cut off / empty (task)", "answers cut off / empty (add)"]
    assert (rows[0]["candidate"], rows[0]["base"], rows[0]["incumbent"]) == (
        "0 / 1 of 300",
        "0 / 20 of 300",
        "no model",
    )
    assert rows[0]["gates"].endswith("(the base is not held to it on the task)")
    assert rows[1]["base"] == "2 / 0 of 80" and "not held" not in rows[1]["gates"]
