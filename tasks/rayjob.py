"""Submit a stage as a Ray job, follow it, and read back its result.json.

The submission id is derived from the run id and the job name, so a Prefect retry attaches
to the job already running (or finished) instead of starting a duplicate. A job that ended
FAILED or STOPPED gets a new attempt id (<run>-<job>-a2) on the next submission, because Ray
never reuses a submission id. Logs stream line by line to a callback (the Prefect logger);
a timeout, or any exception while following (a cancelled flow run), stops the Ray job.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from ray.job_submission import JobStatus, JobSubmissionClient

from tuneproof.core.config import PipelineConfig
from tuneproof.control.identity import stage_working_dir
from tuneproof.core.results import FailureClass, StageResult, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.envelope import ENV_VAR, PROGRESS_PREFIX, JobEnvelope

TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
LIVE = {JobStatus.PENDING, JobStatus.RUNNING}
MAX_ATTEMPTS = 20


@dataclass
class JobSpec:
    job: str
    """Job name: the submission id suffix and the result's folder (runs/<run>/stages/<job>/)."""
    module: str
    """Entrypoint module, run as `python -m <module>`."""
    timeout_s: int
    params: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    """Pipeline-set environment (e.g. NCCL debug); recorded apart from the user's additions."""


@dataclass
class JobOutcome:
    submission_id: str
    entrypoint: str
    job_status: str
    attached: bool
    working_dir_hash: str
    runtime_env_additions: dict[str, Any]
    pipeline_env: dict[str, str]
    submitted_at: str
    ended_at: str
    result: StageResult

    def to_record(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["result"] = self.result.model_dump(mode="json")
        return doc


def auth_headers(cfg: PipelineConfig) -> dict[str, str] | None:
    """The Ray token header when a token file is configured (Ray 2.59+ local clusters use token auth)."""
    token_file = cfg.cluster.auth_token_file
    if not token_file:
        return None
    path = Path(token_file)
    if not path.exists():
        raise FileNotFoundError(
            f"cluster.auth_token_file {token_file} does not exist: start the local cluster with "
            "`tuneproof local up`, or set cluster.auth_token_file=null for a cluster without token auth"
        )
    return {"Authorization": f"Bearer {path.read_text().strip()}"}


def progress_text(event: dict[str, Any]) -> str:
    """'finetune 120/400 loss=0.5312 lr=0.00194' from a progress event."""
    extras = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                      for k, v in event.items() if k not in ("stage", "done", "total"))
    return f"{event.get('stage')} {event.get('done')}/{event.get('total')} {extras}".rstrip()


def submission_id(run_id: str, job: str, attempt: int = 1) -> str:
    return f"{run_id}-{job}" if attempt == 1 else f"{run_id}-{job}-a{attempt}"


class RayJobRunner:
    """Runs JobSpecs for one pipeline run against the configured cluster."""

    def __init__(self, cfg: PipelineConfig, run_id: str, on_line: Callable[[str], None] = print,
                 on_progress: Callable[[dict], None] | None = None,
                 on_status: Callable[[str, str], None] | None = None, poll_s: float = 1.0):
        self.cfg = cfg
        self.run_id = run_id
        self.on_line = on_line
        self.on_progress = on_progress
        self.on_status = on_status or (lambda sid, status: None)
        self.poll_s = poll_s
        self.storage = Storage.from_config(cfg.storage)
        self.client = JobSubmissionClient(cfg.cluster.address, headers=auth_headers(cfg))

    def run(self, spec: JobSpec, stop_when: Callable[[str], bool] | None = None) -> JobOutcome:
        """Submit (or attach), follow to the end, read the result. `stop_when(line)` stops the job early."""
        submitted_at = now_iso()
        sid, attached, entrypoint, wd_hash = self.submit_or_attach(spec)
        try:
            status = self.follow(sid, spec.timeout_s, stop_when)
            result = self.read_result(spec, sid, status)
        except JobTimeout as e:
            status = self.client.get_job_status(sid)
            result = StageResult(stage=spec.job, status="failed", failure_class=FailureClass.infrastructure,
                                 cause=str(e), started_at=submitted_at, ended_at=now_iso())
        return JobOutcome(
            submission_id=sid, entrypoint=entrypoint, job_status=status.value, attached=attached,
            working_dir_hash=wd_hash, runtime_env_additions=self.cfg.runtime_env.model_dump(),
            pipeline_env=spec.env, submitted_at=submitted_at, ended_at=now_iso(), result=result,
        )

    def submit_or_attach(self, spec: JobSpec) -> tuple[str, bool, str, str]:
        entrypoint = f"python -m {spec.module}"
        workdir, wd_hash = stage_working_dir()
        for attempt in range(1, MAX_ATTEMPTS + 1):
            sid = submission_id(self.run_id, spec.job, attempt)
            status = self.status(sid)
            if status is None:
                # A result left by an earlier, failed attempt must not be mistaken for this one's.
                self.storage.remove("runs", self.run_id, "stages", spec.job, "result.json")
                self.client.submit_job(
                    entrypoint=entrypoint, submission_id=sid,
                    runtime_env=self.runtime_env(spec, str(workdir)),
                    metadata={"tuneproof_run": self.run_id, "tuneproof_job": spec.job, "working_dir_hash": wd_hash},
                )
                self.on_line(f"submitted Ray job {sid}: {entrypoint}")
                return sid, False, entrypoint, wd_hash
            if status not in (JobStatus.FAILED, JobStatus.STOPPED):
                self.on_line(f"attached to existing Ray job {sid} ({status.value})")
                return sid, True, entrypoint, wd_hash
        raise RuntimeError(f"{spec.job}: {MAX_ATTEMPTS} attempts already exist for run {self.run_id}")

    def runtime_env(self, spec: JobSpec, workdir: str) -> dict[str, Any]:
        # Ray Train re-prints worker output through its own logger unless told not to: lines came twice.
        env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **self.cfg.runtime_env.env_vars, **spec.env}
        env[ENV_VAR] = JobEnvelope(run_id=self.run_id, job=spec.job, config=self.cfg, params=spec.params).encode()
        runtime_env: dict[str, Any] = {"working_dir": workdir, "env_vars": env}
        if self.cfg.runtime_env.pip:
            runtime_env["pip"] = list(self.cfg.runtime_env.pip)
        return runtime_env

    def status(self, sid: str) -> JobStatus | None:
        try:
            return self.client.get_job_status(sid)
        except RuntimeError as e:  # the SDK raises RuntimeError on 404
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise

    def follow(self, sid: str, timeout_s: int, stop_when: Callable[[str], bool] | None = None) -> JobStatus:
        """Stream logs until the job ends; stop it on timeout, on stop_when, or on cancellation."""
        deadline = time.monotonic() + timeout_s
        seen, last_status = 0, None
        try:
            while True:
                status = self.client.get_job_status(sid)
                if status != last_status:
                    self.on_status(sid, status.value)
                    last_status = status
                logs = self.client.get_job_logs(sid)
                for line in logs[seen:].splitlines():
                    self.emit(line)
                    if stop_when and stop_when(line):
                        self.stop(sid, "stop condition met")
                        return self.wait_terminal(sid)
                seen = len(logs)
                if status in TERMINAL:
                    return status
                if time.monotonic() > deadline:
                    self.stop(sid, f"timed out after {timeout_s}s")
                    self.wait_terminal(sid)
                    raise JobTimeout(f"Ray job {sid} timed out after {timeout_s}s and was stopped")
                time.sleep(self.poll_s)
        except Exception:
            # A transient error (lost connection) leaves the job running so a retry re-attaches.
            raise
        except BaseException:
            # Cancellation (Ctrl-C, Prefect's TerminationSignal on a cancelled flow run) stops the job.
            self.stop(sid, "the flow run was interrupted or cancelled")
            raise

    def emit(self, line: str) -> None:
        """Pass a log line on; progress lines become a readable line plus a progress event."""
        # Worker lines arrive prefixed by Ray, e.g. "(RayTrainWorker pid=12) TUNEPROOF_PROGRESS {...}".
        at = line.find(PROGRESS_PREFIX)
        if at >= 0:
            try:
                event = json.loads(line[at + len(PROGRESS_PREFIX):])
            except ValueError:
                event = None
            if event is not None:
                if self.on_progress:
                    self.on_progress(event)
                line = line[:at] + "progress " + progress_text(event)
        self.on_line(line)

    def stop(self, sid: str, why: str) -> None:
        self.on_line(f"stopping Ray job {sid}: {why}")
        try:
            self.client.stop_job(sid)
        except Exception as e:  # noqa: BLE001 - best effort: report, the original cause matters more
            self.on_line(f"could not stop Ray job {sid}: {e}")

    def wait_terminal(self, sid: str, timeout_s: float = 60.0) -> JobStatus:
        deadline = time.monotonic() + timeout_s
        status = self.client.get_job_status(sid)
        while status not in TERMINAL and time.monotonic() < deadline:
            time.sleep(0.5)
            status = self.client.get_job_status(sid)
        return status

    def read_result(self, spec: JobSpec, sid: str, status: JobStatus) -> StageResult:
        parts = ("runs", self.run_id, "stages", spec.job, "result.json")
        if self.storage.exists(*parts):
            return StageResult.model_validate(self.storage.read_json(*parts))
        # No result: the job died before its harness could write one (import error, OOM kill, stop).
        info = self.client.get_job_info(sid)
        cause = info.message or f"job ended {status.value} without writing {'/'.join(parts)}"
        return StageResult(
            stage=spec.job, status="failed", failure_class=FailureClass.infrastructure,
            cause=one_line(f"Ray job {sid} {status.value}: {cause}"), started_at=now_iso(), ended_at=now_iso(),
        )


class JobTimeout(Exception):
    """A stage job ran past its timeout and was stopped (an infrastructure failure)."""
