"""The rollback flow: move a model's production pointer back to an earlier version, from the Prefect UI.

    prefect deployment run 'tuneproof-rollback/rollback' -p model=NAME -p reason='...' -p by=NAME \
        [-p to_version=v0001-...] [-p storage='{"root": "s3://bucket/prefix"}']

The same as `tuneproof rollback NAME [--to VERSION] --reason TEXT` (tasks.promote.roll_back): refused,
with the pointer where it was, when the target's files do not match its manifest or another flow holds
the model's pointer; recorded in the model's production history and in the rolled-back run's record.
The form is typed: model, reason and by are required (a UI run has no user of its own to record: the
open-source Prefect server names a flow run's creator only for an automation, Prefect Cloud for a user too,
and that creator is recorded beside `by` when there is one), to_version is optional, and `storage` is the
registry's root: the embedded default's directory locally, the EKS profile's bucket on the
`eks-rollback` deployment.
"""

from __future__ import annotations

from typing import Annotated
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State
from pydantic import Field

from tasks.promote import rollback as rollback_task
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_cluster import StorageConfig
from tuneproof.core.names import slug_problem

ModelName = Annotated[str, Field(min_length=1, description="The registered model, e.g. dates-qwen2-tiny.")]
Reason = Annotated[str, Field(min_length=1, description="Why production goes back (recorded in the history).")]
Who = Annotated[str, Field(min_length=1, description="Who rolls back (recorded in the history), e.g. ana@team.")]
Version = Annotated[
    str | None,
    Field(description="The version to go back to, e.g. v0001-<run>; empty: the version production replaced."),
]


@flow(name="tuneproof-rollback", log_prints=True)
def rollback(
    model: ModelName,
    reason: Reason,
    by: Who,
    to_version: Version = None,
    storage: StorageConfig = StorageConfig(),
) -> State:
    """Move `model`'s production pointer back to `to_version` (default: the version production replaced)."""
    # The form sends a cleared field as "": the field says empty means the version production replaced.
    to_version = to_version if to_version and to_version.strip() else None
    for label, value in (("model", model), ("to_version", to_version)):
        if value is not None and (problem := slug_problem(value)):
            return Failed(message=f"nothing moved: {label} {value!r} {problem}")
    if not reason.strip() or not by.strip():
        return Failed(message="nothing moved: a rollback needs a non-empty reason and who does it (by)")
    cfg = PipelineConfig(storage=storage)
    run_id = str(flow_run.get_id())
    result = rollback_task(cfg, model, reason, who(by, flow_run_creator(run_id)), to_version, run_id)
    if not result.rolled_back:
        return Failed(message="rollback refused, the pointer did not move: " + "; ".join(result.reasons), data=result)
    get_run_logger().info(f"{model}: {result.from_version} -> {result.to_version} (history move #{result.move})")
    for warning in result.warnings:  # the rollback stands; what it could not record is said where people look
        get_run_logger().warning(warning)
    return Completed(message=f"{model} production is {result.to_version}", data=result)


def who(by: str, creator: str | None) -> str:
    """The history's `by`: the person the form names, and the flow run's creator when Prefect recorded one. Pure."""
    return f"{by} (flow run created by {creator})" if creator else by


def flow_run_creator(run_id: str) -> str | None:
    """Who Prefect says created this flow run ('AUTOMATION nightly-guard', 'USER ana'), or None when it
    recorded nobody (a deployment run from the open-source UI or CLI)."""
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        created_by = client.read_flow_run(UUID(run_id)).created_by
    if created_by is None:
        return None
    return f"{created_by.type or 'creator'} {created_by.display_value or created_by.id}".strip()
