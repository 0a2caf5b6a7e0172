"""The promote stage (a Prefect task, not a Ray job): only on evidence, and never over a stale incumbent.

Promotion needs evidence about exactly the model it copies: the current (not superseded) evaluation
passed every gate for the content hash of the current fine-tune's export, the export in storage still
has that hash, and the resume test passed on the same fine-tune's Ray Train run. The model is copied
to models/<name>/<version>/ with its card (the copy checked against the hash), then the production
pointer, naming the hash, moves with a compare-and-swap on the pointer the evaluation compared
against, so two concurrent runs cannot both promote over the same incumbent. A refusal leaves the
pointer untouched and says why. `tuneproof promote RUN --force --reason` is the logged override
(it bypasses the gates, never the check that the copied files are the export's own).
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from prefect import task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from pydantic import BaseModel, ConfigDict

from tasks import artifacts
from tasks.jobs import StageCall, runner_for
from tuneproof.control import cost, history, registry
from tuneproof.control import record as records
from tuneproof.control import rollback as rollbacks
from tuneproof.control.cost import VersionCost
from tuneproof.control.history import MoveIntent
from tuneproof.control.lease import Lease, LeaseHeld
from tuneproof.control.record import JobEntry, Override, RolledBack, RunRecord, StageEntry
from tuneproof.core import markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_train import LORA_ADAPTER_DIR
from tuneproof.core.results import FailureClass, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import CopyCheckSummary, EvaluateSummary, Forced, PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary


def refusal_reasons(cfg: PipelineConfig, record: RunRecord) -> list[str]:
    """Why this run may not be promoted (empty when it may). Pure over the record."""
    finetune = record.summary("finetune", FinetuneSummary) if record.passed("finetune") else None
    if finetune is None or finetune.export_sha256 is None:
        return [f"run {record.run_id} has no succeeded fine-tune with a hashed export: run finetune first"]
    return resume_reasons(cfg, record, finetune) + evaluation_reasons(record, finetune)


def resume_reasons(cfg: PipelineConfig, record: RunRecord, finetune: FinetuneSummary) -> list[str]:
    resume = record.stages.get("resume")
    if not cfg.resume.enabled:
        return ["resume test disabled (resume.enabled=false): no evidence that checkpoints restore"]
    if resume is None:
        return [f"resume test did not run for the current fine-tune{superseded_note(record, 'resume')}"]
    if not resume.ok:
        return [f"resume test {resume.status}: {resume.cause or ''}".rstrip(": ")]
    summary = resume.summary_as(ResumeSummary)
    if summary is None or not summary.interrupted or summary.restored_step != summary.interrupted_at_step:
        return ["resume test has no proof of an interruption restored at its hold step"]
    if summary.tested_run_name != finetune.run_name:
        return [
            f"resume test tested Ray Train run {summary.tested_run_name}, not the fine-tune being promoted "
            f"({finetune.run_name}): rerun the resume stage"
        ]
    return []


def evaluation_reasons(record: RunRecord, finetune: FinetuneSummary) -> list[str]:
    evaluation = record.stages.get("evaluate")
    summary = record.summary("evaluate", EvaluateSummary)
    if evaluation is None:
        return [
            f"evaluation gates not passed: evaluate did not run for the current fine-tune{superseded_note(record, 'evaluate')}"
        ]
    if not evaluation.ok or summary is None or not summary.gates.passed:
        return [f"evaluation gates not passed: {evaluation.cause or evaluation.status}"]
    forgot = [s.gates.failure_cause() for s in summary.suites if not s.gates.passed]
    if forgot:
        return [f"regression suite gates not passed: {cause}" for cause in forgot]
    scored = summary.models.get("candidate")
    scored_hash = scored.content_sha256 if scored else None
    if scored_hash != finetune.export_sha256:
        return [
            f"evaluation scored content {str(scored_hash)[:12]}, but the current fine-tune's export "
            f"{finetune.export_path} is content {str(finetune.export_sha256)[:12]}: re-run evaluate"
        ]
    return []


def superseded_note(record: RunRecord, stage: str) -> str:
    """' (its last result was superseded by invocation N's rerun)' when the stage's evidence went stale."""
    stale = [e for e in record.superseded if e.stage == stage]
    if not stale:
        return ""
    return f" (its last result, from invocation {stale[-1].invocation}, was superseded by a rerun of an earlier stage)"


def model_card(cfg: PipelineConfig, record: RunRecord, forced: Forced | None = None) -> registry.CardFacts:
    evaluation = record.summary("evaluate", EvaluateSummary)
    resume = record.summary("resume", ResumeSummary)
    cluster = record.cluster
    return registry.CardFacts(
        name=cfg.model.name,
        run_id=record.run_id,
        base_model=cfg.model.source,
        **base_facts(record),
        **method_facts(record),
        metrics={role: (score.metrics if score else None) for role, score in evaluation.models.items()}
        if evaluation
        else {},
        incumbent_version=evaluation.incumbent_version if evaluation else None,
        gates=card_gate_lines(evaluation) if evaluation else [],
        suites=evaluation.suite_rows() if evaluation and evaluation.suites else [],
        dataset_hash=record.data.content_hash if record.data else None,
        replay=replay_facts(record),
        image=cfg.cluster.expect.image,
        image_digest=cluster.image_digest if cluster else None,
        environment_digest=cluster.environment_digest if cluster else None,
        code_sha=record.code.git_sha,
        code_dirty=record.code.dirty,
        working_dir_hash=record.code.working_dir_hash,
        config_hash=record.config_hash,
        resume=registry.Restored(restored_step=resume.restored_step, max_loss_diff=resume.max_loss_diff)
        if resume
        else None,
        forced=forced,
    )


def card_gate_lines(evaluation: EvaluateSummary) -> list[str]:
    """Every gate line of the task and the suites, each naming the split it was decided on; the plain lines of a
    decision without verdicts (an older record)."""
    decisions = [evaluation.gates, *(s.gates for s in evaluation.suites)]
    return [line for d in decisions for line in ([v.with_split() for v in d.verdicts] or d.lines)]


def base_facts(record: RunRecord) -> dict[str, Any]:
    """The base's content hash and recipe, where the fine-tune found its build record (base.json)."""
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None or finetune.base_model is None:
        return {}
    return {"base_content_hash": finetune.base_model.content_hash, "base_recipe": finetune.base_model.recipe}


def replay_facts(record: RunRecord) -> registry.Replayed | None:
    """The data.replay file the training split mixed in (against forgetting), as the data stage hashed it."""
    data = record.summary("data", DataSummary)
    manifest = data.manifest if data else None
    if manifest is None or manifest.replay is None:
        return None
    return registry.Replayed(
        source=manifest.replay.uri, sha256=manifest.replay.sha256, share=manifest.settings["replay"]["share"]
    )


def method_facts(record: RunRecord) -> dict[str, Any]:
    """How the promoted model was trained: method, parameter counts and, for LoRA, the adapter's folder."""
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None:
        return {}
    return {
        "method": finetune.method,
        "trainable_params": finetune.trainable_params,
        "total_params": finetune.total_params,
        "adapter": LORA_ADAPTER_DIR if finetune.adapter_path else None,
    }


@task(name="promote", cache_policy=NO_CACHE)
def promote(call: StageCall) -> StageEntry:
    started = now_iso()
    reasons = refusal_reasons(call.cfg, call.record)
    if reasons:
        return refused(started, reasons, FailureClass.modeling)
    jobs: list[JobEntry] = []
    checker = copy_checker(call, jobs)
    entry = move_pointer(call.cfg, call.record, started, forced=None, check_copy=checker, jobs=jobs)
    entry = with_copy_check(entry, jobs)
    if entry.ok:
        publish_history(Storage.from_config(call.cfg.storage), call.cfg.model.name, call.record.run_id)
    return entry


def publish_history(storage: Storage, name: str, key_id: str) -> None:
    """The model's production history as a markdown artifact of this flow run (where people look)."""
    moves = registry.read_history(storage, name)
    text = "\n".join([f"# {name}: production history", "", *history.render(moves)])
    create_markdown_artifact(
        text, key=artifacts.key("production-history", key_id), description=f"{name} production history"
    )


def move_pointer(
    cfg: PipelineConfig,
    record: RunRecord,
    started: str,
    forced: Forced | None,
    check_copy: Callable[[str], None] | None = None,
    jobs: list[JobEntry] | None = None,
) -> StageEntry:
    """Check the export is the judged content, copy it to a new version, check the copy (check_copy, given
    the version's path) and CAS the pointer against the incumbent that was evaluated. Every refusal
    happens before the pointer is touched. `jobs` is the promote stage's own (check_copy appends the copy
    check's): the card's cost, computed once the check has run, includes them."""
    storage = Storage.from_config(cfg.storage)
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None or finetune.export_path is None:
        return refused(started, [f"run {record.run_id} has no exported model"], FailureClass.infrastructure)
    problem, content = export_problem(storage, finetune, forced)
    if problem or content is None:
        return refused(started, [problem or "no content hash"], FailureClass.infrastructure)
    evaluation = record.summary("evaluate", EvaluateSummary)
    evaluated = evaluation.incumbent_version if evaluation else None
    try:
        pointer, token = registry.read_pointer(storage, cfg.model.name)
    except registry.RegistryUnreadable as e:  # never moved against a pointer nobody can read
        return refused(started, [str(e)], FailureClass.infrastructure)
    current = pointer.version if pointer else None
    if registry.is_promotion_of(pointer, record.run_id, content):
        # This run's own promotion already landed: a retry, or a continuation of a run whose flow died
        # between the pointer's swap and the record's save. The same version, not a second copy, and not
        # "the production model changed since evaluation" (it changed to this run).
        logging.getLogger("tuneproof.promote").info(f"{cfg.model.name} {current} is already this run's model")
        summary = promoted_summary(pointer, forced)
        return StageEntry.succeeded("promote", summary, started)
    if forced is None and current != evaluated:
        return refused(
            started,
            [f"the production model changed since evaluation ({evaluated} -> {current}); re-evaluate"],
            FailureClass.infrastructure,
        )
    card = model_card(cfg, record, forced).model_copy(update={"content_sha256": content})

    def cost_of(move: history.Move) -> VersionCost:
        return promotion_cost(storage, cfg, as_stored(record, started, jobs or []), move)

    try:
        with rollbacks.hold(storage, cfg.model.name, record.run_id, f"promote {record.run_id}", HOLD_WAIT_S):
            result = registry.promote(
                storage,
                cfg.model.name,
                record.run_id,
                finetune.export_path,
                card,
                token,
                content_sha256=content,
                intent=move_intent(record, forced),
                check_copy=check_copy,
                cost_of=cost_of,
            )
    except CopyCheckFailed as e:
        return refused(started, [str(e)], FailureClass.infrastructure)
    except (registry.PromotionConflict, rollbacks.PointerHeld) as e:
        return refused(started, [f"lost a concurrent promotion: {e}"], FailureClass.infrastructure)
    except markers.ExportUnverified as e:
        return refused(started, [f"the copied model is not the judged export: {e}"], FailureClass.infrastructure)
    logging.getLogger("tuneproof.promote").info(f"promoted {cfg.model.name} {result.version} (previous: {current})")
    summary = promoted_summary(result, forced)
    return StageEntry.succeeded("promote", summary, started)


def promotion_cost(storage: Storage, cfg: PipelineConfig, record: RunRecord, move: history.Move) -> VersionCost:
    """What the version `move` promotes cost: this run as `record` has it, and
    the model's other runs since the previous promotion. The card states it; `models show` shows the card's."""
    stored, _ = records.list_records(storage)
    runs = [r for r in cost.records_of(stored, cfg.model.name) if r.run_id != record.run_id] + [record]
    moves = [*registry.read_history(storage, cfg.model.name), move]
    side = cost.side_runs(storage, [r.run_id for r in runs])
    return cost.version_costs(runs, moves, cfg.cost.prices, side)[-1]


def as_stored(record: RunRecord, started: str, jobs: list[JobEntry]) -> RunRecord:
    """The run's record as the flow will store it once this promote stage ends: with the stage's jobs so far
    (the copy check's), so the card charges the run for them. A promotion without jobs (the override) adds none."""
    if not jobs:
        return record
    entry = StageEntry(
        stage="promote",
        status="succeeded",
        started_at=started,
        ended_at=now_iso(),
        jobs=list(jobs),
        invocation=len(record.invocations) or 1,
    )
    return record.model_copy(update={"stages": {**record.stages, "promote": entry}})


COPY_CHECK_EXAMPLES = 32
"""Eval items the registry copy answers before the pointer moves: enough for a corrupted or wrong model to
score differently, few enough to cost seconds."""


class CopyCheckFailed(RuntimeError):
    """The registry copy did not score like the evaluated export on the fixed slice (or could not be scored)."""


def copy_checker(call: StageCall, jobs: list[JobEntry]) -> Callable[[str], None] | None:
    """A check_copy for registry.promote: a Ray job (eval.copy_check) that loads the copy from the registry's
    bytes and scores the first COPY_CHECK_EXAMPLES items evaluate saved; its JobEntry goes to `jobs`.
    None when the evaluation saved no candidate answers to compare with."""
    storage = Storage.from_config(call.cfg.storage)
    items = copy_check_slice(storage, call.record.summary("evaluate", EvaluateSummary))
    if items is None:
        return None

    def check(model_path: str) -> None:
        params = {"model": model_path, **items}
        spec = call.spec("eval.copy_check", params, suffix="copy-check", summary=CopyCheckSummary)
        job = runner_for(call).run(spec)
        jobs.append(job)
        if job.result.status != "succeeded":
            raise CopyCheckFailed(f"copy check ({job.submission_id}): {job.result.cause}")

    return check


def copy_check_slice(storage: Storage, evaluation: EvaluateSummary | None) -> dict[str, list[str]] | None:
    """{"prompts", "references", "answers"}: the first saved predictions with a candidate answer (None: none)."""
    uri = evaluation.predictions_uri if evaluation else None
    prefix = storage.uri() + "/"
    if not uri or not uri.startswith(prefix):
        return None
    lines = storage.read_text(*uri.removeprefix(prefix).split("/")).splitlines()
    rows = [row for row in map(json.loads, filter(None, lines)) if row.get("candidate") is not None]
    rows = rows[:COPY_CHECK_EXAMPLES]
    if not rows:
        return None
    return {key: [row[field] for row in rows] for key, field in FIELDS.items()}


FIELDS = {"prompts": "prompt", "references": "reference", "answers": "candidate"}


def with_copy_check(entry: StageEntry, jobs: list[JobEntry]) -> StageEntry:
    """The promote entry with the copy check's job, and its summary in the promote summary."""
    if not jobs:
        return entry
    update: dict[str, Any] = {"jobs": [*entry.jobs, *jobs]}
    summary = entry.summary_as(PromoteSummary)
    if summary is not None and jobs[-1].result.summary is not None:
        checked = CopyCheckSummary.model_validate(jobs[-1].result.summary)
        update["summary"] = summary.model_copy(update={"copy_check": checked}).to_json()
    return entry.model_copy(update=update)


HOLD_WAIT_S = 120.0
"""How long a promotion waits for another flow's hold on the pointer (a rollback, another promotion)."""


def promoted_summary(pointer: registry.ProductionPointer, forced: Forced | None) -> PromoteSummary:
    """The promotion as the record keeps it: the pointer's fields (its move lives in the model's history)."""
    return PromoteSummary(promoted=True, forced=forced, **pointer.model_dump(exclude={"move"}))


def move_intent(record: RunRecord, forced: Forced | None) -> MoveIntent:
    """Who moves the pointer and why: the override's author and reason, or the gates' pass with the
    hash of the evidence they judged."""
    if forced is not None:
        return MoveIntent(kind="forced-promote", by=forced.by, reason=forced.reason)
    return MoveIntent(
        kind="promote",
        by=registry.current_user(),
        reason="every gate and the resume test passed",
        evidence_sha256=evidence_sha256(record),
    )


def evidence_sha256(record: RunRecord) -> str:
    """sha256 of the summaries a promotion rests on (fine-tune export, resume test, evaluation). Pure."""
    judged = {stage: record.stages[stage].summary for stage in EVIDENCE_STAGES if stage in record.stages}
    return hashlib.sha256(json.dumps(judged, sort_keys=True).encode()).hexdigest()


EVIDENCE_STAGES = ("finetune", "resume", "evaluate")


def export_problem(storage: Storage, finetune: FinetuneSummary, forced: Forced | None) -> tuple[str | None, str | None]:
    """(why the stored export may not be promoted, its content hash): its files must match its manifest,
    and (unless forced past the gates) the manifest must be the content the fine-tune wrote and evaluate scored."""
    path = finetune.export_path or ""
    try:
        content = markers.verify_export(storage, path).content_sha256
    except markers.ExportUnverified as e:
        return f"the export is not what was judged: {e}", None
    if forced is None and content != finetune.export_sha256:
        return (
            f"{storage.uri(path)} is content {content[:12]}, not the evaluated {str(finetune.export_sha256)[:12]}",
            None,
        )
    return None, content


def approval_refused(started: str, approver: str, comment: str) -> StageEntry:
    return refused(
        started, [f"approval refused by {approver or 'an approver'}: {comment or 'no comment'}"], FailureClass.modeling
    )


def refused(started: str, reasons: list[str], failure_class: FailureClass) -> StageEntry:
    return StageEntry.failed(
        "promote", failure_class, "; ".join(reasons), started, summary=PromoteSummary(promoted=False, reasons=reasons)
    )


def forced_promotion(cfg: PipelineConfig, run_id: str, reason: str, user: str) -> PromoteSummary:
    """`tuneproof promote RUN --force --reason`: bypass the gates, and say so in the record and the card."""
    storage = Storage.from_config(cfg.resolved().storage)
    record = records.load(storage, run_id)
    finetune = record.stages.get("finetune")
    if finetune is None or not finetune.ok:
        why = finetune.status if finetune else "did not run"
        return PromoteSummary(promoted=False, reasons=[f"run {run_id} has no exported model (finetune {why})"])
    forced = Forced(by=user, reason=reason, at=now_iso(), bypassed=refusal_reasons(cfg, record))
    entry = move_pointer(cfg, record, now_iso(), forced)
    result = entry.summary_as(PromoteSummary) or PromoteSummary(promoted=False, reasons=[entry.cause or ""])
    record.overrides.append(
        Override(
            action="promote --force", by=user, reason=reason, at=forced.at, bypassed=forced.bypassed, result=result
        )
    )
    record.promotion = result
    records.save(storage, record)
    return result


class RollbackResult(BaseModel):
    """What `tuneproof rollback` (and the rollback flow) did: the move, or why nothing moved."""

    model_config = ConfigDict(extra="forbid")

    rolled_back: bool
    model: str
    from_version: str | None = None
    to_version: str | None = None
    move: int | None = None
    """The move's number in the model's production history."""
    rolled_back_run: str | None = None
    """The run whose model was production before, whose record now names the rollback."""
    reasons: list[str] = []
    """Why it was refused (empty when it moved)."""


def roll_back(
    cfg: PipelineConfig, name: str, reason: str, by: str, to_version: str | None, flow_run_id: str | None = None
) -> RollbackResult:
    """Move the pointer back (control.rollback) and note it in the rolled-back run's record, under that
    run's lease so no flow writes the record meanwhile. Every refusal leaves the pointer where it was."""
    storage = Storage.from_config(cfg.resolved().storage)
    try:
        pointer, _ = registry.read_pointer(storage, name)
    except registry.RegistryUnreadable as e:  # nothing to roll back from that anyone can name
        return RollbackResult(rolled_back=False, model=name, reasons=[str(e)])
    run_id = pointer.run_id if pointer else None
    lease = None
    if run_id and storage.exists("runs", run_id, records.RECORD):
        lease = Lease(storage, run_id, flow_run_id, f"tuneproof rollback {name}")
    try:
        with lease.held(on_problem=logging.getLogger("tuneproof.rollback").warning) if lease else nullcontext():
            new = rollbacks.rollback(storage, name, reason, by, to_version)
            move = new.move
            assert move is not None and move.from_version is not None  # rollback always records its move
            if lease is not None:
                note_rollback(storage, lease.run_id, name, move)
    except (
        rollbacks.RollbackRefused,
        rollbacks.PointerHeld,
        registry.PromotionConflict,
        registry.RegistryUnreadable,
        LeaseHeld,
    ) as e:
        return RollbackResult(
            rolled_back=False, model=name, from_version=pointer.version if pointer else None, reasons=[str(e)]
        )
    return RollbackResult(
        rolled_back=True,
        model=name,
        from_version=move.from_version,
        to_version=move.to_version,
        move=move.seq,
        rolled_back_run=run_id,
    )


def note_rollback(storage: Storage, run_id: str, name: str, move: history.Move) -> None:
    record = records.load(storage, run_id)
    record.rollbacks.append(
        RolledBack(
            model=name,
            from_version=str(move.from_version),
            to_version=move.to_version,
            by=move.by,
            reason=move.reason,
            at=move.at,
            seq=move.seq,
        )
    )
    records.save(storage, record)


@task(name="rollback", cache_policy=NO_CACHE)
def rollback(
    cfg: PipelineConfig, name: str, reason: str, by: str, to_version: str | None, flow_run_id: str
) -> RollbackResult:
    result = roll_back(cfg, name, reason, by, to_version, flow_run_id)
    publish_history(Storage.from_config(cfg.resolved().storage), name, f"rollback-{flow_run_id}")
    return result
