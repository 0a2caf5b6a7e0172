"""Stage 7, promote (a Prefect task, not a Ray job): only on evidence, and never over a stale incumbent.

Promotion needs the resume test and every evaluation gate passed. The model is copied to
models/<name>/<version>/ with its card, then the production pointer moves with a compare-and-swap
on the pointer the evaluation compared against, so two concurrent runs cannot both promote over
the same incumbent. `tuneproof promote RUN --force --reason` is the logged override.
"""

from __future__ import annotations

import logging
from typing import Any

from prefect import task
from prefect.cache_policies import NO_CACHE

from tasks.jobs import StageCall
from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.control.record import Override, RunRecord, StageEntry
from tuneproof.core.config import LORA_ADAPTER_DIR, PipelineConfig
from tuneproof.core.results import FailureClass, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import EvaluateSummary, FinetuneSummary, Forced, PromoteSummary, ResumeSummary


def refusal_reasons(cfg: PipelineConfig, record: RunRecord) -> list[str]:
    """Why this run may not be promoted (empty when it may). Pure over the record."""
    reasons = []
    resume = record.stages.get("resume")
    if not cfg.resume.enabled:
        reasons.append("resume test disabled (resume.enabled=false): no evidence that checkpoints restore")
    elif resume is None or not resume.ok:
        how = "did not run" if resume is None else resume.status
        reasons.append(f"resume test {how}: {resume.cause or ''}".rstrip(": ") if resume else f"resume test {how}")
    evaluation = record.stages.get("evaluate")
    summary = record.summary("evaluate", EvaluateSummary)
    if evaluation is None or not evaluation.ok or summary is None or not summary.gates.passed:
        cause = evaluation.cause if evaluation is not None else "evaluate did not run"
        reasons.append(f"evaluation gates not passed: {cause}")
    return reasons


def model_card(cfg: PipelineConfig, record: RunRecord, forced: Forced | None = None) -> dict[str, Any]:
    evaluation = record.summary("evaluate", EvaluateSummary)
    resume = record.summary("resume", ResumeSummary)
    cluster = record.cluster
    return {
        "name": cfg.model.name,
        "run_id": record.run_id,
        "base_model": cfg.model.source,
        **method_facts(record),
        "metrics": {role: (score.metrics if score else None) for role, score in evaluation.models.items()}
        if evaluation
        else {},
        "incumbent_version": evaluation.incumbent_version if evaluation else None,
        "gates": evaluation.gates.lines if evaluation else [],
        "dataset_hash": record.data.content_hash if record.data else None,
        "image": cfg.cluster.expect.image,
        "image_digest": cluster.image_digest if cluster else None,
        "environment_digest": cluster.environment_digest if cluster else None,
        "code_sha": record.code.git_sha,
        "code_dirty": record.code.dirty,
        "working_dir_hash": record.code.working_dir_hash,
        "config_hash": record.config_hash,
        "resume": {"restored_step": resume.restored_step, "max_loss_diff": resume.max_loss_diff} if resume else {},
        "forced": forced.to_json() if forced else None,
    }


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
    return move_pointer(call.cfg, call.record, started, forced=None)


def move_pointer(cfg: PipelineConfig, record: RunRecord, started: str, forced: Forced | None) -> StageEntry:
    """Copy the export to a new version and CAS the pointer against the incumbent that was evaluated."""
    storage = Storage.from_config(cfg.storage)
    evaluation = record.summary("evaluate", EvaluateSummary)
    evaluated = evaluation.incumbent_version if evaluation else None
    pointer, token = registry.read_pointer(storage, cfg.model.name)
    current = (pointer or {}).get("version")
    if forced is None and current != evaluated:
        return refused(
            started,
            [f"the production model changed since evaluation ({evaluated} -> {current}); re-evaluate"],
            FailureClass.infrastructure,
        )
    finetune = record.summary("finetune", FinetuneSummary)
    if finetune is None or finetune.export_path is None:
        return refused(started, [f"run {record.run_id} has no exported model"], FailureClass.infrastructure)
    try:
        result = registry.promote(
            storage, cfg.model.name, record.run_id, finetune.export_path, model_card(cfg, record, forced), token
        )
    except registry.PromotionConflict as e:
        return refused(started, [f"lost a concurrent promotion: {e}"], FailureClass.infrastructure)
    logging.getLogger("tuneproof.promote").info(f"promoted {cfg.model.name} {result['version']} (previous: {current})")
    summary = PromoteSummary(promoted=True, forced=forced, **{**result, "previous_version": current})
    return StageEntry.succeeded("promote", summary, started)


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
