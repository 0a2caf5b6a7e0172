"""The harness every stage entrypoint uses inside its Ray job.

The submitting task passes one JSON document in the TUNEPROOF_JOB environment variable:
{"run_id", "job", "config", "params"} (tuneproof.core.envelope). The stage body returns its stage's summary
model (tuneproof.core.summaries) or raises
StageFailure; either way a StageResult lands at runs/<run>/stages/<job>/result.json, which
the task reads back. Unclassified exceptions are infrastructure failures: the code that runs
here is pinned with the pipeline, so an unexpected error is an environment problem until
shown otherwise.

No Prefect and no job client here: this runs on the published Ray image.
"""

from __future__ import annotations

import atexit
import os
import sys
import threading
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, NoReturn

from pydantic import BaseModel

from tuneproof.core import forward_env
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_base import reads_recorded
from tuneproof.core.envelope import ENV_VAR, JobEnvelope, ProgressEvent
from tuneproof.core.results import FailureClass, StageFailure, StageResult, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import Summary


@dataclass
class JobContext:
    run_id: str
    job: str
    config: PipelineConfig
    params: dict[str, Any] = field(default_factory=dict)

    @property
    def storage(self) -> Storage:
        return Storage.from_config(self.config.storage)

    def run_parts(self, *parts: str) -> tuple[str, ...]:
        """Relative storage parts under runs/<run>/."""
        return ("runs", self.run_id, *parts)

    def stage_parts(self, *parts: str) -> tuple[str, ...]:
        """Relative storage parts under runs/<run>/stages/<job>/."""
        return ("runs", self.run_id, "stages", self.job, *parts)


READS = "reads"
"""runs/<run>/stages/<job>/reads/: each Ray Train worker's config reads (rank-<r>.json)."""


def encode_job(run_id: str, job: str, config: PipelineConfig, params: dict[str, Any] | None = None) -> str:
    return JobEnvelope(run_id=run_id, job=job, config=config, params=params or {}).encode()


def load_context(environ: dict[str, str] | None = None, forwarded: bool = True) -> JobContext:
    """The job's context from its envelope; with `forwarded`, runtime_env.forward_env's variables are put
    into this process's environment first (every process of a job that runs user code calls this)."""
    envelope = JobEnvelope.decode((environ or os.environ).get(ENV_VAR))
    if forwarded:
        forward_env.load(envelope.config.runtime_env.forward_env)
    return JobContext(envelope.run_id, envelope.job, envelope.config, envelope.params)


def log(message: str) -> None:
    """One line to the job log, which the submitting task streams into Prefect."""
    print(f"[tuneproof] {message}", flush=True)


def progress(stage: str, done: int, total: int, **metrics: Any) -> None:
    """A machine-readable progress line; the task turns it into a progress display."""
    print(ProgressEvent(stage=stage, done=done, total=total, metrics=metrics).line(), flush=True)


def run_stage(body: Callable[[JobContext], Summary]) -> None:
    """Run a stage body, write its StageResult, and exit 0 (succeeded) or 1 (failed).

    The settings the stage read, here and in its Ray Train workers (`worker_reads_saved`), go into the
    result: they are the stage's config inputs, which a continued run compares.
    """
    ctx = load_context(forwarded=False)
    started = now_iso()
    ctx.storage.remove(*ctx.stage_parts(READS), recursive=True)  # a retried job: only this attempt's reads
    with reads_recorded(ctx.config) as reads:
        result = _run_body(ctx, body, started)
    result.config_reads = sorted(reads | _worker_reads(ctx))
    ctx.storage.write_json(result.model_dump(mode="json"), *ctx.stage_parts("result.json"))
    exit_now(0 if result.ok else 1)


def _run_body(ctx: JobContext, body: Callable[[JobContext], Summary], started: str) -> StageResult:
    try:
        forward_env.load(ctx.config.runtime_env.forward_env)
        summary = body(ctx)
        return StageResult(
            stage=ctx.job, status="succeeded", summary=summary.to_json(), started_at=started, ended_at=now_iso()
        )
    except StageFailure as f:
        log(f"stage failed ({f.failure_class.value}): {f.cause}")
        return _failed(ctx, started, f.failure_class, f.cause, f.summary)
    except Exception as e:  # noqa: BLE001 - every failure must leave a classified result behind
        traceback.print_exc()
        return _failed(ctx, started, FailureClass.infrastructure, f"{type(e).__name__}: {e}", None)


@contextmanager
def worker_reads_saved(ctx: JobContext, rank: int) -> Iterator[None]:
    """A Ray Train worker's reads of the config, saved beside the job's result for `run_stage` to add."""
    with reads_recorded(ctx.config) as reads:
        try:
            yield
        finally:
            ctx.storage.write_json(sorted(reads), *ctx.stage_parts(READS, f"rank-{rank}.json"))


def _worker_reads(ctx: JobContext) -> set[str]:
    found: set[str] = set()
    for name in ctx.storage.listdir(*ctx.stage_parts(READS)):
        found.update(ctx.storage.read_json(*ctx.stage_parts(READS, name)))
    return found


def exit_now(code: int) -> NoReturn:
    """End the job process as Python's own exit would, minus its final teardown.

    Threads still running are waited for and the exit handlers run (ray.shutdown, temporary directories,
    logging), as at any exit. What is skipped is freeing every module one by one: after torch and a Ray
    driver that takes 2 to 4 s, and the pipeline waits for it, since a job has ended only when its process has.
    """
    here = threading.current_thread()
    for thread in threading.enumerate():
        if thread is not here and thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more can reach the log
            pass
    os._exit(code)


def _failed(ctx: JobContext, started: str, cls: FailureClass, cause: str, summary: BaseModel | None) -> StageResult:
    return StageResult(
        stage=ctx.job,
        status="failed",
        failure_class=cls,
        cause=one_line(cause),
        summary=summary.model_dump(mode="json") if summary is not None else None,
        started_at=started,
        ended_at=now_iso(),
    )
