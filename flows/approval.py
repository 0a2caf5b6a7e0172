"""The approval pause before the production pointer moves (promote.require_approval): a typed form in the UI."""

from __future__ import annotations

from prefect import get_run_logger, pause_flow_run
from prefect.input import RunInput
from pydantic import Field

from tuneproof.control.record import RunRecord
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import now_iso
from tuneproof.core.summaries_eval import ApprovalAnswer, EvaluateSummary


class Approval(RunInput):
    """The form an approver fills in the Prefect UI before the production pointer moves."""

    approve: bool = False
    # A pattern, not a validator: it is in the form's JSON schema, so Prefect's server refuses a blank approver
    # and the flow stays paused for a real answer (an anonymous approval moved the pointer "by" nobody).
    approver: str = Field(
        pattern=r"\S",
        description="Who decides, approving or refusing (required): recorded on the promotion, the model card "
        "and the production history.",
    )
    comment: str = Field("", description="Why: recorded with the decision.")

    def answer(self) -> ApprovalAnswer:
        """The decision as the record, the card and the history keep it."""
        return ApprovalAnswer(
            approve=self.approve, by=self.approver.strip(), comment=self.comment.strip(), at=now_iso()
        )


def ask_for_approval(cfg: PipelineConfig, record: RunRecord) -> Approval:
    evaluation = record.summary("evaluate", EvaluateSummary)
    lines = evaluation.gates.lines if evaluation else []
    get_run_logger().info("waiting for approval to promote; gates: " + "; ".join(lines))
    # Checked every second, not Prefect's default 10: an approver who answers waits for the flow to notice.
    return pause_flow_run(wait_for_input=Approval, timeout=cfg.promote.approval_timeout_s, poll_interval=1)
