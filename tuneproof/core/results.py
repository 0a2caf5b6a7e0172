"""Stage results and failure classes: the contract between Ray jobs and the flow.

A job writes one StageResult as runs/<run>/stages/<stage>/result.json; the Prefect task
reads it back and validates it. Failure classes separate infrastructure from modeling
everywhere: in results, in the run record, in the flow's final state and in exit codes.
"""

from __future__ import annotations

from datetime import UTC, datetime
from enum import Enum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

JsonDict = dict[str, Any]


class Model(BaseModel):
    """Base of the stored and exchanged documents (records, manifests, leases, job envelopes and results): strict,
    so a field it does not know is an error, not dropped."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class FailureClass(str, Enum):
    infrastructure = "infrastructure"
    data = "data"
    modeling = "modeling"


# `tuneproof run` exit codes; documented in the README.
EXIT_OK = 0
EXIT_INVALID_CONFIG = 3
EXIT_BY_CLASS = {
    FailureClass.infrastructure: 4,
    FailureClass.data: 5,
    FailureClass.modeling: 6,
}


class StageFailure(Exception):
    """A classified stage failure: the cause is one line; summary keeps the evidence gathered so far
    (the stage's summary model, or None when the failure came before there was any)."""

    def __init__(self, failure_class: FailureClass | str, cause: str, summary: BaseModel | None = None):
        self.failure_class = FailureClass(failure_class)
        self.cause = one_line(cause)
        self.summary = summary
        super().__init__(f"{self.failure_class.value}: {self.cause}")


class StageResult(Model):
    """What a job leaves at runs/<run>/stages/<job>/result.json, whatever happened to it."""

    stage: str
    """The job's name (its result folder), e.g. 'finetune' or 'resume-t1'."""
    status: Literal["succeeded", "failed"]
    failure_class: FailureClass | None = None
    cause: str | None = None
    summary: JsonDict | None = None
    """The stage's summary model as JSON; the reader validates it with the same model."""
    started_at: str
    ended_at: str
    config_reads: list[str] = []
    """The dotted config paths the job read (tuneproof.core.config_reads): the stage's config inputs."""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"


def now_iso() -> str:
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def one_line(text: str, limit: int = 400) -> str:
    line = " ".join(str(text).split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def error_line(e: BaseException, limit: int = 400) -> str:
    """'<Type>: <message>' in one line; where the message runs over lines, its first and its last.

    Ray Train's worker-group error opens with a header ('Training failed due to worker errors:') and
    then each failed rank's traceback, which ends with the worker's own exception: the header alone
    names no cause, and the whole squeezed into one line loses that exception past the limit."""
    lines = [line.strip() for line in f"{type(e).__name__}: {e}".splitlines() if line.strip()]
    return one_line(lines[0] if len(lines) < 2 else f"{lines[0]} ... {lines[-1]}", limit)


def first_problem(e: ValidationError) -> str:
    """'<field.path>: <message> (N problem(s))': why a stored document was refused, in one line (pydantic's own
    text spans a paragraph per field and quotes the input)."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    return one_line(f"{where + ': ' if where else ''}{first['msg']} ({e.error_count()} problem(s))", 300)


def first_and_more(lines: list[str]) -> str:
    """'<first line> (+N more)': one line that stands for several problems; '' for none."""
    if not lines:
        return ""
    return lines[0] + (f" (+{len(lines) - 1} more)" if len(lines) > 1 else "")


def exit_code_for(failure_class: FailureClass | str | None) -> int:
    return EXIT_OK if failure_class is None else EXIT_BY_CLASS[FailureClass(failure_class)]
