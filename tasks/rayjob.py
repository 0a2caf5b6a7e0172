"""Submit a stage as a Ray job, follow its log as a stream, and read back its result.json.

The submission id is derived from the run id and the job name, so a Prefect retry attaches to the job
already running or ended instead of starting a duplicate: a verdict a job reached, failed or not, is read,
never re-rolled (`reattaches`). A job stopped, or ended without a result, gets a new attempt id
(<run>-<job>-a2) on the next submission, because Ray never reuses a submission id; the attempt it replaces
stays evidence (`RayJobRunner.superseded`). So does an id held by another run's job
(the same run id under another storage root, on a shared cluster): its job's metadata names the run, the job
and the storage root, and only a job of this run is attached to, so its result is never read as this run's.
Logs arrive through Ray's log-tail websocket (each byte once, not the whole log every poll) and are cut into
whole lines before anyone sees them; a timeout, or any BaseException while following (Ctrl-C, a cancelled
flow run), stops the Ray job.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import requests
from pydantic import ValidationError
from ray.job_submission import JobDetails, JobStatus, JobSubmissionClient

from tuneproof.control.identity import stage_working_dir
from tuneproof.control.record import JobEntry, RuntimeEnvAdditions
from tuneproof.core import forward_env
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ENV_VAR, JobEnvelope, ProgressEvent, parse_progress
from tuneproof.core.results import FailureClass, StageResult, first_and_more, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import Summary

TERMINAL = {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}
MAX_ATTEMPTS = 20
UNREACHABLE_WAIT_S = 120.0
"""How long a submission waits for an unreachable Ray dashboard (a head restarting) before the stage fails."""
INVOCATION = "tuneproof_invocation"
"""Job metadata: the run's invocation that submitted it (record.invocations), so a Prefect retry within that
invocation knows its own job from an earlier invocation's. Not the flow run id: a flow run retried from the
Prefect UI keeps its id but is a new invocation, which reruns an infrastructure failure."""


class ClusterUnreachable(ConnectionError):
    """The Ray dashboard did not answer within UNREACHABLE_WAIT_S: an infrastructure failure naming the address."""


def backoff_delays(bound_s: float, first_s: float = 2.0, cap_s: float = 15.0) -> list[float]:
    """Waits between tries (2, 4, 8, 15, 15, ...) that add up to at most `bound_s`. Pure."""
    delays: list[float] = []
    delay = first_s
    while sum(delays) + delay <= bound_s:
        delays.append(delay)
        delay = min(delay * 2, cap_s)
    return delays


def while_unreachable(call: Callable[[], Any], address: str, on_line: Callable[[str], None], bound_s: float) -> Any:
    """`call()`, retried with backoff while the dashboard at `address` refuses connections, up to `bound_s`;
    each wait is reported. ClusterUnreachable, naming the address and the last error, after the bound."""
    waited = 0.0
    for delay in [*backoff_delays(bound_s), None]:
        try:
            return call()
        except (ConnectionError, requests.exceptions.ConnectionError) as e:  # the SDK raises either
            if delay is None:
                raise ClusterUnreachable(
                    f"the Ray dashboard at {address} did not answer for {waited:.0f}s "
                    f"({type(e).__name__}: {one_line(str(e), 200)}): check the cluster (`tuneproof local status`)"
                ) from e
            on_line(
                f"the Ray dashboard at {address} is unreachable; retrying in {delay:.0f}s (waited {waited:.0f}s of {bound_s:.0f}s)"
            )
            time.sleep(delay)
            waited += delay
    raise AssertionError("unreachable")  # the loop returns or raises


def connect(
    cfg: PipelineConfig, on_line: Callable[[str], None], bound_s: float = UNREACHABLE_WAIT_S
) -> JobSubmissionClient:
    """A job client for the configured cluster; waits (bounded) while its dashboard is unreachable."""
    address = cfg.cluster.address
    return while_unreachable(lambda: JobSubmissionClient(address, headers=auth_headers(cfg)), address, on_line, bound_s)


@dataclass
class JobSpec:
    job: str
    """Job name: the submission id suffix and the result's folder (runs/<run>/stages/<job>/)."""
    module: str
    """Entrypoint module, run as `python -m <module>`."""
    timeout_s: int
    summary: type[Summary]
    """The model the job's summary must validate against."""
    params: dict[str, Any] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    """Pipeline-set environment (e.g. NCCL debug); recorded apart from the user's additions."""


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


def submission_id(run_id: str, job: str, attempt: int = 1) -> str:
    return f"{run_id}-{job}" if attempt == 1 else f"{run_id}-{job}-a{attempt}"


def reattaches(status: JobStatus, result: StageResult | None, same_invocation: bool) -> bool:
    """Whether a submission attaches to this run's latest job for a stage job (else it submits a new attempt).
    `result` is what the job left, None while it runs or when it left none. Pure.

    A job still going is followed. A job that ended with a result reached a verdict that must not vanish: a
    Prefect retry (the same invocation) reads it, failed or not, and so does a continuation (a later invocation),
    except an infrastructure failure, which is what a continuation reruns (a fine-tune then resumes from its
    checkpoint). A stopped job, or one that ended without a result, reached no verdict: a new attempt replaces it.
    """
    if status not in TERMINAL:
        return True
    if status == JobStatus.STOPPED or result is None:
        return False
    return same_invocation or result.failure_class != FailureClass.infrastructure


@dataclass(frozen=True)
class LatestJob:
    """This run's newest Ray job for a stage job, as a submission finds it."""

    sid: str
    status: JobStatus
    info: JobDetails
    same_invocation: bool
    """Submitted by this invocation (a Prefect retry's earlier try): no entry holds its verdict yet."""


class LineAssembler:
    """Cuts a stream of text chunks into whole lines: a line split across chunks comes out once, whole."""

    def __init__(self) -> None:
        self._partial = ""

    def feed(self, chunk: str) -> list[str]:
        """The lines this chunk completes; an unterminated tail waits for the next chunk."""
        text = self._partial + chunk
        *lines, self._partial = text.split("\n")
        return [line.rstrip("\r") for line in lines]

    def flush(self) -> list[str]:
        """At the end of the stream: the last line, if it had no newline."""
        rest, self._partial = self._partial, ""
        return [rest.rstrip("\r")] if rest else []


_END = object()
"""Queue sentinel: the log stream ended normally."""


class LogStream:
    """Ray's log tail for one job, read on a background thread into a queue of whole lines.

    The websocket closes when the job reaches a terminal state; an error in it (the dashboard went
    away) is handed over as an exception, so following can fail like any lost connection. Ray notices
    the end late: its tail re-reads the log file once a second and checks the job's status once per
    empty read, so the socket closes 2 to 4 s after the job ended. `finish` ends the stream as soon as
    the follower has seen a terminal status, with the rest of the (then complete) log.
    """

    def __init__(self, client: JobSubmissionClient, sid: str):
        self.lines: queue.Queue[Any] = queue.Queue()
        self._assembler = LineAssembler()
        self._lock = threading.Lock()
        self._received = 0
        """Characters of the log handed over so far: where the rest of the complete log begins."""
        self._closed = False
        self._thread = threading.Thread(target=self._run, args=(client, sid), daemon=True, name=f"logs-{sid}")
        self._thread.start()

    def _run(self, client: JobSubmissionClient, sid: str) -> None:
        try:
            asyncio.run(self._read(client, sid))
            self._end("")
        except Exception as e:  # noqa: BLE001 - handed to the following thread, which raises it
            with self._lock:
                if not self._closed:
                    self.lines.put(e)

    async def _read(self, client: JobSubmissionClient, sid: str) -> None:
        async for chunk in client.tail_job_logs(sid):
            with self._lock:
                if self._closed:
                    return  # finished from the complete log: what the tail still sends was handed over
                self._received += len(chunk)
                for line in self._assembler.feed(chunk):
                    self.lines.put(line)

    def finish(self, complete_log: str) -> None:
        """The job has ended, so `complete_log` (its whole log, read after the end) is all there will be:
        hand over the part the tail has not delivered yet and end the stream now."""
        self._end(complete_log, rest_only=True)

    def _end(self, text: str, rest_only: bool = False) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            rest = text[self._received :] if rest_only else text
            for line in [*self._assembler.feed(rest), *self._assembler.flush()]:
                self.lines.put(line)
            self.lines.put(_END)


class RayJobRunner:
    """Runs JobSpecs for one pipeline run against the configured cluster."""

    def __init__(
        self,
        cfg: PipelineConfig,
        run_id: str,
        on_line: Callable[[str], None] = print,
        on_progress: Callable[[ProgressEvent], None] | None = None,
        on_status: Callable[[str, str], None] | None = None,
        poll_s: float = 1.0,
        client: JobSubmissionClient | None = None,
        on_wait: Callable[[str], None] | None = None,
        invocation: int = 1,
    ):
        self.cfg = cfg
        self.run_id = run_id
        self.invocation = invocation
        """The record's invocation this runner submits for (tasks.jobs.StageCall.invocation)."""
        self.on_line = on_line
        self.on_progress = on_progress
        self.on_status = on_status or (lambda sid, status: None)
        self.on_wait = on_wait or on_line
        """Where waits go (an unreachable dashboard, a cluster without free resources): louder than log lines."""
        self.poll_s = poll_s
        self.storage = Storage.from_config(cfg.storage)
        self.client = client or connect(cfg, self.on_wait)
        self.following = ""
        """The submission id being followed (its status events name it)."""
        self.waiting = False
        """Whether the current wait for cluster resources has been reported (emit)."""
        self.superseded: list[JobEntry] = []
        """Attempts of this invocation the last submission replaced (stopped, or ended without a result): in no
        entry yet, so the caller lists them before the job `run` returns."""

    def run(self, spec: JobSpec, stop_when: Callable[[str], bool] | None = None, attach_only: bool = False) -> JobEntry:
        """Submit (or attach), follow to the end, read the result. `stop_when(line)` stops the job early.
        `attach_only`: a job that would need a new attempt raises instead (`attaches` said it would not)."""
        submitted_at = now_iso()
        sid, attached, entrypoint, wd_hash = self.submit_or_attach(spec, attach_only)
        try:
            status = self.follow(sid, spec.timeout_s, stop_when)
            forward_env.discard(
                forward_env.run_key(self.run_id, self.storage.root), spec.job
            )  # the job has ended: nothing reads its values again
            result = self.read_result(spec, sid, status)
        except JobTimeout as e:
            forward_env.discard(forward_env.run_key(self.run_id, self.storage.root), spec.job)
            status = self.client.get_job_status(sid)
            result = StageResult(
                stage=spec.job,
                status="failed",
                failure_class=FailureClass.infrastructure,
                cause=str(e),
                started_at=submitted_at,
                ended_at=now_iso(),
            )
        started, ended = self.ray_times(sid)
        return JobEntry(
            submission_id=sid,
            entrypoint=entrypoint,
            job_status=status.value,
            attached=attached,
            working_dir_hash=wd_hash,
            runtime_env_additions=RuntimeEnvAdditions.of(self.cfg, spec.module),
            pipeline_env=spec.env,
            submitted_at=submitted_at,
            ended_at=now_iso(),
            result=result,
            ray_started_at=started,
            ray_ended_at=ended,
        )

    def ray_times(self, sid: str) -> tuple[str | None, str | None]:
        """The job's own start and end as Ray reports them (an attached job ran before this flow watched it); (None,
        None) when Ray cannot say now: they are the cost's evidence, not the stage's, and a job that ended must
        not become an exception over them (the cost then falls back to the flow's times and says so)."""
        try:
            info = self.client.get_job_info(sid)
        except Exception as e:  # noqa: BLE001 - a dashboard blink, a job record Ray no longer holds
            self.on_wait(f"{sid}: Ray's start and end times could not be read ({type(e).__name__}: {e})")
            return None, None
        return ray_time(info.start_time), ray_time(info.end_time)

    def submit_or_attach(self, spec: JobSpec, attach_only: bool = False) -> tuple[str, bool, str, str]:
        entrypoint = f"python -m {spec.module}"
        workdir, wd_hash = stage_working_dir()
        attempt, latest = self.latest_ours(spec)
        self.superseded = []
        if latest is not None and self.attaches_to(spec, latest):
            self.on_line(f"attached to existing Ray job {latest.sid} ({latest.status.value})")
            return latest.sid, True, entrypoint, wd_hash
        if attach_only:
            found = f"{latest.sid} is {latest.status.value} without a result" if latest else "none is there"
            raise RuntimeError(f"{spec.job}: expected a Ray job of run {self.run_id} to attach to, but {found}")
        if latest is not None and latest.same_invocation:  # an earlier try of this task: it raised, no entry lists it
            self.superseded.append(self.superseded_entry(spec, latest))
        sid = submission_id(self.run_id, spec.job, attempt)
        # What the replaced attempt left is no verdict of this one's.
        self.storage.remove(*result_path(self.run_id, spec.job))
        self.client.submit_job(
            entrypoint=entrypoint,
            submission_id=sid,
            runtime_env=self.runtime_env(spec, str(workdir)),
            metadata={**self.owner(spec), "working_dir_hash": wd_hash, INVOCATION: str(self.invocation)},
        )
        self.on_line(f"submitted Ray job {sid}: {entrypoint}")
        return sid, False, entrypoint, wd_hash

    def attaches(self, spec: JobSpec) -> bool:
        """Whether `run(spec)` would attach to a job already there rather than submit one."""
        _, latest = self.latest_ours(spec)
        return latest is not None and self.attaches_to(spec, latest)

    def latest_ours(self, spec: JobSpec) -> tuple[int, LatestJob | None]:
        """The first free attempt number, and the newest attempt that is this run's job (Ray holds attempt ids
        in order, and each earlier one of ours had ended when the next was submitted)."""
        taken: list[tuple[str, JobStatus]] = []
        for attempt in range(1, MAX_ATTEMPTS + 1):
            sid = submission_id(self.run_id, spec.job, attempt)
            status = while_unreachable(
                functools.partial(self.status, sid), self.cfg.cluster.address, self.on_wait, UNREACHABLE_WAIT_S
            )
            if status is None:
                break
            taken.append((sid, status))
        else:
            raise RuntimeError(f"{spec.job}: {MAX_ATTEMPTS} attempts already exist for run {self.run_id}")
        for sid, status in reversed(taken):
            info = self.client.get_job_info(sid)
            if self.is_ours(info, spec):
                mine = (info.metadata or {}).get(INVOCATION) == str(self.invocation)
                return attempt, LatestJob(sid, status, info, mine)
            self.on_line(f"Ray job {sid} is another run's (same run id, another storage root): not attaching")
        return attempt, None

    def attaches_to(self, spec: JobSpec, latest: LatestJob) -> bool:
        ended = latest.status in TERMINAL and self.storage.exists(*result_path(self.run_id, spec.job))
        result = self.read_result(spec, latest.sid, latest.status) if ended else None
        return reattaches(latest.status, result, latest.same_invocation)

    def superseded_entry(self, spec: JobSpec, latest: LatestJob) -> JobEntry:
        """The record of an attempt a new one replaces: what it cost and how it ended."""
        info = latest.info
        return JobEntry(
            submission_id=latest.sid,
            entrypoint=info.entrypoint,
            job_status=latest.status.value,
            attached=False,
            working_dir_hash=(info.metadata or {}).get("working_dir_hash", ""),
            runtime_env_additions=RuntimeEnvAdditions.of(self.cfg, spec.module),
            pipeline_env=spec.env,
            submitted_at=iso_from_ms(info.start_time),
            ended_at=iso_from_ms(info.end_time),
            result=self.read_result(spec, latest.sid, latest.status),
            ray_started_at=ray_time(info.start_time),
            ray_ended_at=ray_time(info.end_time),
        )

    def owner(self, spec: JobSpec) -> dict[str, str]:
        """The job's metadata that says whose it is: a retry attaches only to a job that names all of it."""
        return {"tuneproof_run": self.run_id, "tuneproof_job": spec.job, "tuneproof_storage": self.storage.uri()}

    def is_ours(self, info: JobDetails, spec: JobSpec) -> bool:
        metadata = info.metadata or {}
        return all(metadata.get(key) == value for key, value in self.owner(spec).items())

    def runtime_env(self, spec: JobSpec, workdir: str) -> dict[str, Any]:
        # Ray Train re-prints worker output through its own logger unless told not to: lines came twice.
        env = {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **self.cfg.runtime_env.env_vars, **spec.env}
        env[ENV_VAR] = JobEnvelope(run_id=self.run_id, job=spec.job, config=self.cfg, params=spec.params).encode()
        names = self.cfg.runtime_env.forward_env
        if names and self.cfg.cluster.backend == "local":
            # Values go to a private file on this machine; Ray sees (and logs) only its path. On EKS the
            # Ray pods have them from a Kubernetes Secret.
            env[forward_env.FILE_VAR] = str(
                forward_env.write_values(names, forward_env.run_key(self.run_id, self.storage.root), spec.job)
            )
        runtime_env: dict[str, Any] = {"working_dir": workdir, "env_vars": env}
        if pip := self.cfg.job_pip(spec.module):  # the user's additions, and peft for a LoRA fine-tune
            runtime_env["pip"] = pip
        return runtime_env

    def status(self, sid: str) -> JobStatus | None:
        try:
            return self.client.get_job_status(sid)
        except RuntimeError as e:  # the SDK raises RuntimeError on 404
            if "does not exist" in str(e) or "404" in str(e):
                return None
            raise

    def follow(self, sid: str, timeout_s: int, stop_when: Callable[[str], bool] | None = None) -> JobStatus:
        """Stream the log until the job ends; stop it on timeout, on stop_when, or on cancellation."""
        deadline = time.monotonic() + timeout_s
        try:
            return self._follow(sid, deadline, timeout_s, stop_when)
        except Exception:
            # A transient error (lost connection) leaves the job running so a retry re-attaches.
            raise
        except BaseException:
            # Cancellation (Ctrl-C, Prefect's TerminationSignal on a cancelled flow run) stops the job.
            self.stop(sid, "the flow run was interrupted or cancelled")
            raise

    def _follow(self, sid: str, deadline: float, timeout_s: int, stop_when: Callable[[str], bool] | None) -> JobStatus:
        self.following = sid
        stream = LogStream(self.client, sid)
        status, ended, next_poll, finishing = None, False, 0.0, False
        while True:
            if time.monotonic() >= next_poll:
                status = self._poll_status(sid, status)
                next_poll = time.monotonic() + self.poll_s
                if status in TERMINAL and not ended and not finishing:
                    finishing = True  # once: should the read fail, the tail still ends the stream
                    self._finish_early(stream, sid)
            if ended and status in TERMINAL:
                return status
            if time.monotonic() > deadline:
                self.stop(sid, f"timed out after {timeout_s}s")
                self.wait_terminal(sid)
                raise JobTimeout(f"Ray job {sid} timed out after {timeout_s}s and was stopped")
            try:
                # Wait for a line only until the next status poll is due: a job that ended right after a
                # line was seen is noticed within poll_s, not poll_s after that line.
                item = stream.lines.get(timeout=max(0.0, next_poll - time.monotonic()))
            except queue.Empty:
                continue
            if item is _END:
                ended = True
                next_poll = 0.0  # the stream ends with the job: read its final status now
            elif isinstance(item, Exception):
                raise item
            else:
                self.emit(item)
                if stop_when and stop_when(item):
                    self.stop(sid, "stop condition met")
                    return self.wait_terminal(sid)

    def _finish_early(self, stream: LogStream, sid: str) -> None:
        """The log is complete once the job has ended: read its rest now rather than wait seconds for Ray's
        tail to notice the end (lines still arrive once, in order). Should the read fail, the tail ends the
        stream as before."""
        try:
            complete_log = self.client.get_job_logs(sid)
        except (RuntimeError, OSError) as e:  # the SDK raises RuntimeError; requests' errors are OSErrors
            self.on_line(
                f"reading the rest of Ray job {sid}'s log failed ({one_line(str(e), 200)}); following its tail"
            )
            return
        stream.finish(complete_log)

    def _poll_status(self, sid: str, last: JobStatus | None) -> JobStatus:
        status = self.client.get_job_status(sid)
        if status != last:
            self.on_status(sid, status.value)
        return status

    def emit(self, line: str) -> None:
        """Pass a log line on; progress lines become a readable line plus a progress event."""
        if waiting_for_resources(line):
            # Ray Train logs each placement retry (several lines a second under load): say it once per wait.
            if not self.waiting:
                self.on_wait(WAITING)
                self.on_status(self.following, "waiting for resources")
            self.waiting = True
        parsed = parse_progress(line)
        if parsed is not None:
            self.waiting = False  # training steps: a later wait is news again
            before, event = parsed
            if self.on_progress:
                self.on_progress(event)
            line = before + "progress " + event.text()
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
        """The job's result.json with its summary checked against the stage's model; a job that left
        none (died before its harness could write one) or a malformed one is an infrastructure failure."""
        parts = result_path(self.run_id, spec.job)
        if not self.storage.exists(*parts):
            info = self.client.get_job_info(sid)
            cause = info.message or f"job ended {status.value} without writing {'/'.join(parts)}"
            return self._failed(spec, f"Ray job {sid} {status.value}: {cause}")
        try:
            result = StageResult.model_validate(self.storage.read_json(*parts))
            if result.summary is not None:
                spec.summary.model_validate(result.summary)
        except ValidationError as e:
            return self._failed(
                spec, f"Ray job {sid} wrote a result that is not a {spec.summary.__name__}: {validation_problem(e)}"
            )
        except ValueError as e:
            return self._failed(spec, f"Ray job {sid} wrote an unreadable {'/'.join(parts)}: {e}")
        return result

    def _failed(self, spec: JobSpec, cause: str) -> StageResult:
        return StageResult(
            stage=spec.job,
            status="failed",
            failure_class=FailureClass.infrastructure,
            cause=one_line(cause),
            started_at=now_iso(),
            ended_at=now_iso(),
        )


def result_path(run_id: str, job: str) -> tuple[str, ...]:
    return ("runs", run_id, "stages", job, "result.json")


def iso_from_ms(ms: int | None) -> str:
    """Ray's job times (ms since the epoch) as the record's ISO times; now when Ray has none."""
    return ray_time(ms) or now_iso()


def ray_time(ms: int | None) -> str | None:
    """One of Ray's job times (ms since the epoch) as an ISO time; None when Ray has none (a job not ended)."""
    return datetime.fromtimestamp(ms / 1000, UTC).isoformat(timespec="milliseconds") if ms else None


def validation_problem(e: ValidationError) -> str:
    """'field.path: message (+N more)' for a pydantic error, short enough for a one-line cause."""
    problems = [f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors()]
    return first_and_more(problems)


WAITING = (
    "waiting for resources: Ray Train cannot place its workers yet (the cluster is busy with other runs); it retries"
)
STARTUP_TIMED_OUT = "worker group startup timed out"
"""Ray Train V2's controller error when its workers cannot be placed in time: it retries without limit
(a controller failure, not counted in max_failures), so for a run it means waiting for CPUs or GPUs."""


def waiting_for_resources(line: str) -> bool:
    """True for the log line Ray Train writes while its workers wait for cluster resources. Pure."""
    return STARTUP_TIMED_OUT in line


class JobTimeout(Exception):
    """A stage job ran past its timeout and was stopped (an infrastructure failure)."""
