"""One fine-tune rank's steps: set up, restore, train a step, record it, end with an outcome.

Runs inside Ray Train workers; training/finetune.py's train_loop calls these in order (its story):
`setup` loads the base model, applies LoRA when asked, shards it with FSDP2 and builds the optimizer
and batches; `resolve_start` and `restore` make "latest complete checkpoint, or params.init_from, or
fresh" the normal start; `train_step` is one optimizer step (training/step.py); `record` keeps rank 0's
metrics row; `finish` writes outcome.json, which the driver reads.
"""

from __future__ import annotations

import math
import posixpath
import time
from typing import TYPE_CHECKING, Any

from training import fault_hooks, jobkit
from training.checkpoint_listing import check_complete, latest_complete_checkpoint, read_step
from training.checkpointing import (
    ChangedCheckpoint,
    TrainingProgress,
    load_shards,
    progress_file,
    restore_rng,
    seed_everything,
)
from training.finetune_saving import check_checkpoint_home, flush_metrics
from training.finetune_state import OUTCOME, TrainParams, Worker, identity_differences, run_identity
from training.jobkit import JobContext
from training.preemption import NoticeWatch
from training.schedule import WarmupCosine
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef

if TYPE_CHECKING:  # torch and the data module load inside workers only
    from transformers import PreTrainedModel

    from training.train_data import StepBatches


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
    model.to(device)  # type: ignore[arg-type]  # transformers wraps .to with functools.wraps: mypy reads device as self
    probe_first_batch(model, batches, rank)  # the fp32 model, before it is sharded or compiled
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
    w.identity = run_identity(ctx, params, world)
    check_checkpoint_home(w)
    w.mesh = list(mesh_shape(cfg.sharding, world, cfg.shard_group_size, local_world_size()))  # as shard_model built it
    w.save_group = dist.new_group(backend="gloo")  # collective: every rank creates it, in the same order
    w.notices = NoticeWatch.start(cfg.checkpoint_on_preemption, w.log)
    w.log(
        f"method {cfg.method}: {counts[0]:,} of {counts[1]:,} parameters train; {cfg.sharding} sharding, mesh {w.mesh}"
    )
    return w


def probe_first_batch(model: PreTrainedModel, batches: StepBatches, rank: int) -> None:
    """With packed rows, step 1's first micro-batch goes through training.packing's probe on the fp32
    model before it is sharded (on GPU FSDP2 computes in bf16): a leak across examples fails the stage."""
    from training.packing import probe_packing

    rows = batches.micro_examples(1)[0]
    if any(row.packed for row in rows):
        worst = probe_packing(model, rows, batches.pad_id)
        if rank == 0:
            jobkit.log(f"packing probe: per-example loss packed vs alone agrees within {worst:.2g} on the first batch")


def resolve_start(w: Worker) -> CheckpointRef | None:
    """The latest complete checkpoint of this run, else params.init_from, else None (fresh).

    Ray's own latest checkpoint is always complete when this starts: Ray registers a checkpoint only after its
    marker (complete_checkpoint), and the job's driver takes any that failed its check since out of Ray's
    bookkeeping (skip_unusable). One that fails here changed during this Ray Train run: the run stops, naming
    it, and its continuation skips it. A newer complete checkpoint than Ray's (the kill fell between the
    marker and Ray's registration) is resumed from: Ray never held it, so nothing of Ray's points at its step.
    """
    import ray.train

    # Markers and sizes only: restore hashes each file this rank loads as it reads it (the job's driver hashed
    # every file of the one it chose before the trainer started, once, not once per rank).
    latest = latest_complete_checkpoint(w.storage, *w.run_parts, contents=False)
    reported = ray.train.get_checkpoint()
    if reported is not None:
        name = posixpath.basename(reported.path.rstrip("/"))
        problem = check_complete(w.storage, *w.run_parts, name, contents=False)
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
    check_identity(w, ref)
    try:
        loaded = load_shards(
            w.model, w.optimizer, Storage(ref.uri, w.ctx.config.storage.endpoint_url), w.rank, trainable_only=w.lora
        )
    except ChangedCheckpoint as e:
        raise StageFailure(
            FailureClass.infrastructure,
            f"a file of checkpoint {ref.uri} changed after its job checked it; continue the run (a new job finds it "
            f"changed, sets it aside and resumes from the one before): {e}",
        ) from None
    progress = loaded.progress
    w.log(
        f"read {len(loaded.read)} files, {sum(loaded.read.values()) / 1e6:.1f} MB, from {ref.uri} (each verified by one rank)"
    )
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


def check_identity(w: Worker, ref: CheckpointRef) -> None:
    """Refuse a checkpoint written under other settings than this run's (finetune_state.run_identity), as an
    unusable checkpoint, naming each setting that differs: resumed, it would train on as neither run. One
    written before identities were recorded is restored unchecked, and the log says so.

    Rank 0's progress file is read before any shard is loaded (the load verifies it against the marker
    after): a checkpoint of another base model would otherwise fail inside DCP on a shape, naming no setting."""
    saved = TrainingProgress(**Storage(ref.uri, w.ctx.config.storage.endpoint_url).read_json(progress_file(0)))
    if saved.identity is None:
        w.log(
            f"checkpoint {ref.uri} records no run identity (written before it was recorded): its base model, "
            "dataset, seed, LR schedule and global batch could not be checked against this run's"
        )
        return
    differences = identity_differences(saved.identity, w.identity)
    if differences:  # the differences first: a cause is cut to one line of 400 characters
        raise StageFailure(
            FailureClass.infrastructure,
            f"checkpoint {posixpath.basename(ref.uri.rstrip('/'))} was written under other settings than this "
            f"run's: {'; '.join(differences)}. Resume it only with its own settings, or train a fresh run "
            f"(train.continue_previous=false). The checkpoint: {ref.uri}",
        )


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


def divergence(loss: float, grad_norm: float, step: int, limit: float) -> str | None:
    """The failure cause when a step's loss or gradient norm means training has diverged. Pure."""
    if not math.isfinite(loss):
        return f"loss is {loss} at step {step}"
    if loss > limit:
        return f"loss is {loss:.4g} at step {step}, above train.divergence_loss {limit}"
    if not math.isfinite(grad_norm):  # a finite loss, but the update would have made every weight NaN
        return f"gradient norm is {grad_norm} at step {step} (loss {loss:.4g}): its update was not applied"
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
