"""Prefect tasks for the job-backed stages: build the job request, run it, return a record entry.

Each task returns the stage's record entry (tuneproof.control.record.stage_entry); classified failures
are values, not exceptions, so Prefect retries (retries=1) only cover the unexpected — a lost
connection while following a job — and a retry re-attaches to the same Ray submission.
"""

from __future__ import annotations

from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import artifacts, events
from tasks.rayjob import JobOutcome, JobSpec, RayJobRunner
from tuneproof.control import registry
from tuneproof.core.config import PipelineConfig
from tuneproof.core.storage import Storage
from tuneproof.core.transport import nccl_env
from tuneproof.control.record import stage_entry
from tuneproof.core.results import now_iso

RETRY = {"retries": 1, "retry_delay_seconds": 5, "cache_policy": NO_CACHE}


def runner_for(cfg: PipelineConfig, run_id: str, stage: str) -> RayJobRunner:
    logger = get_run_logger()

    progress = artifacts.Progress(run_id, stage)

    def on_progress(event: dict) -> None:
        events.publish("progress", **{"stage": stage, **event})
        try:
            progress.update(int(event.get("done", 0)), int(event.get("total") or 1))
        except Exception as e:  # noqa: BLE001 - a progress bar must never fail a stage
            logger.warning(f"progress artifact: {e}")

    def on_status(submission_id: str, status: str) -> None:
        events.publish("job", stage=stage, submission_id=submission_id, status=status)

    return RayJobRunner(cfg, run_id, on_line=logger.info, on_progress=on_progress, on_status=on_status)


def entry_from(stage: str, outcomes: list[JobOutcome], started_at: str, summary: dict | None = None) -> dict[str, Any]:
    """A record entry whose verdict is the last job's result (earlier jobs are evidence)."""
    last = outcomes[-1].result
    return stage_entry(
        stage=stage, status=last.status, failure_class=last.failure_class.value if last.failure_class else None,
        cause=last.cause, summary=summary if summary is not None else last.summary,
        jobs=[o.to_record() for o in outcomes], started_at=started_at, ended_at=now_iso(),
    )


def job_name(stage: str, invocation: int) -> str:
    """The first invocation of a run uses the stage's name; a later rerun (--only) gets fresh Ray jobs
    and result folders ('evaluate-r2'), while a Prefect retry within one invocation re-attaches."""
    return stage if invocation <= 1 else f"{stage}-r{invocation}"


def run_single_job(cfg: PipelineConfig, run_id: str, stage: str, spec: JobSpec) -> dict[str, Any]:
    started = now_iso()
    events.publish("stage", stage=stage, status="running")
    outcome = runner_for(cfg, run_id, stage).run(spec)
    return entry_from(stage, [outcome], started)


@task(name="verify", **RETRY)
def verify(cfg: PipelineConfig, run_id: str, invocation: int = 1) -> dict[str, Any]:
    """Versions, GPUs and environment digest on every node; shared storage writable from a worker.

    On EKS the same findings also cover the Kubernetes objects (RayCluster ready, pods on the pinned
    digest, num-gpus == pod GPU limit == GPUs Ray advertises, GPU/EFA devices on the nodes), read
    with the pipeline's own read-only service account.
    """
    spec = JobSpec(job_name("verify", invocation), "training.verify", cfg.timeouts.verify)
    entry = run_single_job(cfg, run_id, "verify", spec)
    if cfg.cluster.backend == "eks":
        add_kubernetes_half(cfg, entry)
    return entry


def add_kubernetes_half(cfg: PipelineConfig, entry: dict[str, Any]) -> None:
    from tuneproof.core.findings import errors
    from tuneproof.control.kube import fetch_cluster_objects
    from tuneproof.control.kube_checks import check_cluster, summarize
    from tuneproof.core.results import StageFailure

    summary = entry["summary"]
    try:
        objects = {**fetch_cluster_objects(cfg.cluster.kubernetes), "ray_nodes": summary.get("nodes") or []}
    except StageFailure as e:
        entry.update(status="failed", failure_class=e.failure_class.value, cause=e.cause)
        return
    findings = check_cluster(objects, cfg)
    summary["kubernetes"] = {"findings": [f.to_json() for f in findings], **summarize(objects, cfg)}
    summary.setdefault("cluster", {})["image_digest"] = kube_image_digest(summary["kubernetes"])
    failed = errors(findings)
    if failed and entry["status"] == "succeeded":
        more = f" (+{len(failed) - 1} more)" if len(failed) > 1 else ""
        entry.update(status="failed", failure_class="infrastructure", cause=failed[0].line() + more)


def kube_image_digest(kube_summary: dict[str, Any]) -> str | dict | None:
    """The one digest every Ray pod runs, or the per-pod map when they differ."""
    digests = kube_summary.get("image_digests") or {}
    values = {d for d in digests.values() if d}
    return values.pop() if len(values) == 1 else (digests or None)


@task(name="connectivity", **RETRY)
def connectivity(cfg: PipelineConfig, run_id: str, invocation: int = 1) -> dict[str, Any]:
    """All ranks join collectives; all-reduce bandwidth by size; the transport NCCL really used."""
    job = job_name("connectivity", invocation)
    env = nccl_env(f"{run_id}-{job}") if cfg.train.use_gpu else {}
    spec = JobSpec(job, "training.connectivity", cfg.timeouts.connectivity, env=env)
    return run_single_job(cfg, run_id, "connectivity", spec)


@task(name="data", **RETRY)
def data(cfg: PipelineConfig, run_id: str, invocation: int = 1) -> dict[str, Any]:
    """Read, template, tokenize, split and write the dataset content-addressed (or reuse it)."""
    spec = JobSpec(job_name("data", invocation), "training.data_prep", cfg.timeouts.data)
    return run_single_job(cfg, run_id, "data", spec)


@task(name="finetune", **RETRY)
def finetune(cfg: PipelineConfig, run_id: str, dataset_path: str, invocation: int = 1) -> dict[str, Any]:
    """FSDP2 fine-tune with DCP checkpoints on shared storage, then a Hugging Face export."""
    spec = JobSpec(job_name("finetune", invocation), "training.finetune", cfg.timeouts.finetune,
                   params={"dataset": dataset_path})
    return run_single_job(cfg, run_id, "finetune", spec)


@task(name="evaluate", **RETRY)
def evaluate(cfg: PipelineConfig, run_id: str, dataset_path: str, candidate_path: str,
             invocation: int = 1) -> dict[str, Any]:
    """Candidate vs base vs incumbent on the held-out split, and the gate decision."""
    pointer, _ = registry.read_pointer(Storage.from_config(cfg.storage), cfg.model.name)
    incumbent = {"version": pointer["version"], "path": pointer["path"]} if pointer else None
    params = {"dataset": dataset_path, "candidate": candidate_path, "incumbent": incumbent}
    spec = JobSpec(job_name("evaluate", invocation), "eval.evaluate_job", cfg.timeouts.evaluate, params=params)
    return run_single_job(cfg, run_id, "evaluate", spec)
