"""Issue 28's rows on resuming: a corrupted checkpoint skipped in step with Ray Train; a planted sampler bug
caught by the data-order ledger.

    python -m faults --only corrupt-checkpoint,sampler-seed-lost

corrupt-checkpoint  the pipeline through the fine-tune is stopped (`ray job stop`) once checkpoint 20 is
                    registered by Ray Train; one byte in the middle of the newest complete checkpoint's largest shard is
                    flipped (same size: only its sha256 tells); `run --run-id X --until finetune` continues.
                    The continuation must restore the checkpoint before it, name the skipped one and why,
                    finish, and export the reference's weights. num_to_keep 2 makes Ray Train prune twice
                    after the step is saved again: with the bad checkpoint left in Ray's bookkeeping, that
                    prune fails the run on "Path not found" (issue 28's held-out failure)
sampler-seed-lost   the pipeline through the resume test with a planted sampler bug: the continue phase's
                    workers, once they restore the interruption step, lose their epoch seed
                    (TUNEPROOF_FAULT_AT=sampler:35) and draw the rest of the epoch unseeded. resume.loss_rtol
                    is 1.0, so replayed losses "look close"; the resume test must still fail, its ledger
                    comparison naming the first step whose samples differ (36)
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from faults.f_flow import FLOW, continue_run, logged_step, ray_client, row_for, start, wait_for
from faults.f_train import forwarded
from faults.harness import FaultRow, Lab, scenario
from training.checkpoint_listing import RAY_SNAPSHOT, latest_complete_checkpoint, snapshot_checkpoints
from training.fault_hooks import FAULT_AT
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary

KEEP_TWO = ("train.num_to_keep=2",)


def flip_middle_byte(checkpoint_dir: Path) -> str:
    """Flip one byte halfway through the checkpoint's largest shard, keeping its size; returns what was done."""
    shard = max((p for p in checkpoint_dir.iterdir() if p.suffix == ".distcp"), key=lambda p: p.stat().st_size)
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    return f"byte {len(data) // 2} of {shard.name} ({len(data)} bytes) flipped"


def wait_stopped(lab: Lab, submission_id: str, timeout: float = 120) -> None:
    """Until Ray says the job is no longer running: no worker can be writing the checkpoint about to change."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if ray_client(lab).get_job_status(submission_id).is_terminal():
            return
        time.sleep(0.5)
    raise TimeoutError(f"Ray job {submission_id} still running {timeout:.0f}s after it was stopped")


def ray_holds(storage: Storage, run_id: str, name: str) -> bool:
    """Ray Train's checkpoint manager snapshot of the run's fine-tune lists checkpoint `name`."""
    parts = ("runs", run_id, "train", run_id, RAY_SNAPSHOT)
    try:
        return name in snapshot_checkpoints(json.loads(storage.read_bytes(*parts)))
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-rewrite
        return False


def train_parts(storage: Storage, run_id: str) -> tuple[str, ...]:
    """The fine-tune's Ray Train run: the first invocation's trains under the run id (the continuation resumes
    it); connectivity's has a name of its own beside it."""
    parts = ("runs", run_id, "train", run_id)
    if not storage.exists(*parts):
        raise RuntimeError(f"run {run_id} has no Ray Train run {run_id}: {storage.listdir(*parts[:-1])}")
    return parts


@scenario(order=35, name="corrupt-checkpoint")
def corrupt_checkpoint(lab: Lab) -> FaultRow:
    lab.reference()
    run_id = "resume-corrupt-checkpoint"
    proc = start(lab, run_id, KEEP_TWO)
    # Stopped once Ray Train's own bookkeeping holds checkpoint 20 (it registers a checkpoint after its marker):
    # the continuation must then take it out of Ray's snapshot, not only out of the restore.
    wait_for(
        "checkpoint 20 in Ray Train's snapshot", lambda: ray_holds(proc.storage, run_id, "checkpoint_000020"), proc
    )
    step = logged_step(proc.storage, run_id)
    ray_client(lab).stop_job(f"{run_id}-finetune")
    first = proc.wait()
    wait_stopped(lab, f"{run_id}-finetune")
    parts = train_parts(first.storage, run_id)
    newest = latest_complete_checkpoint(first.storage, *parts)
    if newest is None:
        raise RuntimeError(f"run {run_id} left no complete checkpoint to corrupt")
    flipped = flip_middle_byte(Path(newest.uri))
    cont = continue_run(lab, run_id, KEEP_TWO)
    problems = check_skipped(cont.record.summary("finetune", FinetuneSummary) if cont.record else None, newest.step)
    row = row_for(
        lab, "corrupt-checkpoint", f"step {step} of 40 (job stopped), then checkpoint {newest.step} corrupted",
        f"ray job stop; {flipped} in checkpoint_{newest.step:06d}; run --run-id X --until finetune (num_to_keep 2)",
        first, cont, problems,
    )  # fmt: skip
    tuned = cont.record.summary("finetune", FinetuneSummary) if cont.record else None
    if tuned and row.outcome == "survived":
        (skipped,) = tuned.skipped_checkpoints
        row.notes = (
            f"restored step {tuned.start_step}; skipped {skipped.name} ({skipped.reason[-140:]}), set aside as "
            f"{skipped.set_aside_as}, dropped from Ray's snapshot: {skipped.dropped_from_ray}"
        )
    return row


def check_skipped(tuned: FinetuneSummary | None, corrupted: int) -> list[str]:
    """The continuation resumed from the checkpoint before the corrupted one and names it, with its sha256."""
    if tuned is None:
        return ["the continuation recorded no fine-tune"]
    problems = []
    if tuned.start_step != corrupted - 10 or tuned.restored_from is None:
        problems.append(f"the continuation started at step {tuned.start_step}, not from checkpoint {corrupted - 10}")
    named = [s for s in tuned.skipped_checkpoints if s.step == corrupted]
    if not named or "sha256" not in named[0].reason or not named[0].dropped_from_ray:
        problems.append(
            f"the record does not name checkpoint {corrupted} as skipped for its sha256: {tuned.skipped_checkpoints}"
        )
    return problems


INTERRUPT_AT = 35
"""The resume test's interruption step on the fault workload: its seed is the last checkpoint (30) that leaves
resume.extra_steps + replay_steps (5 + 5) steps before step 40."""


@scenario(order=37, name="sampler-seed-lost")
def sampler_seed_lost(lab: Lab) -> FaultRow:
    lab.reference()
    run_id = "resume-sampler-seed-lost"
    spec = f"sampler:{INTERRUPT_AT}"
    sets = [*FLOW, "resume.loss_rtol=1.0", forwarded(FAULT_AT)]
    out = lab.run(run_id, only=None, until="resume", sets=sets, env={FAULT_AT: spec})
    rec = out.record
    entry = rec.stages.get("resume") if rec else None
    summary = rec.summary("resume", ResumeSummary) if rec else None
    ledger = summary.ledger_comparison if summary else None
    losses = summary.loss_comparison if summary else None
    caught = (
        out.exit_code == 4
        and entry is not None
        and out.failure_class == "infrastructure"
        and summary is not None
        and summary.interrupted_at_step == INTERRUPT_AT
        and ledger is not None
        and ledger.first_differing_step == INTERRUPT_AT + 1
        and "data order differs" in (entry.cause or "")
    )
    loss_note = (
        f"max relative loss difference {losses.max_rel_diff:.3g} (ok at rtol 1.0: {losses.ok})"
        if losses
        else "no loss comparison"
    )
    return FaultRow(
        fault="sampler-seed-lost",
        injected_at=f"the resume test's restore of step {INTERRUPT_AT}",
        outcome="failed-as-expected" if caught else "FAILED",
        failure_class=out.failure_class,
        seconds=round(out.seconds, 1),
        how=f"{FAULT_AT}={spec}: the restored workers draw their epoch order unseeded; resume.loss_rtol=1.0",
        notes=f"{loss_note}; ledger: {ledger.reason if ledger else None}; cause: {(entry.cause if entry else out.tail(300))}"[
            :600
        ],
    )
