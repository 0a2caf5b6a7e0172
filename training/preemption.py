"""Ray's preemption notice in the fine-tune's step loop: a checkpoint before a drained node goes.

A spot reclaim kills a node; Ray Train restarts the worker group from the latest checkpoint, and every
step since that checkpoint is trained again (ray#63968: "checkpoint every 1000 steps, died at 999").
Ray Core is told in advance when a node is drained with a deadline (a spot interruption on EKS: 120 s;
by hand `ray drain-node --node-id X --reason DRAIN_NODE_REASON_PREEMPTION --reason-message M
--deadline-remaining-seconds N`). Ray Train (2.58+) watches for it (its PreemptionWatcher polls the
GCS every RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, default 5 s), tells every worker, and restarts the
group once the deadline passes, whatever the workers are doing then. `ray.train.get_preemption_info()`
returns the notice, rank 0's broadcast to all: a barrier that every rank must call at the same steps.

With train.checkpoint_on_preemption the step loop (training/finetune.py, `act_on_notice`) asks after
every ASK_EVERY_STEPS-th step. At the first notice it saves that step's checkpoint through the usual save path and waits
for it; then the group waits for Ray Train's restart, since a step trained now would be trained again
after it, unless the rest of the run fits well before the deadline (then it trains on and finishes).
Rank 0 appends each notice acted on to runs/<run>/stages/<job>/notices.jsonl; training.restarts puts its
step on the restart that followed (`Restart.notice_step`). The decisions are pure
(`saves_now`, `waits_for_restart`; tests/test_preemption.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tuneproof.core.rowlog import append_rows
from tuneproof.core.storage import Storage

NOTICES = "notices.jsonl"
"""Rank 0, per notice acted on: {attempt, step, deadline_ms, ranks, wait, time}."""
RESTART_FALLBACK_S = 120.0
"""How long Ray Train waits for a notice without a deadline before it restarts the group
(ray.train.v2._internal.constants.DEFAULT_PREEMPTION_DEADLINE_S)."""
ASK_EVERY_STEPS = 5
"""The loop asks Ray at every 5th step: one ask cost 5.6 ms (2 CPU workers, 200 calls, load 9 on 2 cores;
a gloo all_reduce of one float 0.9 ms), about 5 % of the local demo's step; every 5th, about 1 %. The
notice then reaches the loop at most 5 steps late, against a deadline of minutes (AWS: 120 s)."""
WAIT_PAST_DEADLINE_S = 60.0
"""A group that waited this long past the deadline without being restarted trains on (a Ray that
does not restart on the notice): the wait is bounded, never a hang."""


@dataclass(frozen=True)
class Notice:
    """Ray's preemption notice as the step loop uses it."""

    deadline_ms: int | None
    """When the drained node goes, unix time in ms (None: the drain gave no deadline)."""
    ranks: tuple[int, ...]
    """The worker ranks on the drained node(s)."""

    def seconds_left(self, now_s: float) -> float | None:
        return None if self.deadline_ms is None else self.deadline_ms / 1000 - now_s


def saves_now(notice: Notice | None, saved_at: int | None, saving_this_step: bool) -> bool:
    """Whether this step saves a checkpoint on the notice: at the first step one is seen, one save per
    notice, none when this step's scheduled checkpoint is being saved anyway. Pure."""
    return notice is not None and saved_at is None and not saving_this_step


def waits_for_restart(notice: Notice, step: int, max_steps: int, step_seconds: float | None, now_s: float) -> bool:
    """After the notice's checkpoint: wait for Ray Train's restart (every step trained now is trained again
    after it), unless the steps left, at `step_seconds` each (the loop's wall time per step, everything in
    it; None: not known yet), fit in half the time left before the deadline. Pure."""
    left = notice.seconds_left(now_s)
    if step >= max_steps:
        return False
    if left is None or step_seconds is None:
        return True
    return (max_steps - step) * step_seconds > left / 2


def wait_until(notice: Notice, now_s: float) -> float:
    """Until when the group waits for the restart: the deadline (or Ray's fallback for none) plus
    WAIT_PAST_DEADLINE_S. Pure."""
    left = notice.seconds_left(now_s)
    return now_s + (RESTART_FALLBACK_S if left is None else max(0.0, left)) + WAIT_PAST_DEADLINE_S


def supported() -> bool:
    """Ray Train has the notice (2.58 and 2.60 have it; earlier releases do not)."""
    import ray.train

    return hasattr(ray.train, "get_preemption_info")


def ask_ray() -> Notice | None:
    """The notice, if any node of this worker group is being drained. Collective: every rank, same steps."""
    import ray.train

    info = ray.train.get_preemption_info()
    if info is None:
        return None
    return Notice(info.deadline_ms, tuple(info.preempted_ranks))


@dataclass
class NoticeWatch:
    """One worker's view of preemption notices over one attempt of the worker group."""

    enabled: bool
    saved_at: int | None = None
    """The step this attempt saved on its notice (None: none acted on yet)."""
    since: tuple[int, float] | None = None
    """The first step this attempt asked about, and when: the loop's pace is measured from there."""

    @classmethod
    def start(cls, wanted: bool, log: Callable[[str], None]) -> NoticeWatch:
        """train.checkpoint_on_preemption, where this Ray can honour it; says once when it cannot."""
        if wanted and not supported():
            import ray

            log(
                f"train.checkpoint_on_preemption: Ray {ray.__version__} has no ray.train.get_preemption_info "
                "(Ray 2.58+): a preempted node costs the steps since the last checkpoint"
            )
        return cls(enabled=wanted and supported())

    def poll(self, step: int, now_s: float) -> Notice | None:
        """The notice, when enabled, not acted on yet and at an ASK_EVERY_STEPS step; asks Ray (a barrier)
        only then: every rank asks at the same steps."""
        if self.since is None:
            self.since = (step, now_s)
        return ask_ray() if self.enabled and self.saved_at is None and step % ASK_EVERY_STEPS == 0 else None

    def step_seconds(self, step: int, now_s: float) -> float | None:
        """Wall seconds per step of the loop since the first poll (None before a second step). Pure."""
        if self.since is None or step <= self.since[0]:
            return None
        return (now_s - self.since[1]) / (step - self.since[0])


def record_notice(
    storage: Storage, stage_parts: tuple[str, ...], attempt: int, step: int, notice: Notice, wait: bool
) -> None:
    """Rank 0: append the notice acted on to notices.jsonl."""
    row: dict[str, Any] = {
        "attempt": attempt,
        "step": step,
        "deadline_ms": notice.deadline_ms,
        "ranks": list(notice.ranks),
        "wait": wait,
        "time": time.time(),
    }
    append_rows(storage, [row], *stage_parts, NOTICES)


def wait_for_restart(notice: Notice, log: Callable[[str], None]) -> None:
    """Sleep until Ray Train tears this group down (at the deadline); returns, to train on, only if that
    has not happened by `wait_until`."""
    until = wait_until(notice, time.time())
    while time.time() < until:
        time.sleep(0.5)
    log(f"no restart {WAIT_PAST_DEADLINE_S:.0f} s past the preemption deadline: training on")
