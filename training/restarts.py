"""Restarts of the fine-tune's worker group: what failed, and the step each new attempt resumed at.

Ray Train (train.max_failures >= 1) restarts a failed worker group from the latest checkpoint; the
summary's `restarts` says so. Two files under runs/<run>/stages/<job>/, cleared when the job starts:

    attempts.jsonl   rank 0 of every attempt, once restored: {attempt, restored_step, restored_from, started_at}
    failures.jsonl   the Ray Train controller (FailureLog), when workers fail: {time, cause}

Metrics rows carry the attempt that wrote them, so `restarts()` (pure) can say at which step each
failed attempt stopped. Used by training/finetune.py (driver, workers and the controller's callback).
"""

from __future__ import annotations

import time
from typing import Any

import ray.train

from tuneproof.core.results import one_line
from tuneproof.core.rowlog import append_rows, read_rows
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import Restart

ATTEMPTS = "attempts.jsonl"
FAILURES = "failures.jsonl"


def begin_attempt(storage: Storage, stage_parts: tuple[str, ...], restored_step: int, restored_from: str | None) -> int:
    """Rank 0, once restored: record this attempt; returns its number (0 for the job's first)."""
    attempt = len(read_rows(storage, *stage_parts, ATTEMPTS))
    row = {
        "attempt": attempt,
        "restored_step": restored_step,
        "restored_from": restored_from,
        "started_at": time.time(),
    }
    append_rows(storage, [row], *stage_parts, ATTEMPTS)
    return attempt


class FailureLog(ray.train.UserCallback):
    """Runs in the Ray Train controller: writes each worker-group failure's cause to failures.jsonl."""

    def __init__(self, root: str, endpoint_url: str | None, stage_parts: tuple[str, ...]):
        self.root, self.endpoint_url, self.stage_parts = root, endpoint_url, stage_parts

    def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
        cause = "; ".join(
            f"rank {rank}: {one_line(f'{type(error).__name__}: {error}')}"
            for rank, error in sorted(worker_exceptions.items())
        )
        row = {"time": time.time(), "cause": cause[:500]}
        append_rows(Storage(self.root, self.endpoint_url), [row], *self.stage_parts, FAILURES)


def restarts(
    attempts: list[dict], failures: list[dict], rows: list[dict], notices: list[dict] | None = None
) -> list[Restart]:
    """One Restart per attempt after the first: the step the one before it stopped at (its last logged
    row), the failure the controller saw in between, where the new attempt resumed, the steps lost
    between the two, and the step the one before saved at on a preemption notice (notices.jsonl). Pure."""
    found = []
    for before, after in zip(attempts, attempts[1:]):
        steps = [r["step"] for r in rows if r.get("attempt") == before["attempt"] and r["time"] >= before["started_at"]]
        causes = [f["cause"] for f in failures if before["started_at"] <= f["time"] <= after["started_at"]]
        at_step = max(steps, default=None)
        noticed = [n["step"] for n in notices or [] if n["attempt"] == before["attempt"]]
        found.append(
            Restart(
                attempt=after["attempt"],
                at_step=at_step,
                restored_step=after["restored_step"],
                restored_from=after["restored_from"],
                cause=causes[0] if causes else None,
                lost_steps=None if at_step is None else max(0, at_step - after["restored_step"]),
                notice_step=noticed[0] if noticed else None,
            )
        )
    return found
