"""The stage table: what each stage is, needs and shows, defined once and read by everything else.

The flow runs STAGES in order; `--only` planning, the terminal summary, `runs diff` and the record's
JSON Schema all read the same descriptors. These are facts only: nothing here imports Prefect, so the
readers (`tuneproof runs list|show|diff`) start without it. Which Prefect task runs a stage and which
artifact it publishes is bound in flows/stage_tasks.py; a stage that is one Ray job names its module
(`job=`) and needs no task of its own. Adding a stage is its job module (training/ or eval/), its
summary model (tuneproof/core/summaries*.py) and one Stage(...) below, whose timeout is a number of seconds
until a profile needs to change it (then a config.timeouts field in tuneproof/core/config_cluster.py).

Read it top to bottom: the small functions first (evidence lines, diff metrics, identity lifted
into the record), then the table. Regenerate the record's committed JSON Schema with `make schema`.
"""

from __future__ import annotations

import hashlib
import posixpath
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tuneproof.control import registry
from tuneproof.control.record import RunRecord, StageEntry, StageInputs, json_schema
from tuneproof.core import config_reads
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_cluster import Timeouts
from tuneproof.core.hashing import sha256_json
from tuneproof.core.results import FailureClass
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ConnectivitySummary, Summary, VerifySummary
from tuneproof.core.summaries_data import DataIdentity, DataSummary
from tuneproof.core.summaries_eval import ROLES, EvaluateSummary, PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary

INFRA, DATA, MODELING = FailureClass.infrastructure, FailureClass.data, FailureClass.modeling
Metrics = dict[str, float | None]


@dataclass(frozen=True)
class Need:
    """An output of an earlier stage that this stage takes as input: `<stage>.<output>` of its summary."""

    stage: str
    output: str
    identity: str | None = None
    """The summary field that identifies the output's content when the output itself does not (an export's
    path stays `model` while its weights change: its identity is export_sha256). None: the value itself."""

    def __str__(self) -> str:
        return f"{self.stage}.{self.output}"


IN_FLOW = "in-flow"
"""A Stage's `timeout` when it runs in the flow process and submits no Ray job."""


@dataclass(frozen=True, kw_only=True)
class Stage:
    name: str
    summary: type[Summary]
    """The model of what the stage proves (tuneproof.core.summaries)."""
    evidence: Callable[[Any], str]
    """One line for the terminal summary, from a succeeded stage's summary."""
    fails_as: tuple[FailureClass, ...]
    """The failure classes this stage can end with."""
    timeout: str | int = ""
    """What bounds the stage's Ray jobs: a config.timeouts field (a deadline profiles can change), a fixed
    number of seconds (a new stage's, before any profile needs another), or IN_FLOW for a stage that submits
    none. Required: a job without a deadline would be stopped at its first status poll."""
    needs: tuple[Need, ...] = ()
    """Outputs of earlier stages passed to the task as inputs; each needs that stage succeeded."""
    reads: tuple[str, ...] = ()
    """Earlier stages whose evidence this stage judges from the record (not inputs)."""
    job: str | None = None
    """The module of a stage that is one Ray job (`python -m <job>`); None for a stage whose Prefect task
    is bound by name in flows/stage_tasks.py."""
    metrics: Callable[[Any], Metrics] | None = None
    """Numbers `runs diff` compares between two runs."""
    lift: Callable[[RunRecord, Any], None] | None = None
    """Identity facts the stage's summary contributes to the record's top level."""
    skip: Callable[[PipelineConfig], str | None] | None = None
    """Why the configured run leaves this stage out, or None to run it."""
    external: Callable[[PipelineConfig, Storage, RunRecord], dict[str, str]] | None = None
    """Inputs from outside the run that the stage's result depends on (evaluate: the production model it
    compares against; data: its source files' contents); part of its inputs key, so a continued run re-evaluates
    when production moved, and prepares the data again when a source file changed under the same path."""
    verdict_code: tuple[str, ...] = ()
    """Modules outside the job code (relative to the project root) that decide the stage's verdict in the flow:
    their hash is part of its inputs key, so a fix to how it judges reruns it on a continuation."""
    resumable: bool = False
    """An interrupted attempt (failed as infrastructure, or cut short by a dead flow) continued with the same
    inputs reuses that attempt's Ray job and Ray Train names, so training resumes from its checkpoint."""

    def __post_init__(self) -> None:
        if isinstance(self.timeout, int) and not isinstance(self.timeout, bool):
            if self.timeout <= 0:
                raise ValueError(
                    f"stage {self.name!r}: timeout must be a positive number of seconds, got {self.timeout}"
                )
            return
        if not self.timeout:
            raise ValueError(
                f"stage {self.name!r} has no timeout: set timeout= to a config.timeouts field "
                f"({', '.join(Timeouts.model_fields)}), a number of seconds, or IN_FLOW when it submits no Ray job"
            )
        if self.timeout != IN_FLOW and self.timeout not in Timeouts.model_fields:
            raise ValueError(
                f"stage {self.name!r}: timeout must name a config.timeouts field ({', '.join(Timeouts.model_fields)}) "
                f"or be IN_FLOW for a stage that submits no Ray job, got {self.timeout!r}"
            )

    def upstream(self) -> set[str]:
        return {n.stage for n in self.needs} | set(self.reads)

    def timeout_s(self, cfg: PipelineConfig) -> int:
        if isinstance(self.timeout, int):
            return self.timeout
        return 0 if self.timeout == IN_FLOW else int(getattr(cfg.timeouts, self.timeout))


# ---- evidence, metrics and lifts, stage by stage ------------------------------------------------


def _num(value: float | None, spec: str = ".3f") -> str:
    return "n/a" if value is None else format(value, spec)


def verify_evidence(s: VerifySummary) -> str:
    return f"{len(s.nodes)} node(s), env {s.cluster.environment_digest}"


def lift_cluster(record: RunRecord, s: VerifySummary) -> None:
    record.cluster = s.cluster


def connectivity_evidence(s: ConnectivitySummary) -> str:
    return f"{s.world_size} ranks, transport {s.transport.kind}"


def connectivity_metrics(s: ConnectivitySummary) -> Metrics:
    if not s.allreduce:
        return {}
    # Every size: small messages measure latency, large ones bandwidth; a change can show in either.
    return {f"connectivity.busbw_GBps@{row.size_bytes}B": row.busbw_GBps for row in s.allreduce}


def data_evidence(s: DataSummary) -> str:
    """The dataset's hash and what went into it: a dropped row is seen here, not only in the manifest."""
    head = f"{s.content_hash}{' (cache hit)' if s.cache_hit else ''}"
    if s.manifest is None:
        return head
    m = s.manifest
    replay = m.settings.get("replay") or {}
    # Replayed rows are repeated up to their share: the training split can hold more rows than were read.
    mixed = {"train": f" ({replay['share']:.0%} replayed)" if "share" in replay else ""}
    rows = ", ".join(f"{n} {m.splits[n].rows:,}{mixed.get(n, '')}" for n in ("train", "eval") if n in m.splits)
    drops = ", ".join(f"{reason} {d.count:,}" for reason, d in m.dropped.items())
    return f"{head}: {rows} rows of {m.total_rows:,} read" + (f"; dropped {drops}" if drops else ", none dropped")


def source_contents(cfg: PipelineConfig, storage: Storage, record: RunRecord) -> dict[str, str]:
    """The content of each file the data stage reads, by setting ('data.source content'): a file edited in place
    keeps its path, the only thing the settings say, so without this a continuation kept a dataset (and a model)
    made from the old rows. Files: data.source, data.eval_source, data.replay.source and each suite's source."""
    replay = cfg.data.replay.source if cfg.data.replay else None
    sources = {"data.source": cfg.data.source, "data.eval_source": cfg.data.eval_source, "data.replay.source": replay}
    sources |= {f"eval.suites.{name}.source": suite.source for name, suite in cfg.eval.suites.items()}
    hub = cfg.data.format == "hf"
    return {
        f"{key} content": content_identity(uri, cfg.storage.endpoint_url, hub and key.startswith("data."))
        for key, uri in sources.items()
        if uri
    }


def content_identity(uri: str, endpoint_url: str | None, hub: bool = False) -> str:
    """A local file's sha256 (exact, and cheap beside the data job, which reads and hashes every byte of it
    again: about 0.7 s a GB here), an S3 object's ETag and size (its content's, without reading it), a hub
    dataset's URI (no identity short of downloading it). One that cannot be read here (a path on the cluster's
    nodes alone) says so: the data stage, which reads it there, is the judge."""
    if hub or uri.startswith("hf://"):
        return uri
    try:
        source = Storage(uri, endpoint_url)
        if source.is_s3:
            info = source.fs.info(source.path())
            return f"etag {info.get('ETag') or info.get('etag')}, {info.get('size')} bytes"
        with open(source.path(), "rb") as f:
            return "sha256 " + hashlib.file_digest(f, "sha256").hexdigest()
    except (OSError, ValueError) as e:
        return f"unreadable here ({type(e).__name__})"


def lift_data(record: RunRecord, s: DataSummary) -> None:
    if s.content_hash:
        # Its identity fields only: a DataSummary is a DataIdentity, but the record keeps no more than these.
        record.data = DataIdentity(**s.model_dump(include=set(DataIdentity.model_fields)))


def finetune_evidence(s: FinetuneSummary) -> str:
    trained = f", {s.trainable_params:,} of {s.total_params:,} params trained" if s.trainable_params is not None else ""
    mesh = f", {s.sharding} mesh {'x'.join(map(str, s.mesh))}" if s.sharding and s.mesh else ""
    skipped = "".join(f"; skipped {c.name} ({c.reason.rsplit(': ', 1)[-1]})" for c in s.skipped_checkpoints)
    return f"{s.method}: loss {_num(s.first_loss)} -> {_num(s.final_loss)} in {s.steps} steps{trained}{mesh}{skipped}"


def finetune_metrics(s: FinetuneSummary) -> Metrics:
    return {
        "finetune.tokens_per_s": s.tokens_per_s,
        "finetune.final_loss": s.final_loss,
        "finetune.seconds": s.seconds,
        "finetune.seconds_per_step": s.seconds / s.steps if s.steps else None,
    }


def resume_evidence(s: ResumeSummary) -> str:
    ledger = s.ledger_comparison
    if ledger is None:
        order = ""
    elif ledger.ok:
        order = f", same samples as the main run over {ledger.steps_compared} steps"
    else:
        order = f", samples differ from step {ledger.first_differing_step}"
    return f"restored step {s.restored_step}, max loss diff {s.max_loss_diff}{order}"


def resume_metrics(s: ResumeSummary) -> Metrics:
    return {"resume.max_loss_diff": s.max_loss_diff}


def resume_disabled(cfg: PipelineConfig) -> str | None:
    return None if cfg.resume.enabled else "resume.enabled is false"


def evaluate_evidence(s: EvaluateSummary) -> str:
    """'exact_match: candidate 1.000, base 0.000, incumbent -' for each task metric (losses left out)."""
    candidate = s.models.get("candidate")
    names = [n for n in (candidate.metrics if candidate else {}) if n not in ("eval_loss", "perplexity")]
    parts = []
    for name in names:
        values = []
        for role in ROLES:
            score = s.models.get(role)
            value = score.metrics.get(name) if score else None
            values.append(f"{role} {_num(value) if value is not None else '-'}")
        parts.append(f"{name}: " + ", ".join(values))
    return "; ".join(parts)


def evaluate_metrics(s: EvaluateSummary) -> Metrics:
    return {
        f"eval.{role}.{name}": value
        for role, score in s.models.items()
        if score
        for name, value in score.metrics.items()
    }


def production_version(cfg: PipelineConfig, storage: Storage, record: RunRecord) -> dict[str, str]:
    """The version evaluate scores the candidate against (`incumbent`), or 'none'."""
    try:
        pointer, _ = registry.read_pointer(storage, cfg.model.name)
    except registry.RegistryUnreadable as e:
        # Not a reason to end the run here: the key says what was seen, and the evaluate task, which reads the
        # pointer again, fails as infrastructure naming the file.
        return {"registry.production": f"unreadable: {e}"}
    found = incumbent(pointer, record)
    return {"registry.production": found.version if found else "none"}


@dataclass(frozen=True)
class Incumbent:
    """A registry version evaluate scores the candidate against, and where its model is (storage-relative)."""

    version: str
    path: str


def incumbent(pointer: registry.ProductionPointer | None, record: RunRecord) -> Incumbent | None:
    """What this run's current fine-tune is compared against: the production model, or, when production already
    is this fine-tune's model (this run promoted it, and a continuation or `--only evaluate,promote` evaluates it
    again), the version that promotion replaced, so the candidate is never scored against itself. Decided from the
    pointer, not from record.promotion, which a rerun of evaluate supersedes before evaluate runs. `pointer` is
    registry.read_pointer's: its name, versions and path are checked to be this model's there. Pure."""
    finetune = record.summary("finetune", FinetuneSummary) if record.passed("finetune") else None
    content = finetune.export_sha256 if finetune else None
    if content is not None and registry.is_promotion_of(pointer, record.run_id, content):
        replaced = pointer.previous_version
        return Incumbent(replaced, posixpath.join(registry.MODELS, pointer.name, replaced)) if replaced else None
    return Incumbent(pointer.version, pointer.path) if pointer else None


def promote_evidence(s: PromoteSummary) -> str:
    return f"{s.version} (previous: {s.previous_version or 'none'})"


def lift_promotion(record: RunRecord, s: PromoteSummary) -> None:
    record.promotion = s


# ---- the table ---------------------------------------------------------------------------------

FINETUNED = "export_sha256"
"""A fine-tune's outputs (checkpoints, loss curve, export) are identified by the content hash of its export."""

STAGES: tuple[Stage, ...] = (
    Stage(
        name="verify",
        summary=VerifySummary,
        evidence=verify_evidence,
        fails_as=(INFRA,),
        timeout="verify",
        lift=lift_cluster,
        verdict_code=("tuneproof/control/kube_checks.py",),  # the Kubernetes half, judged in the flow on eks
    ),
    Stage(
        name="connectivity",
        summary=ConnectivitySummary,
        evidence=connectivity_evidence,
        fails_as=(INFRA,),
        timeout="connectivity",
        metrics=connectivity_metrics,
    ),
    Stage(
        name="data",
        job="training.data_prep",
        summary=DataSummary,
        evidence=data_evidence,
        fails_as=(DATA, INFRA),
        timeout="data",
        external=source_contents,
        lift=lift_data,
    ),
    Stage(
        name="finetune",
        summary=FinetuneSummary,
        evidence=finetune_evidence,
        fails_as=(INFRA, MODELING, DATA),
        timeout="finetune",
        resumable=True,
        needs=(Need("data", "dataset_path"),),
        metrics=finetune_metrics,
    ),
    Stage(
        name="resume",
        summary=ResumeSummary,
        evidence=resume_evidence,
        fails_as=(INFRA,),
        timeout="resume",
        needs=(
            Need("data", "dataset_path"),
            Need("finetune", "checkpoints", identity=FINETUNED),
            Need("finetune", "loss_curve", identity=FINETUNED),
        ),
        metrics=resume_metrics,
        skip=resume_disabled,
        verdict_code=("tasks/resume.py", "tuneproof/control/resume_evidence.py"),
    ),
    Stage(
        name="evaluate",
        summary=EvaluateSummary,
        evidence=evaluate_evidence,
        fails_as=(MODELING, INFRA, DATA),
        timeout="evaluate",
        external=production_version,
        # data.suites: each suite file's hash as the data stage checked it against the training split; the job
        # scores no other bytes (eval/suites.py unmeasured).
        needs=(
            Need("data", "dataset_path"),
            Need("data", "suites"),
            Need("finetune", "export_path", identity=FINETUNED),
        ),
        metrics=evaluate_metrics,
    ),
    Stage(
        name="promote",
        summary=PromoteSummary,
        evidence=promote_evidence,
        fails_as=(MODELING, INFRA),
        reads=("finetune", "resume", "evaluate"),
        timeout="promote",  # the copy check's Ray job
        lift=lift_promotion,
        verdict_code=("tasks/promote.py",),
    ),
)


# ---- reading the table -------------------------------------------------------------------------


class UnknownStages(ValueError):
    """Stage names that are not in the table."""


def names(stages: Iterable[Stage] | None = None) -> list[str]:
    return [s.name for s in (STAGES if stages is None else stages)]


def by_name(name: str) -> Stage:
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise UnknownStages(f"unknown stage {name!r}; expected one of {', '.join(names())}")


def plan(only: list[str] | None, until: str | None = None) -> list[Stage]:
    """The stages to run, in table order: all of them, the subset named in `only`, or the stages up to and
    including `until` (a run that stops there and is continued later with its run id)."""
    if until is not None:
        if only is not None:
            raise UnknownStages(f"--only and --until do not combine (got --only {','.join(only)} --until {until})")
        last = STAGES.index(by_name(until))
        return list(STAGES[: last + 1])
    if only is None:
        return list(STAGES)
    unknown = [name for name in only if name not in names()]
    if unknown:
        raise UnknownStages(f"unknown stage(s) {', '.join(unknown)}; expected some of {', '.join(names())}")
    if not only:
        raise UnknownStages(f"no stage named: expected some of {', '.join(names())}")
    return [s for s in STAGES if s.name in only]


def needs_an_earlier_run(planned: list[Stage]) -> bool:
    """True when a stage in the plan needs or reads a stage that is not in it (so it reruns against a run)."""
    chosen = {s.name for s in planned}
    return any(stage.upstream() - chosen for stage in planned)


def downstream(name: str) -> list[str]:
    """Every stage that needs or reads `name`, directly or through another stage, in table order."""
    found = {name}
    for stage in STAGES:  # table order is topological: a stage only needs earlier ones
        if stage.upstream() & found:
            found.add(stage.name)
    return [s.name for s in STAGES if s.name in found and s.name != name]


def stale_after(rerun: list[str]) -> list[str]:
    """The stages a rerun of `rerun` makes stale: themselves and everything downstream, in table order."""
    stale = set(rerun).union(*(downstream(name) for name in rerun))
    return [name for name in names() if name in stale]


class MissingStageOutput(RuntimeError):
    """A stage's input is not in the run's record: a usage error (run the earlier stage first)."""


def inputs_for(stage: Stage, record: RunRecord) -> dict[str, Any]:
    """The outputs of earlier stages that `stage` needs, from the record; MissingStageOutput when one is absent."""
    inputs: dict[str, Any] = {}
    for need in stage.needs:
        value = output_of(need, record.stages)
        if value is None:
            raise MissingStageOutput(
                f"stage {stage.name} needs {need} from a succeeded {need.stage} stage of run {record.run_id}; "
                f"run the {need.stage} stage first (e.g. --only {need.stage},{stage.name})"
            )
        inputs[need.output] = value
    return inputs


def output_of(need: Need, entries: dict[str, StageEntry]) -> Any:
    """The needed output as the succeeded entry of its stage holds it; None when there is none. Pure."""
    entry = entries.get(need.stage)
    summary = entry.summary_as(by_name(need.stage).summary) if entry and entry.ok else None
    return getattr(summary, need.output, None) if summary is not None else None


def check_needs(planned: list[Stage], record: RunRecord) -> None:
    """MissingStageOutput when a planned stage needs an output that neither an earlier planned stage makes nor
    an entry left standing once the plan's supersede has run holds: `--only data,evaluate` is refused before data
    runs (it would supersede the fine-tune evaluate needs), not after. Pure."""
    chosen = names(planned)
    stale = stale_after(chosen)
    standing = {name: entry for name, entry in record.stages.items() if name not in stale}
    for position, stage in enumerate(planned):
        for need in stage.needs:
            if need.stage in chosen[:position] or output_of(need, standing) is not None:
                continue
            entry = standing.get(need.stage)
            why = "has not run" if entry is None else f"{entry.status} without it"
            why = "is superseded by this rerun" if need.stage in stale else why
            hint = [name for name in names() if name in chosen or name == need.stage]
            raise MissingStageOutput(
                f"stage {stage.name} needs {need} from a succeeded {need.stage} stage, and run {record.run_id}'s "
                f"{need.stage} {why}; run it too (e.g. --only {','.join(hint)})"
            )


# ---- continuing a run ---------------------------------------------------------------------------


def stage_inputs(
    stage: Stage,
    config: dict[str, Any],
    working_dir_hash: str,
    record: RunRecord,
    external: dict[str, str] | None = None,
    reads: Iterable[str] | None = None,
) -> StageInputs:
    """What `stage` would run with now: the settings it reads (their values in the config as JSON), the job
    code, the identities of the outputs it needs as the record holds them (an absent one is "missing") and
    its external inputs (read by the caller with `stage.external`). `reads`: the settings the stage read
    when it ran (observed, tuneproof.core.config_reads); None takes what it read last time. Pure."""
    settings = config_reads.reads_hashes(config, list(reads) if reads is not None else last_reads(stage.name, record))
    needs = {str(need): need_identity(need, record) for need in stage.needs} | (external or {})
    key = sha256_json({"config": settings, "working_dir_hash": working_dir_hash, "needs": needs})
    return StageInputs(key=key, config=settings, working_dir_hash=working_dir_hash, needs=needs)


def attempts(name: str, record: RunRecord) -> list[StageEntry]:
    """Every entry of stage `name` in this run, oldest first: the superseded ones, then the current one."""
    return [e for e in [*record.superseded, record.stages.get(name)] if e is not None and e.stage == name]


def last_reads(name: str, record: RunRecord) -> list[str]:
    """The settings stage `name` read the last time it ran in this run; every section but the timeouts (which
    bound a stage without changing its result) when it never ran, so a first attempt's key misses nothing."""
    for entry in reversed(attempts(name, record)):
        if entry.inputs is not None:
            return list(entry.inputs.config)
    return [s for s in PipelineConfig.model_fields if s not in config_reads.NOT_INPUTS]


def resumes_invocation(stage: Stage, now: StageInputs, record: RunRecord) -> int | None:
    """The invocation whose interrupted attempt `stage` continues, or None to start fresh. It continues when the
    stage is resumable and its latest attempt in this run was interrupted (failed as infrastructure: a stopped
    job, a dead flow) with the inputs key it has now. `now` is taken just before the stage runs, after any
    upstream stage reran: an upstream that reran to the same output identity (data's content hash) leaves the
    key equal, so `--only data,finetune` resumes as a continuation does. Pure."""
    latest = attempts(stage.name, record)[-1:]
    if not stage.resumable or not latest:
        return None
    entry = latest[0]
    interrupted = entry.status == "failed" and entry.failure_class == INFRA
    if not interrupted or entry.inputs is None or entry.inputs.key != now.key:
        return None
    return entry.job_invocation or entry.invocation


def reads_when_last_run(stages: list[str], records: Iterable[RunRecord]) -> set[str] | None:
    """The settings `stages` read the last time each ran with its reads observed (records newest first);
    None when one of them has not run so, here: what it reads is then not known."""
    found: set[str] = set()
    for name in stages:
        entry = next((r.stages[name] for r in records if name in r.stages and _observed(r.stages[name])), None)
        if entry is None or entry.inputs is None:
            return None
        found |= set(entry.inputs.config)
    return found


def _observed(entry: StageEntry) -> bool:
    """Inputs keyed by observed reads (dotted settings), not by a first attempt's whole sections."""
    return entry.inputs is not None and any("." in path for path in entry.inputs.config)


def observed_reads(entry: StageEntry, flow_side: set[str]) -> set[str]:
    """The settings a stage read: in its Ray jobs (each job's result says) and in the flow while it ran."""
    return flow_side.union(*(job.result.config_reads for job in entry.jobs))


def reads_reported(entry: StageEntry) -> bool:
    """False when the stage's Ray jobs were cut short before saying what they read (a stopped or killed job): its
    observed reads are then only the flow's, a key too narrow to notice a changed setting (train.lr) when the
    stage is continued; the caller keeps the key it had before the stage ran. Pure."""
    return not entry.jobs or any(job.result.config_reads for job in entry.jobs)


def need_identity(need: Need, record: RunRecord) -> str:
    entry = record.stages.get(need.stage)
    summary = entry.summary_as(by_name(need.stage).summary) if entry and entry.ok else None
    if summary is None:
        return "missing"
    value = getattr(summary, need.identity or need.output, None)
    return value if need.identity and isinstance(value, str) else sha256_json(jsonable(value))


def jsonable(value: Any) -> Any:
    if isinstance(value, list):
        return [jsonable(v) for v in value]
    return value.to_json() if hasattr(value, "to_json") else value


@dataclass(frozen=True)
class Continuation:
    """How a run continues: the stages kept and the stages that run again with why. Whether an interrupted
    stage resumes is decided as it starts (`resumes_invocation`), once what it needs has rerun."""

    kept: list[str]
    reran: dict[str, str]


def plan_continuation(entries: dict[str, StageEntry], now: dict[str, StageInputs]) -> Continuation:
    """Keep a stage only when it succeeded (or was skipped) with the inputs it would have now and nothing it
    needs or reads runs again; everything else reruns, with the reason. Pure."""
    kept: list[str] = []
    reran: dict[str, str] = {}
    for stage in STAGES:
        entry = entries.get(stage.name)
        upstream = [name for name in names() if name in stage.upstream() and name in reran]
        if upstream:
            reran[stage.name] = f"{', '.join(upstream)} reran"
        elif entry is None:
            reran[stage.name] = "no result yet"
        elif entry.inputs is None:
            reran[stage.name] = "its result has no inputs key (recorded by an earlier release)"
        elif entry.inputs.key != now[stage.name].key:
            reran[stage.name] = "inputs changed: " + changed_inputs(entry.inputs, now[stage.name])
        elif entry.status == "failed":
            failure = entry.failure_class.value if entry.failure_class else "unclassified"
            reran[stage.name] = f"failed ({failure}): {entry.cause}"
        else:
            kept.append(stage.name)
    return Continuation(kept, reran)


def changed_inputs(before: StageInputs, now: StageInputs) -> str:
    """'config train, code (working_dir hash), finetune.export_path': what differs between two inputs."""
    parts = [
        f"config {name}"
        for name in sorted(set(before.config) | set(now.config))
        if before.config.get(name) != now.config.get(name)
    ]
    if before.working_dir_hash != now.working_dir_hash:
        parts.append(f"code (working_dir {before.working_dir_hash[:12]} -> {now.working_dir_hash[:12]})")
    parts += [
        need for need in sorted(set(before.needs) | set(now.needs)) if before.needs.get(need) != now.needs.get(need)
    ]
    return ", ".join(parts) or "inputs key"


def typed_summary(entry: StageEntry) -> BaseModel | None:
    """An entry's summary as its stage's model (None for unknown stages or entries without one)."""
    try:
        stage = by_name(entry.stage)
    except UnknownStages:
        return None
    return entry.summary_as(stage.summary)


def evidence_line(entry: StageEntry) -> str:
    """The terminal's line for a stage: its evidence when it succeeded, else its cause."""
    summary = typed_summary(entry) if entry.ok else None
    if summary is None:
        return entry.cause or ""
    return by_name(entry.stage).evidence(summary)


def diff_metrics(record: RunRecord) -> Metrics:
    """Every stage's diff metrics, from the stages of the record that succeeded with a summary: a failed stage's
    summary is kept as evidence, but its numbers measured a stage that did not work (a connectivity stage whose
    ranks did not all finish), so they are nobody's metric."""
    out: Metrics = {}
    for stage in STAGES:
        entry = record.stages.get(stage.name)
        summary = entry.summary_as(stage.summary) if entry and entry.ok and stage.metrics else None
        if summary is not None and stage.metrics is not None:
            out.update(stage.metrics(summary))
    return out


def record_schema() -> dict[str, Any]:
    """The run record's JSON Schema with each stage's summary model: a succeeded `verify` entry's summary
    must be a VerifySummary, and so on. Committed as schemas/run-record.schema.json (`make schema` runs this
    module to regenerate it; tests check it)."""
    schema = json_schema()
    defs = schema.setdefault("$defs", {})
    conditions = []
    for stage in STAGES:
        model_schema = stage.summary.model_json_schema(mode="serialization", ref_template="#/$defs/{model}")
        defs.update(model_schema.pop("$defs", {}))
        defs[stage.summary.__name__] = model_schema
        conditions.append(
            {
                "if": {
                    "properties": {"stage": {"const": stage.name}, "summary": {"type": "object"}},
                    "required": ["stage", "summary"],
                },
                "then": {"properties": {"summary": {"$ref": f"#/$defs/{stage.summary.__name__}"}}},
            }
        )
    defs["StageEntry"]["allOf"] = conditions
    return schema


if __name__ == "__main__":
    import json
    import sys

    json.dump(record_schema(), sys.stdout, indent=1, sort_keys=True)
    print()
