"""rouge_l as a local `evaluate` module: ROUGE-L F1 (longest common subsequence), averaged.

Loaded offline with `evaluate.load("eval/metrics/rouge_l")`; self-contained (no rouge_score,
no nltk) because evaluate copies this file into its module cache. Tokenisation follows
rouge_score's default without stemming: lower-case, every run of characters other than a-z and
0-9 is a separator. Per example F1 = 2PR/(P+R) with P = LCS/len(prediction) and
R = LCS/len(reference); an empty side scores 0, as in rouge_score.
"""

import re

import datasets
import evaluate

_DESCRIPTION = "Mean ROUGE-L F1 over examples (LCS of lower-cased alphanumeric tokens, no stemming)."
_KWARGS = """
Args:
    predictions (list of str): generated answers.
    references (list of str): expected answers, one per prediction.
Returns:
    rouge_l (float): mean F1 in [0, 1]; 0.0 for no examples.
Example:
    >>> m = evaluate.load("eval/metrics/rouge_l")
    >>> m.compute(predictions=["the cat sat"], references=["the cat sat down"])
    {'rouge_l': 0.857...}
"""

_SEPARATORS = re.compile(r"[^a-z0-9]+")


def tokens(text: str) -> list[str]:
    return _SEPARATORS.sub(" ", text.lower()).split()


def lcs_length(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence, one row of the DP table at a time."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b):
            current.append(previous[j] + 1 if x == y else max(previous[j + 1], current[j]))
        previous = current
    return previous[-1]


def f1(prediction: str, reference: str) -> float:
    pred, ref = tokens(prediction), tokens(reference)
    common = lcs_length(pred, ref)
    if common == 0:
        return 0.0
    precision, recall = common / len(pred), common / len(ref)
    return 2 * precision * recall / (precision + recall)


class RougeL(evaluate.Metric):
    CASE_INSENSITIVE = True
    """Both texts are lower-cased on purpose, as rouge_score does: the evaluation's self-test does not count a
    case-swapped answer's full credit as blindness (eval/metrics_loader.py case_insensitive)."""

    def _info(self) -> evaluate.MetricInfo:
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation="Lin, C.-Y. (2004). ROUGE: A Package for Automatic Evaluation of Summaries.",
            inputs_description=_KWARGS,
            features=datasets.Features(
                {"predictions": datasets.Value("string"), "references": datasets.Value("string")}
            ),
        )

    def _compute(self, predictions: list[str], references: list[str]) -> dict[str, float]:
        if not predictions:
            return {"rouge_l": 0.0}
        return {"rouge_l": sum(f1(p, r) for p, r in zip(predictions, references)) / len(predictions)}
