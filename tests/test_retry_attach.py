"""A Prefect retry never re-rolls a verdict: it attaches to the job its earlier try submitted and reads what it left.

    python -m pytest -q tests/test_retry_attach.py

The retry comes after the unexpected (a lost dashboard connection while following a job), by which time the job
may have ended. A job that ended with a result reached a verdict, failed or not, and the retry's entry is that
verdict; only a job that was stopped or left no result is replaced by a new attempt, which the entry still lists.
The Ray job client is a double of the calls the runner makes; storage is a temporary directory.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import requests
from ray.job_submission import JobStatus

from tasks.rayjob import INVOCATION, JobSpec, RayJobRunner, reattaches
from tuneproof.control import cost
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass, StageResult, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import EvaluateSummary

RUN = "r-retry"
GATE_FAILED = StageResult(
    stage="evaluate",
    status="failed",
    failure_class=FailureClass.modeling,
    cause="gate exact_match >= 0.8: 0.62 [0.55, 0.69] (fail)",
    started_at=now_iso(),
    ended_at=now_iso(),
)
PASSED = StageResult(stage="evaluate", status="succeeded", started_at=now_iso(), ended_at=now_iso())
INFRA = GATE_FAILED.model_copy(update={"failure_class": FailureClass.infrastructure, "cause": "NCCL timeout"})


def test_which_jobs_a_submission_attaches_to():
    assert reattaches(JobStatus.RUNNING, None, same_invocation=False)  # still going: follow it
    assert reattaches(JobStatus.FAILED, GATE_FAILED, same_invocation=True)  # a retry reads its failed verdict
    assert reattaches(JobStatus.FAILED, INFRA, same_invocation=True)  # an infrastructure failure stays one
    assert reattaches(JobStatus.SUCCEEDED, PASSED, same_invocation=False)
    assert reattaches(JobStatus.FAILED, GATE_FAILED, same_invocation=False)  # a crashed flow's job: the verdict stands
    assert not reattaches(JobStatus.FAILED, INFRA, same_invocation=False)  # what a continuation reruns (or resumes)
    assert not reattaches(JobStatus.FAILED, None, same_invocation=True)  # it left no verdict
    assert not reattaches(JobStatus.SUCCEEDED, None, same_invocation=True)
    assert not reattaches(JobStatus.STOPPED, INFRA, same_invocation=True)


@dataclass
class Info:
    """The JobDetails fields the runner reads."""

    metadata: dict[str, str]
    entrypoint: str = "python -m eval.evaluate_job"
    message: str | None = None
    start_time: int | None = 1_700_000_000_000
    end_time: int | None = 1_700_000_090_000


@dataclass
class FakeRay:
    """The JobSubmissionClient calls the runner makes. Each submission ends at once as the next of `outcomes`
    says (its status, and the result it writes or None); `lose` lists ids whose first status poll ends with a
    lost connection, as the job ends."""

    storage: Storage
    outcomes: list[tuple[JobStatus, StageResult | None]]
    lose: set[str] = field(default_factory=set)
    jobs: dict[str, tuple[JobStatus, Info]] = field(default_factory=dict)
    submitted: list[str] = field(default_factory=list)

    def get_job_status(self, sid: str) -> JobStatus:
        if sid not in self.jobs:
            raise RuntimeError(f"Job {sid} does not exist")
        if sid in self.lose:
            self.lose.discard(sid)
            raise requests.exceptions.ConnectionError("Connection aborted: RemoteDisconnected")
        return self.jobs[sid][0]

    def submit_job(self, entrypoint: str, submission_id: str, runtime_env: dict, metadata: dict[str, str]) -> None:
        status, result = self.outcomes.pop(0)
        self.add(submission_id, status, result, metadata)
        self.submitted.append(submission_id)

    def add(self, sid: str, status: JobStatus, result: StageResult | None, metadata: dict[str, str]) -> None:
        self.jobs[sid] = (status, Info(metadata))
        job = metadata["tuneproof_job"]
        if result is not None:  # where the job writes it: its job's folder in the storage it was given
            written = result.model_copy(update={"stage": job}).model_dump(mode="json")
            self.storage.write_json(written, "runs", RUN, "stages", job, "result.json")

    def get_job_info(self, sid: str) -> Info:
        return self.jobs[sid][1]

    async def tail_job_logs(self, sid: str):
        for line in ["evaluating\n"]:
            yield line

    def get_job_logs(self, sid: str) -> str:
        return "evaluating\n"

    def stop_job(self, sid: str) -> None:
        raise AssertionError(f"nothing stops {sid} here")


SPEC = JobSpec("evaluate", "eval.evaluate_job", 60, EvaluateSummary)


def runner_for(tmp_path, outcomes, lose=()) -> tuple[RayJobRunner, FakeRay]:
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}}).resolved()
    client = FakeRay(Storage.from_config(cfg.storage), outcomes, set(lose))
    runner = RayJobRunner(cfg, RUN, on_line=lambda line: None, poll_s=0.01, client=client)  # type: ignore[arg-type]
    return runner, client


def test_a_retry_reads_the_failed_verdict_of_the_job_its_earlier_try_lost_sight_of(tmp_path):
    runner, ray = runner_for(
        tmp_path, [(JobStatus.FAILED, GATE_FAILED), (JobStatus.SUCCEEDED, PASSED)], {f"{RUN}-evaluate"}
    )
    with pytest.raises(requests.exceptions.ConnectionError):
        runner.run(SPEC)  # the earlier try: the job ends while the connection drops
    retried = runner.run(SPEC)  # Prefect's retry
    assert ray.submitted == [f"{RUN}-evaluate"]  # no second roll of the dice
    assert (retried.submission_id, retried.attached, retried.job_status) == (f"{RUN}-evaluate", True, "FAILED")
    assert retried.result == GATE_FAILED and runner.superseded == []


def test_a_retry_keeps_an_infrastructure_failure_for_the_next_continuation_to_rerun(tmp_path):
    runner, ray = runner_for(tmp_path, [(JobStatus.FAILED, INFRA), (JobStatus.SUCCEEDED, PASSED)], {f"{RUN}-evaluate"})
    with pytest.raises(requests.exceptions.ConnectionError):
        runner.run(SPEC)
    retried = runner.run(SPEC)
    assert ray.submitted == [f"{RUN}-evaluate"] and retried.result == INFRA


def test_a_job_that_left_no_result_is_replaced_and_stays_listed(tmp_path):
    runner, ray = runner_for(tmp_path, [(JobStatus.FAILED, None), (JobStatus.SUCCEEDED, PASSED)], {f"{RUN}-evaluate"})
    with pytest.raises(requests.exceptions.ConnectionError):
        runner.run(SPEC)
    retried = runner.run(SPEC)
    assert ray.submitted == [f"{RUN}-evaluate", f"{RUN}-evaluate-a2"]
    assert (retried.submission_id, retried.result) == (f"{RUN}-evaluate-a2", PASSED)
    (lost,) = runner.superseded
    assert (lost.submission_id, lost.job_status, lost.result.failure_class) == (
        f"{RUN}-evaluate",
        "FAILED",
        FailureClass.infrastructure,
    )
    assert lost.entrypoint == "python -m eval.evaluate_job"
    assert (lost.submitted_at, lost.ended_at) == ("2023-11-14T22:13:20.000+00:00", "2023-11-14T22:14:50.000+00:00")


def test_a_continuation_reruns_an_infrastructure_failure_and_reads_a_modeling_one(tmp_path):
    """A later invocation (a continuation after the flow died, or a flow run retried from the Prefect UI, which
    keeps its flow run id) attaches to a verdict, but not to an infrastructure failure: rerunning those is what
    a continuation is for. The earlier invocation's job is not listed again."""
    runner, ray = runner_for(tmp_path, [(JobStatus.SUCCEEDED, PASSED)])
    earlier = {**runner.owner(SPEC), INVOCATION: "1"}
    runner.invocation = 2

    ray.add(f"{RUN}-evaluate", JobStatus.FAILED, GATE_FAILED, earlier)
    assert runner.run(SPEC).result == GATE_FAILED and ray.submitted == []

    ray.add(f"{RUN}-evaluate", JobStatus.FAILED, INFRA, earlier)
    rerun = runner.run(SPEC)
    assert (rerun.submission_id, rerun.result) == (f"{RUN}-evaluate-a2", PASSED)
    assert runner.superseded == []


def test_a_job_found_ended_is_charged_the_time_ray_ran_it(tmp_path):
    # A restarted flow attached to a job that had run 90 s and ended: timed from the attach, it cost 0.02 s.
    runner, ray = runner_for(tmp_path, [])
    ray.add(f"{RUN}-evaluate", JobStatus.FAILED, GATE_FAILED, {**runner.owner(SPEC), INVOCATION: "1"})
    runner.invocation = 2
    found = runner.run(SPEC)
    assert found.attached and (found.ray_started_at, found.ray_ended_at) == (
        "2023-11-14T22:13:20.000+00:00",
        "2023-11-14T22:14:50.000+00:00",
    )
    assert cost.job_seconds(found) == 90.0 and not cost.timed_from_attach(found)


def test_a_job_whose_times_ray_cannot_give_keeps_its_verdict_and_is_timed_by_the_flow(tmp_path, monkeypatch):
    # The times are the cost's evidence: a failed read of them after the job ended must not lose its verdict.
    runner, ray = runner_for(tmp_path, [(JobStatus.SUCCEEDED, PASSED)])

    def gone(sid: str) -> Info:
        raise requests.exceptions.ConnectionError("Connection aborted: RemoteDisconnected")

    monkeypatch.setattr(ray, "get_job_info", gone)  # a fresh submission reads no info before its end
    entry = runner.run(SPEC)
    assert (entry.job_status, entry.result.status) == ("SUCCEEDED", "succeeded")
    assert (entry.ray_started_at, entry.ray_ended_at) == (None, None)
    assert cost.job_seconds(entry) >= 0 and not cost.timed_from_attach(entry)


def test_another_runs_ended_job_is_never_read_as_this_runs(tmp_path):
    runner, ray = runner_for(tmp_path, [(JobStatus.SUCCEEDED, PASSED)])
    other = {**runner.owner(SPEC), "tuneproof_storage": str(tmp_path / "other"), INVOCATION: "1"}
    ray.add(f"{RUN}-evaluate", JobStatus.FAILED, GATE_FAILED, other)  # our storage now holds a result it did not write
    outcome = runner.run(SPEC)
    assert (outcome.submission_id, outcome.attached, outcome.result) == (f"{RUN}-evaluate-a2", False, PASSED)


def test_attach_only_refuses_to_submit(tmp_path):
    runner, ray = runner_for(tmp_path, [(JobStatus.SUCCEEDED, PASSED)])
    ray.add(f"{RUN}-evaluate", JobStatus.FAILED, None, {**runner.owner(SPEC), INVOCATION: "1"})
    assert not runner.attaches(SPEC)
    with pytest.raises(RuntimeError, match="is FAILED without a result"):
        runner.run(SPEC, attach_only=True)
    assert ray.submitted == []


def resume_call(tmp_path):
    from tasks.jobs import StageCall
    from tuneproof.control.record import CodeIdentity, new_record
    from tuneproof.core.summaries import CheckpointRef
    from tuneproof.core.summaries_training import ResumeSummary

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}}).resolved()
    inputs = {
        "checkpoints": [CheckpointRef(2, "/c/2")],
        "loss_curve": [(s, 1.0) for s in range(1, 21)],
        "dataset_path": "/d",
    }
    record = new_record(RUN, cfg, CodeIdentity(), None)
    return StageCall("resume", cfg, RUN, 1, 60, ResumeSummary, inputs, record)


@pytest.mark.parametrize(
    ("first", "attempts"),
    [
        ((JobStatus.FAILED, INFRA), ["resume-t1"]),  # its verdict stands: no t2 to pass in its place
        ((JobStatus.FAILED, None), ["resume-t1", "resume-t2"]),  # no verdict: a fresh attempt, never t1-a2
    ],
)
def test_a_retried_resume_test_reads_its_earlier_attempt_or_starts_a_fresh_one(tmp_path, monkeypatch, first, attempts):
    """t1's job ends while the connection drops (after it made its Ray Train run folder); Prefect retries."""
    import tasks.resume as resume

    call = resume_call(tmp_path)
    storage = Storage.from_config(call.cfg.storage)
    client = FakeRay(storage, [first, (JobStatus.SUCCEEDED, PASSED)], {f"{RUN}-resume-t1"})
    real_add = client.add

    def add_after_training(sid, status, result, metadata):  # the job's Ray Train run folder, then its end
        storage.write_json({}, "runs", RUN, "train", f"{RUN}-{metadata['tuneproof_job']}", "marker.json")
        real_add(sid, status, result, metadata)

    client.add = add_after_training  # type: ignore[method-assign]
    runner = RayJobRunner(call.cfg, RUN, on_line=lambda line: None, poll_s=0.01, client=client)  # type: ignore[arg-type]
    monkeypatch.setattr(resume, "runner_for", lambda call: runner)
    with pytest.raises(requests.exceptions.ConnectionError):
        resume.resume_test.fn(call)
    entry = resume.resume_test.fn(call)
    assert client.submitted == [f"{RUN}-{job}" for job in attempts]
    assert [job.submission_id for job in entry.jobs] == [f"{RUN}-{job}" for job in attempts[-1:]]
    if first[1] is INFRA:
        assert (entry.status, entry.cause) == ("failed", INFRA.cause)


def test_a_resume_job_that_succeeded_without_its_continue_phase_fails_the_stage(tmp_path, monkeypatch):
    """The task, not only its helper: a SUCCEEDED job whose summary has no continue phase gives a failed entry."""
    import tasks.resume as resume
    from tuneproof.core.summaries_training import ResumeJobSummary

    call = resume_call(tmp_path)
    storage = Storage.from_config(call.cfg.storage)
    left = ResumeJobSummary(interrupt_job="resume-t1-interrupt", continue_job="resume-t1-continue")
    succeeded = PASSED.model_copy(update={"summary": left.to_json()})
    client = FakeRay(storage, [(JobStatus.SUCCEEDED, succeeded)])
    runner = RayJobRunner(call.cfg, RUN, on_line=lambda line: None, poll_s=0.01, client=client)  # type: ignore[arg-type]
    monkeypatch.setattr(resume, "runner_for", lambda call: runner)
    entry = resume.resume_test.fn(call)
    assert (entry.status, entry.failure_class) == ("failed", FailureClass.infrastructure)
    assert "left no continue phase" in (entry.cause or "") and entry.jobs[-1].job_status == "SUCCEEDED"
