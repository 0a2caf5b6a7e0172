"""What a fine-tune rank writes: metrics rows, asynchronous sharded checkpoints, the interruption points, the export.

Runs inside Ray Train workers (training/finetune.py's train_loop, through training/finetune_worker.py).
A checkpoint's DCP shards are written in the background while the next steps train (`save_checkpoint`);
once every rank's are written (`complete_checkpoint_if_written`, asked after each step; `complete_checkpoint`
waits), rank 0 writes the marker, and only then Ray Train registers the directory, so Ray never holds a
checkpoint that is not complete. `hold` and `interrupt` are the resume
test's stopping points; `export_model` gathers the weights and rank 0 writes a Hugging Face model.
The library pieces are training/checkpointing.py (DCP save and load, RNG state), training/checkpoint_listing.py
(markers, which checkpoints count) and training/hf_export.py (the export).
"""

from __future__ import annotations

import os
import posixpath
import signal
import time
from typing import NoReturn

from training import fault_hooks, jobkit
from training.checkpoint_listing import write_marker
from training.checkpointing import (
    TrainingProgress,
    capture_rng,
    checkpoint_dir_name,
    finish_saving_shards,
    start_saving_shards,
    written_on_every_rank,
)
from training.finetune_state import INTERRUPTED, METRICS, Worker
from training.hf_export import write_hf_export
from tuneproof.core.markers import Digests
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.rowlog import append_rows


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


def flush_metrics(w: Worker) -> None:
    """Rank 0 appends the rows logged since the last flush: the cost is theirs, not the whole log's."""
    if w.rank == 0 and w.metrics:
        after = None if w.metrics_chunk is None else w.metrics_chunk + 1
        w.metrics_chunk = append_rows(w.storage, w.metrics, *w.ctx.stage_parts(METRICS), chunk=after)
        w.metrics = []


def save_checkpoint(w: Worker, step: int) -> None:
    """Start this step's checkpoint: every rank's state is copied to memory now and its DCP shards are
    written into the checkpoint's storage directory in the background while the next steps train;
    `complete_checkpoint_if_written` finishes it once every rank has written it (the next save waits)."""
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


def complete_checkpoint_if_written(w: Worker) -> None:
    """After each step: complete the save in flight once every rank has written and hashed it
    (written_on_every_rank), else train on. A save that takes several steps to write then costs the loop
    only the CPU its background thread shares, not a wait at the step after it began; the next save, the
    interruption points and the end of the run still wait for it (complete_checkpoint). Collective."""
    if w.saving is not None and written_on_every_rank(w.saving, w.device):
        complete_checkpoint(w)


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
        identity=w.identity,
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
