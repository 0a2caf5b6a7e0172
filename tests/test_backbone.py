"""The backbone through a real local Ray head and a real Prefect test harness: failure classes and exit codes,
config rejection before submission, retry re-attachment, timeouts and cancellation. (What verify and connectivity
record on success is asserted on the session's demo run: tests/test_full_pipeline.py.)"""

from __future__ import annotations

import pytest
from ray.job_submission import JobSubmissionClient
from typer.testing import CliRunner

from tuneproof.app.cli import app
from tuneproof.control import record as records
from tuneproof.core.config import load_config
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import VerifySummary

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A directory for model.source: these tests run verify, which reads no model, so they need not wait for
    the session's tiny base (about a minute to build at the session's start) and run beside its build."""
    return tmp_path_factory.mktemp("no-model-needed")


@pytest.fixture
def overrides(ray_head, tmp_path, model_dir):
    return [
        f"cluster.address={ray_head.address}",
        f"cluster.auth_token_file={ray_head.token_file}",
        f"storage.root={tmp_path / 'storage'}",
        f"model.source={model_dir}",
    ]


def jobs_for(ray_head, run_id: str) -> list:
    client = JobSubmissionClient(ray_head.address, headers={"Authorization": f"Bearer {ray_head.token()}"})
    return [j for j in client.list_jobs() if (j.submission_id or "").startswith(run_id)]


def test_wrong_ray_version_fails_verify_as_infrastructure(prefect_harness, overrides, ray_head, tmp_path):
    result = CliRunner().invoke(
        app,
        [
            "run",
            "--only",
            "verify,connectivity",
            "--run-id",
            "bb-badver",
            *sum((["--set", o] for o in overrides), []),
            "--set",
            "cluster.expect.ray_version=2.0.0",
        ],
    )
    assert result.exit_code == 4, result.output
    rec = records.load(Storage(str(tmp_path / "storage")), "bb-badver")
    verify = rec.stages["verify"]
    assert verify.failure_class == "infrastructure"
    assert (
        "ray_version" in (verify.cause or "")
        and "'2.60.0'" in (verify.cause or "")
        and "'2.0.0'" in (verify.cause or "")
    )
    assert "node" in (verify.cause or "")
    assert "connectivity" not in rec.stages
    assert rec.status == "failed" and rec.failure_class == "infrastructure"
    assert [j.submission_id for j in jobs_for(ray_head, "bb-badver")] == ["bb-badver-verify"]


def test_invalid_config_is_rejected_before_anything_is_submitted(ray_head, overrides):
    before = len(jobs_for(ray_head, ""))
    result = CliRunner().invoke(
        app,
        [
            "run",
            *sum((["--set", o] for o in overrides), []),
            "--set",
            "train.lr=-1",
            "--set",
            "data.eval_fraction=2",
            "--set",
            "train.learning_rate=0.1",
        ],
    )
    assert result.exit_code == 3
    for name in ("train.lr", "data.eval_fraction", "train.learning_rate"):
        assert name in result.output
    assert len(jobs_for(ray_head, "")) == before


def test_a_prefect_retry_attaches_to_the_same_ray_submission(prefect_harness, overrides, ray_head, monkeypatch):
    """The first attempt loses its connection while following the job; the retry must re-attach."""
    from prefect import flow

    from tasks.jobs import StageCall, verify
    from tasks.rayjob import RayJobRunner
    from tuneproof.control.record import CodeIdentity, new_record
    from tuneproof.control.stages import by_name

    real_follow = RayJobRunner.follow
    calls = {"n": 0}

    def flaky_follow(self, sid, timeout_s, stop_when=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise ConnectionError("dashboard connection reset while following the job")
        return real_follow(self, sid, timeout_s, stop_when)

    monkeypatch.setattr(RayJobRunner, "follow", flaky_follow)
    cfg = load_config(overrides=overrides)

    stage = by_name("verify")
    call = StageCall(
        stage="verify",
        cfg=cfg,
        run_id="bb-retry",
        invocation=1,
        timeout_s=stage.timeout_s(cfg),
        summary=stage.summary,
        inputs={},
        record=new_record("bb-retry", cfg, CodeIdentity(), None),
    )

    @flow
    def only_verify():
        return verify.with_options(retry_delay_seconds=0)(call)

    entry = only_verify()
    assert entry is not None and calls["n"] == 2
    assert entry.status == "succeeded"
    assert entry.jobs[0].attached is True
    assert [j.submission_id for j in jobs_for(ray_head, "bb-retry")] == ["bb-retry-verify"]


def test_a_job_of_the_same_run_id_under_another_storage_root_is_never_attached_to(overrides, ray_head, tmp_path):
    """Two storage roots share a cluster and a run id: the second run must not take the first's job (and then
    its own storage's result.json, which may be stale) as its own. It submits under the next attempt's id."""
    from tasks.rayjob import JobSpec, RayJobRunner

    client = JobSubmissionClient(ray_head.address, headers={"Authorization": f"Bearer {ray_head.token()}"})
    other = {"tuneproof_run": "bb-shared", "tuneproof_job": "verify", "tuneproof_storage": str(tmp_path / "other")}
    client.submit_job(entrypoint="python -c pass", submission_id="bb-shared-verify", metadata=other)
    cfg = load_config(overrides=overrides)
    runner = RayJobRunner(cfg, "bb-shared", on_line=lambda line: None, poll_s=0.2)
    assert runner.wait_terminal("bb-shared-verify").value == "SUCCEEDED"
    outcome = runner.run(JobSpec("verify", "training.verify", timeout_s=120, summary=VerifySummary))
    assert (outcome.submission_id, outcome.attached) == ("bb-shared-verify-a2", False)
    assert outcome.result.status == "succeeded", outcome.result.cause


def test_a_stage_past_its_timeout_is_stopped_and_is_an_infrastructure_failure(overrides, ray_head):
    from tasks.rayjob import JobSpec, RayJobRunner

    cfg = load_config(overrides=overrides)
    outcome = RayJobRunner(cfg, "bb-timeout", on_line=lambda line: None, poll_s=0.2).run(
        JobSpec("verify", "training.verify", timeout_s=1, summary=VerifySummary)
    )
    assert outcome.result.failure_class is not None
    assert outcome.result.failure_class.value == "infrastructure"
    assert "timed out after 1s" in (outcome.result.cause or "")
    assert outcome.job_status == "STOPPED"


def test_a_cancelled_run_stops_its_ray_job(overrides, ray_head):
    """Cancellation arrives as a BaseException (Ctrl-C, Prefect's TerminationSignal) while following."""
    from tasks.rayjob import JobSpec, RayJobRunner

    def cancel_once_running(line: str) -> None:
        if "Running entrypoint" in line:
            raise KeyboardInterrupt

    cfg = load_config(overrides=overrides)
    runner = RayJobRunner(cfg, "bb-cancel", on_line=cancel_once_running, poll_s=0.2)
    with pytest.raises(KeyboardInterrupt):
        runner.run(JobSpec("verify", "training.verify", timeout_s=120, summary=VerifySummary))
    assert runner.wait_terminal("bb-cancel-verify").value == "STOPPED"
