"""The rollback flow: move a model's production pointer back to an earlier version, from the Prefect UI.

    prefect deployment run 'tuneproof-rollback/rollback' -p model=NAME -p reason='...' [-p to_version=v0001-...]

The same as `tuneproof rollback NAME [--to VERSION] --reason TEXT` (tasks.promote.roll_back): refused,
with the pointer where it was, when the target's files do not match its manifest or another flow holds
the model's pointer; recorded in the model's production history and in the rolled-back run's record.
"""

from __future__ import annotations

from typing import Annotated

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import Field

from tasks.promote import rollback as rollback_task
from tuneproof.core.config import PipelineConfig
from tuneproof.core.names import slug_problem

ModelName = Annotated[str, Field(min_length=1, description="The registered model, e.g. dates-qwen2-tiny.")]
Reason = Annotated[str, Field(min_length=1, description="Why production goes back (recorded in the history).")]


@flow(name="tuneproof-rollback", log_prints=True)
def rollback(
    model: ModelName,
    reason: Reason,
    to_version: str | None = None,
    by: str = "prefect",
    config: PipelineConfig = PipelineConfig(),
) -> State:
    """Move `model`'s production pointer back to `to_version` (default: the version before production)."""
    for label, value in (("model", model), ("to_version", to_version)):
        if value is not None and (problem := slug_problem(value)):
            return Failed(message=f"nothing moved: {label} {value!r} {problem}")
    if not reason.strip():
        return Failed(message="nothing moved: a rollback needs a non-empty reason")
    result = rollback_task(config, model, reason, by, to_version, str(flow_run.get_id()))
    if not result.rolled_back:
        return Failed(message="rollback refused, the pointer did not move: " + "; ".join(result.reasons), data=result)
    get_run_logger().info(f"{model}: {result.from_version} -> {result.to_version} (history move #{result.move})")
    return Completed(message=f"{model} production is {result.to_version}", data=result)
