"""Load an `evaluate` metric by name inside the evaluate job: a local module under eval/metrics/, or
the hub where eval.hub_metrics allows it (names resolve in tuneproof.core.metric_names, which the
Prefect side also uses to refuse a bad name before anything is submitted). Also what the self-test and the
summary need to know of a loaded module: whether case means nothing to it, and the files it was loaded from."""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

from tuneproof.core.metric_names import resolve_metric

CASE_INSENSITIVE_HUB = frozenset({"rouge"})
"""Hub metrics that lower-case both texts by design (rouge_score's tokenizer), and cannot declare it themselves:
the self-test does not count a case-swapped answer's full credit against them."""


def load_metric(name: str, allow_hub: bool = False) -> Any:
    """An `evaluate` metric ready for .compute(predictions=, references=); kept in memory, no cache files."""
    import evaluate

    return evaluate.load(resolve_metric(name, allow_hub), keep_in_memory=True)


def case_insensitive(name: str, metric: Any) -> bool:
    """Whether case carries no meaning to the metric, by its own declaration (a class attribute
    `CASE_INSENSITIVE = True`: accuracy compares case-folded labels, rouge_l lower-cases as rouge_score does) or,
    for a hub module, by CASE_INSENSITIVE_HUB. Declared, not inferred from its scores: a metric that casefolds
    without saying so scores a case-swapped wrong answer ('paris' for a name, 'NO' for a code) right, and the
    self-test calls it blind."""
    return getattr(metric, "CASE_INSENSITIVE", False) is True or name in CASE_INSENSITIVE_HUB


def loaded_module_files(metric: Any) -> tuple[Path, list[str]] | None:
    """The folder the metric's module was imported from and the Python files in it (evaluate.load copies a
    module's script, and any file it imports beside it, into one folder of its modules cache): what scored. None
    where the class has no source file."""
    try:
        source = Path(inspect.getfile(type(metric)))
    except (TypeError, OSError):
        return None
    folder = source.parent
    return folder, sorted(p.name for p in folder.glob("*.py") if p.is_file())
