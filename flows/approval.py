"""The approval pause before the production pointer moves (promote.require_approval): a typed form in the UI."""

from __future__ import annotations

from prefect import get_run_logger, pause_flow_run
from prefect.input import RunInput

from tuneproof.control.record import RunRecord
from tuneproof.core.config import PipelineConfig
from tuneproof.core.summaries_eval import EvaluateSummary


class Approval(RunInput):
    """The form an approver fills in the Prefect UI before the production pointer moves."""

    approve: bool = False
    approver: str = ""
    comment: str = ""


def ask_for_approval(cfg: PipelineConfig, record: RunRecord) -> Approval:
    evaluation = record.summary("evaluate", EvaluateSummary)
    lines = evaluation.gates.lines if evaluation else []
    get_run_logger().info("waiting for approval to promote; gates: " + "; ".join(lines))
    # Checked every second, not Prefect's default 10: an approver who answers waits for the flow to notice.
    return pause_flow_run(wait_for_input=Approval, timeout=cfg.promote.approval_timeout_s, poll_interval=1)
