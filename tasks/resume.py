"""The resume stage: prove that a checkpoint restores, instead of assuming it.

One Ray job (training.resume) in two phases, under one Ray Train run name "<run>-resume-t<N>":
1. interrupt: a new training run starts from an intermediate checkpoint k of the main run, checkpoints
   at k+extra, and every rank SIGKILLs itself right after that checkpoint is complete.
2. continue: a new Ray Train run under the same name and storage (new controller, new workers) resumes
   from the latest complete checkpoint. It must restart at k+extra, not at step 0 or k.
3. replay: the losses logged by both phases for steps k+1 .. k+extra+replay must equal the main
   run's (within resume.loss_rtol; 0 on CPU fp32, where replays are bit for bit).

The test passes only on proof: an interrupt phase that was never killed at its interruption step, or a
continue phase that restored any step but that one, is an infrastructure failure. Every new job
trains under its own Ray Train run name and job name (-t<N>, N the first attempt number that left
nothing in storage), so no job can resume an earlier attempt's checkpoints past the interruption step
and pass without a real restart. A Prefect retry whose earlier try's job is still running, or ended with
a result, attaches to that job and reads its verdict instead (`attempt_number`). The summary names the
fine-tune's Ray Train run it tested; promotion needs that to be the promoted model's.
An unusable checkpoint is an infrastructure failure, and blocks promotion.
"""

from __future__ import annotations

from typing import Any

from prefect import task

from tasks import events
from tasks.jobs import RETRY, StageCall, entry_from_jobs, runner_for
from tasks.rayjob import JobSpec, RayJobRunner
from tuneproof.control.record import StageEntry
from tuneproof.control.resume_evidence import (
    Ledger,
    as_ledger,
    check_first_step,
    check_phase_steps,
    check_restart,
    compare_ledgers,
    compare_losses,
)
from tuneproof.core.results import FailureClass, StageFailure, now_iso
from tuneproof.core.rowlog import read_rows, rows_sha256
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef
from tuneproof.core.summaries_training import (
    METRICS_LOG,
    FinetuneSummary,
    LedgerComparison,
    LedgerPoint,
    LossComparison,
    LossPoint,
    ResumeJobSummary,
    ResumeSummary,
    ledger_points,
    loss_curve,
)


def pick_checkpoint(checkpoints: list[CheckpointRef], final_step: int, extra: int, replay: int) -> CheckpointRef | None:
    """The latest main-run checkpoint that leaves room for extra + replay steps before the end."""
    usable = [c for c in checkpoints if c.step + extra + replay <= final_step]
    return max(usable, key=lambda c: c.step) if usable else None


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

    interrupt_at = seed.step + extra
    storage = Storage.from_config(cfg.storage)
    runner = runner_for(call)
    n, earlier = attempt_number(storage, call, runner)
    tag = f"t{n}"
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
        "interrupt_at": interrupt_at,
        "max_steps": interrupt_at + replay,
        "invocation": call.invocation,
    }
    # An earlier attempt's job is only ever attached to: a new job under its name would resume its checkpoints.
    ran = runner.run(resume_spec(call, tag, params), attach_only=earlier)
    jobs = [*runner.superseded, ran]
    job = ResumeJobSummary.model_validate(ran.result.summary) if ran.result.summary is not None else None
    if not ran.result.ok or job is None or job.resumed is None:
        killed_at = job.interrupted_at_step if job else None
        summary = ResumeSummary(**lineage, interrupted=killed_at is not None, interrupted_at_step=killed_at)
        return without_continue_evidence(entry_from_jobs(call, jobs, started, summary), job)

    evidence = judge(call, job, seed, interrupt_at, loss_curve).model_copy(update=lineage)
    outcome = entry_from_jobs(call, jobs, started, evidence)
    return unproven(outcome, "; ".join(evidence.problems)) if evidence.problems else outcome


def without_continue_evidence(entry: StageEntry, job: ResumeJobSummary | None) -> StageEntry:
    """The entry of a resume job that left no continue phase to judge: its own failure when it failed; when it
    ended well, an infrastructure failure naming the missing evidence, never a pass. Pure.

    A job that exits cleanly without the continue phase's summary (a harness that lost it, another release's
    job) has proved nothing about the checkpoint; a succeeded entry would be refused only later, at promotion."""
    if not entry.ok:
        return entry
    if job is None:
        missing = "no summary (ResumeJobSummary)"
    else:
        missing = f"no continue phase (resumed is None; its stage folder {job.continue_job})"
    return unproven(
        entry,
        f"the resume job succeeded but left {missing}: no evidence that a new run continued from the checkpoint",
    )


def unproven(entry: StageEntry, cause: str) -> StageEntry:
    """`entry` failed as infrastructure with `cause`: the checkpoint was not shown to restore. Pure."""
    return entry.model_copy(update={"status": "failed", "failure_class": FailureClass.infrastructure, "cause": cause})


def attempt_run_name(call: StageCall, tag: str) -> str:
    return f"{call.run_id}-{call.job_name(tag)}"


def resume_spec(call: StageCall, tag: str, params: dict[str, Any] | None = None) -> JobSpec:
    return call.spec("training.resume", params, suffix=tag, summary=ResumeJobSummary)


def attempt_number(storage: Storage, call: StageCall, runner: RayJobRunner) -> tuple[int, bool]:
    """This attempt's N, and whether it is an earlier attempt's: the previous attempt's when `runner` attaches to
    its job (a Prefect retry after a lost connection: that job is still running, or ended with a verdict that
    must stand), else the first unused."""
    n = first_unused_attempt(storage, call)
    if n > 1 and runner.attaches(resume_spec(call, f"t{n - 1}")):
        return n - 1, True
    return n, False


def first_unused_attempt(storage: Storage, call: StageCall) -> int:
    """The lowest N whose Ray Train run and job folder do not exist yet: this attempt's t<N>.

    A Prefect retry re-runs this task; an earlier attempt's run (checkpoints past the interruption step,
    a continue phase that finished) must never be what the retry's job resumes from.
    """
    n = 1
    while storage.exists("runs", call.run_id, "train", attempt_run_name(call, f"t{n}")) or storage.exists(
        "runs", call.run_id, "stages", call.job_name(f"t{n}")
    ):
        n += 1
    return n


def judge(
    call: StageCall, job: ResumeJobSummary, seed: CheckpointRef, interrupt_at: int, main_curve: list[LossPoint]
) -> ResumeSummary:
    """Compare the restarted trajectory with the main run: the step it restored, and losses and data order step for
    step over every step each phase had to train (phase_steps), no fewer and no others."""
    cfg = call.cfg
    resumed = job.resumed
    assert resumed is not None  # the caller returns early without a continue phase
    storage = Storage.from_config(cfg.storage)
    interrupted = phase_rows(storage, call.run_id, job.interrupt_job)
    main = call.record.summary("finetune", FinetuneSummary)
    try:
        main_curve, main_ledger = every_point(storage, main, main_curve) if main else (main_curve, [])
        resumed_curve, resumed_ledger = every_point(storage, resumed, resumed.loss_curve)
    except StageFailure as e:
        return ResumeSummary(
            seed_checkpoint=seed, interrupted=True, interrupted_at_step=job.interrupted_at_step, problems=[e.cause]
        )
    main_logged = (as_losses(main_curve), as_ledger(main_ledger))
    interrupt_losses = as_losses([(r["step"], r["loss"]) for r in interrupted if "loss" in r])
    logged = {
        "interrupt": (interrupt_losses, as_ledger(ledger_points(interrupted))),
        "continue": (as_losses(resumed_curve), as_ledger(resumed_ledger)),
    }
    replayed_losses = logged["interrupt"][0] | logged["continue"][0]
    replayed_ledger = logged["interrupt"][1] | logged["continue"][1]
    comparison = LossComparison.model_validate(compare_losses(main_logged[0], replayed_losses, cfg.resume.loss_rtol))
    ledger = LedgerComparison.model_validate(compare_ledgers(main_logged[1], replayed_ledger))
    problems = []
    if job.interrupted_at_step != interrupt_at:
        problems.append(f"the interrupt phase was killed after step {job.interrupted_at_step}, not {interrupt_at}")
    if restart := check_restart(interrupt_at, resumed.restored_step):
        problems.append(restart.line())
    if not comparison.ok:
        problems.append(loss_problem(comparison, cfg.resume.loss_rtol))
    if not ledger.ok:
        what = "differs from the main run's" if ledger.steps_compared else "cannot be checked"
        problems.append(f"the data order {what}: {ledger.reason}")
    expected = phase_steps(seed.step, interrupt_at, cfg.resume.replay_steps)
    problems += step_problems(expected, resumed.restored_step, logged, main_logged)
    first_at, killed_at = resumed.first_step_completed_at, job.interrupted_at
    return ResumeSummary(
        seed_checkpoint=seed,
        interrupted=True,
        interrupted_at_step=job.interrupted_at_step,
        restored_step=resumed.restored_step,
        restored_from=resumed.restored_from,
        seconds_to_first_resumed_step=round(first_at - killed_at, 2) if first_at and killed_at else None,
        loss_comparison=comparison,
        max_loss_diff=comparison.max_abs_diff,
        loss_rtol=cfg.resume.loss_rtol,
        ledger_comparison=ledger,
        problems=problems,
    )


def phase_steps(seed_step: int, interrupt_at: int, replay: int) -> dict[str, range]:
    """The steps each phase must train and log, all replayed against the main run: the interrupt phase's, from
    the seed checkpoint to the kill, and the continue phase's, from the restored step to max_steps. Pure."""
    return {
        "interrupt": range(seed_step + 1, interrupt_at + 1),
        "continue": range(interrupt_at + 1, interrupt_at + replay + 1),
    }


def step_problems(
    expected: dict[str, range],
    restored_step: int | None,
    logged: dict[str, tuple[dict[int, float], Ledger]],
    main: tuple[dict[int, float], Ledger],
) -> list[str]:
    """Problem lines when the replay was not compared on every step it had to train: the restarted run's first
    logged step is not the one after its restore, or a phase's losses or data order were not compared with the
    main run's on exactly its `expected` steps (phase_steps). Pure.

    The comparisons judge only the steps both runs logged; without these checks a continue phase whose metrics
    were lost would pass on the interrupt phase's steps alone."""
    continued_losses, continued_ledger = logged["continue"]
    problems = [check_first_step(restored_step, [*continued_losses, *continued_ledger])]
    for phase, (losses, ledger) in logged.items():
        problems.append(check_phase_steps(phase, "losses", expected[phase], losses, main[0]))
        problems.append(check_phase_steps(phase, "data order", expected[phase], ledger, main[1]))
    return [problem for problem in problems if problem]


def loss_problem(comparison: LossComparison, rtol: float) -> str:
    """The problem line of a failed loss comparison; one with no step compared says so, with its reason. Pure."""
    if comparison.max_rel_diff is None:
        return f"the replayed losses cannot be checked, 0 steps compared: {comparison.reason}"
    return (
        f"replayed losses differ from the main run: max relative difference "
        f"{comparison.max_rel_diff:.3g} > tolerance {rtol}"
    )


def as_losses(points: list[LossPoint]) -> dict[int, float]:
    """{step: loss}, a loss that was not finite (logged as null) as NaN, which never matches."""
    return {int(step): float("nan") if loss is None else float(loss) for step, loss in points}


def every_point(
    storage: Storage, summary: FinetuneSummary, curve: list[LossPoint]
) -> tuple[list[LossPoint], list[LedgerPoint]]:
    """Every step's loss and ledger point of a fine-tune: `curve` and the summary's ledger when the summary
    holds every step; else (a long run's thinned summary) read back from the metrics log it names, which must
    hash as it did when the summary was written (else StageFailure, naming both hashes)."""
    if not summary.thinned:
        return curve, summary.ledger
    rows = read_rows(storage, *(summary.metrics_path or "").split("/"))
    if (seen := rows_sha256(rows)) != summary.metrics_sha256:
        raise StageFailure(
            FailureClass.infrastructure,
            f"metrics log {summary.metrics_path} changed since its fine-tune summary was written: "
            f"sha256 {seen}, expected {summary.metrics_sha256}",
        )
    return loss_curve(rows), ledger_points(rows)


def phase_rows(storage: Storage, run_id: str, job: str) -> list[dict]:
    """The metrics rows the interrupt phase logged before it was killed (its metrics.jsonl was flushed at the
    checkpoint): losses and ledger of the steps it trained."""
    return read_rows(storage, "runs", run_id, "stages", job, METRICS_LOG)
