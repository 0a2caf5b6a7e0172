"""The tuneproof pipeline flow: verify -> connectivity -> data -> finetune -> resume -> evaluate -> promote.

Run it with `tuneproof run` (in-process) or from a Prefect deployment (prefect.yaml). The flow
only orders and branches: every stage is a task (a Ray job, or the promotion), every result
lands in the run record, and the first failed stage ends the run with its failure class.
"""

from __future__ import annotations

from typing import Any

from prefect import flow, get_run_logger, pause_flow_run
from prefect.input import RunInput
from prefect.runtime import flow_run
from prefect.states import Completed, Failed

from tasks import artifacts, events, promote as promote_tasks, resume as resume_tasks, stages
from tuneproof.control import record as records
from tuneproof.core.config import STAGES, PipelineConfig
from tuneproof.control.identity import git_identity
from tuneproof.core.results import now_iso, one_line
from tuneproof.core.storage import Storage


@flow(name="tuneproof-pipeline", log_prints=True)
def pipeline(config: PipelineConfig = PipelineConfig(), run_id: str | None = None, only: list[str] | None = None):
    """Fine-tune and promote only on evidence. `only` reruns a subset against an existing run's outputs."""
    cfg = config.resolved()
    run_id = run_id or records.make_run_id()
    storage = Storage.from_config(cfg.storage)
    record = open_record(storage, cfg, run_id, only)
    plan = [s for s in STAGES if not only or s in only]
    get_run_logger().info(f"run {run_id}: stages {', '.join(plan)}; storage {storage.uri('runs', run_id)}")

    for stage in plan:
        try:
            entry = run_stage(stage, cfg, run_id, record)
        except MissingStageOutput as e:
            return unusable_request(storage, record, str(e))
        except Exception as e:  # noqa: BLE001 - the record must say how the run ended, whatever happened
            entry = crashed(stage, e)
        record_stage(record, stage, entry)
        records.save(storage, record)
        report(artifacts.for_stage, record, stage, storage)
        events.publish("stage", stage=stage, status=entry["status"], failure_class=entry["failure_class"])
        if entry["status"] == "failed":
            return finish(storage, record, entry)
    return finish(storage, record, None)


def run_stage(stage: str, cfg: PipelineConfig, run_id: str, record: dict) -> dict[str, Any]:
    """Dispatch one stage with the outputs of earlier stages (from this run's record)."""
    n = len(record["invocations"])  # reruns against a run get fresh Ray jobs; retries re-attach
    if stage == "verify":
        return stages.verify(cfg, run_id, n)
    if stage == "connectivity":
        return stages.connectivity(cfg, run_id, n)
    if stage == "data":
        return stages.data(cfg, run_id, n)
    if stage == "finetune":
        return stages.finetune(cfg, run_id, needs(record, "data", "dataset_path"), n)
    if stage == "resume":
        if not cfg.resume.enabled:
            return skipped(stage, "resume.enabled is false")
        return resume_tasks.resume_test(cfg, run_id, needs(record, "data", "dataset_path"),
                                        needs(record, "finetune", "checkpoints"), needs(record, "finetune", "loss_curve"), n)
    if stage == "evaluate":
        return stages.evaluate(cfg, run_id, needs(record, "data", "dataset_path"), needs(record, "finetune", "export_path"), n)
    if stage == "promote":
        if cfg.promote.require_approval and not promote_tasks.refusal_reasons(cfg, record):
            approval = ask_for_approval(cfg, record)
            if not approval.approve:
                return promote_tasks.approval_refused(now_iso(), approval.approver, approval.comment)
        return promote_tasks.promote(cfg, run_id, record)
    raise ValueError(f"unknown stage {stage!r}; expected one of {', '.join(STAGES)}")


class Approval(RunInput):
    """The form an approver fills in the Prefect UI before the production pointer moves."""

    approve: bool = False
    approver: str = ""
    comment: str = ""


def ask_for_approval(cfg: PipelineConfig, record: dict) -> Approval:
    gates = ((record["stages"].get("evaluate") or {}).get("summary") or {}).get("gates") or {}
    get_run_logger().info("waiting for approval to promote; gates: " + "; ".join(gates.get("lines", [])))
    return pause_flow_run(wait_for_input=Approval, timeout=cfg.promote.approval_timeout_s)


def needs(record: dict, stage: str, key: str) -> Any:
    """An earlier stage's output; a clear error when a subset rerun lacks it."""
    entry = record["stages"].get(stage)
    if not entry or entry["status"] != "succeeded" or key not in entry["summary"]:
        raise MissingStageOutput(
            f"this stage needs {stage}.{key} from a succeeded {stage} stage of run {record['run_id']}; "
            f"run the {stage} stage first (e.g. --only {stage},...)"
        )
    return entry["summary"][key]


class MissingStageOutput(RuntimeError):
    pass


def crashed(stage: str, error: Exception) -> dict[str, Any]:
    """An unexpected error outside any job (cluster unreachable, storage error): infrastructure."""
    cause = one_line(f"{type(error).__name__}: {error}")
    get_run_logger().exception(f"stage {stage} raised")
    return records.stage_entry(stage, "failed", "infrastructure", cause, {}, [], now_iso(), now_iso())


def skipped(stage: str, why: str) -> dict[str, Any]:
    return records.stage_entry(stage, "skipped", None, why, {}, [], now_iso(), now_iso())


def open_record(storage: Storage, cfg: PipelineConfig, run_id: str, only: list[str] | None) -> dict:
    """A fresh record, or the existing one when a subset of stages reruns against a run."""
    invocation = {"flow_run_id": str(flow_run.get_id()), "only": only, "at": now_iso(), "config_hash": cfg.config_hash()}
    if storage.exists("runs", run_id, records.RECORD):
        record = records.load(storage, run_id)
        record.update(status="running", failure_class=None, cause=None)
        # Stages that rerun replace their entries; the old ones stay in the record's history.
        plan = [s for s in STAGES if not only or s in only]
        for stage in plan:
            if stage in record["stages"]:
                record.setdefault("superseded", []).append(record["stages"].pop(stage))
        if "promote" in plan:
            record["promotion"] = None
    else:
        record = records.new_record(run_id, cfg, git_identity(), str(flow_run.get_id()))
    record["invocations"].append(invocation)
    records.save(storage, record)
    return record


def record_stage(record: dict, stage: str, entry: dict) -> None:
    """Store the entry and lift identity facts (cluster, data) to the record's top level."""
    record["stages"][stage] = entry
    summary = entry["summary"]
    if stage == "verify" and summary.get("cluster"):
        record["cluster"] = summary["cluster"]
    if stage == "data" and summary.get("content_hash"):
        record["data"] = {k: summary.get(k) for k in ("dataset_path", "dataset_uri", "content_hash", "cache_hit")}
    if stage == "promote":
        record["promotion"] = summary
    if entry["jobs"]:
        record["code"]["working_dir_hash"] = entry["jobs"][-1]["working_dir_hash"]


def report(fn, *args) -> None:
    """Artifacts are evidence for people, not part of the verdict: a failure to publish one is logged."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        get_run_logger().warning(f"could not publish artifact {fn.__name__}: {type(e).__name__}: {e}")


def unusable_request(storage: Storage, record: dict, cause: str):
    """A subset rerun that lacks an earlier stage's output: a usage error, not a stage failure."""
    record.update(status="failed", failure_class=None, cause=cause)
    records.save(storage, record)
    return Failed(message=f"nothing ran: {cause}")


def finish(storage: Storage, record: dict, failed: dict | None):
    if failed is None:
        record.update(status="succeeded", failure_class=None, cause=None)
        records.save(storage, record)
        report(artifacts.stage_table, record)
        report(artifacts.run_report, record)
        return Completed(message=f"run {record['run_id']} succeeded", data=summary_of(record))
    cause = f"{failed['stage']}: {failed['cause']}"
    record.update(status="failed", failure_class=failed["failure_class"], cause=cause)
    if failed["stage"] != "promote" and "promote" not in record["stages"]:
        # Nothing is promoted after a failed stage; the refusal and its reason are part of the record.
        record["promotion"] = {"promoted": False, "reasons": [f"{failed['failure_class']} failure in {cause}"]}
    records.save(storage, record)
    report(artifacts.stage_table, record)
    report(artifacts.run_report, record)
    return Failed(message=f"{failed['failure_class']} failure in {cause}", data=summary_of(record))


def summary_of(record: dict) -> dict[str, Any]:
    return {
        "run_id": record["run_id"], "status": record["status"], "failure_class": record["failure_class"],
        "cause": record["cause"], "stages": {k: v["status"] for k, v in record["stages"].items()},
    }
