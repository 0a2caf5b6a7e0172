"""The finetune stage: fine-tune with FSDP2 under Ray Train, sharded checkpoints on shared storage, HF export.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m training.finetune    (submitted by tasks/ as a Ray job)

The driver (this process) runs a TorchTrainer over train.num_workers workers with Ray Train
storage at runs/<run>/train/<run_name>; the same name and storage path resume the run (Ray Train
V2). Each worker: load the base model -> FSDP2 -> restore the latest complete checkpoint, else
params.init_from, else start fresh -> train (warmup + cosine, grad accumulation, clipping),
checkpointing every train.checkpoint_every steps, at the end and, with train.checkpoint_on_preemption, at
Ray's notice that a node of the group is being drained (training.preemption) -> rank 0 exports a Hugging
Face model to runs/<run>/model. A checkpoint's shards are written and hashed in the background (asynchronous
DCP save) while the next steps train; it is completed (the marker, then Ray Train registers it) after the first
step by whose end every rank has written it, so an unfinished save never has a marker, and training stalls by
the state's copy to CPU memory plus the CPU the background write shares (bench/checkpoint.py measures it in steps). Workers hand results back through storage, never as exceptions
crossing Ray: runs/<run>/stages/<job>/metrics.jsonl (every step) and outcome.json (how it ended).

Params (ctx.params), checked by TrainParams: dataset (required), run_name, init_from, max_steps,
checkpoint_every, export, hold_after_checkpoint_step, interrupt_after_checkpoint_step, first_step_marker,
inject_nan_at_step, invocation.
A job whose run already holds a complete checkpoint at max_steps would train nothing: it is refused
(a modeling failure naming train.max_steps and train.continue_previous) instead of re-exporting old weights.
A checkpoint written under other settings (finetune_state.run_identity) is refused as unusable. The stage
fails as modeling when the loss (or the gradient norm) diverges, and then sets the run's latest checkpoint
aside so that no continuation resumes into the divergence; and when the loss did not fall over a run
trained from step 1 (finetune_summary.loss_trend).

This file holds the driver's story (`finetune`) and each worker's (`train_loop`); their pieces live
beside it: training/finetune_state.py (TrainParams, the Worker state), training/finetune_worker.py
(set-up, restore, the step, the outcome), training/finetune_saving.py (metrics, checkpoints, the
interruption points, the export) and training/finetune_summary.py (what the driver reads back).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

from training import fault_hooks, jobkit
from training.checkpoint_listing import (
    check_complete,
    find_checkpoints,
    remove_unmarked,
    set_aside_latest,
    set_aside_unusable_ray_snapshot,
    skip_unusable,
)
from training.finetune_saving import (
    act_on_notice,
    complete_checkpoint,
    complete_checkpoint_if_written,
    export_model,
    hold,
    interrupt,
    save_checkpoint,
)
from training.finetune_state import INTERRUPTED, OUTCOME, TrainParams
from training.finetune_summary import summarize
from training.finetune_worker import (
    account_samples,
    divergence,
    finish,
    record,
    resolve_start,
    restore,
    setup,
    train_step,
)
from training.jobkit import JobContext, run_stage
from training.preemption import NOTICES
from tuneproof.core.envelope import ENV_VAR
from tuneproof.core.fit import refusal
from tuneproof.core.results import FailureClass, StageFailure, error_line, one_line
from tuneproof.core.rowlog import remove_log
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef
from tuneproof.core.summaries_training import FinetuneSummary, FitEstimate, SkippedCheckpoint

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
    if outcome["status"] == "diverged" and (aside := set_aside_diverged(ctx, params, outcome["cause"])):
        skipped.append(aside)
    summary = summarize(ctx, params, outcome, time.time() - started, fit).model_copy(
        update={"skipped_checkpoints": skipped}
    )
    if cause := modeling_failure(outcome, summary):
        raise StageFailure(FailureClass.modeling, cause, summary)
    return summary


def set_aside_diverged(ctx: JobContext, params: TrainParams, cause: str) -> SkippedCheckpoint | None:
    """After a divergence, set the run's latest checkpoint aside (checkpoint_listing.set_aside_latest): it holds
    the weights the diverging steps trained from (one saved at the step before the divergence holds the very
    weights whose loss diverged), so a continuation from it would diverge again."""
    aside = set_aside_latest(
        ctx.storage, f"the loss diverged after it: {cause}", *ctx.run_parts("train", params.run_name)
    )
    if aside is not None:
        jobkit.log(
            f"set aside {aside.name} as {aside.set_aside_as} (the loss diverged after it): a continuation resumes "
            "from the complete checkpoint before it, or fresh"
        )
    return aside


def modeling_failure(outcome: dict[str, Any], summary: FinetuneSummary) -> str | None:
    """Why a run that ended fails as modeling: its loss diverged, or it did not fall (summary.loss_falling). Pure."""
    if outcome["status"] == "diverged":
        return str(outcome["cause"])
    if summary.loss_falling is False:
        return f"the loss did not fall: {summary.loss_trend}"
    return None


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
        raise StageFailure(
            FailureClass.infrastructure, train_failure_cause(str(error), ctx.storage.uri("runs"), error_line(error))
        )
    if outcome is None:
        raise StageFailure(
            FailureClass.infrastructure, f"training ended without writing {ctx.storage.uri(*ctx.stage_parts(OUTCOME))}"
        )
    return outcome


def train_failure_cause(error: str, where: str, line: str | None = None) -> str:
    """The failure's one-line cause (`line`, the error as error_line gives it, else `error`); a full disk,
    found anywhere in the error's text, is named as such, with what to do. Pure."""
    if any(sign in error for sign in ("No space left on device", "ENOSPC", "[Errno 28]")):
        return (
            f"storage full: no space left on device (ENOSPC) writing under {where}; free space there or point "
            f"storage.root at a larger volume, then continue with train.continue_previous=true. "
            f"Ray Train: {one_line(line or error, 300)}"
        )
    return f"Ray Train run failed: {line or error}"


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


# ---------------------------------------------------------------- workers


def train_loop(loop_config: dict) -> None:
    """Per-worker body under Ray Train: the fine-tune's story."""
    import torch.distributed as dist

    from training.restarts import begin_attempt

    ctx = jobkit.load_context({ENV_VAR: loop_config["job"]})
    params = TrainParams.model_validate(ctx.params)
    with jobkit.worker_reads_saved(ctx, dist.get_rank()), outcome_on_failure(ctx, dist.get_rank()):
        w = setup(ctx, params)
        start = restore(w, resolve_start(w))
        if w.rank == 0:
            w.attempt = begin_attempt(w.storage, ctx.stage_parts(), start, w.restored_from)
        for step in range(start + 1, params.max_steps + 1):
            stats = train_step(w, step)
            account_samples(w, step)
            complete_checkpoint_if_written(w)  # an earlier step's save, once every rank has written it
            fault_hooks.after_step(w.rank, step)
            record(w, step, stats, start)
            if cause := divergence(stats["loss"], stats["grad_norm"], step, ctx.config.train.divergence_loss):
                complete_checkpoint(w)  # the save in flight ends; the driver sets the latest checkpoint aside
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
def outcome_on_failure(ctx: JobContext, rank: int) -> Iterator[None]:
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


def main() -> None:
    run_stage(finetune)


if __name__ == "__main__":
    main()
