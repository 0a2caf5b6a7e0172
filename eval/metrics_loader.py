"""Load an `evaluate` metric by name inside the evaluate job: a local module under eval/metrics/, or
the hub where eval.hub_metrics allows it (names resolve in tuneproof.core.metric_names, which the
Prefect side also uses to refuse a bad name before anything is submitted)."""

from __future__ import annotations

from typing import Any

from tuneproof.core.metric_names import resolve_metric


def load_metric(name: str, allow_hub: bool = False) -> Any:
    """An `evaluate` metric ready for .compute(predictions=, references=); kept in memory, no cache files."""
    import evaluate

    return evaluate.load(resolve_metric(name, allow_hub), keep_in_memory=True)
