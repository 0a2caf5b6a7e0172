"""One writer per run, crashed and cancelled runs, and secrets that stay in the environment.

    .venv/bin/python -m pytest -q tests/test_guard.py -m "not integration"   # the lease, the detector (seconds)
    .venv/bin/python -m pytest -q tests/test_guard.py -m integration         # flows on the session's Ray head

The integration tests run real flows against the session's Prefect server and Ray head: the planted
secret rides through the whole demo pipeline (`finished_run`), a storage error crashes a flow, a
KeyboardInterrupt cancels one, and two `tuneproof run` processes race for one run id.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID

import pytest
import yaml

from tests.conftest import TEST_BUCKET, tuneproof
from tests.reading import present, summary_of
from tuneproof.control import lease as leases
from tuneproof.control.lease import Lease, LeaseHeld, LeaseInfo, LeaseLost, stale_reason
from tuneproof.core import forward_env
from tuneproof.core.config import PROJECT_ROOT, ConfigError, load_config
from tuneproof.core.credentials import credential_problems
from tuneproof.core.storage import Storage

# ---------------------------------------------------------------- the lease


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant_lease(storage: Storage, run_id: str, **fields) -> LeaseInfo:
    """A lease written as another holder would have left it."""
    now = datetime.now(UTC).isoformat()
    base = {"holder": socket.gethostname(), "pid": os.getpid(), "flow_run_id": "f-old", "renewed": now}
    info = LeaseInfo(run_id=run_id, command="old", started=now, **{**base, **fields})
    storage.write_bytes(info.model_dump_json().encode(), "runs", run_id, leases.LEASE)
    return info


def exercise_lease(storage: Storage) -> None:
    """The lease's contract, the same on every store."""
    first = Lease(storage, "r1", "flow-a", "first")
    first.acquire()
    assert present(leases.read(storage, "r1")).flow_run_id == "flow-a"

    with pytest.raises(LeaseHeld) as held:
        Lease(storage, "r1", "flow-b", "second").acquire()
    assert "'first'" in str(held.value) and "flow-a" in str(held.value) and str(os.getpid()) in str(held.value)

    before = present(leases.read(storage, "r1")).renewed
    time.sleep(0.01)
    first.renew()
    assert present(leases.read(storage, "r1")).renewed > before

    first.release()
    assert leases.read(storage, "r1") is None
    second = Lease(storage, "r1", "flow-b", "second")
    second.acquire()  # free again
    assert second.taken_over is None
    second.release()

    # A holder whose pid is gone (kill -9) on this host is taken over at once, and the new holder says whose.
    plant_lease(storage, "r2", pid=dead_pid())
    taker = Lease(storage, "r2", "flow-c", "taker")
    taker.acquire()
    assert (
        "took over" in (taker.taken_over or "")
        and "f-old" in (taker.taken_over or "")
        and "is gone" in (taker.taken_over or "")
    )
    assert present(leases.read(storage, "r2")).flow_run_id == "flow-c"
    taker.release()

    # A holder on another host that stopped renewing is taken over after its ttl, not before.
    old = (datetime.now(UTC) - timedelta(seconds=30)).isoformat()
    plant_lease(storage, "r3", holder="elsewhere", renewed=old, ttl_s=60)
    with pytest.raises(LeaseHeld):
        Lease(storage, "r3", "flow-d", "early").acquire()
    plant_lease(storage, "r3", holder="elsewhere", renewed=old, ttl_s=10)
    late = Lease(storage, "r3", "flow-d", "late")
    late.acquire()
    assert "not renewed for" in (late.taken_over or "")

    # The holder presumed dead finds out on its next renewal, and its release leaves the successor's lease.
    presumed_dead = Lease(storage, "r4", "flow-e", "slow", ttl_s=0.05)
    presumed_dead.acquire()
    time.sleep(0.1)
    successor = Lease(storage, "r4", "flow-f", "successor")
    successor.acquire()
    with pytest.raises(LeaseLost):
        presumed_dead.renew()
    presumed_dead.release()
    assert present(leases.read(storage, "r4")).flow_run_id == "flow-f"
    successor.release()

    # Whatever happens inside, `held` releases.
    with pytest.raises(RuntimeError), Lease(storage, "r5", "flow-g", "raises").held():
        assert leases.read(storage, "r5") is not None
        raise RuntimeError("boom")
    assert leases.read(storage, "r5") is None


def test_lease_on_local_disk(tmp_path):
    exercise_lease(Storage(str(tmp_path / "storage")))


@pytest.mark.integration
def test_lease_on_s3(s3_endpoint):
    exercise_lease(Storage(f"s3://{TEST_BUCKET}/lease-unit", s3_endpoint))


def test_one_of_many_concurrent_creates_wins(tmp_path):
    """Exclusive create: of racing acquirers exactly one holds the lease."""
    import threading

    storage = Storage(str(tmp_path / "storage"))
    outcomes: list[str] = []

    def contend(i: int) -> None:
        try:
            Lease(storage, "race", f"flow-{i}", f"contender {i}").acquire()
            outcomes.append("held")
        except LeaseHeld:
            outcomes.append("refused")

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(outcomes) == ["held"] + ["refused"] * 7


def test_heartbeat_renews(tmp_path):
    storage = Storage(str(tmp_path / "storage"))
    with Lease(storage, "hb", "flow", "heartbeat", ttl_s=0.2).held():
        first = present(leases.read(storage, "hb")).renewed
        time.sleep(0.3)
        assert present(leases.read(storage, "hb")).renewed > first


def test_staleness_is_a_pure_decision():
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    info = LeaseInfo(
        run_id="r", holder="h1", pid=7, command="c", started=now.isoformat(), renewed=now.isoformat(), ttl_s=60
    )
    assert stale_reason(info, now + timedelta(seconds=59), "h1", lambda pid: True) is None
    assert "not renewed for 61s" in present(stale_reason(info, now + timedelta(seconds=61), "h1", lambda pid: True))
    assert "pid 7 on h1 is gone" in (stale_reason(info, now, "h1", lambda pid: False) or "")
    assert stale_reason(info, now, "h2", lambda pid: False) is None  # another host's pid says nothing here


# ---------------------------------------------------------------- credentials in config

FAKE_SECRET_KEY = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"


@pytest.mark.parametrize(
    ("dotted", "value", "why"),
    [
        ("runtime_env.env_vars.AWS_SECRET_ACCESS_KEY", "x", "named like a credential"),
        ("runtime_env.env_vars.HF_TOKEN", "x", "named like a credential"),
        ("runtime_env.env_vars.DB_PASSWORD", "x", "named like a credential"),
        ("runtime_env.env_vars.GOOGLE_APPLICATION_CREDENTIALS", "x", "named like a credential"),
        ("runtime_env.env_vars.SSH_PRIVATE_KEY", "x", "named like a credential"),
        ("runtime_env.env_vars.SOME_ID", "AKIAIOSFODNN7EXAMPLE", "an AWS access key id"),
        ("runtime_env.env_vars.SESSION", "ASIAIOSFODNN7EXAMPLE", "an AWS access key id"),
        ("runtime_env.env_vars.BLOB", FAKE_SECRET_KEY, "a long random token"),
        ("model.source", "-----BEGIN OPENSSH PRIVATE KEY-----", "a PEM private key"),
        ("runtime_env.pip[0]", "git+https://me:ghp_abc123@github.com/x/y", "a URL with a password"),
        ("data.source", "3f9a" * 16, "a long hexadecimal secret"),
    ],
)
def test_credentials_are_refused_by_dotted_key_without_the_value(dotted, value, why):
    data: dict = {}
    parts = dotted.replace("[0]", "").split(".")
    node = data
    for part in parts[:-1]:
        node = node.setdefault(part, {})
    node[parts[-1]] = [value] if dotted.endswith("[0]") else value
    problems = credential_problems(data)
    assert len(problems) == 1 and problems[0].startswith(dotted + ":"), problems
    assert why in problems[0] and "forward_env" in problems[0]
    assert value not in problems[0]


@pytest.mark.parametrize("profile", sorted((PROJECT_ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_no_false_positives_on_the_shipped_configs(profile):
    assert credential_problems(yaml.safe_load(profile.read_text())) == []
    load_config(profile)


def test_ordinary_values_are_not_credentials():
    ordinary = {
        "model": {"source": "Qwen/Qwen2.5-1.5B", "revision": "0123456789abcdef0123456789abcdef01234567"},
        "cluster": {"auth_token_file": "/var/run/secrets/tuneproof/ray-auth/auth_token", "address": "http://h:8265"},
        "runtime_env": {"env_vars": {"NCCL_DEBUG": "INFO", "HF_HOME": "/cache/huggingface_hub_2026_models"}},
        "storage": {"root": "s3://tuneproof-artifacts/pipeline"},
    }
    assert credential_problems(ordinary) == []


def test_a_credential_on_the_command_line_is_refused_before_anything_runs():
    result = tuneproof("run", "--set", f"runtime_env.env_vars.AWS_SECRET_ACCESS_KEY={FAKE_SECRET_KEY}")
    assert result.exit_code == 3, result.output
    assert "runtime_env.env_vars.AWS_SECRET_ACCESS_KEY" in result.output and "forward_env" in result.output
    assert FAKE_SECRET_KEY not in result.output
    result = tuneproof("run", "--set", f"runtime_env.env_vars.OPAQUE={FAKE_SECRET_KEY}")
    assert result.exit_code == 3 and FAKE_SECRET_KEY not in result.output
    assert "runtime_env.env_vars.OPAQUE: looks like a long random token" in result.output


def test_a_prefect_parameter_with_a_credential_fails_without_echoing_it():
    from pydantic import ValidationError

    from tuneproof.core.config import PipelineConfig

    with pytest.raises(ValidationError) as e:
        PipelineConfig.model_validate({"runtime_env": {"env_vars": {"X": FAKE_SECRET_KEY}}})
    assert FAKE_SECRET_KEY not in str(e.value) and "runtime_env.env_vars.X" in str(e.value)


def test_forward_env_takes_names_only():
    with pytest.raises(ConfigError) as e:
        load_config(None, ["runtime_env.forward_env=[NOT-A-NAME]"])
    assert "runtime_env.forward_env" in str(e.value)
    with pytest.raises(ConfigError):
        load_config(None, ["runtime_env.forward_env=[TUNEPROOF_JOB]"])
    with pytest.raises(ConfigError) as e:
        load_config(None, ["runtime_env.forward_env=[A]", "runtime_env.env_vars.A=one"])
    assert "either forwarded or given" in str(e.value)


# ---------------------------------------------------------------- forwarding by file


def test_values_travel_in_a_private_file_and_land_in_the_job_environment(tmp_path):
    submitting = {"TP_A": "value-a", "TP_B": "value-b", "OTHER": "x"}
    path = forward_env.write_values(["TP_A", "TP_B"], "run1", "verify", submitting)
    try:
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
        assert json.loads(path.read_text()) == {"TP_A": "value-a", "TP_B": "value-b"}
        job_env = {forward_env.FILE_VAR: str(path)}
        forward_env.load(["TP_A", "TP_B"], job_env)
        assert job_env["TP_A"] == "value-a" and forward_env.presence(["TP_A", "TP_B"], job_env) == {
            "TP_A": True,
            "TP_B": True,
        }
        assert path.exists()  # the job deletes nothing: other processes of the job read it too
    finally:
        forward_env.discard("run1")
    assert not path.exists()


def test_a_missing_forwarded_variable_is_named():
    with pytest.raises(forward_env.ForwardEnvMissing, match="TP_MISSING, not set in the submitting"):
        forward_env.write_values(["TP_MISSING"], "run1", "verify", {})
    with pytest.raises(forward_env.ForwardEnvMissing, match="TP_MISSING, not set in the job's environment"):
        forward_env.load(["TP_MISSING"], {})


def test_exit_codes_of_crashed_and_cancelled_runs():
    from tuneproof.app.cli import run_exit_code

    assert run_exit_code({"status": "crashed", "failure_class": None}) == 4
    assert run_exit_code({"status": "cancelled", "failure_class": None}) == 130
    assert run_exit_code({"status": "failed", "failure_class": None}) == 3
    assert run_exit_code({"status": "failed", "failure_class": "data"}) == 5


# ---------------------------------------------------------------- integration: the planted secret


def files_containing(root: Path, needle: bytes) -> list[str]:
    """Every file under root whose bytes contain the needle."""
    hits = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            try:
                if needle in path.read_bytes():
                    hits.append(str(path))
            except OSError:
                continue  # a socket or a file removed while walking
    return hits


def prefect_documents(flow_run_ids: list[str]) -> dict[str, str]:
    """Parameters, artifacts and logs of the given flow runs, as text, from the session's Prefect server."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId
    from prefect.logging.handlers import APILogWorker

    APILogWorker.drain_all()  # logs are shipped in batches: the last ones must be on the server first
    docs = {}
    with get_client(sync_client=True) as client:
        for fid in flow_run_ids:
            docs[f"flow run {fid} parameters"] = json.dumps(client.read_flow_run(UUID(fid)).parameters, default=str)
        runs = FlowRunFilter(id=FlowRunFilterId(any_=flow_run_ids))
        for artifact in client.read_artifacts(flow_run_filter=runs):
            docs[f"artifact {artifact.key or artifact.id}"] = json.dumps(artifact.data, default=str)
        logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=flow_run_ids)))
        docs["flow-run logs"] = "\n".join(log.message for log in logs)
    assert docs["flow-run logs"], "no Prefect logs read back: the scan would prove nothing"
    return docs


def ray_documents(ray_head) -> dict[str, str]:
    """Every job the session's Ray head knows: its info (entrypoint, runtime_env, metadata) and its log."""
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(ray_head.address, headers={"Authorization": f"Bearer {ray_head.token()}"})
    docs = {}
    for job in client.list_jobs():
        name = job.submission_id or job.job_id or "?"
        docs[f"Ray job {name} info"] = json.dumps(
            job.model_dump() if hasattr(job, "model_dump") else job.dict(), default=str
        )
        if job.submission_id:
            docs[f"Ray job {name} log"] = client.get_job_logs(job.submission_id)
    return docs


@pytest.mark.integration
def test_planted_secret_reaches_the_jobs_and_nothing_that_is_published(finished_run, demo_env, ray_head):
    """The demo run (`finished_run`) ran with TUNEPROOF_TEST_SECRET forwarded: the job saw it, and its value
    is in no file under the storage root, no Prefect parameter, artifact or log, no Ray job info or log,
    and nowhere in the Ray head's session directory."""
    from tests.conftest import PLANTED_SECRET
    from tuneproof.core.summaries import VerifySummary

    secret = demo_env.secret
    record = finished_run.record
    assert record.status == "succeeded"
    assert summary_of(record, "verify", VerifySummary).forwarded_env == {PLANTED_SECRET: True}
    assert record.runtime_env_additions.forwarded_env == [PLANTED_SECRET]

    docs = {**prefect_documents([inv.flow_run_id for inv in record.invocations]), **ray_documents(ray_head)}
    assert any("runtime_env" in k or "info" in k for k in docs) and len(docs) > 10, sorted(docs)
    assert any(forward_env.FILE_VAR in text for text in docs.values()), "the jobs got the file's path"
    hits = [where for where, text in docs.items() if secret in text]
    for root in (finished_run.pristine, demo_env.root, Path(ray_head.temp_dir)):
        hits += files_containing(root, secret.encode())
    assert hits == []
    # The values' files are gone once their jobs ended.
    assert not list(forward_env.private_dir().glob("demo-*.json"))


# ---------------------------------------------------------------- integration: crashed, cancelled, stale


@pytest.mark.integration
def test_crashed_and_cancelled_runs_say_so(clone_run, monkeypatch):
    """A storage error in the flow crashes it (exit 4, record `crashed`), Ctrl-C cancels one (exit 130,
    record `cancelled`), a writer killed with -9 leaves a run that `runs list` shows crashed; no lease is
    left behind and none of them is picked as the latest run."""
    import shutil

    import flows.pipeline as pipeline_module
    from tuneproof.control import record as records

    storage = Storage(str(clone_run.root / "storage"))
    real_save = records.save
    broken: list[str] = []

    def save_while_the_record_path_is_blocked(storage_: Storage, record, lease=None) -> None:
        # After verify, record.json's place is taken by a directory for one write: the write fails in the
        # storage layer for real (IsADirectoryError), as a disk or a bucket that refuses writes does.
        if record.run_id == "crash" and "verify" in record.stages and not broken:
            broken.append(record.run_id)
            path = Path(storage_.path("runs", record.run_id, records.RECORD))
            aside = path.with_name("record.aside")
            path.rename(aside)
            (path / "blocker").mkdir(parents=True)
            try:
                real_save(storage_, record, lease)
            finally:
                shutil.rmtree(path)
                aside.rename(path)
        else:
            real_save(storage_, record, lease)

    monkeypatch.setattr(records, "save", save_while_the_record_path_is_blocked)
    result = tuneproof("run", "--run-id", "crash", "--only", "verify,connectivity", *clone_run.args)
    assert result.exit_code == 4, result.output
    crashed = records.load(storage, "crash")
    assert crashed.status == "crashed" and "IsADirectoryError" in (crashed.cause or "")
    assert crashed.stages["verify"].ok and "connectivity" not in crashed.stages
    assert leases.read(storage, "crash") is None
    monkeypatch.setattr(records, "save", real_save)

    real_run_stage = pipeline_module.run_stage

    def ctrl_c_at_connectivity(stage, *args):
        if stage.name == "connectivity":
            raise KeyboardInterrupt
        return real_run_stage(stage, *args)

    monkeypatch.setattr(pipeline_module, "run_stage", ctrl_c_at_connectivity)
    result = tuneproof("run", "--run-id", "cancel", "--only", "verify,connectivity", *clone_run.args)
    assert result.exit_code == 130, result.output
    cancelled = records.load(storage, "cancel")
    assert cancelled.status == "cancelled" and "KeyboardInterrupt" in (cancelled.cause or "")
    assert leases.read(storage, "cancel") is None
    monkeypatch.setattr(pipeline_module, "run_stage", real_run_stage)

    # kill -9: the record stays "running" and the lease names a pid that is gone.
    orphan = cancelled.model_copy(update={"run_id": "orphan", "status": "running", "cause": None})
    orphan.created_at = "9999-01-01T00:00:00+00:00"  # the newest record
    real_save(storage, orphan)
    plant_lease(storage, "orphan", pid=dead_pid())

    listed = tuneproof("runs", "list", "--json", *clone_run.args)
    assert listed.exit_code == 0, listed.output
    status = {row["run_id"]: row for row in json.loads(listed.output)}
    assert status["crash"]["status"] == "crashed" and status["cancel"]["status"] == "cancelled"
    assert status["orphan"]["status"] == "crashed" and "is gone" in status["orphan"]["cause"]
    assert status["demo"]["status"] == "succeeded"
    shown = tuneproof("runs", "show", "orphan", "--json", *clone_run.args)
    assert shown.exit_code == 0 and json.loads(shown.output)["status"] == "crashed", shown.output

    from tuneproof.app.cli import latest_run_id

    assert latest_run_id(load_config(None, clone_run.sets)) == "demo"


# ---------------------------------------------------------------- integration: one writer per run


def cli_process(*args: str, prefect_url: str) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": f"{prefect_url}/api"}
    return subprocess.Popen(
        [sys.executable, "-m", "tuneproof.app.cli", *args],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def one_line(text: str) -> str:
    return " ".join(text.split())


def wait_for_lease(storage: Storage, run_id: str, pids: set[int], timeout: float = 180) -> LeaseInfo:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        info = leases.read(storage, run_id)
        if info is not None and info.pid in pids:
            return info
        time.sleep(0.2)
    raise TimeoutError(f"no lease on {run_id} from {pids} within {timeout}s")


@pytest.mark.integration
def test_two_concurrent_runs_on_one_id_one_runs_the_other_is_refused(clone_run, prefect_server):
    storage = Storage(str(clone_run.root / "storage"))
    args = ("run", "--run-id", "twice", "--only", "verify,connectivity", *clone_run.args)
    first, second = cli_process(*args, prefect_url=prefect_server), cli_process(*args, prefect_url=prefect_server)
    holder = wait_for_lease(storage, "twice", {first.pid, second.pid})

    # While a flow holds the run, the override is refused too, naming the holder.
    forced = tuneproof("promote", "twice", "--force", "--reason", "test", *clone_run.args)
    assert forced.exit_code == 3, forced.output
    assert "is held by" in one_line(forced.output) and f"pid {holder.pid}" in one_line(forced.output)

    # The terminal folds long lines: compare with the whitespace collapsed.
    outputs = {p.pid: one_line(p.communicate(timeout=600)[0]) for p in (first, second)}
    codes = {p.pid: p.returncode for p in (first, second)}
    refused_pid = next(pid for pid in codes if pid != holder.pid)
    assert codes[holder.pid] == 0, outputs[holder.pid]
    assert codes[refused_pid] == 3, outputs[refused_pid]
    assert "nothing ran" in outputs[refused_pid] and f"pid {holder.pid}" in outputs[refused_pid]
    assert holder.flow_run_id is not None and holder.flow_run_id in outputs[refused_pid]
    assert leases.read(storage, "twice") is None
    assert len(Storage(str(clone_run.root / "storage")).listdir("runs", "twice", "stages")) == 2

    # A writer killed with -9 leaves its lease; the next run on the id takes it over and says so.
    killed = cli_process(*args, prefect_url=prefect_server)
    wait_for_lease(storage, "twice", {killed.pid})
    killed.kill()
    killed.wait()
    taken = tuneproof("run", "--run-id", "twice", "--only", "verify", *clone_run.args)
    assert taken.exit_code == 0, taken.output
    from tuneproof.control import record as records

    takeover = records.load(storage, "twice").invocations[-1].lease_takeover
    assert takeover and f"pid {killed.pid}" in takeover and "is gone" in takeover
    assert leases.read(storage, "twice") is None


# ---------------------------------------------------------------- lint: forwarded names come from a Secret


def test_lint_requires_forwarded_names_from_a_secret(tmp_path):
    import shutil

    from tuneproof.app.lint import lint_paths
    from tuneproof.core.findings import errors

    deploy = tmp_path / "deployments"
    shutil.copytree(PROJECT_ROOT / "deployments", deploy)
    eks = PROJECT_ROOT / "configs" / "eks.yaml"
    forwarding = load_config(eks, ["runtime_env.forward_env=[HF_TOKEN]"])
    # The committed RayCluster loads the optional Secret tuneproof-job-env, created out of band: nothing to say.
    assert errors(lint_paths([str(deploy)], forwarding)) == []

    # With the Secret among the manifests, its keys are checked against the names.
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": "tuneproof-job-env", "namespace": "tuneproof"},
        "stringData": {"WANDB_API_KEY": "placeholder"},
    }
    (deploy / "job-env-secret.yaml").write_text(yaml.safe_dump(secret))
    found = [f for f in errors(lint_paths([str(deploy)], forwarding)) if "forward_env" in f.message]
    assert len(found) == 2 and all("HF_TOKEN" in str(f.expected) for f in found)  # head and worker group

    secret["stringData"] = {"HF_TOKEN": "placeholder"}
    (deploy / "job-env-secret.yaml").write_text(yaml.safe_dump(secret))
    assert [f for f in errors(lint_paths([str(deploy)], forwarding)) if "forward_env" in f.message] == []
