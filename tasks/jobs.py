"""Prefect tasks for the job-backed stages: build the job request, run it, return the stage's record entry.

The flow hands every stage task one StageCall: the config, the run, which invocation this is, the
stage's timeout and summary model from the stage table (tuneproof/control/stages.py), and the earlier stages'
outputs the table says it needs. Classified failures are values (a failed StageEntry), not
exceptions, so Prefect retries (retries=1) only cover the unexpected — a lost connection while
following a job — and a retry re-attaches to the same Ray submission.

A simple stage is a job module plus the generic `job_stage`; verify, connectivity and evaluate add
what only they need (the Kubernetes half, NCCL logging, the incumbent from the registry).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from prefect import get_run_logger, task
from prefect.cache_policies import NO_CACHE

from tasks import artifacts, events
from tasks.rayjob import JobSpec, RayJobRunner
from tuneproof.control import cost, registry
from tuneproof.control import stages as table
from tuneproof.control.record import JobEntry, RunRecord, StageEntry
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ProgressEvent
from tuneproof.core.findings import errors
from tuneproof.core.results import FailureClass, StageFailure, first_and_more, now_iso
from tuneproof.core.rowlog import read_rows
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import Summary, VerifySummary
from tuneproof.core.summaries_training import METRICS_LOG, FinetuneSummary
from tuneproof.core.transport import nccl_env

RETRY: dict[str, Any] = {"retries": 1, "retry_delay_seconds": 5, "cache_policy": NO_CACHE}


@dataclass(frozen=True)
class StageCall:
    """What the flow hands a stage's task."""

    stage: str
    cfg: PipelineConfig
    run_id: str
    invocation: int
    """1 for the run's first flow run; later invocations (reruns with --only) get fresh Ray jobs."""
    timeout_s: int
    summary: type[Summary]
    inputs: dict[str, Any]
    """Outputs of earlier stages, by the names in the stage's `needs`."""
    record: RunRecord
    """The run's record as it stood before this stage (read-only: the flow writes it)."""
    resumes: int | None = None
    """An earlier invocation whose interrupted attempt this call continues: its Ray job names and Ray Train
    run are reused (a stopped job gets a new attempt id; a job still running is attached to)."""

    @property
    def job_invocation(self) -> int:
        """The invocation whose names this call's jobs run under: its own, or the one it resumes."""
        return self.resumes or self.invocation

    def job_name(self, suffix: str = "") -> str:
        """The first invocation uses the stage's name ('evaluate'); a rerun gets fresh Ray jobs and result
        folders ('evaluate-r2'), while a Prefect retry within one invocation re-attaches."""
        name = f"{self.stage}-{suffix}" if suffix else self.stage
        return name if self.job_invocation <= 1 else f"{name}-r{self.job_invocation}"

    def spec(
        self,
        module: str,
        params: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        suffix: str = "",
        summary: type[Summary] | None = None,
    ) -> JobSpec:
        """A job of this stage; its summary is the stage's model unless the job is another stage's kind
        (the resume test runs fine-tune jobs)."""
        return JobSpec(self.job_name(suffix), module, self.timeout_s, summary or self.summary, params or {}, env or {})


def runner_for(call: StageCall) -> RayJobRunner:
    """A job runner whose log lines go to the Prefect log and whose progress feeds the display and artifact."""
    logger = get_run_logger()
    progress = artifacts.Progress(call.run_id, call.stage)

    def on_progress(event: ProgressEvent) -> None:
        events.publish("progress", stage=call.stage, event=event)
        try:
            progress.update(event)
        except Exception as e:  # noqa: BLE001 - a progress bar must never fail a stage
            logger.warning(f"progress artifact: {e}")

    def on_status(submission_id: str, status: str) -> None:
        events.publish("job", stage=call.stage, submission_id=submission_id, status=status)

    return RayJobRunner(
        call.cfg,
        call.run_id,
        on_line=logger.info,
        on_progress=on_progress,
        on_status=on_status,
        on_wait=logger.warning,  # shown on the terminal too, which hides the job's own log lines
        invocation=call.invocation,
    )


def run_single_job(call: StageCall, spec: JobSpec) -> StageEntry:
    """Run one job and return an entry whose verdict is the job's own result."""
    started = now_iso()
    events.publish("stage", stage=call.stage, status="running")
    runner = runner_for(call)
    job = runner.run(spec)
    # An earlier try of this task whose job left no verdict is replaced, and listed: it was paid for.
    return StageEntry.from_jobs(call.stage, job.result, [*runner.superseded, job], started)


def entry_from_jobs(call: StageCall, jobs: list[JobEntry], started: str, summary: Summary | None = None) -> StageEntry:
    """An entry whose verdict is the last job's result (earlier jobs are evidence)."""
    return StageEntry.from_jobs(call.stage, jobs[-1].result, jobs, started, summary)


@task(name="stage-job", **RETRY)
def run_job_stage(call: StageCall, module: str, params: dict[str, Any]) -> StageEntry:
    """A stage that is one Ray job running `python -m <module>`."""
    return run_single_job(call, call.spec(module, params))


def job_stage(
    module: str, params: Callable[[dict[str, Any]], dict[str, Any]] = dict
) -> Callable[[StageCall], StageEntry]:
    """The run function of a stage that is one job: its params are built from the stage's inputs."""

    def run(call: StageCall) -> StageEntry:
        return run_job_stage.with_options(name=call.stage)(call, module, params(call.inputs))

    run.__name__ = f"job_stage[{module}]"
    return run


def finetune(call: StageCall) -> StageEntry:
    """The fine-tune job under this invocation's Ray Train run name (see finetune_run_name), or, continuing an
    interrupted fine-tune, under that attempt's name: Ray Train resumes it from its latest complete checkpoint."""
    run_name = finetune_run_name(call.record, call.run_id, call.job_invocation, call.cfg.train.continue_previous)
    params = {
        "dataset": call.inputs["dataset_path"],
        "run_name": run_name,
        "invocation": call.invocation,
    }
    if call.cfg.train.use_gpu and (capacity := verified_gpu_memory(call.record)) is not None:
        params["gpu_memory_bytes"] = capacity  # the job refuses a configuration that cannot fit it
    entry = run_job_stage.with_options(name=call.stage)(call, "training.finetune", params)
    return with_logged_steps(Storage.from_config(call.cfg.storage), call.run_id, entry)


def with_logged_steps(storage: Storage, run_id: str, entry: StageEntry) -> StageEntry:
    """Each fine-tune job that left no summary (stopped, lost, failed inside Ray Train) with the steps its metrics
    log shows it trained between its submission and its end: what it paid for (tuneproof.control.cost). A log
    that cannot be read leaves it None: the cost then counts the steps the checkpoints prove."""
    jobs = []
    for job in entry.jobs:
        if job.result.summary is None:
            try:
                rows = read_rows(storage, "runs", run_id, "stages", job.result.stage, METRICS_LOG)
            except (OSError, ValueError) as e:  # the stage's verdict stands; only this evidence is missing
                logging.getLogger("tuneproof.cost").warning(f"{job.submission_id}: its metrics log cannot be read: {e}")
                rows = None
            if rows is not None:
                # Ray's times where it gave them: a job this flow attached to trained before the flow watched it.
                start, end = job.ray_started_at or job.submitted_at, job.ray_ended_at or job.ended_at
                job = job.model_copy(update={"logged_steps": cost.logged_steps(rows, start, end)})
        jobs.append(job)
    return entry.model_copy(update={"jobs": jobs})


def verified_gpu_memory(record: RunRecord) -> int | None:
    """The smallest GPU memory the run's verify stage reported; None without one. Pure."""
    from tuneproof.core.fit import gpu_capacity

    entry = record.stages.get("verify")
    summary = entry.summary_as(VerifySummary) if entry else None
    return gpu_capacity(summary.nodes) if summary else None


def finetune_run_name(record: RunRecord, run_id: str, invocation: int, continue_previous: bool) -> str:
    """`<run>` for the run's first invocation, `<run>-r<N>` for invocation N: a rerun trains from the base
    model under its own name instead of silently restoring the previous run's final checkpoint.
    With train.continue_previous the latest fine-tune's run name is reused, so Ray Train resumes it; a
    fine-tune that failed without a summary (e.g. its storage filled up) is continued under the name its
    invocation trained with, so its complete checkpoints are resumed rather than thrown away. Pure."""
    if continue_previous:
        entries = [e for e in [*record.superseded, record.stages.get("finetune")] if e and e.stage == "finetune"]
        if entries:
            summary = entries[-1].summary_as(FinetuneSummary)
            return summary.run_name if summary else finetune_run_name(record, run_id, entries[-1].invocation, False)
    return run_id if invocation <= 1 else f"{run_id}-r{invocation}"


@task(name="verify", **RETRY)
def verify(call: StageCall) -> StageEntry:
    """Versions, GPUs and environment digest on every node; shared storage writable from a worker.

    On EKS the same findings also cover the Kubernetes objects (RayCluster ready, pods on the pinned
    digest, num-gpus == pod GPU limit == GPUs Ray advertises, GPU/EFA devices on the nodes), read
    with the pipeline's own read-only service account.
    """
    entry = run_single_job(call, call.spec("training.verify"))
    if call.cfg.cluster.backend == "eks":
        entry = add_kubernetes_half(call.cfg, entry)
    return entry


def add_kubernetes_half(cfg: PipelineConfig, entry: StageEntry) -> StageEntry:
    from tuneproof.control.kube import fetch_cluster_objects
    from tuneproof.control.kube_checks import check_cluster, summarize

    summary = entry.summary_as(VerifySummary)
    try:
        objects = fetch_cluster_objects(cfg.cluster.kubernetes)
    except StageFailure as e:
        return entry.model_copy(update={"status": "failed", "failure_class": e.failure_class, "cause": e.cause})
    if summary is None:
        return entry  # the Ray half failed before it collected anything: its cause stands
    objects["ray_nodes"] = [n.model_dump(mode="json") for n in summary.nodes]
    findings = check_cluster(objects, cfg)
    kube = {"findings": [f.to_json() for f in findings], **summarize(objects, cfg)}
    cluster = summary.cluster.model_copy(update={"image_digest": kube_image_digest(kube)})
    summary = summary.model_copy(update={"kubernetes": kube, "cluster": cluster})
    update: dict[str, Any] = {"summary": summary.to_json()}
    failed = errors(findings)
    if failed and entry.ok:
        update.update(
            status="failed", failure_class=FailureClass.infrastructure, cause=first_and_more([f.line() for f in failed])
        )
    return entry.model_copy(update=update)


def kube_image_digest(kube_summary: dict[str, Any]) -> str | dict | None:
    """The one digest every Ray pod runs, or the per-pod map when they differ."""
    digests = kube_summary.get("image_digests") or {}
    values = {d for d in digests.values() if d}
    return values.pop() if len(values) == 1 else (digests or None)


@task(name="connectivity", **RETRY)
def connectivity(call: StageCall) -> StageEntry:
    """All ranks join collectives; all-reduce bandwidth by size; the transport NCCL really used."""
    job = call.job_name()
    env = nccl_env(f"{call.run_id}-{job}") if call.cfg.train.use_gpu else {}
    return run_single_job(call, call.spec("training.connectivity", env=env))


@task(name="evaluate", **RETRY)
def evaluate(call: StageCall) -> StageEntry:
    """Candidate vs base vs incumbent on the held-out split, and the gate decision.

    The incumbent is the production model when the job is built (or, when that is this fine-tune's own
    promotion, the version it replaced: stages.incumbent, which evaluate's inputs key reads too); promotion
    later checks that it is still the production model (compare-and-swap on the pointer).
    """
    try:
        pointer, _ = registry.read_pointer(Storage.from_config(call.cfg.storage), call.cfg.model.name)
    except registry.RegistryUnreadable as e:  # no incumbent anyone can name: nothing is scored against a guess
        return StageEntry.failed(call.stage, FailureClass.infrastructure, str(e), started_at=now_iso())
    found = table.incumbent(pointer, call.record)
    incumbent = {"version": found.version, "path": found.path} if found else None
    params = {
        "dataset": call.inputs["dataset_path"],
        "candidate": call.inputs["export_path"],
        "incumbent": incumbent,
        "suites": [suite.to_json() for suite in call.inputs["suites"]],  # what the data stage measured: the job checks
    }
    return run_single_job(call, call.spec("eval.evaluate_job", params))
