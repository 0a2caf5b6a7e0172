"""The job-log follower: Ray's log tail arrives in chunks that can end mid-line; every line reaches the
display once and whole, progress lines included, and a stop marker split across chunks still stops."""

from __future__ import annotations

import asyncio

import pytest
from ray.job_submission import JobStatus

from tasks.rayjob import LineAssembler, RayJobRunner
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ProgressEvent


def test_a_line_split_across_chunks_comes_out_once_whole():
    lines = LineAssembler()
    assert lines.feed("first line\nsecond ha") == ["first line"]
    assert lines.feed("lf of a line") == []
    assert lines.feed(" ends here\r\nthird\n") == ["second half of a line ends here", "third"]
    assert lines.feed("no newline at the end") == []
    assert lines.flush() == ["no newline at the end"]
    assert lines.flush() == []


class FakeClient:
    """The JobSubmissionClient calls the follower makes: a log tail in given chunks, then a final status."""

    def __init__(self, chunks: list[str], delay_s: float = 0.01):
        self.chunks, self.delay_s, self.stopped = chunks, delay_s, list[str]()
        self.streamed = False

    async def tail_job_logs(self, sid: str):
        for chunk in self.chunks:
            await asyncio.sleep(self.delay_s)
            yield chunk
        self.streamed = True

    def get_job_status(self, sid: str) -> JobStatus:
        if self.stopped:
            return JobStatus.STOPPED
        return JobStatus.SUCCEEDED if self.streamed else JobStatus.RUNNING

    def stop_job(self, sid: str) -> bool:
        self.stopped.append(sid)
        return True

    def get_job_logs(self, sid: str) -> str:
        return "".join(self.chunks)


def follower(client: FakeClient) -> tuple[RayJobRunner, list[str], list[ProgressEvent]]:
    lines: list[str] = []
    events: list[ProgressEvent] = []
    runner = RayJobRunner(
        PipelineConfig(),
        "r1",
        on_line=lines.append,
        on_progress=events.append,
        poll_s=0.05,
        client=client,  # type: ignore[arg-type]  # a double of the JobSubmissionClient calls made
    )
    return runner, lines, events


def test_the_follower_delivers_each_line_once_even_when_a_chunk_ends_mid_line():
    progress = 'TUNEPROOF_PROGRESS {"stage": "finetune", "done": 120, "total": 400, "loss": 0.5312}'
    chunks = ["starting\n(RayTrainWorker pid=7) TUNEPROOF_PRO", progress[len("TUNEPROOF_PRO") :], "\nfinished"]
    runner, lines, events = follower(FakeClient(chunks))
    assert runner.follow("r1-finetune", timeout_s=30) == JobStatus.SUCCEEDED
    assert lines == ["starting", "(RayTrainWorker pid=7) progress finetune 120/400 loss=0.5312", "finished"]
    assert events == [ProgressEvent(stage="finetune", done=120, total=400, metrics={"loss": 0.5312})]


def test_a_stop_marker_split_across_chunks_still_stops_the_job():
    client = FakeClient(["step 303\n[tuneproof] HOLDING after che", "ckpoint step 304\n", "never read\n"], delay_s=0.05)
    runner, lines, _ = follower(client)
    status = runner.follow(
        "r1-resume-interrupt", timeout_s=30, stop_when=lambda line: "HOLDING after checkpoint step 304" in line
    )
    assert status == JobStatus.STOPPED and client.stopped == ["r1-resume-interrupt"]
    assert "[tuneproof] HOLDING after checkpoint step 304" in lines and "never read" not in lines


class SlowTail(FakeClient):
    """Ray's tail as it behaves: the job has ended (its log is complete), but the socket delivers the last
    chunk and closes only seconds later."""

    def __init__(self, chunks: list[str], delivered: int, tail_lag_s: float):
        super().__init__(chunks)
        self.delivered, self.tail_lag_s, self.reads = delivered, tail_lag_s, 0

    async def tail_job_logs(self, sid: str):
        for chunk in self.chunks[: self.delivered]:
            yield chunk
        await asyncio.sleep(self.tail_lag_s)
        for chunk in self.chunks[self.delivered :]:
            yield chunk

    def get_job_status(self, sid: str) -> JobStatus:
        return JobStatus.SUCCEEDED

    def get_job_logs(self, sid: str) -> str:
        self.reads += 1
        return super().get_job_logs(sid)


def test_a_job_that_has_ended_is_followed_to_its_last_line_without_waiting_for_rays_tail():
    import time

    progress = 'TUNEPROOF_PROGRESS {"stage": "data", "done": 2, "total": 2}'
    chunks = [
        "start\n(pid=3) TUNEPROOF_PROG",
        progress[len("TUNEPROOF_PROG") :] + "\n[tuneproof] wrote the",
        " result\nbye",
    ]
    client = SlowTail(chunks, delivered=1, tail_lag_s=30)
    runner, lines, events = follower(client)
    began = time.monotonic()
    assert runner.follow("r1-data", timeout_s=60) == JobStatus.SUCCEEDED
    assert time.monotonic() - began < 5, "the follower waited for Ray's tail instead of reading the complete log"
    # The line cut at the end of the delivered chunk is completed from the log, and nothing comes twice.
    assert lines == ["start", "(pid=3) progress data 2/2", "[tuneproof] wrote the result", "bye"]
    assert events == [ProgressEvent(stage="data", done=2, total=2)] and client.reads == 1


def test_when_the_complete_log_cannot_be_read_the_tail_still_ends_the_stream():
    class Unreadable(SlowTail):
        def get_job_logs(self, sid: str) -> str:
            raise RuntimeError("Request failed with status code 500")

    runner, lines, _ = follower(Unreadable(["one\ntw", "o\n"], delivered=1, tail_lag_s=0.3))
    assert runner.follow("r1-data", timeout_s=60) == JobStatus.SUCCEEDED
    failed = [line for line in lines if line.startswith("reading the rest of Ray job r1-data's log failed")]
    assert len(failed) == 1 and [line for line in lines if line not in failed] == ["one", "two"]


def test_a_broken_log_stream_is_raised_so_a_retry_re_attaches():
    class Broken(FakeClient):
        async def tail_job_logs(self, sid: str):
            yield "partial"
            raise RuntimeError("WebSocket connection closed unexpectedly with close code 1006")

    runner, _, _ = follower(Broken([]))
    with pytest.raises(RuntimeError, match="closed unexpectedly"):
        runner.follow("r1-data", timeout_s=30)


def test_an_unreachable_dashboard_is_retried_with_backoff_within_a_bound(monkeypatch):
    from tasks import rayjob

    assert rayjob.backoff_delays(30) == [2.0, 4.0, 8.0, 15.0]
    assert sum(rayjob.backoff_delays(120)) <= 120
    monkeypatch.setattr(rayjob.time, "sleep", lambda s: None)
    answers = iter([ConnectionError("refused"), ConnectionError("refused"), "ok"])

    def flaky():
        answer = next(answers)
        if isinstance(answer, Exception):
            raise answer
        return answer

    lines: list[str] = []
    assert rayjob.while_unreachable(flaky, "http://head:8265", lines.append, 30) == "ok"
    assert lines == [
        "the Ray dashboard at http://head:8265 is unreachable; retrying in 2s (waited 0s of 30s)",
        "the Ray dashboard at http://head:8265 is unreachable; retrying in 4s (waited 2s of 30s)",
    ]


def test_a_dashboard_unreachable_past_the_bound_fails_naming_the_address(monkeypatch):
    from tasks import rayjob

    monkeypatch.setattr(rayjob.time, "sleep", lambda s: None)

    def down():
        raise ConnectionError("Failed to connect")

    with pytest.raises(
        rayjob.ClusterUnreachable, match=r"the Ray dashboard at http://head:8265 did not answer for 14s"
    ):
        rayjob.while_unreachable(down, "http://head:8265", lambda line: None, 20)


def test_a_train_run_waiting_for_cluster_resources_is_shown_as_waiting():
    statuses: list[tuple[str, str]] = []
    lines: list[str] = []
    runner = RayJobRunner(
        PipelineConfig(),
        "r1",
        on_line=lines.append,
        on_status=lambda *s: statuses.append(s),
        client=FakeClient([]),  # type: ignore[arg-type]  # a double of the JobSubmissionClient calls made
    )
    runner.following = "r1-finetune"
    runner.emit(
        "(TrainController pid=1) [FailurePolicy] RETRY ... The worker group startup timed out after 60.0 seconds "
        "waiting for 2 workers."
    )
    assert statuses == [("r1-finetune", "waiting for resources")]
    assert lines[0].startswith("waiting for resources: Ray Train cannot place its workers yet")
    # Each retry logs the line again: the wait is said once, until training steps show it ended.
    retry = "(TrainController pid=1) The worker group startup timed out after 60.0 seconds waiting for 2 workers."
    runner.emit(retry)
    runner.emit(retry)
    assert statuses == [("r1-finetune", "waiting for resources")]
    assert sum(line.startswith("waiting for resources") for line in lines) == 1
    # Training stepped (a progress line), so a wait after it is a new one and is said again.
    from tuneproof.core.envelope import ProgressEvent

    runner.emit("(RayTrainWorker pid=2) " + ProgressEvent(stage="finetune", done=3, total=40).line())
    runner.emit(retry)
    assert statuses == [("r1-finetune", "waiting for resources")] * 2
