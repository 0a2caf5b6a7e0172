"""The finetune stage: fine-tune with FSDP2 under Ray Train, sharded checkpoints on shared storage, HF export.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m training.finetune    (submitted by tasks/ as a Ray job)

The driver (this process) runs a TorchTrainer over train.num_workers workers with Ray Train
storage at runs/<run>/train/<run_name>; the same name and storage path resume the run (Ray Train
V2). Each worker: load the base model -> FSDP2 -> restore the latest complete checkpoint, else
params.init_from, else start fresh -> train (warmup + cosine, grad accumulation, clipping),
checkpointing every train.checkpoint_every steps, at the end and, with train.checkpoint_on_preemption, at
Ray's notice that a node of the group is being drained (training.preemption) -> rank 0 exports a Hugging
Face model to runs/<run>/model. A checkpoint's shards are written and hashed in the background (asynchronous
DCP save) while the next step trains; it is completed (the marker, then Ray Train registers it) right after that step,
so an unfinished save never has a marker, and training stalls by the state's copy to CPU memory plus
whatever of the write outlasts one step (bench/checkpoint.py measures it in steps). Workers hand results back through storage, never as exceptions
crossing Ray: runs/<run>/stages/<job>/metrics.jsonl (every step) and outcome.json (how it ended).

Params (ctx.params), checked by TrainParams: dataset (required), run_name, init_from, max_steps,
checkpoint_every, export, hold_after_checkpoint_step, interrupt_after_checkpoint_step, first_step_marker,
inject_nan_at_step, invocation.
A job whose run already holds a complete checkpoint at max_steps would train nothing: it is refused
(a modeling failure naming train.max_steps and train.continue_previous) instead of re-exporting old weights.
"""

from __future__ import annotations

import contextlib
import math
import os
import posixpath
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NoReturn

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training import fault_hooks, jobkit
from training.checkpointing import (
    CheckpointRef,
    ShardsInFlight,
    StagingBuffers,
    TrainingProgress,
    capture_rng,
    check_complete,
    checkpoint_dir_name,
    complete_checkpoints,
    find_checkpoints,
    finish_saving_shards,
    latest_complete_checkpoint,
    load_shards,
    local_copy,
    read_step,
    remove_unmarked,
    restore_rng,
    seed_everything,
    set_aside_unusable_ray_snapshot,
    skip_unusable,
    start_saving_shards,
    write_hf_export,
    write_marker,
)
from training.jobkit import JobContext, run_stage
from training.lora import ADAPTER_DIR
from training.modeling import base_model_facts
from training.preemption import NOTICES, NoticeWatch
from training.schedule import WarmupCosine
from tuneproof.core.fit import refusal
from tuneproof.core.markers import Digests, ExportUnverified, read_export_manifest
from tuneproof.core.results import FailureClass, StageFailure, one_line
from tuneproof.core.rowlog import append_rows, read_rows, remove_log, rows_sha256
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import (
    METRICS_LOG,
    FinetuneSummary,
    FitEstimate,
    RankMemory,
    latest_rows,
    ledger_points,
    loss_curve,
    thin,
)

if TYPE_CHECKING:  # torch and the data module load inside workers only
    import torch

    from training.train_data import StepBatches

OUTCOME = "outcome.json"
METRICS = METRICS_LOG
INTERRUPTED = "interrupted.json"
"""Written by rank 0 just before a planned interruption kills every rank: {step, time}."""


class TrainParams(BaseModel):
    """What the submitting task may set for one fine-tune job; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    """Storage path of the prepared dataset, datasets/<name>/<hash>."""
    run_name: str
    """Ray Train run name (RunConfig.name); the same name resumes. Defaults to the run id."""
    init_from: str | None = None
    """URI of a complete checkpoint to start from when run_name has none of its own."""
    max_steps: int = Field(ge=1)
    """Step to stop after; defaults to train.max_steps. The LR schedule always spans train.max_steps,
    so a run stopped early or continued past the end replays the same rates step for step."""
    checkpoint_every: int = Field(ge=1)
    export: bool = True
    hold_after_checkpoint_step: int | None = Field(None, ge=1)
    """After this step's checkpoint is complete, every rank sleeps until the job is stopped from outside."""
    interrupt_after_checkpoint_step: int | None = Field(None, ge=1)
    """After this step's checkpoint is complete, every rank SIGKILLs itself (the resume test's interruption).
    The run's max_failures is 0 then: the kill ends the run, and the restart under test is a new one."""
    first_step_marker: bool = False
    """Record restored_step and first_step_completed_at (unix time) in the summary."""
    inject_nan_at_step: int | None = Field(None, ge=1)
    """Test hook: make the loss NaN at this step."""
    invocation: int | None = None
    """The run record's invocation this job belongs to; written into the export's manifest."""
    gpu_memory_bytes: int | None = Field(None, ge=1)
    """The smallest GPU the verify stage reported (the task reads it from the record); None: unknown."""

    @model_validator(mode="after")
    def _stop_on_a_checkpoint(self) -> TrainParams:
        stops = {"hold_after_checkpoint_step": self.hold_after_checkpoint_step}
        stops["interrupt_after_checkpoint_step"] = self.interrupt_after_checkpoint_step
        if None not in stops.values():
            raise ValueError("hold_after_checkpoint_step and interrupt_after_checkpoint_step do not combine")
        for name, step in stops.items():
            if step is not None and step % self.checkpoint_every and step != self.max_steps:
                raise ValueError(
                    f"{name} must be a checkpoint step (a multiple of checkpoint_every "
                    f"{self.checkpoint_every}, or max_steps {self.max_steps}), got {step}"
                )
        return self

    @classmethod
    def resolve(cls, ctx: JobContext) -> TrainParams:
        defaults = {
            "run_name": ctx.run_id,
            "max_steps": ctx.config.train.max_steps,
            "checkpoint_every": ctx.config.train.checkpoint_every,
        }
        return cls.model_validate({**defaults, **ctx.params})

    def export_dir(self, run_id: str) -> str:
        """runs/<run>/model for the run's own training; a differently named run exports beside it."""
        return "model" if self.run_name == run_id else f"model-{self.run_name}"


# ---------------------------------------------------------------- driver


def finetune(ctx: JobContext) -> FinetuneSummary:
    """Stage body: run the trainer, then read back what the workers wrote and summarize it."""
    from training.restarts import ATTEMPTS, FAILURES

    params = TrainParams.resolve(ctx)
    started = time.time()
    if params.init_from:
        require_complete(params.init_from, ctx.config.storage.endpoint_url, "params.init_from")
    run_parts = ctx.run_parts("train", params.run_name)
    found = find_checkpoints(ctx.storage, *run_parts)
    refuse_nothing_to_train(params, found.latest)
    fit = check_fit(ctx, params)
    if set_aside := set_aside_unusable_ray_snapshot(ctx.storage, *run_parts):
        jobkit.log(f"{set_aside}: the run resumes from its latest complete checkpoint")
    skipped = skip_unusable(ctx.storage, found, *run_parts)
    for s in skipped:
        done = f"set aside as {s.set_aside_as}" if s.set_aside_as else "left to be saved over"
        jobkit.log(f"skipped {s.name} ({s.reason}): {done}, out of Ray Train's snapshot: {s.dropped_from_ray}")
    for name in (OUTCOME, INTERRUPTED):  # an earlier job's ending says nothing of this one
        ctx.storage.remove(*ctx.stage_parts(name))
    for log in (ATTEMPTS, FAILURES, NOTICES):
        remove_log(ctx.storage, *ctx.stage_parts(log))
    error = run_trainer(ctx, params)
    if error is not None and (dropped := remove_unmarked(ctx.storage, *ctx.run_parts("train", params.run_name))):
        jobkit.log(f"removed checkpoints the failed run left without a completion marker: {', '.join(dropped)}")
    outcome = read_outcome(ctx, error)
    summary = summarize(ctx, params, outcome, time.time() - started, fit).model_copy(
        update={"skipped_checkpoints": skipped}
    )
    if outcome["status"] == "diverged":
        raise StageFailure(FailureClass.modeling, outcome["cause"], summary)
    return summary


def require_complete(uri: str, endpoint_url: str | None, what: str) -> None:
    problem = check_complete(Storage(uri, endpoint_url))
    if problem:
        raise StageFailure(FailureClass.infrastructure, f"{what} is not a complete checkpoint: {problem}")


def refuse_nothing_to_train(params: TrainParams, latest: CheckpointRef | None) -> None:
    """A run whose latest complete checkpoint is already at (or past) max_steps would train 0 steps."""
    if latest is not None and latest.step >= params.max_steps:
        raise StageFailure(
            FailureClass.modeling,
            f"Ray Train run {params.run_name} already has a complete checkpoint at step {latest.step} >= "
            f"max_steps {params.max_steps}: nothing to train. Raise train.max_steps to continue it "
            "(with train.continue_previous=true), or leave continue_previous false to train a fresh run",
        )


def run_trainer(ctx: JobContext, params: TrainParams) -> Exception | None:
    """TorchTrainer.fit over the configured workers; returns the training error, if any."""
    import ray.train
    from ray.train.torch import TorchTrainer

    from training.restarts import FailureLog

    cfg = ctx.config.train
    filesystem, storage_path = ctx.storage.train_storage(*ctx.run_parts("train"))
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"job": jobkit.encode_job(ctx.run_id, ctx.job, ctx.config, params.model_dump())},
        scaling_config=ray.train.ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu),
        run_config=ray.train.RunConfig(
            name=params.run_name,
            storage_path=storage_path,
            storage_filesystem=filesystem,
            checkpoint_config=ray.train.CheckpointConfig(num_to_keep=cfg.num_to_keep),
            # A planned interruption must end the run: the resume test restarts it as a new run.
            failure_config=ray.train.FailureConfig(
                max_failures=0 if params.interrupt_after_checkpoint_step else cfg.max_failures
            ),
            # Ray types callbacks as its V1 Callback; V2 takes (and checks for) a UserCallback.
            callbacks=[FailureLog(ctx.config.storage.root, ctx.config.storage.endpoint_url, ctx.stage_parts())],  # type: ignore[list-item]
        ),
    )
    try:
        trainer.fit()
    except ray.train.TrainingFailedError as e:
        return e
    return None


def read_outcome(ctx: JobContext, error: Exception | None) -> dict[str, Any]:
    """The workers' outcome.json; a classified failure in it wins over the bare Ray error."""
    outcome = (
        ctx.storage.read_json(*ctx.stage_parts(OUTCOME)) if ctx.storage.exists(*ctx.stage_parts(OUTCOME)) else None
    )
    if outcome and outcome["status"] == "failed":
        raise StageFailure(outcome["failure_class"], outcome["cause"])
    if error is not None:
        raise StageFailure(FailureClass.infrastructure, train_failure_cause(str(error), ctx.storage.uri("runs")))
    if outcome is None:
        raise StageFailure(
            FailureClass.infrastructure, f"training ended without writing {ctx.storage.uri(*ctx.stage_parts(OUTCOME))}"
        )
    return outcome


def train_failure_cause(error: str, where: str) -> str:
    """The failure's one-line cause; a full disk is named as such, with what to do. Pure."""
    if any(sign in error for sign in ("No space left on device", "ENOSPC", "[Errno 28]")):
        return (
            f"storage full: no space left on device (ENOSPC) writing under {where}; free space there or point "
            f"storage.root at a larger volume, then continue with train.continue_previous=true. "
            f"Ray Train: {one_line(error, 300)}"
        )
    return f"Ray Train run failed: {error}"


def check_fit(ctx: JobContext, params: TrainParams) -> FitEstimate | None:
    """On GPU, the configuration's memory per GPU estimated before any Ray Train run starts (training.memory);
    a configuration that cannot fit on the smallest GPU the verify stage reported is refused, naming both."""
    from training.memory import fit_estimate
    from training.modeling import load_config

    cfg = ctx.config
    if not cfg.train.use_gpu:
        return None
    model_config = load_config(cfg.model.source, cfg.model.revision, cfg.storage.endpoint_url)
    workers, seq_len = cfg.train.num_workers, cfg.data.max_seq_len
    fit = fit_estimate(model_config, cfg.train, seq_len, workers, gpu=True, capacity_bytes=params.gpu_memory_bytes)
    if cause := refusal(fit, cfg.train.micro_batch_size):
        raise StageFailure(FailureClass.infrastructure, cause)
    return fit


def summarize(
    ctx: JobContext, params: TrainParams, outcome: dict, seconds: float, fit: FitEstimate | None = None
) -> FinetuneSummary:
    from training.restarts import ATTEMPTS, FAILURES, restarts

    rows = read_metrics(ctx.storage, ctx.stage_parts(METRICS))
    run_parts = ctx.run_parts("train", params.run_name)
    checkpoints = sorted(complete_checkpoints(ctx.storage, *run_parts), key=lambda c: c.step)
    speeds = [r["tokens_per_s"] for r in latest_rows(rows)]
    mfus = [r["mfu"] for r in latest_rows(rows) if r.get("mfu") is not None]
    export = outcome.get("export_path")
    export_sha256 = export_content_hash(ctx.storage, export) if export else None
    restored = params.first_step_marker and outcome["restored_from"]
    return FinetuneSummary(
        run_name=params.run_name,
        train_storage_uri=ctx.storage.uri(*run_parts),
        checkpoints=checkpoints,
        latest_checkpoint=checkpoints[-1] if checkpoints else None,
        start_step=outcome["start_step"],
        restored_from=outcome["restored_from"],
        steps=outcome["steps"],
        **curve_fields(rows, posixpath.join(*ctx.stage_parts(METRICS))),
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        seconds=round(seconds, 3),
        export_path=export,
        export_uri=ctx.storage.uri(export) if export else None,
        export_sha256=export_sha256,
        invocation=params.invocation,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        restored_step=outcome["start_step"] if restored else None,
        first_step_completed_at=outcome["first_step_completed_at"] if restored else None,
        method=ctx.config.train.method,
        trainable_params=outcome["trainable_params"],
        total_params=outcome["total_params"],
        sharding=ctx.config.train.sharding,
        mesh=outcome.get("mesh"),
        adapter_path=posixpath.join(export, ADAPTER_DIR) if export and ctx.config.train.method == "lora" else None,
        memory=[RankMemory.model_validate(m) for m in outcome.get("memory", [])],
        fit_estimate=fit,
        restarts=restarts(
            read_rows(ctx.storage, *ctx.stage_parts(ATTEMPTS)),
            read_rows(ctx.storage, *ctx.stage_parts(FAILURES)),
            rows,
            read_rows(ctx.storage, *ctx.stage_parts(NOTICES)),
        ),
        base_model=base_model_facts(ctx.config.model.source),
    )


def curve_fields(rows: list[dict[str, Any]], metrics_path: str) -> dict[str, Any]:
    """The summary's loss and ledger fields from every metrics row. The record keeps at most CURVE_POINTS of
    each (its size must not grow with the steps); the log itself, named by path and hash, keeps them all. Pure."""
    curve = loss_curve(rows)
    return {
        "first_loss": curve[0][1] if curve else None,
        "final_loss": curve[-1][1] if curve else None,
        "loss_curve": thin(curve),
        "curve_steps": len(curve),
        "ledger": thin(ledger_points(rows)),
        "metrics_path": metrics_path,
        "metrics_sha256": rows_sha256(rows),
    }


def export_content_hash(storage: Storage, export: str) -> str:
    """The content hash in the export's manifest (just written by rank 0)."""
    try:
        return read_export_manifest(storage, export).content_sha256
    except ExportUnverified as e:
        raise StageFailure(FailureClass.infrastructure, str(e)) from None


def read_metrics(storage: Storage, parts: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every row every attempt of this job logged, in order (a replayed step's row comes after the first)."""
    return read_rows(storage, *parts)


# ---------------------------------------------------------------- workers


@dataclass
class Worker:
    """Everything one rank trains with; built once by `setup`."""

    ctx: JobContext
    params: TrainParams
    rank: int
    world_size: int
    device: torch.device
    model: torch.nn.Module
    """The FSDP2-sharded model."""
    optimizer: torch.optim.Optimizer
    batches: StepBatches
    schedule: WarmupCosine
    flops_per_token: float
    """Model FLOPs per trained token (training.flops), for MFU."""
    peak_flops: float | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0: the rows logged since the last flush, which appends them to metrics.jsonl."""
    metrics_chunk: int | None = None
    """On S3, the number of this worker's last metrics chunk (None: list the chunks once to find it)."""
    restored_from: str | None = None
    attempt: int = 0
    """Which start of the worker group this is within the job (0 first; more after Ray Train restarts)."""
    first_step_completed_at: float | None = None
    param_counts: tuple[int, int] = (0, 0)
    """(trainable, total) parameters of the model as set up (base + adapters under LoRA)."""
    mesh: list[int] = field(default_factory=list)
    """The device mesh's shape the model is sharded on (training.fsdp.mesh_shape)."""
    save_group: Any = None
    """A gloo process group of the checkpoint writer's own (the async DCP save's collectives run on it)."""
    saving: ShardsInFlight | None = None
    """The checkpoint whose shards are being written in the background; not complete, no marker yet."""
    staging: StagingBuffers = field(default_factory=StagingBuffers)
    """CPU memory each asynchronous save copies the state into, kept across saves (one save at a time)."""
    ledger: str | None = ""
    """The data-order ledger after the last step trained (training.train_data.fold_ledger); "" before step 1."""
    samples: str = ""
    """The last step's sample ids, as their digest (every rank's)."""
    notices: NoticeWatch = field(default_factory=lambda: NoticeWatch(enabled=False))
    """Ray's preemption notices (train.checkpoint_on_preemption), asked every few steps."""

    def log(self, message: str) -> None:
        if self.rank == 0:
            jobkit.log(message)

    @property
    def storage(self) -> Storage:
        return self.ctx.storage

    @property
    def run_parts(self) -> tuple[str, ...]:
        return self.ctx.run_parts("train", self.params.run_name)

    @property
    def lora(self) -> bool:
        """Only the adapters train: checkpoints hold them (and their optimizer state), not the frozen base."""
        return self.ctx.config.train.method == "lora"


def train_loop(loop_config: dict) -> None:
    """Per-worker body under Ray Train: the fine-tune's story."""
    import torch.distributed as dist

    from training.restarts import begin_attempt

    ctx = jobkit.load_context({jobkit.ENV_VAR: loop_config["job"]})
    params = TrainParams.model_validate(ctx.params)
    with jobkit.worker_reads_saved(ctx, dist.get_rank()), outcome_on_failure(ctx, dist.get_rank()):
        w = setup(ctx, params)
        start = restore(w, resolve_start(w))
        if w.rank == 0:
            w.attempt = begin_attempt(w.storage, ctx.stage_parts(), start, w.restored_from)
        for step in range(start + 1, params.max_steps + 1):
            stats = train_step(w, step)
            account_samples(w, step)
            complete_checkpoint(w)  # the previous step's save was written while this step ran
            fault_hooks.after_step(w.rank, step)
            record(w, step, stats, start)
            if cause := divergence(stats["loss"], step, ctx.config.train.divergence_loss):
                return finish(w, start, step, status="diverged", cause=cause)
            if step % params.checkpoint_every == 0 or step == params.max_steps:
                save_checkpoint(w, step)
            act_on_notice(w, step)
            if step == params.hold_after_checkpoint_step:
                hold(w, step)
            if step == params.interrupt_after_checkpoint_step:
                interrupt(w, step)
        complete_checkpoint(w)
        last = max(start, params.max_steps)
        export = export_model(w, last) if params.export else None
        finish(w, start, last, status="completed", export_path=export)


@contextlib.contextmanager
def outcome_on_failure(ctx: JobContext, rank: int):
    """A classified failure is written to outcome.json (rank 0); Ray only sees that the run stopped."""
    try:
        yield
    except StageFailure as f:
        if rank == 0:
            ctx.storage.write_json(
                {"status": "failed", "failure_class": f.failure_class.value, "cause": f.cause},
                *ctx.stage_parts(OUTCOME),
            )
        raise RuntimeError(f"{f.failure_class.value}: {f.cause}") from None


def setup(ctx: JobContext, params: TrainParams) -> Worker:
    import torch
    import torch.distributed as dist
    from transformers.utils import logging as hf_logging

    from training.flops import ModelShape, train_flops_per_token
    from training.fsdp import local_world_size, mesh_shape, peak_flops, shard_model, worker_device
    from training.lora import parameter_counts
    from training.modeling import load_model
    from training.step import build_optimizer, compile_layers
    from training.train_data import BatchLayout, StepBatches, load_examples

    hf_logging.disable_progress_bar()  # tqdm bars make unreadable job logs
    cfg, rank, world = ctx.config.train, dist.get_rank(), dist.get_world_size()
    device = worker_device(cfg.use_gpu)
    # fp32 master weights everywhere; on GPU FSDP2 computes in bf16.
    model = load_model(
        ctx.config.model.source, ctx.config.model.revision, ctx.config.storage.endpoint_url, dtype=torch.float32
    )
    # Attention counted at data.max_seq_len: an upper bound when the sequences are shorter.
    flops_per_token = train_flops_per_token(ModelShape.from_hf(model.config), ctx.config.data.max_seq_len)
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0
    if cfg.method == "lora":
        from training.lora import apply_lora

        apply_lora(model, cfg.lora, cfg.seed)  # in place: `model` now carries the adapters, its base frozen
    counts = parameter_counts(model)
    layout = BatchLayout(cfg.micro_batch_size, cfg.grad_accum_steps, world)
    batches = StepBatches(load_examples(ctx.storage, params.dataset, "train"), layout, cfg.seed, rank, pad_id)
    probe_first_batch(model.to(device), batches, rank)  # the fp32 model, before it is sharded or compiled
    if cfg.compile:
        compile_layers(model)
    shard_model(model, device, cfg.activation_checkpointing, cfg.sharding, cfg.shard_group_size).train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(trainable, cfg.lr, cfg.weight_decay, device)
    schedule = WarmupCosine(cfg.lr, cfg.warmup_steps, cfg.max_steps, cfg.min_lr_ratio)
    w = Worker(
        ctx, params, rank, world, device, model, optimizer, batches, schedule, flops_per_token, peak_flops(device)
    )
    w.param_counts = counts
    check_checkpoint_home(w)
    w.mesh = list(mesh_shape(cfg.sharding, world, cfg.shard_group_size, local_world_size()))  # as shard_model built it
    w.save_group = dist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
    w.notices = NoticeWatch.start(cfg.checkpoint_on_preemption, w.log)
    w.log(
        f"method {cfg.method}: {counts[0]:,} of {counts[1]:,} parameters train; {cfg.sharding} sharding, mesh {w.mesh}"
    )
    return w


def probe_first_batch(model, batches: StepBatches, rank: int) -> None:
    """With packed rows, step 1's first micro-batch goes through training.packing's probe on the fp32
    model before it is sharded (on GPU FSDP2 computes in bf16): a leak across examples fails the stage."""
    from training.packing import probe_packing

    rows = batches.micro_examples(1)[0]
    if any(row.packed for row in rows):
        worst = probe_packing(model, rows, batches.pad_id)
        if rank == 0:
            jobkit.log(f"packing probe: per-example loss packed vs alone agrees within {worst:.2g} on the first batch")


def check_checkpoint_home(w: Worker) -> None:
    """Shards are written where Ray Train keeps the run's checkpoints, and Ray registers them in place
    (complete_checkpoint): the two must be one directory, or Ray would restore from a path with no files."""
    import ray.train

    ray_dir = ray.train.get_context().get_storage().experiment_fs_path.rstrip("/")
    ours = w.storage.path(*w.run_parts).rstrip("/")
    if ray_dir != ours:
        raise StageFailure(
            FailureClass.infrastructure,
            f"Ray Train keeps run {w.params.run_name}'s checkpoints at {ray_dir}, but its shards are written to "
            f"{ours}: the RunConfig storage path and storage.root disagree",
        )


def resolve_start(w: Worker) -> CheckpointRef | None:
    """The latest complete checkpoint of this run, else params.init_from, else None (fresh).

    Ray's own latest checkpoint is always complete when this starts: Ray registers a checkpoint only after its
    marker (complete_checkpoint), and the job's driver takes any that failed its check since out of Ray's
    bookkeeping (skip_unusable). One that fails here changed during this Ray Train run: the run stops, naming
    it, and its continuation skips it. A newer complete checkpoint than Ray's (the kill fell between the
    marker and Ray's registration) is resumed from: Ray never held it, so nothing of Ray's points at its step.
    """
    import ray.train

    latest = latest_complete_checkpoint(w.storage, *w.run_parts)
    reported = ray.train.get_checkpoint()
    if reported is not None:
        name = posixpath.basename(reported.path.rstrip("/"))
        problem = check_complete(w.storage, *w.run_parts, name)
        if problem and latest is None:
            raise StageFailure(
                FailureClass.infrastructure,
                f"run {w.params.run_name} has no complete checkpoint to resume from: {problem}",
            )
        if problem and latest is not None:
            # It passed the job's check at start, so it changed while this Ray Train run held it. Resuming from
            # an older one here would save its step again under the name Ray's checkpoint manager still holds
            # (and later prunes); a new job takes it out of Ray's bookkeeping first (skip_unusable).
            raise StageFailure(
                FailureClass.infrastructure,
                f"Ray Train's latest checkpoint failed its check during run {w.params.run_name}; continue the run "
                f"(a new job skips it and resumes from {latest.uri}): {problem}",
            )
    if latest is not None:
        if w.params.init_from:
            w.log(f"run {w.params.run_name} has its own checkpoints; params.init_from {w.params.init_from} is not used")
        return latest
    if w.params.init_from:
        return CheckpointRef(
            read_step(Storage(w.params.init_from, w.ctx.config.storage.endpoint_url)), w.params.init_from
        )
    return None


def restore(w: Worker, ref: CheckpointRef | None) -> int:
    """Load the checkpoint's model, optimizer, RNG and progress; returns the step it was taken at."""
    if ref is None:
        seed_everything(w.ctx.config.train.seed + w.rank)
        w.log(f"starting fresh from the base model {w.ctx.config.model.source}")
        return 0
    with local_copy(ref.uri, w.ctx.config.storage.endpoint_url) as local_dir:
        progress = load_shards(w.model, w.optimizer, local_dir, w.rank, trainable_only=w.lora)
    if progress.world_size != w.world_size:
        w.log(
            f"checkpoint was written by {progress.world_size} ranks, now {w.world_size}: DCP reshards the state; "
            "ranks the checkpoint did not have start from rank 0's RNG state, so replay is not exact"
        )
    restore_rng(progress.rng)
    w.ledger = progress.ledger
    fault_hooks.after_restore(w.batches, progress.step)
    w.restored_from = ref.uri
    w.log(f"RESUMED at step {progress.step} from {ref.uri}")
    return progress.step


def account_samples(w: Worker, step: int) -> None:
    """Fold the ids of the samples every rank trained on at `step` into the data-order ledger (collective).

    The ids are what each rank's batches were cut from, gathered rather than recomputed from the plan, so a
    sampler that drifted on one rank (or after a restore) shows in the ledger."""
    import torch.distributed as dist

    from training.train_data import fold_ledger, samples_digest

    every_rank: list[list[int]] = [[] for _ in range(w.world_size)]
    dist.all_gather_object(every_rank, w.batches.sample_ids(step))
    ids = [i for rank_ids in every_rank for i in rank_ids]
    w.samples, w.ledger = samples_digest(ids), fold_ledger(w.ledger, step, ids)


def train_step(w: Worker, step: int) -> dict[str, Any]:
    """One optimizer step over grad_accum_steps micro-batches (training.step); the loss is the mean over all
    target tokens."""
    from training.flops import mfu
    from training.step import global_counts, optimizer_step

    began = time.perf_counter()
    lr = w.schedule.lr_at(step)
    for group in w.optimizer.param_groups:
        group["lr"] = lr
    micro = [{k: v.to(w.device) for k, v in b.items()} for b in w.batches.micro_batches(step)]
    targets, tokens = global_counts(micro, w.device)
    poison = step == w.params.inject_nan_at_step
    loss, grad_norm = optimizer_step(
        w.model, w.optimizer, micro, targets, w.ctx.config.train.max_grad_norm, poison=poison
    )
    seconds = time.perf_counter() - began
    stats = {
        "loss": loss,
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": tokens / seconds,
        "step_seconds": seconds,
    }
    if w.peak_flops:
        stats["mfu"] = mfu(w.flops_per_token, tokens / seconds / w.world_size, w.peak_flops)
    return stats


def divergence(loss: float, step: int, limit: float) -> str | None:
    """The failure cause when a loss means training has diverged. Pure."""
    if not math.isfinite(loss):
        return f"loss is {loss} at step {step}"
    if loss > limit:
        return f"loss is {loss:.4g} at step {step}, above train.divergence_loss {limit}"
    return None


def record(w: Worker, step: int, stats: dict[str, Any], start: int) -> None:
    """Rank 0 keeps the step's metrics row; prints progress and appends to metrics.jsonl every log_every steps."""
    if w.rank != 0:
        return
    row: dict[str, Any] = {"step": step, **{k: finite_or_none(v) for k, v in stats.items()}}
    row |= {"time": time.time(), "attempt": w.attempt, "samples": w.samples, "ledger": w.ledger}
    w.metrics.append(row)
    if step == start + 1:
        w.first_step_completed_at = row["time"]
    if step % w.ctx.config.train.log_every == 0 or step == w.params.max_steps:
        shown = {k: row[k] for k in ("loss", "lr", "grad_norm", "tokens_per_s", "mfu") if k in row}
        jobkit.progress("finetune", step, w.params.max_steps, **shown)
        flush_metrics(w)


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN: a non-finite metric is written as null."""
    return value if math.isfinite(value) else None


def flush_metrics(w: Worker) -> None:
    """Rank 0 appends the rows logged since the last flush: the cost is theirs, not the whole log's."""
    if w.rank == 0 and w.metrics:
        after = None if w.metrics_chunk is None else w.metrics_chunk + 1
        w.metrics_chunk = append_rows(w.storage, w.metrics, *w.ctx.stage_parts(METRICS), chunk=after)
        w.metrics = []


def save_checkpoint(w: Worker, step: int) -> None:
    """Start this step's checkpoint: every rank's state is copied to memory now and its DCP shards are
    written into the checkpoint's storage directory in the background while the next step trains;
    `complete_checkpoint` finishes it."""
    flush_metrics(w)  # metrics survive an interruption at least up to this checkpoint
    complete_checkpoint(w)  # at most one save in flight
    w.saving = start_saving_shards(
        w.model,
        w.optimizer,
        progress_at(w, step),
        w.storage,
        (*w.run_parts, checkpoint_dir_name(step)),
        w.save_group,
        trainable_only=w.lora,
        buffers=w.staging,
    )


def complete_checkpoint(w: Worker) -> None:
    """Wait for the save in flight (if any); rank 0 writes the marker; then Ray Train registers the directory.

    Every rank's files are in storage before the all_gather returns (each waited for its own), so the
    marker never precedes a shard. Ray is not asked to copy anything (NO_UPLOAD): the files are already
    where it keeps checkpoints, and its bookkeeping (get_checkpoint after a restart, num_to_keep) covers
    the directory as it would an uploaded one. Ray registers a checkpoint once every rank has reported it,
    and rank 0 reports only after its marker: Ray never holds a checkpoint that was not complete, so a
    restart never resumes behind Ray's latest and saves a step Ray already holds again (two entries for one
    directory, and Ray's pruning of the older one deletes the newer). A save that fails or is cut short
    raises here (or never gets here): no marker, not in Ray's bookkeeping, so it never counts.
    """
    import ray.train
    import torch.distributed as dist

    saving, w.saving = w.saving, None
    if saving is None:
        return
    began = time.perf_counter()
    files = finish_saving_shards(saving)
    waited = time.perf_counter() - began
    every_rank: list[Digests] = [{} for _ in range(w.world_size)]
    dist.all_gather_object(every_rank, files)
    name = checkpoint_dir_name(saving.step)
    fault_hooks.before_marker(w.storage, w.ctx.stage_parts(), w.rank, saving.step)
    if w.rank == 0:
        listed = {file: digest for files_of_rank in every_rank for file, digest in files_of_rank.items()}
        write_marker(w.storage, saving.step, listed, *w.run_parts, name)
        w.log(f"checkpoint step {saving.step} complete: {saving.uri} (waited {waited:.2f}s for the background write)")
    ray_storage = ray.train.get_context().get_storage()
    ray.train.report(
        {"step": saving.step},
        checkpoint=ray.train.Checkpoint(
            path=posixpath.join(ray_storage.experiment_fs_path, name), filesystem=ray_storage.storage_filesystem
        ),
        checkpoint_upload_mode=ray.train.CheckpointUploadMode.NO_UPLOAD,
    )


def act_on_notice(w: Worker, step: int) -> None:
    """Ray's preemption notice (training.preemption), asked every few steps: at the first, this step's
    checkpoint is saved and completed at once; then the group waits for Ray Train's restart at the deadline,
    unless the rest of the run fits before it. Collective; rank 0 decides and records."""
    import torch.distributed as dist

    from training import preemption

    notice = w.notices.poll(step, time.time())
    if notice is None:
        return
    if preemption.saves_now(notice, w.notices.saved_at, w.saving is not None and w.saving.step == step):
        save_checkpoint(w, step)
    complete_checkpoint(w)
    w.notices.saved_at = step
    pace = w.notices.step_seconds(step, time.time())
    decided = [preemption.waits_for_restart(notice, step, w.params.max_steps, pace, time.time())]
    dist.broadcast_object_list(decided, src=0)  # one decision: a rank that trains on alone would hang
    if w.rank == 0:
        preemption.record_notice(w.storage, w.ctx.stage_parts(), w.attempt, step, notice, decided[0])
    left = notice.seconds_left(time.time())
    w.log(
        f"PREEMPTION NOTICE for ranks {list(notice.ranks)} "
        f"({'no deadline' if left is None else f'deadline in {left:.1f} s'}): checkpoint step {step} saved; "
        + ("waiting for Ray Train's restart" if decided[0] else "training on: the rest of the run fits before it")
    )
    if decided[0]:
        preemption.wait_for_restart(notice, w.log)


def progress_at(w: Worker, step: int) -> TrainingProgress:
    from training.train_data import position

    epoch, batch_in_epoch = position(step + 1, w.batches.per_epoch)
    return TrainingProgress(
        step=step,
        epoch=epoch,
        batch_in_epoch=batch_in_epoch,
        seed=w.ctx.config.train.seed,
        rank=w.rank,
        world_size=w.world_size,
        schedule=w.schedule.to_dict(),
        rng=capture_rng(),
        ledger=w.ledger,
    )


def hold(w: Worker, step: int) -> None:
    """Resume-test interruption point: the checkpoint is made complete, announced, then every rank sleeps
    until the job is stopped."""
    complete_checkpoint(w)
    if w.rank == 0:
        jobkit.progress("finetune", step, w.params.max_steps, holding=True)
    w.log(f"HOLDING after checkpoint step {step}")
    while True:
        time.sleep(60)


def interrupt(w: Worker, step: int) -> NoReturn:
    """Resume-test interruption point: once this step's checkpoint is complete on every rank (rank 0's marker
    written) and rank 0 has recorded the step in interrupted.json, every rank SIGKILLs itself: no handler and
    no cleanup run, as when a node is lost. Nothing of this process survives for the restart to lean on."""
    import torch.distributed as dist

    complete_checkpoint(w)
    flush_metrics(w)
    dist.barrier()  # every rank's shards are stored and the marker is written
    if w.rank == 0:
        w.storage.write_json({"step": step, "time": time.time()}, *w.ctx.stage_parts(INTERRUPTED))
        w.log(f"INTERRUPTING after checkpoint step {step}: every rank SIGKILLs itself")
    dist.barrier()  # the record exists before any rank dies
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable: SIGKILL was sent to this process")


def export_model(w: Worker, step: int) -> str:
    """Gather the full weights (collective), then rank 0 writes a Hugging Face model; returns its storage path."""
    import torch.distributed as dist

    from training.fsdp import full_state_dict
    from training.lora import trained_state_dict, write_lora_export

    state = trained_state_dict(w.model) if w.lora else full_state_dict(w.model)
    path = posixpath.join(*w.ctx.run_parts(w.params.export_dir(w.ctx.run_id)))
    made_by = {"run_id": w.ctx.run_id, "invocation": w.params.invocation, "run_name": w.params.run_name}
    if w.rank == 0 and w.lora:  # merged model, adapter/ inside it: one manifest over both
        write_lora_export(state, step, w.ctx.config, w.storage, path, made_by)
    elif w.rank == 0:
        write_hf_export(state, step, w.ctx.config.model, w.ctx.config.storage.endpoint_url, w.storage, path, made_by)
        w.log(f"exported the model to {w.storage.uri(path)}")
    dist.barrier()
    return path


def finish(
    w: Worker, start: int, step: int, status: str, cause: str | None = None, export_path: str | None = None
) -> None:
    """Rank 0 saves the metrics and writes outcome.json, which the driver reads, with every rank's peak
    memory. Collective."""
    import torch.distributed as dist

    from training.memory import rank_memory

    flush_metrics(w)
    memory: list[Any] = [None] * w.world_size
    dist.all_gather_object(memory, rank_memory(w.rank, w.device).to_json())
    if w.rank != 0:
        return
    if cause:
        jobkit.log(f"training stopped: {cause}")
    outcome = {
        "status": status,
        "cause": cause,
        "start_step": start,
        "steps": step,
        "restored_from": w.restored_from,
        "first_step_completed_at": w.first_step_completed_at,
        "export_path": export_path,
        "trainable_params": w.param_counts[0],
        "total_params": w.param_counts[1],
        "mesh": w.mesh,
        "memory": memory,
    }
    w.storage.write_json(outcome, *w.ctx.stage_parts(OUTCOME))


def main() -> None:
    run_stage(finetune)


if __name__ == "__main__":
    main()
