"""Typed reads of what a test expects to be there: the value, or an AssertionError that names what is missing.

A run record keeps each stage's summary, and the registry its pointer, as optional JSON (None when there is
none); a test that reads one asserts it exists rather than failing on None['key'].
"""

from __future__ import annotations

from typing import Any, TypeVar

from tuneproof.control.record import RunRecord, StageEntry
from tuneproof.control.registry import ProductionPointer, read_pointer
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import Summary

S = TypeVar("S", bound=Summary)
T = TypeVar("T")


def summary_dict(rec: RunRecord, stage: str) -> dict[str, Any]:
    """The JSON summary the record keeps for `stage` (mutable: tests edit it to build a variant record)."""
    summary = rec.stages[stage].summary
    assert summary is not None, f"record {rec.run_id}: stage {stage} has no summary"
    return summary


def production_pointer(storage: Storage, name: str) -> ProductionPointer:
    """The production pointer of model `name`."""
    found, _ = read_pointer(storage, name)
    assert found is not None, f"model {name} has no production pointer in {storage.root}"
    return found


def summary_of(rec: RunRecord, stage: str, model: type[S]) -> S:
    """The summary the record keeps for `stage`, as its model."""
    return entry_summary(rec.stages[stage], model)


def entry_summary(entry: StageEntry, model: type[S]) -> S:
    """A stage entry's summary as its model."""
    summary = entry.summary_as(model)
    assert summary is not None, f"stage {entry.stage} has no summary"
    return summary


def present(value: T | None) -> T:
    """`value`, which the test expects to be there (a call that may answer None)."""
    assert value is not None, "expected a value, got None"
    return value
