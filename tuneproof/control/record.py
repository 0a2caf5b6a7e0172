"""The run record: everything needed to explain an observation, in runs/<run>/record.json.

Identity (image digest, cluster, code SHA + dirty flag, working_dir hash, config + hash, runtime_env
additions, dataset hash) and, per stage: its Ray jobs (entrypoint, submission id, working_dir hash,
runtime_env additions, times), its summary (the stage's model from tuneproof.core.summaries, stored
as JSON and read back with `RunRecord.summary`), failure class and cause. The flow is the only
writer; it rewrites the whole document after each stage.

Beside it, runs/<run>/row.json holds the record's `runs list` line (RecordRow), rewritten with it, so
listing N runs reads N small files, not N whole records (their size grows with stages and reruns). The row
carries a stamp over its fields and the record file it was written after (size and modification, as one
metadata request reads them), so a row that a crash between the two writes, a hand edit or a deletion left
behind its record is never listed for it: the record is read instead.

The JSON Schema of this document is committed (schemas/run-record.schema.json) and `schema_version`
says which shape a stored record has; `load` upgrades older shapes, so records written by earlier
releases still show.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from pydantic import BaseModel, ValidationError, field_validator

from tuneproof.core.config import PipelineConfig
from tuneproof.core.files import FileRefused, read_stored
from tuneproof.core.results import FailureClass, JsonDict, Model, StageResult, first_problem, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ClusterFacts, Summary
from tuneproof.core.summaries_data import DataIdentity
from tuneproof.core.summaries_eval import PromoteSummary

if TYPE_CHECKING:
    from tuneproof.control.lease import Lease

RECORD = "record.json"
ROW = "row.json"
MAX_ROW_BYTES = 64 << 10
SCHEMA_VERSION = 2
"""1: the untyped record of the first release (no schema_version field). 2: this module's models."""

S = TypeVar("S", bound=Summary)
RunStatus = Literal["running", "succeeded", "failed", "crashed", "cancelled"]
StageStatus = Literal["succeeded", "failed", "skipped"]


class CodeIdentity(Model):
    git_sha: str | None = None
    dirty: bool | None = None
    working_dir_hash: str | None = None
    """sha256 of the Ray working_dir the last job ran with: exactly the job side (core, training, eval)."""


class RuntimeEnvAdditions(Model):
    """Dependencies added at submission: pip packages, plain environment settings, and the names (only)
    of the variables forwarded from the submitting environment or a Kubernetes Secret."""

    pip: list[str] = []
    env_vars: dict[str, str] = {}
    forwarded_env: list[str] = []

    @classmethod
    def of(cls, cfg: PipelineConfig, module: str | None = None) -> RuntimeEnvAdditions:
        """What a run of `cfg` adds to the runtime_env of a job running `module` (None: of any of its jobs):
        the user's additions and the method's (peft for a LoRA fine-tune), and the forwarded variables'
        names (never their values)."""
        env = cfg.runtime_env
        return cls(pip=cfg.job_pip(module), env_vars=dict(env.env_vars), forwarded_env=list(env.forward_env))


class JobEntry(Model):
    """One Ray job of a stage: how it was submitted and what it left."""

    submission_id: str
    entrypoint: str
    job_status: str
    attached: bool
    """True when a retry re-attached to a job an earlier attempt had submitted."""
    working_dir_hash: str
    runtime_env_additions: RuntimeEnvAdditions
    pipeline_env: dict[str, str] = {}
    """Environment the pipeline itself set for the job (e.g. NCCL logging), apart from the user's additions."""
    submitted_at: str
    ended_at: str
    """When the flow submitted the job, or attached to it, and when it saw it end (for an attempt a new one
    replaced, Ray's times): the flow's view, which orders jobs and places them in a promotion's window."""
    result: StageResult
    ray_started_at: str | None = None
    ray_ended_at: str | None = None
    """The job's own start and end as Ray reports them (JobDetails start_time, end_time): what it cost, however
    late the flow attached (one that found it ended watched it for no time at all). None in records written
    before they were kept, or where Ray had none (a job still not ended when its timeout gave up on it)."""
    logged_steps: int | None = None
    """A fine-tune job that left no summary (stopped, lost, failed inside Ray Train): the steps its metrics log
    shows it trained, counted when it ended (tuneproof.control.cost.logged_steps); None for any other job."""

    @field_validator("submitted_at", "ended_at", "ray_started_at", "ray_ended_at")
    @classmethod
    def _iso_with_offset(cls, v: str | None) -> str | None:
        """Readers subtract these (a run's cost, a job's duration): a record whose job time is not an ISO-8601
        time with its UTC offset is refused when it is read (RecordUnreadable naming the file), not when shown."""
        if v is None:
            return v
        try:
            aware = datetime.fromisoformat(v).tzinfo is not None
        except ValueError:
            raise ValueError(
                f"time {v!r} is not an ISO-8601 time (expected e.g. 2026-12-01T04:12:46.502+00:00)"
            ) from None
        if not aware:
            raise ValueError(f"time {v!r} has no UTC offset (expected e.g. 2026-12-01T04:12:46.502+00:00)")
        return v


class StageInputs(Model):
    """What a stage's result depends on, so a continued run (`tuneproof run --run-id X`) keeps a stage only
    when none of it changed: the settings the stage read, the job code, and the outputs it needs."""

    key: str
    """sha256 over the three below: equal keys mean equal inputs."""
    config: dict[str, str]
    """sha256 of each setting the stage read when it ran (observed in its jobs and in the flow, by dotted path:
    `train.num_workers`, `eval.gates`), or of every section but the timeouts before it first ran."""
    working_dir_hash: str
    """The Ray working_dir hash (tuneproof/core, training, eval) the stage would run."""
    needs: dict[str, str] = {}
    """The identity (content hash, or the value itself when it is content-addressed) of each needed output."""


class StageEntry(Model):
    """One stage's outcome in the record."""

    stage: str
    status: StageStatus
    failure_class: FailureClass | None = None
    cause: str | None = None
    started_at: str
    ended_at: str
    summary: JsonDict | None = None
    """The stage's summary model as JSON (see RunRecord.summary for typed reading); None when no job left one."""
    jobs: list[JobEntry] = []
    invocation: int = 1
    """Which invocation of the run produced this entry (RunRecord.invocations)."""
    inputs: StageInputs | None = None
    """The inputs it ran with (None in records written before continued runs compared them)."""
    job_invocation: int | None = None
    """The invocation whose Ray job names (and Ray Train run) its jobs used, when not `invocation`'s own: a
    continued fine-tune resumes the interrupted invocation's training instead of starting fresh."""

    @property
    def ok(self) -> bool:
        return self.status == "succeeded"

    def summary_as(self, model: type[S]) -> S | None:
        return model.model_validate(self.summary) if self.summary is not None else None

    @classmethod
    def from_jobs(
        cls, stage: str, result: StageResult, jobs: list[JobEntry], started_at: str, summary: Summary | None = None
    ) -> StageEntry:
        """An entry whose verdict is `result` (usually the last job's); `summary` replaces the job's own."""
        return cls(
            stage=stage,
            status=result.status,
            failure_class=result.failure_class,
            cause=result.cause,
            started_at=started_at,
            ended_at=now_iso(),
            summary=summary.to_json() if summary is not None else result.summary,
            jobs=jobs,
        )

    @classmethod
    def failed(
        cls,
        stage: str,
        failure_class: FailureClass,
        cause: str,
        started_at: str | None = None,
        summary: Summary | None = None,
        jobs: list[JobEntry] | None = None,
    ) -> StageEntry:
        return cls(
            stage=stage,
            status="failed",
            failure_class=failure_class,
            cause=one_line(cause),
            started_at=started_at or now_iso(),
            ended_at=now_iso(),
            summary=summary.to_json() if summary is not None else None,
            jobs=jobs or [],
        )

    @classmethod
    def succeeded(cls, stage: str, summary: Summary, started_at: str, jobs: list[JobEntry] | None = None) -> StageEntry:
        return cls(
            stage=stage,
            status="succeeded",
            started_at=started_at,
            ended_at=now_iso(),
            summary=summary.to_json(),
            jobs=jobs or [],
        )

    @classmethod
    def skipped(cls, stage: str, why: str) -> StageEntry:
        return cls(stage=stage, status="skipped", cause=why, started_at=now_iso(), ended_at=now_iso())


class StageAttempt(Model):
    """The stage an invocation is running, saved before it starts: if the flow dies mid-stage (kill -9, a lost
    machine), the next invocation knows what was interrupted and with which inputs."""

    stage: str
    inputs: StageInputs
    job_invocation: int
    started_at: str


class Invocation(Model):
    """One `tuneproof run` / flow run against this run id: the first creates the run, later ones rerun stages."""

    number: int = 1
    flow_run_id: str | None = None
    only: list[str] | None = None
    until: str | None = None
    """`--until STAGE`: this invocation ran the stages up to that one and stopped there."""
    at: str
    config_hash: str
    config: JsonDict | None = None
    """The full validated config of this invocation (None in records written before it was kept)."""
    lease_takeover: str | None = None
    """Set when this invocation took over the lease of a writer presumed dead: whose, and why."""
    kept: list[str] = []
    """A continued run (no --only): the stages whose earlier results stand, their inputs unchanged."""
    reran: dict[str, str] = {}
    """A continued run: each stage that ran again, and why (no result, failed, inputs changed, upstream reran)."""
    running: StageAttempt | None = None
    """The stage in progress; cleared when it ends. Left set only when the invocation died mid-stage."""
    status: RunStatus | None = None
    """How this invocation ended (None while it runs, and in records written before it was kept)."""
    cause: str | None = None


class Override(Model):
    """A logged override (`tuneproof promote RUN --force --reason`)."""

    action: str
    by: str
    reason: str
    at: str
    bypassed: list[str]
    result: PromoteSummary


class RolledBack(Model):
    """This run's model was production until a rollback moved the pointer away from it
    (`tuneproof rollback NAME`): the move as the production history records it."""

    model: str
    from_version: str
    to_version: str
    by: str
    reason: str
    at: str
    seq: int
    """The move's number in models/<model>/history/."""


class RunRecord(Model):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    flow_run_id: str | None = None
    created_at: str
    updated_at: str
    status: RunStatus
    failure_class: FailureClass | None = None
    cause: str | None = None
    profile: str
    code: CodeIdentity
    config: JsonDict
    """The full validated config (PipelineConfig as JSON) of the latest invocation (each one's: invocations)."""
    config_hash: str
    runtime_env_additions: RuntimeEnvAdditions
    cluster: ClusterFacts | None = None
    """Lifted from the latest succeeded verify stage."""
    data: DataIdentity | None = None
    """Lifted from the latest succeeded data stage."""
    stages: dict[str, StageEntry] = {}
    superseded: list[StageEntry] = []
    """Entries replaced by a rerun of their stage, oldest first."""
    promotion: PromoteSummary | None = None
    invocations: list[Invocation] = []
    unread_settings: list[str] = []
    """Settings given a value of their own that no stage read when the run last ended (config_reads)."""
    overrides: list[Override] = []
    rollbacks: list[RolledBack] = []
    """Rollbacks that moved production away from this run's model, oldest first."""

    def summary(self, stage: str, model: type[S]) -> S | None:
        """The stage's summary as its model, or None when the stage has no entry or no summary."""
        entry = self.stages.get(stage)
        return entry.summary_as(model) if entry else None

    def passed(self, stage: str) -> bool:
        entry = self.stages.get(stage)
        return entry is not None and entry.ok

    # ---- the run's state machine: running -> succeeded | failed | crashed | cancelled, and running again
    # when a later invocation continues or reruns it. The flow calls these; it never sets the status itself.

    def start(self) -> None:
        """A later invocation opens the run (a continuation or a subset rerun): running again, no cause."""
        self.status, self.failure_class, self.cause = "running", None, None

    def end(self, status: RunStatus, failure_class: FailureClass | None = None, cause: str | None = None) -> None:
        """How the latest invocation ended: succeeded; failed (a stage's failure class, or None for a request
        refused before any stage ran); crashed (the flow raised) or cancelled. The invocation ends the same way."""
        if status == "running":
            raise ValueError("a run ends succeeded, failed, crashed or cancelled, not running")
        self.status, self.failure_class, self.cause = status, failure_class, cause
        if self.invocations:
            self.close_invocation(self.invocations[-1], status, cause)

    def close_invocation(self, invocation: Invocation, status: RunStatus, cause: str | None) -> None:
        """Mark how an invocation ended; a stage it left running becomes a failed (infrastructure) entry."""
        invocation.status, invocation.cause = status, cause
        attempt, invocation.running = invocation.running, None
        if attempt is None:
            return
        entry = StageEntry.failed(
            attempt.stage,
            FailureClass.infrastructure,
            f"interrupted: invocation {invocation.number} ended {status} while it ran ({cause})",
            started_at=attempt.started_at,
        )
        job_invocation = attempt.job_invocation if attempt.job_invocation != invocation.number else None
        self.stages[attempt.stage] = entry.model_copy(
            update={"inputs": attempt.inputs, "invocation": invocation.number, "job_invocation": job_invocation}
        )


def make_run_id() -> str:
    """Sortable and unique: UTC time plus random bytes."""
    return f"{datetime.now(UTC):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def new_record(run_id: str, cfg: PipelineConfig, code: CodeIdentity, flow_run_id: str | None) -> RunRecord:
    return RunRecord(
        run_id=run_id,
        flow_run_id=flow_run_id,
        created_at=now_iso(),
        updated_at=now_iso(),
        status="running",
        profile=cfg.profile,
        code=code,
        config=cfg.model_dump(mode="json"),
        config_hash=cfg.config_hash(),
        runtime_env_additions=RuntimeEnvAdditions.of(cfg),
    )


def save(storage: Storage, record: RunRecord, lease: Lease | None = None) -> None:
    """Write the record, then its listing row, stamped with the record it follows (a crash between the two
    leaves a row whose stamp is not the record's: readers then read the record). With the writer's lease, only
    while the writer still holds the run: LeaseLost, and nothing written, once a successor has taken it over."""
    if lease is not None:
        lease.fence()
    record.updated_at = now_iso()
    storage.write_json(record.to_json(), "runs", record.run_id, RECORD)
    write_row(storage, row_of(record))


def write_row(storage: Storage, row: RecordRow) -> None:
    """The run's listing row, stamped with its record as it stands now: call it after writing the record."""
    stamped = StoredRow(**row.model_dump(), stamp=row_stamp(row, stamp_of(storage, row.run_id)))
    storage.write_json(stamped.model_dump(), "runs", row.run_id, ROW)


def row_stamp(row: RecordRow, record_stamp: str) -> str:
    """sha256 over the row's fields and its record's stamp (stamp_of): a row edited since it was written, or
    beside a record rewritten since, has another. Pure."""
    fields = json.dumps([row.model_dump(), record_stamp], sort_keys=True)
    return hashlib.sha256(fields.encode()).hexdigest()


def stamp_of(storage: Storage, run_id: str) -> str:
    """The record file's identity as one metadata request reads it, never its bytes: S3's size and ETag (a hash
    of the content); local disk's size, modification time and inode (each save renames a new file into place).
    A record rewritten since, or copied from another run, has another stamp. FileNotFoundError when it is gone."""
    path = storage.path("runs", run_id, RECORD)
    if storage.is_s3:
        info = storage.fs.info(path)
        return f"{info['size']}:{info['ETag']}"
    stat = os.stat(path)  # not fsspec's info: a third of the cost of listing a run went to its bookkeeping
    return f"{stat.st_size}:{stat.st_mtime_ns}:{stat.st_ino}"


class RecordUnreadable(ValueError):
    """A record.json that exists but is not a run record (truncated, hand-edited, another tool's file)."""


MAX_RECORD_BYTES = 64 << 20
"""A record of many invocations is a few hundred kilobytes; past this it is not one (nor worth reading)."""


def load(storage: Storage, run_id: str) -> RunRecord:
    """The record in runs/<run_id>/, which must name `run_id`: a run directory copied under another name holds
    the original's record, and a writer trusting it would rewrite the original's (RecordUnreadable)."""
    if not storage.exists("runs", run_id, RECORD):
        raise FileNotFoundError(f"no run record for run {run_id!r} under {storage.uri('runs')}")
    try:
        record = parse(json.loads(read_stored(storage, ("runs", run_id, RECORD), MAX_RECORD_BYTES)))
    except (ValueError, UnicodeDecodeError, RecursionError, IsADirectoryError, NotADirectoryError, FileRefused) as e:
        # A record.json that is a directory, a FIFO, or absurdly nested JSON, is this record's problem; any
        # other OSError (credentials, network) is the store's, and stays an infrastructure error for the caller.
        why = str(e) if isinstance(e, ValueError) else f"{type(e).__name__}: {getattr(e, 'strerror', None) or e}"
        raise RecordUnreadable(
            f"{storage.uri('runs', run_id, RECORD)} is not a readable run record: {one_line(why, 300)}"
        ) from None
    if record.run_id != run_id:
        raise RecordUnreadable(
            f"{storage.uri('runs', run_id, RECORD)} is the record of run {record.run_id!r}, not of {run_id!r} "
            "(a copied run directory?): it is not read, and never written, under this name"
        )
    return record


def parse(doc: Any) -> RunRecord:
    """A stored record of any schema version, as this version's model."""
    if not isinstance(doc, dict):
        raise ValueError(f"expected a JSON object, got {type(doc).__name__}")
    version = doc.get("schema_version", 1)
    if version == 1:
        try:
            doc = upgrade_v1(doc)
        except (KeyError, TypeError, AttributeError) as e:  # a field of a shape the first release never wrote
            raise ValueError(f"a schema 1 record of an unexpected shape ({type(e).__name__}: {e})") from None
    elif version != SCHEMA_VERSION:
        raise ValueError(f"schema_version {version!r} is not one this release reads (1..{SCHEMA_VERSION})")
    try:
        return RunRecord.model_validate(doc)
    except ValidationError as e:
        raise ValueError(first_problem(e)) from None


def upgrade_v1(doc: dict[str, Any]) -> dict[str, Any]:
    """The first release's record as schema 2: empty identity dicts become None, invocations get numbers,
    a succeeded resume test (which then only succeeded after a real interruption) says so."""
    doc = {**doc, "schema_version": SCHEMA_VERSION}
    doc["cluster"] = doc.get("cluster") or None
    doc["data"] = doc.get("data") or None
    doc["invocations"] = [{**inv, "number": i + 1} for i, inv in enumerate(doc.get("invocations") or [])]
    for entry in [*(doc.get("stages") or {}).values(), *(doc.get("superseded") or [])]:
        entry["summary"] = entry.get("summary") or None
        for job in entry.get("jobs") or []:
            job["result"]["summary"] = job["result"].get("summary") or None
        if entry["stage"] == "resume" and entry["status"] == "succeeded" and entry["summary"]:
            entry["summary"].setdefault("interrupted", True)
    return doc


class RecordRow(BaseModel):
    """One line of `runs list`: a readable record's headline, or why a record could not be read."""

    run_id: str
    created_at: str | None = None
    status: str
    failure_class: str | None = None
    cause: str | None = None


class StoredRow(RecordRow):
    """row.json: the row, stamped with the record it was written after (row_stamp)."""

    stamp: str


def row_of(record: RunRecord) -> RecordRow:
    return RecordRow(
        run_id=record.run_id,
        created_at=record.created_at,
        status=record.status,
        failure_class=record.failure_class.value if record.failure_class else None,
        cause=record.cause,
    )


def list_rows(storage: Storage) -> list[RecordRow]:
    """One row per run that has a record, newest first: its row.json, or, for a record written before rows
    were (or whose row cannot be read), the record itself; a run whose record cannot be read is one row
    marked unreadable. Reads one small file and the record's metadata (one stat, or one HEAD on S3) per run,
    whatever the size of the records; a record only where its row does not match it (read_row)."""
    rows = [row for run_id in storage.listdir("runs") if (row := read_row(storage, run_id)) is not None]
    dated, undated = [r for r in rows if r.created_at], [r for r in rows if not r.created_at]
    return sorted(dated, key=lambda r: r.created_at or "", reverse=True) + undated


def read_row(storage: Storage, run_id: str) -> RecordRow | None:
    """The run's listing row: row.json while it was written after the record as it stands (its stamp), else
    the record's own headline (a crash between the two writes, a hand edit, a row older than stamps); a row
    whose record is gone is listed unreadable, not as it last said; None when runs/<run_id> holds neither."""
    try:
        row = StoredRow.model_validate_json(read_stored(storage, ("runs", run_id, ROW), MAX_ROW_BYTES))
    except (OSError, ValidationError):
        row = None  # missing, unstamped (an older record), hand-edited or unreadable: the record decides
    if row is not None and row.run_id == run_id:
        listed = RecordRow.model_validate(row.model_dump(exclude={"stamp"}))
        try:
            record_stamp = stamp_of(storage, run_id)
        except FileNotFoundError:
            where = storage.uri("runs", run_id, RECORD)
            cause = f"{where} is gone; the listing row left beside it said {row.status}"
            return RecordRow(run_id=run_id, created_at=row.created_at, status="unreadable", cause=cause)
        except OSError:
            record_stamp = None  # the record's metadata cannot be read: load_or_row says why
        if record_stamp is not None and row.stamp == row_stamp(listed, record_stamp):
            return listed
    found = load_or_row(storage, run_id)
    return row_of(found) if isinstance(found, RunRecord) else found


def load_or_row(storage: Storage, run_id: str) -> RunRecord | RecordRow | None:
    """The run's record; a row marked unreadable when it cannot be read; None when there is no record."""
    if not storage.exists("runs", run_id, RECORD):
        return None
    try:
        return load(storage, run_id)
    except RecordUnreadable as e:
        return RecordRow(run_id=run_id, status="unreadable", cause=str(e))
    except OSError as e:  # this one file refused (permissions, vanished): one row, not the end of the listing
        cause = f"{storage.uri('runs', run_id, RECORD)} cannot be read: {e.strerror or e}"
        return RecordRow(run_id=run_id, status="unreadable", cause=cause)


def list_records(storage: Storage) -> tuple[list[RunRecord], list[RecordRow]]:
    """(every readable record newest first, a row per record.json that could not be read). Reads every
    record whole: `runs list` uses list_rows."""
    found = [f for run_id in storage.listdir("runs") if (f := load_or_row(storage, run_id)) is not None]
    records = [f for f in found if isinstance(f, RunRecord)]
    unreadable = [f for f in found if isinstance(f, RecordRow)]
    return sorted(records, key=lambda r: r.created_at, reverse=True), unreadable


def json_schema() -> dict[str, Any]:
    """The record's own models' JSON Schema; the committed schemas/run-record.schema.json adds each stage's
    summary model to it (tuneproof.control.stages.record_schema; `make schema` regenerates it)."""
    schema = RunRecord.model_json_schema(mode="serialization")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = f"tuneproof run record, schema_version {SCHEMA_VERSION}"
    return schema
