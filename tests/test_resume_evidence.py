"""Resume evidence: replayed losses against the reference run, and the restored step."""

import math

import pytest

from tests.reading import present
from tuneproof.control.resume_evidence import Ledger, check_restart, compare_ledgers, compare_losses
from tuneproof.core.findings import Finding
from tuneproof.core.summaries_training import LossPoint


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
    assert present(check_restart(8, 4)).seen == 4


def test_the_interrupt_phase_stops_on_a_checkpoint_step_whatever_the_seed():
    """The interruption step must be a checkpoint step of the interrupt phase, also when the seed checkpoint's
    step is not a multiple of resume.extra_steps (the fault lab's checkpoint_every 10 with extra_steps 4)."""
    from training.finetune_state import TrainParams
    from training.resume import ResumeParams, phase_params

    for seed, extra, replay in ((300, 4, 5), (30, 4, 5), (20, 3, 2), (7, 1, 1)):
        params = ResumeParams(
            dataset="datasets/x/y",
            run_name="r-resume-t1",
            init_from="/ckpt",
            interrupt_at=seed + extra,
            max_steps=seed + extra + replay,
        )
        interrupt = TrainParams.model_validate(phase_params("interrupt", params))
        resumed = TrainParams.model_validate(phase_params("continue", params))
        assert interrupt.interrupt_after_checkpoint_step == interrupt.max_steps == seed + extra
        assert interrupt.interrupt_after_checkpoint_step % interrupt.checkpoint_every == 0
        assert resumed.interrupt_after_checkpoint_step is None and resumed.first_step_marker
        assert resumed.max_steps == seed + extra + replay and resumed.run_name == interrupt.run_name


def test_a_resume_job_must_leave_steps_to_replay():
    from training.resume import ResumeParams

    with pytest.raises(ValueError, match="leaves no step to replay after interrupt_at 8"):
        ResumeParams(dataset="d", run_name="r", init_from="/c", interrupt_at=8, max_steps=8)


# ---------------------------------------------------------------- the task's judgement of the job


def judged(
    tmp_path,
    killed_at: int | None = 304,
    restored: int | None = 304,
    replay_loss_at_307: float = 0.7,
    samples_at_306: str = "s306",
    continued: range | list[int] = range(305, 310),
    main_steps: range = range(1, 401),
):
    """The judge's verdict on a resume job whose interrupt phase logged steps 301..304 and whose continue
    phase logged 305..309, against a main run whose loss at step s is 1/s (0.7 at 307 matches nothing) and
    whose step s trained on samples "s<s>" (a running ledger "r<s>"), as the replay's did but at 306.
    `continued` and `main_steps` change which steps the continue phase and the main run logged."""
    import json

    from tasks.jobs import StageCall
    from tasks.resume import judge
    from tuneproof.control.record import CodeIdentity, StageEntry, new_record
    from tuneproof.core.config import PipelineConfig
    from tuneproof.core.summaries import CheckpointRef
    from tuneproof.core.summaries_training import FinetuneSummary, ResumeJobSummary, ResumeSummary

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "resume": {"loss_rtol": 0.0}})
    main: list[LossPoint] = [(s, 1 / s) for s in main_steps]
    metrics = tmp_path / "runs" / "r1" / "stages" / "resume-t1-interrupt" / "metrics.jsonl"
    metrics.parent.mkdir(parents=True)
    rows = [{"step": s, "loss": 1 / s, "samples": f"s{s}", "ledger": f"r{s}"} for s in range(301, 305)]
    metrics.write_text("".join(json.dumps(row) + "\n" for row in rows))
    replayed = [(s, replay_loss_at_307 if s == 307 else 1 / s) for s in continued]
    ledger = [(s, samples_at_306 if s == 306 else f"s{s}", None if s >= 306 else f"r{s}") for s in continued]
    resumed = FinetuneSummary(
        run_name="r1-resume-t1",
        train_storage_uri="x",
        checkpoints=[],
        start_step=restored or 0,
        steps=309,
        seconds=1.0,
        loss_curve=replayed,
        restored_step=restored,
        first_step_completed_at=1010.0,
        ledger=ledger,
    )
    job = ResumeJobSummary(
        interrupt_job="resume-t1-interrupt",
        continue_job="resume-t1-continue",
        interrupted_at_step=killed_at,
        interrupted_at=1000.0,
        resumed=resumed,
    )
    record = new_record("r1", cfg, CodeIdentity(), None)
    tuned = FinetuneSummary(
        run_name="r1", train_storage_uri="x", checkpoints=[], start_step=0, steps=400, seconds=1.0,
        ledger=[(s, f"s{s}", f"r{s}") for s in main_steps],
    )  # fmt: skip
    record.stages["finetune"] = StageEntry.succeeded("finetune", tuned, "t0")
    call = StageCall("resume", cfg, "r1", 1, 60, ResumeSummary, {}, record)
    return judge(call, job, CheckpointRef(300, "/ckpt/300"), 304, main)


def test_the_judge_passes_a_kill_at_the_interruption_step_restored_there_with_every_loss_equal(tmp_path):
    verdict = judged(tmp_path, replay_loss_at_307=1 / 307)
    assert verdict.problems == [] and verdict.interrupted and verdict.restored_step == 304
    assert verdict.loss_comparison.steps_compared == 9 and verdict.max_loss_diff == 0.0
    assert verdict.seconds_to_first_resumed_step == 10.0  # from the kill to the restarted run's first step
    assert verdict.ledger_comparison.ok and verdict.ledger_comparison.steps_compared == 9


def test_the_judge_fails_a_replay_that_trained_on_other_samples_even_with_every_loss_equal(tmp_path):
    verdict = judged(tmp_path, replay_loss_at_307=1 / 307, samples_at_306="planted")
    assert verdict.loss_comparison.ok and verdict.ledger_comparison.first_differing_step == 306
    assert verdict.problems == [
        "the data order differs from the main run's: 1 of 9 steps trained on other samples than the reference; "
        "first at step 306: its samples differ (replay planted, reference s306)"
    ]


def test_the_judge_names_a_wrong_restore_a_wrong_kill_step_and_a_differing_loss(tmp_path):
    problems = judged(tmp_path, killed_at=308, restored=300).problems
    assert problems[0] == "the interrupt phase was killed after step 308, not 304"
    assert "restored_step" in problems[1] and "300" in problems[1] and "304" in problems[1]
    assert problems[2].startswith("replayed losses differ from the main run")


@pytest.mark.parametrize(
    ("continued", "problems"),
    [
        (  # its metrics lost: the interrupt phase's four steps alone once passed
            [],
            [
                "the restarted run logged no step, expected step 305 first (the one after its restored step 304)",
                "the continue phase's losses compared with the main run's on no steps instead of steps 305..309: "
                "steps 305..309 not logged by it",
                "the continue phase's data order compared with the main run's on no steps instead of steps 305..309: "
                "steps 305..309 not logged by it",
            ],
        ),
        (
            [305],
            [
                "the continue phase's losses compared with the main run's on step 305 instead of steps 305..309: "
                "steps 306..309 not logged by it",
                "the continue phase's data order compared with the main run's on step 305 instead of steps 305..309: "
                "steps 306..309 not logged by it",
            ],
        ),
        (  # claims to restore 304, yet trained from 301: it restored an earlier step
            range(301, 310),
            [
                "the restarted run first logged step 301, expected step 305 first (the one after its restored step "
                "304)",
                "the continue phase's losses compared with the main run's on steps 301..309 instead of steps "
                "305..309: steps 301..304 logged by it but outside its range",
                "the continue phase's data order compared with the main run's on steps 301..309 instead of steps "
                "305..309: steps 301..304 logged by it but outside its range",
            ],
        ),
    ],
)
def test_the_judge_fails_a_continue_phase_that_did_not_log_exactly_the_steps_after_its_restore(
    tmp_path, continued, problems
):
    """Every step k+1 .. k+extra+replay must be compared; the comparisons alone judge the steps both runs logged."""
    verdict = judged(tmp_path, replay_loss_at_307=1 / 307, continued=continued)
    assert verdict.loss_comparison.ok and verdict.ledger_comparison.ok
    assert verdict.problems == problems


def test_the_judge_fails_with_no_step_compared_instead_of_crashing(tmp_path):
    verdict = judged(tmp_path, replay_loss_at_307=1 / 307, main_steps=range(1, 301))
    assert verdict.loss_comparison.steps_compared == 0
    assert verdict.problems[0] == (
        "the replayed losses cannot be checked, 0 steps compared: no common steps: reference logged steps 1..300, "
        "replay logged steps 301..309"
    )
    assert (
        "the continue phase's losses compared with the main run's on no steps instead of steps 305..309: "
        "steps 305..309 not logged by the main run"
    ) in verdict.problems


def test_the_judge_names_the_steps_the_main_run_lacks():
    from tasks.resume import phase_steps, step_problems

    def steps(first: int, last: int) -> tuple[dict[int, float], Ledger]:
        return {s: 1.0 for s in range(first, last + 1)}, {s: (f"s{s}", None) for s in range(first, last + 1)}

    logged = {"interrupt": steps(301, 304), "continue": steps(305, 309)}
    main = (steps(1, 307)[0], steps(1, 309)[1])
    assert step_problems(phase_steps(300, 304, 5), 304, logged, main) == [
        "the continue phase's losses compared with the main run's on steps 305..307 instead of steps 305..309: "
        "steps 308..309 not logged by the main run"
    ]
    assert step_problems(phase_steps(300, 304, 5), 304, logged, steps(1, 309)) == []


def test_identical_ledgers_pass_over_every_common_step():
    reference: Ledger = {1: ("a", "r1"), 2: ("b", "r2"), 3: ("c", "r3")}
    replay: Ledger = {2: ("b", "r2"), 3: ("c", "r3"), 4: ("d", "r4")}
    verdict = compare_ledgers(reference, replay)
    assert verdict == {"steps_compared": 2, "first_differing_step": None, "ok": True, "reason": None}


def test_the_first_step_whose_samples_differ_is_named():
    reference: Ledger = {5: ("a", "r5"), 6: ("b", "r6"), 7: ("c", "r7")}
    verdict = compare_ledgers(reference, {5: ("a", "r5"), 6: ("x", "q6"), 7: ("y", "q7")})
    assert not verdict["ok"] and verdict["first_differing_step"] == 6
    assert verdict["reason"] == (
        "2 of 3 steps trained on other samples than the reference; first at step 6: its samples differ "
        "(replay x, reference b)"
    )


def test_the_same_samples_after_a_different_history_fail_on_the_running_ledger():
    """A restore that skipped or repeated samples before the checkpoint: each later step trains on the planned
    samples, but the running ledger it carried on says the history differs."""
    verdict = compare_ledgers({5: ("a", "r5"), 6: ("b", "r6")}, {5: ("a", "q5"), 6: ("b", "q6")})
    assert verdict["first_differing_step"] == 5 and "running ledger (the order before it)" in verdict["reason"]
    unknown = compare_ledgers({5: ("a", "r5"), 6: ("b", "r6")}, {5: ("a", None), 6: ("b", None)})
    assert unknown["ok"]  # resumed from a checkpoint without a ledger: the per-step samples still count


def test_ledgers_without_a_common_step_are_not_evidence():
    verdict = compare_ledgers({1: ("a", "r")}, {9: ("a", "r")})
    assert (
        not verdict["ok"]
        and verdict["reason"] == "no common steps: reference logged steps 1..1, replay logged steps 9..9"
    )


def test_a_long_runs_thinned_summary_is_judged_on_every_logged_step_and_a_changed_log_is_refused(tmp_path):
    """The record keeps at most CURVE_POINTS of a long run's losses; the resume test reads them all back from
    the metrics log the summary names, and only as they were when the summary was written."""
    from tasks.resume import every_point
    from training.finetune_summary import curve_fields
    from tuneproof.core.results import StageFailure
    from tuneproof.core.rowlog import append_rows
    from tuneproof.core.storage import Storage
    from tuneproof.core.summaries_training import CURVE_POINTS, FinetuneSummary, ledger_points, loss_curve

    rows = [{"step": s, "loss": 1 / s, "samples": f"s{s}", "ledger": f"r{s}"} for s in range(1, 3 * CURVE_POINTS)]
    storage, log = Storage(str(tmp_path)), ("runs", "r1", "stages", "finetune", "metrics.jsonl")
    append_rows(storage, rows, *log)
    fields = curve_fields(rows, "/".join(log))
    summary = FinetuneSummary(run_name="r1", train_storage_uri="x", checkpoints=[], start_step=0, steps=len(rows),
                              seconds=1.0, **fields)  # fmt: skip
    assert summary.thinned and len(summary.loss_curve) == CURVE_POINTS
    assert every_point(storage, summary, summary.loss_curve) == (loss_curve(rows), ledger_points(rows))

    append_rows(storage, [{"step": 7, "loss": 0.5, "samples": "s7", "ledger": "r7"}], *log)  # a replay, after
    with pytest.raises(StageFailure, match=f"changed since .*expected {fields['metrics_sha256']}"):
        every_point(storage, summary, summary.loss_curve)


def test_a_resume_job_that_succeeded_without_a_continue_phase_is_an_infrastructure_failure_not_a_pass():
    """The job's own SUCCEEDED is not evidence: without the continue phase's summary nothing showed a new run
    continuing from the checkpoint, so the entry fails (infrastructure) naming what is missing."""
    from tasks.resume import without_continue_evidence
    from tuneproof.control.record import StageEntry
    from tuneproof.core.results import FailureClass, StageResult
    from tuneproof.core.summaries_training import ResumeJobSummary, ResumeSummary

    passed = StageResult(stage="resume-t1", status="succeeded", started_at="t0", ended_at="t1")
    summary = ResumeSummary(interrupted=True, interrupted_at_step=304)
    entry = StageEntry.from_jobs("resume", passed, [], "t0", summary)
    job = ResumeJobSummary(
        interrupt_job="resume-t1-interrupt", continue_job="resume-t1-continue", interrupted_at_step=304
    )
    for left, missing in ((job, "no continue phase (resumed is None; its stage folder resume-t1-continue)"),
                          (None, "no summary (ResumeJobSummary)")):  # fmt: skip
        judged = without_continue_evidence(entry, left)
        assert (judged.status, judged.failure_class) == ("failed", FailureClass.infrastructure)
        assert judged.cause == (
            f"the resume job succeeded but left {missing}: no evidence that a new run continued from the checkpoint"
        )
        assert judged.summary == entry.summary  # the evidence it did leave stays on the entry

    failed = StageEntry.failed("resume", FailureClass.modeling, "the restarted run failed: loss 62 > 50")
    assert without_continue_evidence(failed, job) == failed  # a job's own failure stands as it was classed
