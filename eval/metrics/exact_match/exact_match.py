"""exact_match as a local `evaluate` module: the share of predictions equal to their reference.

Loaded offline with `evaluate.load("eval/metrics/exact_match")` (eval/metrics_loader.py does
this); evaluate copies this one file into its module cache, so it imports nothing from the project.
Both sides are stripped of surrounding whitespace before comparing: a generated answer followed
by a newline is still the right answer. Nothing else is normalised (case and punctuation count).
"""

import datasets
import evaluate

_DESCRIPTION = "Share of predictions that equal their reference after stripping surrounding whitespace."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): expected answers, one per prediction.
Returns:
    exact_match (float): in [0, 1]; 0.0 for no examples.
Example:
    >>> m = evaluate.load("eval/metrics/exact_match")
    >>> m.compute(predictions=["2024-01-05\\n", "x"], references=["2024-01-05", "y"])
    {'exact_match': 0.5}
"""


class ExactMatch(evaluate.Metric):
    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        if not predictions:
            return {"exact_match": 0.0}
        hits = sum(p.strip() == r.strip() for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}
