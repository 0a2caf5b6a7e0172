"""Ray's preemption notice in the fine-tune (training/preemption.py): when the step loop saves, waits, asks.

    .venv/bin/python -m pytest -q tests/test_preemption.py

Pure decisions and the bookkeeping; the drained node itself is the fault rows preemption-notice and
preemption-no-notice (faults/f_preempt.py).
"""

from __future__ import annotations

import pytest

from training import preemption
from training.preemption import ASK_EVERY_STEPS, Notice, NoticeWatch, saves_now, wait_until, waits_for_restart
from training.restarts import restarts
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config
from tuneproof.core.summaries_training import Restart

NOW = 1_000.0
NOTICE = Notice(deadline_ms=int((NOW + 120) * 1000), ranks=(1,))


def test_the_first_notice_saves_once_and_a_scheduled_checkpoint_counts_as_that_save() -> None:
    assert saves_now(NOTICE, saved_at=None, saving_this_step=False)
    assert not saves_now(None, saved_at=None, saving_this_step=False)  # no notice: the schedule alone
    assert not saves_now(NOTICE, saved_at=15, saving_this_step=False)  # one save per notice
    assert not saves_now(NOTICE, saved_at=None, saving_this_step=True)  # checkpoint_every's save is it


def test_after_the_save_the_group_waits_unless_the_rest_of_the_run_fits_before_the_deadline() -> None:
    # 120 s left: 100 steps of 1 s do not fit in half of it; wait (each would be trained again).
    assert waits_for_restart(NOTICE, step=300, max_steps=400, step_seconds=1.0, now_s=NOW)
    # 50 steps of 1 s fit in 60 s: train on and finish before the node goes.
    assert not waits_for_restart(NOTICE, step=350, max_steps=400, step_seconds=1.0, now_s=NOW)
    assert not waits_for_restart(NOTICE, step=400, max_steps=400, step_seconds=1.0, now_s=NOW)
    # No deadline given: Ray Train restarts RESTART_FALLBACK_S after it saw the notice; wait.
    assert waits_for_restart(Notice(None, (0,)), step=399, max_steps=400, step_seconds=0.01, now_s=NOW)
    # The pace not known yet (the notice at the attempt's first step): wait.
    assert waits_for_restart(NOTICE, step=399, max_steps=400, step_seconds=None, now_s=NOW)


def test_the_pace_is_the_loops_wall_time_per_step_not_the_optimizer_step_alone() -> None:
    # The first fault run of the notice trained on: 25 steps of 0.09 s (the optimizer step) fit in half of
    # the 4.8 s left, but each step of the loop took 0.6 s; a periodic checkpoint then overtook the notice's.
    watch = NoticeWatch(enabled=False)
    assert watch.step_seconds(11, NOW) is None
    watch.poll(11, NOW)
    assert watch.step_seconds(11, NOW) is None and watch.step_seconds(15, NOW + 2.4) == pytest.approx(0.6)
    notice = Notice(deadline_ms=int((NOW + 2.4 + 4.8) * 1000), ranks=(0,))
    assert not waits_for_restart(notice, step=15, max_steps=40, step_seconds=0.09, now_s=NOW + 2.4)
    assert waits_for_restart(
        notice, step=15, max_steps=40, step_seconds=watch.step_seconds(15, NOW + 2.4), now_s=NOW + 2.4
    )


def test_the_wait_is_bounded_past_the_deadline() -> None:
    assert wait_until(NOTICE, NOW) == NOW + 120 + preemption.WAIT_PAST_DEADLINE_S
    assert wait_until(Notice(None, (0,)), NOW) == NOW + preemption.RESTART_FALLBACK_S + preemption.WAIT_PAST_DEADLINE_S
    late = Notice(deadline_ms=int((NOW - 5) * 1000), ranks=(0,))  # seen after its deadline
    assert wait_until(late, NOW) == NOW + preemption.WAIT_PAST_DEADLINE_S


def test_ray_is_asked_at_the_same_steps_on_every_rank_and_not_after_the_notice(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[int] = []

    def ask_ray() -> Notice:
        asked.append(1)
        return NOTICE

    monkeypatch.setattr(preemption, "ask_ray", ask_ray)
    watch = NoticeWatch(enabled=True)
    seen = {step: watch.poll(step, NOW + step) for step in range(1, 2 * ASK_EVERY_STEPS + 1)}
    assert [s for s, n in seen.items() if n] == [ASK_EVERY_STEPS, 2 * ASK_EVERY_STEPS] and len(asked) == 2
    watch.saved_at = ASK_EVERY_STEPS
    assert watch.poll(3 * ASK_EVERY_STEPS, NOW) is None and len(asked) == 2  # acted on: no more barriers
    assert NoticeWatch(enabled=False).poll(ASK_EVERY_STEPS, NOW) is None and len(asked) == 2


def test_a_ray_without_the_notice_is_said_once_and_training_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import ray.train

    monkeypatch.delattr(ray.train, "get_preemption_info")
    said: list[str] = []
    watch = NoticeWatch.start(True, said.append)
    assert not watch.enabled and watch.poll(ASK_EVERY_STEPS, NOW) is None
    assert len(said) == 1 and "no ray.train.get_preemption_info (Ray 2.58+)" in said[0]
    assert NoticeWatch.start(False, said.append) == NoticeWatch(enabled=False) and len(said) == 1


def test_ray_2_60_has_the_notice() -> None:
    assert preemption.supported()


def test_each_restart_names_the_step_its_attempt_saved_at_on_a_notice() -> None:
    attempts: list[dict] = [
        {"attempt": 0, "restored_step": 0, "restored_from": None, "started_at": 100.0},
        {"attempt": 1, "restored_step": 15, "restored_from": "/s/checkpoint_000015", "started_at": 200.0},
        {"attempt": 2, "restored_step": 30, "restored_from": "/s/checkpoint_000030", "started_at": 300.0},
    ]
    rows = [{"step": s, "time": 100.0 + s, "attempt": 0} for s in range(1, 16)]
    rows += [{"step": s, "time": 200.0 + s, "attempt": 1} for s in range(16, 34)]
    notices = [{"attempt": 0, "step": 15, "deadline_ms": 190_000, "ranks": [1], "wait": True, "time": 116.0}]
    found = restarts(attempts, [], rows, notices)
    assert found == [
        Restart(attempt=1, at_step=15, restored_step=15, restored_from="/s/checkpoint_000015", lost_steps=0,
                notice_step=15),
        Restart(attempt=2, at_step=33, restored_step=30, restored_from="/s/checkpoint_000030", lost_steps=3),
    ]  # fmt: skip
    assert restarts(attempts, [], rows) == [r.model_copy(update={"notice_step": None}) for r in found]


def test_the_eks_profile_checkpoints_on_a_notice_and_the_local_default_does_not() -> None:
    assert load_config(PROJECT_ROOT / "configs" / "eks.yaml").train.checkpoint_on_preemption
    assert not PipelineConfig().train.checkpoint_on_preemption
