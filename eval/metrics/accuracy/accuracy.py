"""accuracy as a local `evaluate` module: label accuracy for answers that are a label.

Loaded offline with `evaluate.load("eval/metrics/accuracy")`; self-contained because evaluate
copies this file into its module cache. Hugging Face's hub `accuracy` compares integer class ids
through scikit-learn; a generating model answers in text, so here the label is the first line of
the answer, stripped and case-folded, compared with the reference treated the same way
("Positive\\nbecause ..." counts as "positive"). `sample_weight` and `normalize` keep the hub
metric's meaning.
"""

import datasets
import evaluate

_DESCRIPTION = "Share of answers whose first line equals the reference label, ignoring case and surrounding whitespace."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): expected labels, one per prediction.
    sample_weight (list of float, optional): weight of each example; default 1 each.
    normalize (bool, default True): the weighted share of correct answers; False gives their weighted count.
Returns:
    accuracy (float): 0.0 for no examples.
Example:
    >>> m = evaluate.load("eval/metrics/accuracy")
    >>> m.compute(predictions=["Yes\\nsure", "no"], references=["yes", "yes"])
    {'accuracy': 0.5}
"""


def _label(text: str) -> str:
    lines = text.strip().splitlines()
    return lines[0].strip().casefold() if lines else ""


class Accuracy(evaluate.Metric):
    CASE_INSENSITIVE = True
    """Labels are compared case-folded on purpose ('Positive' is 'positive'): the evaluation's self-test does not
    count a case-swapped answer's full credit as blindness (eval/metrics_loader.py case_insensitive)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(
        self,
        predictions: list[str],
        references: list[str],
        sample_weight: list[float] | None = None,
        normalize: bool = True,
    ) -> dict[str, float]:
        weights = [1.0] * len(predictions) if sample_weight is None else [float(w) for w in sample_weight]
        if len(weights) != len(predictions):
            raise ValueError(
                f"sample_weight has {len(weights)} values, expected one per prediction ({len(predictions)})"
            )
        correct = sum(w for p, r, w in zip(predictions, references, weights) if _label(p) == _label(r))
        if not normalize:
            return {"accuracy": float(correct)}
        total = sum(weights)
        return {"accuracy": correct / total if total else 0.0}
