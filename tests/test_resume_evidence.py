"""Resume evidence: replayed losses against the reference run, and the restored step."""

import math

from tuneproof.control.resume_evidence import check_restart, compare_losses
from tuneproof.core.findings import Finding


def test_identical_losses_pass_with_zero_tolerance():
    reference = {1: 3.0, 2: 2.5, 3: 2.25, 4: 2.0}
    verdict = compare_losses(reference, {3: 2.25, 4: 2.0, 5: 1.9}, rtol=0.0)
    assert verdict == {
        "steps_compared": 2,
        "max_abs_diff": 0.0,
        "max_rel_diff": 0.0,
        "ok": True,
        "mismatches": [],
        "reason": None,
    }


def test_a_difference_beyond_rtol_is_a_mismatch_naming_the_step():
    verdict = compare_losses({5: 2.0, 6: 1.0}, {5: 2.0, 6: 1.05}, rtol=0.01)
    assert not verdict["ok"] and verdict["steps_compared"] == 2
    (mismatch,) = verdict["mismatches"]
    assert mismatch["step"] == 6 and math.isclose(mismatch["rel_diff"], 0.05)
    assert verdict["reason"].startswith("1 of 2 replayed steps differ; first at step 6: replay 1.05, reference 1.0")
    assert compare_losses({5: 2.0, 6: 1.0}, {5: 2.0, 6: 1.05}, rtol=0.06)["ok"]


def test_non_finite_losses_never_match():
    verdict = compare_losses({1: float("nan"), 2: 1.0}, {1: float("nan"), 2: 1.0}, rtol=1.0)
    assert not verdict["ok"] and [m["step"] for m in verdict["mismatches"]] == [1]
    assert verdict["max_abs_diff"] == math.inf


def test_no_common_step_is_not_evidence():
    verdict = compare_losses({1: 2.0, 2: 1.5}, {7: 1.0}, rtol=0.0)
    assert not verdict["ok"] and verdict["steps_compared"] == 0 and verdict["max_abs_diff"] is None
    assert verdict["reason"] == "no common steps: reference logged steps 1..2, replay logged steps 7..7"


def test_check_restart_flags_a_fresh_start_or_another_step():
    assert check_restart(8, 8) is None
    assert check_restart(8, None) == Finding(
        "resumed run", "restored_step", None, 8, "it started from scratch instead of a checkpoint"
    )
    assert check_restart(8, 4).seen == 4


def test_the_interrupt_phase_holds_on_a_checkpoint_step_whatever_the_seed():
    """The hold step must be a checkpoint step of the interrupt job, also when the seed checkpoint's step
    is not a multiple of resume.extra_steps (the fault lab's checkpoint_every 10 with extra_steps 4)."""
    from tasks.resume import phase_steps
    from training.finetune import TrainParams

    for seed, extra, replay in ((300, 4, 5), (30, 4, 5), (20, 3, 2), (7, 1, 1)):
        steps = phase_steps(seed, extra, replay)
        params = TrainParams(
            dataset="datasets/x/y", run_name="r-resume-t1", **steps, hold_after_checkpoint_step=seed + extra
        )
        assert params.hold_after_checkpoint_step % params.checkpoint_every == 0
        assert params.max_steps == seed + extra + replay
