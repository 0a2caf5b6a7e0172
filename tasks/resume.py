"""Stage 5, the resume test: prove that a checkpoint restores, instead of assuming it.

1. interrupt: a new training run "<run>-resume-t<N>" starts from an intermediate checkpoint k of
   the main run, checkpoints at k+extra, and holds; we stop its Ray job (the interruption).
2. continue: the same RunConfig name and storage are resubmitted; Ray Train V2 resumes from the
   latest complete checkpoint. It must restart at k+extra, not at step 0 or k.
3. replay: the losses logged by both jobs for steps k+1 .. k+extra+replay must equal the main
   run's (within resume.loss_rtol; 0 on CPU fp32, where replays are bit for bit).

The test passes only on proof: an interrupt job that was not stopped at its hold point, or a
continue job that restored any step but the hold step, is an infrastructure failure. Every attempt
(a Prefect retry included) trains under its own Ray Train run name and job names (-t<N>, N the
first attempt number that left nothing in storage), so a retry can never resume an earlier
attempt's checkpoints past the hold step and pass without a real restart. The summary names the
fine-tune's Ray Train run it tested; promotion needs that to be the promoted model's.
An unusable checkpoint is an infrastructure failure, and blocks promotion.
"""

from __future__ import annotations

import json
import time

from prefect import task

from tasks import events
from tasks.jobs import RETRY, StageCall, entry_from_jobs, runner_for
from tuneproof.control.record import StageEntry
from tuneproof.control.resume_evidence import check_restart, compare_losses
from tuneproof.core.results import FailureClass, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef, FinetuneSummary, LossComparison, LossPoint, ResumeSummary


def pick_checkpoint(checkpoints: list[CheckpointRef], final_step: int, extra: int, replay: int) -> CheckpointRef | None:
    """The latest main-run checkpoint that leaves room for extra + replay steps before the end."""
    usable = [c for c in checkpoints if c.step + extra + replay <= final_step]
    return max(usable, key=lambda c: c.step) if usable else None


def phase_steps(seed_step: int, extra: int, replay: int) -> dict[str, int]:
    """Where the resume test's jobs stop and checkpoint. Pure.

    max_steps is where the job stops; the LR schedule still spans train.max_steps, so the resumed
    trajectory is comparable step for step with the main run. The interrupt phase holds after a
    checkpoint at seed + extra: checkpoints fall on multiples of checkpoint_every, so the interval is
    the hold step itself (an interval of `extra` missed it whenever the seed step was not a multiple
    of extra, e.g. seed 30 with extra 4 would hold at 34 with checkpoints at 32 and 36).
    """
    hold = seed_step + extra
    return {"max_steps": hold + replay, "checkpoint_every": hold}


@task(name="resume-test", **RETRY)
def resume_test(call: StageCall) -> StageEntry:
    started = now_iso()
    events.publish("stage", stage="resume", status="running")
    cfg = call.cfg
    checkpoints: list[CheckpointRef] = call.inputs["checkpoints"]
    loss_curve: list[LossPoint] = call.inputs["loss_curve"]
    extra, replay = cfg.resume.extra_steps, cfg.resume.replay_steps
    final_step = int(max(step for step, _ in loss_curve))
    seed = pick_checkpoint(checkpoints, final_step, extra, replay)
    if seed is None:
        cause = (
            f"no main-run checkpoint leaves {extra}+{replay} steps before step {final_step} "
            f"(checkpoints at {[c.step for c in checkpoints]}); lower train.checkpoint_every"
        )
        return StageEntry.failed("resume", FailureClass.infrastructure, cause, started)

    hold = seed.step + extra
    storage = Storage.from_config(cfg.storage)
    tag = f"t{first_unused_attempt(storage, call)}"
    finetune = call.record.summary("finetune", FinetuneSummary)
    lineage = {
        "seed_checkpoint": seed,
        "tested_run_name": finetune.run_name if finetune else None,
        "tested_invocation": call.record.stages["finetune"].invocation if finetune else None,
        "attempt_run_name": attempt_run_name(call, tag),
    }
    params = {
        "dataset": call.inputs["dataset_path"],
        "run_name": lineage["attempt_run_name"],
        "init_from": seed.uri,
        **phase_steps(seed.step, extra, replay),
        "export": False,
    }
    runner = runner_for(call)
    interrupt_spec = call.spec(
        "training.finetune",
        {**params, "hold_after_checkpoint_step": hold},
        suffix=f"interrupt-{tag}",
        summary=FinetuneSummary,
    )
    marker = f"HOLDING after checkpoint step {hold}"
    interrupt = runner.run(interrupt_spec, stop_when=lambda line: marker in line)
    if interrupt.result.ok or interrupt.job_status != "STOPPED":
        # It failed on its own (an unusable checkpoint), or ran to its end without ever holding: no proof.
        summary = ResumeSummary(**lineage, interrupted=False)
        if not interrupt.result.ok:
            return entry_from_jobs(call, [interrupt], started, summary)
        cause = (
            f"the interrupt job {interrupt.submission_id} was never stopped at its hold step {hold} "
            f"(ended {interrupt.job_status}): no interruption, no evidence that a checkpoint restores"
        )
        return StageEntry.failed("resume", FailureClass.infrastructure, cause, started, summary, [interrupt])

    resubmitted_at = time.time()
    resumed = runner.run(
        call.spec(
            "training.finetune",
            {**params, "first_step_marker": True},
            suffix=f"continue-{tag}",
            summary=FinetuneSummary,
        )
    )
    if not resumed.result.ok:
        return entry_from_jobs(
            call,
            [interrupt, resumed],
            started,
            ResumeSummary(**lineage, interrupted=True, interrupted_at_step=hold),
        )

    continued = FinetuneSummary.model_validate(resumed.result.summary)
    evidence = judge(call, interrupt_spec.job, seed, hold, loss_curve, continued, resubmitted_at)
    evidence = evidence.model_copy(update=lineage)
    outcome = entry_from_jobs(call, [interrupt, resumed], started, evidence)
    if evidence.problems:
        outcome = outcome.model_copy(
            update={
                "status": "failed",
                "failure_class": FailureClass.infrastructure,
                "cause": "; ".join(evidence.problems),
            }
        )
    return outcome


def attempt_run_name(call: StageCall, tag: str) -> str:
    return f"{call.run_id}-{call.job_name(tag)}"


def first_unused_attempt(storage: Storage, call: StageCall) -> int:
    """The lowest N whose Ray Train run and interrupt job folder do not exist yet: this attempt's t<N>.

    A Prefect retry re-runs this task; an earlier attempt's run (checkpoints past the hold step,
    a continue job that finished) must never be what the retry's jobs resume from.
    """
    n = 1
    while storage.exists("runs", call.run_id, "train", attempt_run_name(call, f"t{n}")) or storage.exists(
        "runs", call.run_id, "stages", call.job_name(f"interrupt-t{n}")
    ):
        n += 1
    return n


def judge(
    call: StageCall,
    interrupt_job: str,
    seed: CheckpointRef,
    hold: int,
    main_curve: list[LossPoint],
    resumed: FinetuneSummary,
    resubmitted_at: float,
) -> ResumeSummary:
    """Compare the resumed trajectory with the main run: restored step, and losses step for step."""
    cfg = call.cfg
    storage = Storage.from_config(cfg.storage)
    replayed = interrupted_losses(storage, call.run_id, interrupt_job) | as_losses(resumed.loss_curve)
    main = as_losses(main_curve)
    comparison = LossComparison.model_validate(compare_losses(main, replayed, cfg.resume.loss_rtol))
    restart = check_restart(hold, resumed.restored_step)
    first_at = resumed.first_step_completed_at
    problems = [restart.line()] if restart else []
    if not comparison.ok:
        problems.append(
            f"replayed losses differ from the main run: max relative difference "
            f"{comparison.max_rel_diff:.3g} > tolerance {cfg.resume.loss_rtol}"
        )
    return ResumeSummary(
        seed_checkpoint=seed,
        interrupted=True,
        interrupted_at_step=hold,
        restored_step=resumed.restored_step,
        restored_from=resumed.restored_from,
        seconds_to_first_resumed_step=round(first_at - resubmitted_at, 2) if first_at else None,
        loss_comparison=comparison,
        max_loss_diff=comparison.max_abs_diff,
        loss_rtol=cfg.resume.loss_rtol,
        problems=problems,
    )


def as_losses(points: list[LossPoint]) -> dict[int, float]:
    """{step: loss}, a loss that was not finite (logged as null) as NaN, which never matches."""
    return {int(step): float("nan") if loss is None else float(loss) for step, loss in points}


def interrupted_losses(storage: Storage, run_id: str, job: str) -> dict[int, float]:
    """Losses the interrupted job logged before it was stopped (its metrics.jsonl survives the stop)."""
    parts = ("runs", run_id, "stages", job, "metrics.jsonl")
    if not storage.exists(*parts):
        return {}
    rows = [json.loads(line) for line in storage.read_text(*parts).splitlines() if line.strip()]
    return as_losses([(r["step"], r["loss"]) for r in rows if "loss" in r])
