"""Which Prefect task runs each stage of the table, and which artifact it publishes on the flow run page.

The stage table (tuneproof/control/stages.py) holds the facts, without Prefect, so the readers start
without it; this module binds them to Prefect. A stage that is one Ray job (`Stage(job=...)`) runs the
generic `job_stage` and needs no line here. A stage with neither a job nor a task is refused at import.
"""

from __future__ import annotations

from collections.abc import Callable

from tasks import artifacts
from tasks import promote as promote_tasks
from tasks import resume as resume_tasks
from tasks.jobs import StageCall, connectivity, evaluate, finetune, job_stage, verify
from tuneproof.control import stages as table
from tuneproof.control.record import RunRecord, StageEntry
from tuneproof.control.stages import Stage
from tuneproof.core.storage import Storage

StageTask = Callable[[StageCall], StageEntry]
Artifact = Callable[[RunRecord, StageEntry, Storage], None]


def promote_stage(call: StageCall) -> StageEntry:
    """Runs in the flow (not a task): an approval pause must belong to the flow run itself."""
    answer = None
    if call.cfg.promote.require_approval and not promote_tasks.refusal_reasons(call.cfg, call.record):
        from flows.approval import ask_for_approval  # Prefect's pause API, only when approval is configured

        answer = ask_for_approval(call.cfg, call.record).answer()
        if not answer.approve:
            return promote_tasks.approval_refused(call.record.updated_at, answer)
    # The answer goes with the promotion: its summary, the card and the history's move name the approver.
    return promote_tasks.promote(call, answer)


TASKS: dict[str, StageTask] = {
    "verify": verify,
    "connectivity": connectivity,
    "finetune": finetune,
    "resume": resume_tasks.resume_test,
    "evaluate": evaluate,
    "promote": promote_stage,
}
"""The stages that are more than one Ray job: StageCall in, record entry out."""

ARTIFACTS: dict[str, Artifact] = {
    "verify": artifacts.verify_findings,
    "connectivity": artifacts.connectivity_table,
    "data": artifacts.dataset_summary,
    "finetune": artifacts.loss_image,
    "evaluate": artifacts.evaluation_table,
}
"""What a finished stage adds to the flow run page (stages not named here add nothing)."""


def task_for(stage: Stage) -> StageTask:
    """The stage's task: its own, or the generic one-job task for a stage that names its job module."""
    if stage.name in TASKS:
        return TASKS[stage.name]
    if stage.job is None:
        raise LookupError(
            f"stage {stage.name!r} has no task: give it job= (its Ray job's module) in the stage table "
            f"or a task in flows/stage_tasks.TASKS"
        )
    return job_stage(stage.job)


def check_bindings(stages: tuple[Stage, ...]) -> None:
    """Every stage runs something and every binding names a stage: a typo here would silently skip a stage."""
    for stage in stages:
        task_for(stage)
        if stage.job is not None and stage.name in TASKS:
            raise ValueError(f"stage {stage.name!r} names job {stage.job!r} and has a task in TASKS: keep one")
    unknown = (set(TASKS) | set(ARTIFACTS)) - set(table.names(stages))
    if unknown:
        raise ValueError(f"flows/stage_tasks binds {', '.join(sorted(unknown))}, not in the stage table")


check_bindings(table.STAGES)
