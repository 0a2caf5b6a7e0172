"""The resume stage's job: a run killed right after a checkpoint restarts under its name, at that step.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m training.resume    (submitted by tasks/resume.py)

1. interrupt: a Ray Train run named params.run_name starts from the main run's checkpoint k
   (params.init_from), checkpoints at params.interrupt_at and trains no further: once that checkpoint is
   complete, every rank SIGKILLs itself (training.finetune_saving.interrupt). Its max_failures is 0, so the
   kill ends the run.
2. continue: a new Ray Train run under the same name and storage path. Its controller and workers are new
   processes, so all it has is shared storage: Ray Train V2 and resolve_start find the latest complete
   checkpoint, which must be the interrupt step, and it trains on to params.max_steps.

The two phases share one Ray job (one submission, one driver) and nothing else. Each writes under a
stage folder of its own, <job>-interrupt and <job>-continue, with the fine-tune's files (metrics.jsonl,
outcome.json, attempts); the flow's task compares their losses with the main run's and judges.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training.finetune import finetune
from training.finetune_state import INTERRUPTED
from training.jobkit import JobContext, run_stage
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_training import ResumeJobSummary

Phase = Literal["interrupt", "continue"]


class ResumeParams(BaseModel):
    """What tasks/resume.py sets for the resume test's job; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    """Storage path of the prepared dataset the main run trained on."""
    run_name: str
    """The Ray Train run both phases train under (one per attempt of the stage)."""
    init_from: str
    """URI of the main run's complete checkpoint the interrupt phase starts from."""
    interrupt_at: int = Field(ge=1)
    """The step whose checkpoint the interrupt phase completes before it is killed."""
    max_steps: int = Field(ge=1)
    """Where the continue phase stops (interrupt_at + resume.replay_steps)."""

    @model_validator(mode="after")
    def _continues_past_the_interruption(self) -> ResumeParams:
        if self.max_steps <= self.interrupt_at:
            raise ValueError(
                f"max_steps {self.max_steps} leaves no step to replay after interrupt_at {self.interrupt_at}"
            )
        return self

    invocation: int | None = None


def resume(ctx: JobContext) -> ResumeJobSummary:
    """Stage body: interrupt a run after a checkpoint, then restart it as a new Ray Train run."""
    params = ResumeParams.model_validate(ctx.params)
    summary = ResumeJobSummary(interrupt_job=phase_job(ctx, "interrupt"), continue_job=phase_job(ctx, "continue"))
    summary = interrupt_phase(ctx, params, summary)
    try:
        resumed = finetune(phase(ctx, "continue", params))
    except StageFailure as f:
        raise StageFailure(f.failure_class, f"the restarted run failed: {f.cause}", summary) from None
    return summary.model_copy(update={"resumed": resumed})


def interrupt_phase(ctx: JobContext, params: ResumeParams, summary: ResumeJobSummary) -> ResumeJobSummary:
    """Train from the seed checkpoint to interrupt_at and be killed there; anything else is a failure."""
    interrupted = phase(ctx, "interrupt", params)
    try:
        ran = finetune(interrupted)
    except StageFailure as f:
        killed = read_interruption(interrupted)
        if killed is None:
            cause = f"the interrupt phase failed before its interruption after step {params.interrupt_at}: {f.cause}"
            raise StageFailure(f.failure_class, cause, summary) from None
        return summary.model_copy(update={"interrupted_at_step": killed["step"], "interrupted_at": killed["time"]})
    raise StageFailure(
        FailureClass.infrastructure,
        f"the interrupt phase ran to step {ran.steps} without being interrupted after step {params.interrupt_at}: "
        "no interruption, no evidence that a checkpoint restores",
        summary,
    )


def phase_job(ctx: JobContext, name: str) -> str:
    return f"{ctx.job}-{name}"


def phase(ctx: JobContext, name: Phase, params: ResumeParams) -> JobContext:
    """A fine-tune context for one phase: the same run and config, the phase's own stage folder."""
    return JobContext(ctx.run_id, phase_job(ctx, name), ctx.config, phase_params(name, params))


def phase_params(name: Phase, params: ResumeParams) -> dict[str, object]:
    """The fine-tune params of one phase. Pure.

    Both checkpoint every interrupt_at steps: checkpoints fall on multiples of checkpoint_every, so that
    interval is the one that always lands on the interruption step (an interval of resume.extra_steps
    missed it whenever the seed step was not a multiple of it: seed 30, extra 4 interrupts at 34, while
    checkpoints would fall at 32 and 36). The LR schedule spans train.max_steps whatever max_steps is,
    so both phases are comparable step for step with the main run.
    """
    interrupt = name == "interrupt"
    return {
        "dataset": params.dataset,
        "run_name": params.run_name,
        "init_from": params.init_from,
        "max_steps": params.interrupt_at if interrupt else params.max_steps,
        "checkpoint_every": params.interrupt_at,
        "export": False,
        "invocation": params.invocation,
        **({"interrupt_after_checkpoint_step": params.interrupt_at} if interrupt else {"first_step_marker": True}),
    }


def read_interruption(ctx: JobContext) -> dict | None:
    """The {step, time} rank 0 recorded just before the planned kill; None when it never got there."""
    parts = ctx.stage_parts(INTERRUPTED)
    return ctx.storage.read_json(*parts) if ctx.storage.exists(*parts) else None


if __name__ == "__main__":
    run_stage(resume)
