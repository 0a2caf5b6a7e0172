"""The two messages that cross between a Prefect task and its Ray job, typed on both sides.

Down: the task puts one JobEnvelope (run id, job name, the validated config, the job's params) in
the TUNEPROOF_JOB environment variable of the job's runtime_env; the job's harness decodes it.
Up: besides result.json in storage, a job prints progress lines `TUNEPROOF_PROGRESS {json}` that
the task's log follower turns into ProgressEvents (a progress bar, a Prefect progress artifact).
"""

from __future__ import annotations

import json
import math
from typing import Any

from pydantic import BaseModel, ValidationError

from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import Model

ENV_VAR = "TUNEPROOF_JOB"
PROGRESS_PREFIX = "TUNEPROOF_PROGRESS "


class JobEnvelope(Model):
    """What a stage job is told: which run, which job (its result folder), the config, its params."""

    run_id: str
    job: str
    """Job name: the submission id suffix and the result's folder (runs/<run>/stages/<job>/)."""
    config: PipelineConfig
    params: dict[str, Any] = {}

    def encode(self) -> str:
        return self.model_dump_json()

    @classmethod
    def decode(cls, raw: str | None) -> JobEnvelope:
        if not raw:
            raise RuntimeError(f"{ENV_VAR} is not set: stage entrypoints run as Ray jobs submitted by tuneproof")
        return cls.model_validate_json(raw)


class ProgressEvent(BaseModel):
    """One progress line: `done` of `total` units of a stage's work, plus the latest metrics."""

    stage: str
    done: int
    total: int
    metrics: dict[str, Any] = {}

    def line(self) -> str:
        """The machine-readable line a job prints."""
        return PROGRESS_PREFIX + json.dumps(
            {"stage": self.stage, "done": self.done, "total": self.total, **self.metrics}
        )

    def text(self) -> str:
        """'finetune 120/400 loss=0.5312 lr=0.00194': how people see it."""
        return f"{self.stage} {self.done}/{self.total} {format_metrics(self.metrics)}".rstrip()

    @property
    def fraction(self) -> float:
        return min(self.done / self.total, 1.0) if self.total > 0 else 0.0


def parse_progress(line: str) -> tuple[str, ProgressEvent] | None:
    """(text before the marker, event) for a progress line, else None.

    Worker lines arrive prefixed by Ray, e.g. "(RayTrainWorker pid=12) TUNEPROOF_PROGRESS {...}".
    """
    at = line.find(PROGRESS_PREFIX)
    if at < 0:
        return None
    try:
        doc = json.loads(line[at + len(PROGRESS_PREFIX) :])
        event = ProgressEvent(
            stage=doc.pop("stage"), done=int(doc.pop("done")), total=int(doc.pop("total") or 0), metrics=doc
        )
    except (ValueError, KeyError, TypeError, AttributeError, ValidationError):
        return None
    return line[:at], event


def format_metrics(metrics: dict[str, Any]) -> str:
    """'loss=0.5312 lr=0.00194': four significant digits for floats, the value as is otherwise."""
    return " ".join(f"{k}={_short(v)}" for k, v in metrics.items())


def _short(value: Any) -> str:
    if isinstance(value, float) and math.isfinite(value):
        return f"{value:.4g}"
    return str(value)
