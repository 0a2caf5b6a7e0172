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

from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.core.config import PipelineConfig
from tuneproof.control.record import stage_entry
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage


def refusal_reasons(cfg: PipelineConfig, record: dict) -> list[str]:
    """Why this run may not be promoted (empty when it may). Pure over the record."""
    stages = record["stages"]
    reasons = []
    resume = stages.get("resume")
    if not cfg.resume.enabled:
        reasons.append("resume test disabled (resume.enabled=false): no evidence that checkpoints restore")
    elif not resume or resume["status"] != "succeeded":
        reasons.append(f"resume test {'did not run' if not resume else resume['status']}: {(resume or {}).get('cause') or ''}".rstrip(": "))
    evaluation = stages.get("evaluate")
    gates = ((evaluation or {}).get("summary") or {}).get("gates") or {}
    if not evaluation or evaluation["status"] != "succeeded" or not gates.get("passed"):
        reasons.append(f"evaluation gates not passed: {(evaluation or {}).get('cause') or 'evaluate did not run'}")
    return reasons


def model_card(cfg: PipelineConfig, record: dict, forced: dict | None = None) -> dict[str, Any]:
    evaluation = (record["stages"].get("evaluate") or {}).get("summary") or {}
    resume = (record["stages"].get("resume") or {}).get("summary") or {}
    return {
        "name": cfg.model.name, "run_id": record["run_id"], "base_model": cfg.model.source,
        "metrics": {k: (v or {}).get("metrics") for k, v in (evaluation.get("models") or {}).items()},
        "incumbent_version": evaluation.get("incumbent_version"),
        "gates": (evaluation.get("gates") or {}).get("lines", []),
        "dataset_hash": (record.get("data") or {}).get("content_hash"),
        "image": cfg.cluster.expect.image, "image_digest": (record.get("cluster") or {}).get("image_digest"),
        "environment_digest": (record.get("cluster") or {}).get("environment_digest"),
        "code_sha": record["code"].get("git_sha"), "code_dirty": record["code"].get("dirty"),
        "working_dir_hash": record["code"].get("working_dir_hash"), "config_hash": record["config_hash"],
        "resume": {k: resume.get(k) for k in ("restored_step", "max_loss_diff")},
        "forced": forced,
    }


@task(name="promote", cache_policy=NO_CACHE)
def promote(cfg: PipelineConfig, run_id: str, record: dict) -> dict[str, Any]:
    started = now_iso()
    reasons = refusal_reasons(cfg, record)
    if reasons:
        return refused(started, reasons, "modeling")
    return move_pointer(cfg, record, started, forced=None)


def move_pointer(cfg: PipelineConfig, record: dict, started: str, forced: dict | None) -> dict[str, Any]:
    """Copy the export to a new version and CAS the pointer against the incumbent that was evaluated."""
    storage = Storage.from_config(cfg.storage)
    evaluated = ((record["stages"].get("evaluate") or {}).get("summary") or {}).get("incumbent_version")
    pointer, token = registry.read_pointer(storage, cfg.model.name)
    current = (pointer or {}).get("version")
    if forced is None and current != evaluated:
        return refused(started, [f"the production model changed since evaluation ({evaluated} -> {current}); re-evaluate"], "infrastructure")
    export_path = record["stages"]["finetune"]["summary"]["export_path"]
    try:
        result = registry.promote(storage, cfg.model.name, record["run_id"], export_path,
                                  model_card(cfg, record, forced), token)
    except registry.PromotionConflict as e:
        return refused(started, [f"lost a concurrent promotion: {e}"], "infrastructure")
    logging.getLogger("tuneproof.promote").info(f"promoted {cfg.model.name} {result['version']} (previous: {current})")
    summary = {"promoted": True, "previous_version": current, **result, "forced": forced}
    return stage_entry("promote", "succeeded", None, None, summary, [], started, now_iso())


def approval_refused(started: str, approver: str, comment: str) -> dict[str, Any]:
    return refused(started, [f"approval refused by {approver or 'an approver'}: {comment or 'no comment'}"], "modeling")


def refused(started: str, reasons: list[str], failure_class: str) -> dict[str, Any]:
    summary = {"promoted": False, "reasons": reasons}
    return stage_entry("promote", "failed", failure_class, "; ".join(reasons), summary, [], started, now_iso())


def forced_promotion(cfg: PipelineConfig, run_id: str, reason: str, user: str) -> dict[str, Any]:
    """`tuneproof promote RUN --force --reason`: bypass the gates, and say so in the record and the card."""
    storage = Storage.from_config(cfg.resolved().storage)
    record = records.load(storage, run_id)
    finetune = record["stages"].get("finetune") or {}
    if finetune.get("status") != "succeeded":
        return {"promoted": False, "reasons": [f"run {run_id} has no exported model (finetune {finetune.get('status', 'did not run')})"]}
    forced = {"by": user, "reason": reason, "at": now_iso(), "bypassed": refusal_reasons(cfg, record)}
    entry = move_pointer(cfg, record, now_iso(), forced)
    record.setdefault("overrides", []).append({"action": "promote --force", **forced, "result": entry["summary"]})
    record["promotion"] = entry["summary"]
    records.save(storage, record)
    return entry["summary"]
