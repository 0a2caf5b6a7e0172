"""The tuneproof pipeline flow: verify -> connectivity -> data -> finetune -> resume -> evaluate -> promote.

Run it with `tuneproof run` (in-process) or from a Prefect deployment (prefect.yaml). The flow
only orders and branches: the stage table (tuneproof/control/stages.py) says what each stage needs,
flows/stage_tasks.py which task runs it, every result lands in the run record, and the first failed
stage ends the run with its failure class.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Annotated, Any

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import WithJsonSchema

from flows.stage_tasks import ARTIFACTS, task_for
from tasks import artifacts, events
from tasks.jobs import StageCall
from tuneproof.control import images, registry
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.control.identity import code_hash, git_identity, working_dir_hash
from tuneproof.control.lease import Lease, LeaseHeld, LeaseLost
from tuneproof.control.record import (
    CodeIdentity,
    Invocation,
    RunRecord,
    StageAttempt,
    StageEntry,
    StageInputs,
)
from tuneproof.control.stages import MissingStageOutput, Stage, UnknownStages
from tuneproof.core import forward_env
from tuneproof.core.config import ConfigError, PipelineConfig
from tuneproof.core.config_base import reads_recorded
from tuneproof.core.config_reads import unread_settings
from tuneproof.core.files import not_a_file
from tuneproof.core.metric_names import check_eval_config
from tuneproof.core.names import slug_problem
from tuneproof.core.results import FailureClass, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import PromoteSummary

StageName = Annotated[str, WithJsonSchema({"type": "string", "enum": table.names()})]
"""A stage name; the Prefect form offers the table's names, and the flow refuses any other."""


class NothingRan(ValueError):
    """A request refused before any stage ran, in every flow (pipeline, compare, canary): a usage error
    (`tuneproof run` exits 3), not a stage failure."""


def refused(cause: object) -> State:
    """The flow's end for a refused request: its message for the Prefect UI, the typed cause for a caller."""
    return Failed(message=f"nothing ran: {cause}", data=NothingRan(str(cause)))


def refusal(state: State) -> str | None:
    """The message of a flow run that was refused before anything ran; None where something ran."""
    if state.is_failed() and isinstance(state.result(raise_on_failure=False), NothingRan):
        return state.message
    return None


@flow(name="tuneproof-pipeline", log_prints=True)
def pipeline(
    config: PipelineConfig = PipelineConfig(),
    run_id: str | None = None,
    only: list[StageName] | None = None,
    until: StageName | None = None,
) -> State:
    """Fine-tune and promote only on evidence. `only` reruns a subset against an existing run's outputs;
    `until` runs the stages up to and including that one and stops (continue the run later with its id)."""
    try:
        plan = table.plan(only, until)
    except UnknownStages as e:
        return refused(e)
    # A run id becomes a storage prefix and part of Ray job routes: refuse a bad one before anything is submitted.
    if run_id is not None and (problem := slug_problem(run_id)):
        return refused(f"run id {run_id!r} {problem}")
    # A deployment's parameters reach here unchecked by the CLI: the same checks, before anything is submitted.
    try:
        cfg = config.resolved()
    except ConfigError as e:
        return refused(e)
    if problems := check_eval_config(cfg.eval):
        return refused(ConfigError(problems))
    run_id = run_id or records.make_run_id()
    storage = Storage.from_config(cfg.storage)
    try:  # EKS runs on the standing cluster run the adopted image (images/current.json), when there is one
        cfg = images.pin_from_pointer(storage, cfg)
    except images.ImagesUnreadable as e:
        return refused(e)
    missing = missing_forwarded_env(cfg) or missing_local_files(cfg, {stage.name for stage in plan})
    if missing:
        return refused(missing)
    logger = get_run_logger()
    # One writer per run: the lease is taken before the record is touched or any job submitted.
    lease = Lease(storage, run_id, str(flow_run.get_id()), holder_command(only, until))
    try:
        with lease.held(on_problem=logger.warning):
            return run_plan(storage, cfg, run_id, plan, only, lease, until)
    except LeaseHeld as e:
        logger.error(str(e))
        return refused(e)


def run_plan(
    storage: Storage,
    cfg: PipelineConfig,
    run_id: str,
    plan: list[Stage],
    only: list[str] | None,
    lease: Lease,
    until: str | None = None,
) -> State:
    """The planned stages in order, under the lease; a flow that raises leaves its record crashed or cancelled.
    Every write of the record is fenced by the lease (records.save): a flow that lost it stops there, and the
    record stays its successor's."""
    record = None
    try:
        if lease.taken_over:
            get_run_logger().warning(lease.taken_over)
        try:
            record, plan = open_record(storage, cfg, run_id, plan, only, lease, until)
        except MissingStageOutput as e:  # refused before the record was touched: nothing ran, nothing superseded
            get_run_logger().error(str(e))
            return refused(e)
        invocation = record.invocations[-1]
        if invocation.kept:
            get_run_logger().info(f"run {run_id} continues: kept {', '.join(invocation.kept)}")
            for name in invocation.kept:
                events.publish("stage", stage=name, status="kept", failure_class=None)
        for name, why in invocation.reran.items():
            get_run_logger().info(f"{name} runs again: {why}")
        get_run_logger().info(
            f"run {run_id}: stages {', '.join(table.names(plan)) or 'none'}; storage {storage.uri('runs', run_id)}"
        )
        if any(ARTIFACTS.get(stage.name) is artifacts.loss_image for stage in plan):
            artifacts.import_plotting_in_background()
        wd_hash = working_dir_hash()
        for stage in plan:
            try:
                entry = run_stage(stage, cfg, record, storage, lease, wd_hash)
            except MissingStageOutput as e:
                return unusable_request(storage, lease, record, str(e))
            record_stage(record, stage, entry)
            records.save(storage, record, lease)
            publish(ARTIFACTS.get(stage.name), record, entry, storage)
            events.publish(
                "stage",
                stage=stage.name,
                status=entry.status,
                failure_class=entry.failure_class.value if entry.failure_class else None,
            )
            if entry.status == "failed":
                return finish(storage, lease, cfg, record, entry)
        return finish(storage, lease, cfg, record, None)
    except LeaseLost as e:  # presumed dead and taken over: the record is the successor's now, not ours to end
        get_run_logger().error(f"run {run_id}: {e}; this flow stopped and wrote nothing more")
        return Failed(message=f"run {run_id}: this flow stopped, its record not written: {e}")
    except BaseException as e:
        end_abnormally(storage, lease, record, e)
        raise
    finally:
        forward_env.discard(forward_env.run_key(run_id, storage.root))


def end_abnormally(storage: Storage, lease: Lease, record: RunRecord | None, e: BaseException) -> None:
    """The flow itself raised: the record says `crashed` (an error: storage, credentials, a bug) or
    `cancelled` (Ctrl-C, a cancelled Prefect flow run), with the cause. Best effort: the storage that
    failed may refuse this write too; then `runs list` still shows the run crashed once its lease is gone."""
    logger = get_run_logger()
    if record is None:
        return
    record.end(
        "crashed" if isinstance(e, Exception) else "cancelled", None, one_line(f"{type(e).__name__}: {e}".rstrip(": "))
    )
    try:
        records.save(storage, record, lease)
    except Exception as save_error:  # noqa: BLE001 - the original exception is what propagates
        logger.error(f"could not mark run {record.run_id} {record.status}: {type(save_error).__name__}: {save_error}")


DEFAULTS = PipelineConfig().resolved().model_dump(mode="json")
"""What a setting is when nobody gave it a value: one that differs and that no stage read was ignored. Resolved as
the run's config is, so a default path made absolute is still the default."""


def missing_forwarded_env(cfg: PipelineConfig) -> str | None:
    """Locally the submitting environment supplies forward_env's values: every name must be set here."""
    missing = [n for n in cfg.runtime_env.forward_env if n not in os.environ]
    if cfg.cluster.backend != "local" or not missing:
        return None
    return (
        f"runtime_env.forward_env names {', '.join(missing)}, not set in the submitting environment: "
        "export it before the run (or drop it from forward_env)"
    )


def missing_local_files(cfg: PipelineConfig, planned: set[str]) -> str | None:
    """Locally the jobs read their files from this machine: each data file must be a file here and a local base model
    a directory, or the run verified the cluster and measured its network before a job found it missing. (Suite
    files: check_suites.)"""
    if cfg.cluster.backend != "local":
        return None  # on EKS a path may be on the nodes alone (an FSx mount)
    replay = cfg.data.replay.source if cfg.data.replay else None
    read = (
        ("data.source", cfg.data.source),
        ("data.eval_source", cfg.data.eval_source),
        ("data.replay.source", replay),
    )
    problems = [
        f"{key}: {what} (got {path!r})"
        for key, path in read
        if "data" in planned and path and "://" not in path and cfg.data.format != "hf" and (what := not_a_file(path))
    ]
    model = cfg.model.source  # resolved: a local one is absolute, a hub id or s3:// is not
    # The stages whose jobs load the base model (its config, tokenizer or weights); verify and promote do not.
    loads_model = planned & {"connectivity", "data", "finetune", "resume", "evaluate"}
    if loads_model and model.startswith("/") and (what := not_a_directory(model)):
        got = one_line(repr(model), 200)
        problems.append(f"model.source: {what} (got {got}); give a local model directory or a hub id (org/name)")
    return "; ".join(problems) or None


def not_a_directory(path: str) -> str | None:
    """Why a local path names no directory here ('no such directory', 'not a directory'), or None."""
    try:
        if Path(path).is_dir():
            return None
        return "not a directory" if Path(path).exists() else "no such directory"
    except OSError as e:  # a name no file system holds (too long): is_dir raises instead of saying False
        return f"no such directory ({e.strerror})"


def holder_command(only: list[str] | None, until: str | None = None) -> str:
    """What holds the lease, as a person would recognise it."""
    stages = f"--until {until}" if until else f"--only {','.join(only) if only else 'all'}"
    return f"{flow_run.get_flow_name()}/{flow_run.get_name()} {stages}"


def run_stage(
    stage: Stage,
    cfg: PipelineConfig,
    record: RunRecord,
    storage: Storage,
    lease: Lease,
    wd_hash: str,
) -> StageEntry:
    """One stage with the outputs of earlier stages (from this run's record). An interrupted attempt with the
    inputs it has now is continued under that attempt's Ray names (table.resumes_invocation). The record names
    the stage as running (with its inputs) while it runs, so a flow that dies mid-stage leaves that behind."""
    with reads_recorded(cfg) as skip_reads:
        why_not = stage.skip(cfg) if stage.skip else None
    external = outside_inputs(stage, cfg, storage, record)
    config = cfg.model_dump(mode="json")
    if why_not:
        inputs = table.stage_inputs(stage, config, wd_hash, record, external, skip_reads)
        return StageEntry.skipped(stage.name, why_not).model_copy(update={"inputs": inputs})
    inputs = table.stage_inputs(stage, config, wd_hash, record, external)  # its last reads, until it has run
    invocation = record.invocations[-1]
    resumes = table.resumes_invocation(stage, inputs, record)
    if resumes is not None:
        note_resume(invocation, stage.name, resumes)
    call = StageCall(
        stage=stage.name,
        cfg=cfg,
        run_id=record.run_id,
        invocation=len(record.invocations),
        timeout_s=stage.timeout_s(cfg),
        summary=stage.summary,
        inputs=table.inputs_for(stage, record),
        record=record.model_copy(deep=True),
        resumes=resumes,
    )
    invocation.running = StageAttempt(
        stage=stage.name, inputs=inputs, job_invocation=call.job_invocation, started_at=now_iso()
    )
    records.save(storage, record, lease)  # fenced: a flow that lost the run submits nothing more
    with reads_recorded(call.cfg) as flow_reads:
        try:
            entry = task_for(stage)(call)
        except Exception as e:  # noqa: BLE001 - the record must say how the stage ended, whatever happened
            get_run_logger().exception(f"stage {stage.name} raised")
            entry = StageEntry.failed(stage.name, FailureClass.infrastructure, f"{type(e).__name__}: {e}")
    if table.reads_reported(entry):  # else the key it had before it ran: its last reads, or every section
        reads = table.observed_reads(entry, skip_reads | flow_reads)
        inputs = table.stage_inputs(stage, config, wd_hash, record, external, reads)
    invocation.running = None
    job_invocation = call.job_invocation if call.job_invocation != call.invocation else None
    return entry.model_copy(update={"inputs": inputs, "job_invocation": job_invocation})


def note_resume(invocation: Invocation, stage: str, resumes: int) -> None:
    """The invocation says the stage resumed, after why it reran (a continuation's reason, e.g. "data reran")."""
    why = invocation.reran.get(stage)
    note = f"resumes invocation {resumes}'s training from its checkpoint (its inputs are unchanged)"
    invocation.reran[stage] = f"{why}; {note}" if why else note


def open_record(
    storage: Storage,
    cfg: PipelineConfig,
    run_id: str,
    plan: list[Stage],
    only: list[str] | None,
    lease: Lease,
    until: str | None = None,
) -> tuple[RunRecord, list[Stage]]:
    """A fresh record, or the run's own: then `only` reruns a subset, and no `only` continues the run (stages
    whose inputs are unchanged are kept; with `until`, up to that stage). Returns the record and the stages to
    run; MissingStageOutput, before anything is saved, when a planned stage needs an output the plan leaves
    nobody to provide."""
    kept: list[str] = []
    reran: dict[str, str] = {}
    if storage.exists("runs", run_id, records.RECORD):
        record = records.load(storage, run_id)
        close_interrupted(record, lease.taken_over)
        if only is None:
            wd_hash = working_dir_hash()
            now = {stage.name: inputs_now(stage, cfg, wd_hash, record, storage) for stage in table.STAGES}
            continuation = table.plan_continuation(record.stages, now)
            planned = table.names(plan)  # with --until, what lies past it neither runs nor counts as rerun
            kept = continuation.kept
            reran = {name: why for name, why in continuation.reran.items() if name in planned}
            plan = [stage for stage in plan if stage.name not in kept]
        table.check_needs(plan, record)
        record.start()
        record.config, record.config_hash = cfg.model_dump(mode="json"), cfg.config_hash()
        supersede(record, table.names(plan))
    else:
        code = CodeIdentity.model_validate(git_identity())
        record = records.new_record(run_id, cfg, code, str(flow_run.get_id()))
        table.check_needs(plan, record)
    record.invocations.append(
        Invocation(
            number=len(record.invocations) + 1,
            flow_run_id=str(flow_run.get_id()),
            only=only,
            until=until,
            at=now_iso(),
            config_hash=cfg.config_hash(),
            config=cfg.model_dump(mode="json"),
            lease_takeover=lease.taken_over,
            kept=kept,
            reran=reran,
        )
    )
    records.save(storage, record, lease)
    return record, plan


def inputs_now(stage: Stage, cfg: PipelineConfig, wd_hash: str, record: RunRecord, storage: Storage) -> StageInputs:
    """The stage's inputs as they stand: the pure key over the record, plus what it reads from outside."""
    external = outside_inputs(stage, cfg, storage, record)
    return table.stage_inputs(stage, cfg.model_dump(mode="json"), wd_hash, record, external)


def outside_inputs(stage: Stage, cfg: PipelineConfig, storage: Storage, record: RunRecord) -> dict[str, str]:
    """What the stage's result depends on besides its settings, the job code and the outputs it needs: its
    external inputs, and the hash of the flow-side code that decides its verdict ('code tasks/promote.py')."""
    external = stage.external(cfg, storage, record) if stage.external else {}
    if stage.verdict_code:
        external[f"code {', '.join(stage.verdict_code)}"] = code_hash(stage.verdict_code)
    return external


def close_interrupted(record: RunRecord, taken_over: str | None) -> None:
    """A record still `running` when the next invocation opens it: its writer died (kill -9, a lost machine).
    Its last invocation ends `crashed`, and the stage it was running becomes a failed (infrastructure) entry,
    so the continuation reruns it and a fine-tune resumes from its checkpoint."""
    if record.status != "running" or not record.invocations:
        return
    cause = f"its writer died: {taken_over}" if taken_over else "its writer ended without closing the record"
    record.close_invocation(record.invocations[-1], "crashed", cause)


def supersede(record: RunRecord, rerun: list[str]) -> None:
    """Stages that rerun, and every stage downstream of them, leave `stages` for `superseded`: evidence
    about an earlier model or dataset never stands beside (or passes for) evidence about the new one."""
    for name in table.stale_after(rerun):
        if name in record.stages:
            record.superseded.append(record.stages.pop(name))
    if "promote" in table.stale_after(rerun):
        record.promotion = None


def record_stage(record: RunRecord, stage: Stage, entry: StageEntry) -> None:
    """Store the entry and lift its identity facts (cluster, data, promotion) to the record's top level."""
    entry.invocation = len(record.invocations)
    record.stages[stage.name] = entry
    summary = entry.summary_as(stage.summary)
    if stage.lift is not None and summary is not None:
        stage.lift(record, summary)
    if entry.jobs:
        record.code.working_dir_hash = entry.jobs[-1].working_dir_hash


def publish(artifact: Any, *args: Any) -> None:
    """Artifacts are evidence for people, not part of the verdict: a failure to publish one is logged."""
    if artifact is None:
        return
    try:
        artifact(*args)
    except Exception as e:  # noqa: BLE001
        name = f"{getattr(artifact, '__module__', '?')}.{getattr(artifact, '__qualname__', artifact)}"
        get_run_logger().warning(f"could not publish artifact {name}: {type(e).__name__}: {e}")


def unusable_request(storage: Storage, lease: Lease, record: RunRecord, cause: str) -> State:
    """A subset rerun that lacks an earlier stage's output: a usage error, not a stage failure."""
    record.end("failed", None, cause)
    records.save(storage, record, lease)
    return refused(cause)


def finish(storage: Storage, lease: Lease, cfg: PipelineConfig, record: RunRecord, failed: StageEntry | None) -> State:
    """End the invocation: the run's status is that of its current entries, not only of the stages this invocation
    ran (`failed`), and its promotion what the registry holds for it."""
    failed = failed or standing_failure(record)
    read = [path for entry in record.stages.values() if entry.inputs is not None for path in entry.inputs.config]
    # A setting is ignored only once every stage has had its turn: `--until data` ran connectivity, which reads
    # train.num_workers, and reported the fine-tune's train.max_failures as set but read by no stage.
    every_stage = failed is None and all(stage.name in record.stages for stage in table.STAGES)
    record.unread_settings = unread_settings(record.config, DEFAULTS, read) if every_stage else []
    if record.unread_settings:
        get_run_logger().warning(f"settings no stage read (ignored): {', '.join(record.unread_settings)}")
    if failed is None:
        record.end("succeeded")
    else:
        failure = failed.failure_class or FailureClass.infrastructure
        earlier = (
            f" (invocation {failed.invocation}'s, still current)" if failed.invocation < len(record.invocations) else ""
        )
        record.end("failed", failure, f"{failed.stage}: {failed.cause}{earlier}")
        if failed.stage != "promote" and "promote" not in record.stages:
            # Nothing is promoted after a failed stage; the refusal and its reason are part of the record.
            record.promotion = PromoteSummary(promoted=False, reasons=[f"{failure.value} failure in {record.cause}"])
    if "promote" not in record.stages and (live := live_promotion(storage, cfg, record)) is not None:
        record.promotion = live
    records.save(storage, record, lease)
    publish(artifacts.stage_table, record, table.names())
    publish(artifacts.run_report, record)
    if failed is None:
        return Completed(message=f"run {record.run_id} succeeded", data=summary_of(record))
    return Failed(
        message=f"{record.failure_class.value if record.failure_class else ''} failure in {record.cause}",
        data=summary_of(record),
    )


def standing_failure(record: RunRecord) -> StageEntry | None:
    """The first current entry that failed, in table order: an earlier invocation's failure stands until its stage
    reruns (`--only verify` after a failed evaluate leaves the run failed). A stage that has not run, or whose
    entry a rerun superseded, is no failure: `--until data` of a new run succeeds through data."""
    return next(
        (entry for name in table.names() if (entry := record.stages.get(name)) and entry.status == "failed"), None
    )


def live_promotion(storage: Storage, cfg: PipelineConfig, record: RunRecord) -> PromoteSummary | None:
    """This run's promotion when production still serves it although no current promote entry says so: a rerun
    superseded the evidence it was promoted on (a re-evaluation that then failed, `--until`, `--only evaluate`),
    but only a rollback takes a model out of production, and the record never denies what the registry serves.
    Its summary as that promotion recorded it (the override's, or the pointer's fields when neither is kept)."""
    try:
        pointer, _ = registry.read_pointer(storage, cfg.model.name)
    except registry.RegistryUnreadable as e:
        get_run_logger().warning(f"cannot tell whether run {record.run_id}'s promotion still serves: {e}")
        return None
    if pointer is None or pointer.run_id != record.run_id:
        return None
    earlier = [entry.summary_as(PromoteSummary) for entry in table.attempts("promote", record)]
    earlier += [override.result for override in record.overrides]
    same = [s for s in earlier if s is not None and s.promoted and s.version == pointer.version]
    return same[-1] if same else PromoteSummary(promoted=True, **pointer.model_dump(exclude={"move"}))


def summary_of(record: RunRecord) -> dict[str, Any]:
    return {
        "run_id": record.run_id,
        "status": record.status,
        "failure_class": record.failure_class.value if record.failure_class else None,
        "cause": record.cause,
        "stages": {name: entry.status for name, entry in record.stages.items()},
    }
