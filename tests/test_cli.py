"""The command line without a cluster: transport verdicts and exit codes, run records, --only planning."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import typer
from typer.testing import CliRunner

from tuneproof.app.cli import app, latest_run_id, run_exit_code
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.core.config import PipelineConfig
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_training import FinetuneSummary

EFA_LOG = """\
ip-10-0-1-5:1234:1234 [0] NCCL INFO NCCL version 2.29.7+cuda13.0
ip-10-0-1-5:1234:1234 [0] NCCL INFO Bootstrap : Using eth0:10.0.1.5<0>
ip-10-0-1-5:1234:1290 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)
ip-10-0-1-5:1234:1290 [0] NCCL INFO Using network Libfabric
ip-10-0-1-5:1234:1291 [0] NCCL INFO Channel 00/0 : 0[0] -> 4[0] [send] via NET/Libfabric/0/GDRDMA
"""
SOCKET_LOG = """\
ip-10-0-1-6:2234:2234 [0] NCCL INFO NCCL version 2.29.7+cuda13.0
ip-10-0-1-6:2234:2290 [0] NCCL INFO NET/OFI No eligible providers were found
ip-10-0-1-6:2234:2290 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.1.6<0>
ip-10-0-1-6:2234:2290 [0] NCCL INFO Using network Socket
"""
SILENT_LOG = """\
ip-10-0-1-7:3234:3234 [0] NCCL INFO NCCL version 2.29.7+cuda13.0
ip-10-0-1-7:3234:3234 [0] NCCL INFO Bootstrap : Using eth0:10.0.1.7<0>
"""


def transport(tmp_path, text: str, *args: str):
    log = tmp_path / "nccl.log"
    log.write_text(text)
    result = CliRunner().invoke(app, ["transport", str(log), *args])
    return result.exit_code, json.loads(result.output)


def test_transport_verdicts_and_exit_codes(tmp_path):
    code, doc = transport(tmp_path, EFA_LOG, "--expect", "efa")
    assert (code, doc["verdict"], doc["ok"]) == (0, "efa", True)
    assert any("Selected provider is efa" in line for line in doc["evidence"])
    code, doc = transport(tmp_path, SOCKET_LOG, "--expect", "efa")
    assert (code, doc["verdict"]) == (1, "socket-fallback")
    assert any("NET/Socket" in line or "No eligible providers" in line for line in doc["evidence"])
    code, doc = transport(tmp_path, SILENT_LOG, "--expect", "efa")
    assert (code, doc["verdict"]) == (1, "inconclusive")
    code, doc = transport(tmp_path, SOCKET_LOG)  # no expectation: a verdict, not a failure
    assert (code, doc["verdict"]) == (0, "socket-fallback")


def test_transport_rejects_an_unknown_expectation(tmp_path):
    log = tmp_path / "nccl.log"
    log.write_text(EFA_LOG)
    result = CliRunner().invoke(app, ["transport", str(log), "--expect", "infiniband"])
    assert result.exit_code == 2 and "infiniband" in result.output


def test_runs_list_is_newest_first_and_show_reads_one(tmp_path):
    storage = Storage(str(tmp_path))
    cfg = PipelineConfig()
    for run_id in ("20261130-100000-aaaaaa", "20261130-110000-bbbbbb"):
        rec = records.new_record(run_id, cfg, records.CodeIdentity(git_sha="abc", dirty=False), None)
        rec.created_at = run_id
        records.save(storage, rec)
    listed = CliRunner().invoke(app, ["runs", "list", "--json", "--set", f"storage.root={tmp_path}"])
    assert [r["run_id"] for r in json.loads(listed.output)] == ["20261130-110000-bbbbbb", "20261130-100000-aaaaaa"]
    shown = CliRunner().invoke(
        app, ["runs", "show", "20261130-100000-aaaaaa", "--json", "--set", f"storage.root={tmp_path}"]
    )
    assert json.loads(shown.output)["config_hash"] == cfg.config_hash()
    missing = CliRunner().invoke(app, ["runs", "show", "nope", "--set", f"storage.root={tmp_path}"])
    assert missing.exit_code == 1 and "nope" in missing.output


def test_only_without_a_run_id_reruns_the_latest_finished_run_of_this_model(tmp_path):
    # `--only promote` with another model's config took the newest finished run of any model: its export was
    # then promoted as this model's production.
    for run_id, model in (("20261130-100000-aaaaaa", "model-b"), ("20261130-110000-bbbbbb", "model-a")):
        cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "model": {"name": model}})
        rec = records.new_record(run_id, cfg, records.CodeIdentity(git_sha="abc", dirty=False), None)
        rec.created_at, rec.status = run_id, "succeeded"
        records.save(Storage(str(tmp_path)), rec)
    model_b = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "model": {"name": "model-b"}})
    assert latest_run_id(model_b) == "20261130-100000-aaaaaa"
    model_c = model_b.model_copy(update={"model": model_b.model.model_copy(update={"name": "model-c"})})
    with pytest.raises(typer.Exit):
        latest_run_id(model_c)


def test_only_without_a_run_id_never_reruns_against_a_run_whose_record_is_not_finished(tmp_path):
    # A flow killed between record.json and row.json left the row saying `succeeded` for a run whose record was
    # running again (its writer dead): `--only` took that crashed run as the latest finished one.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    for run_id in ("20261130-100000-aaaaaa", "20261130-110000-bbbbbb"):
        rec = records.new_record(run_id, cfg, records.CodeIdentity(git_sha="abc", dirty=False), None)
        rec.created_at, rec.status = run_id, "succeeded"
        records.save(storage, rec)
    killed = records.load(storage, "20261130-110000-bbbbbb")
    killed.start()
    storage.write_json(killed.to_json(), "runs", killed.run_id, records.RECORD)  # and no row.json after it
    assert latest_run_id(cfg) == "20261130-100000-aaaaaa"


def test_runs_show_names_a_summary_its_cost_cannot_read(tmp_path, monkeypatch):
    # print_cost ran outside the guard: a summary the cost could not read ended in a raw ValidationError, exit 4.
    storage = Storage(str(tmp_path))
    rec = records.new_record("r0", PipelineConfig(), records.CodeIdentity(git_sha="abc", dirty=False), None)
    records.save(storage, rec)

    def unreadable(*args: object) -> None:
        FinetuneSummary.model_validate({"legacy_field": 1})

    monkeypatch.setattr("tuneproof.control.cost.run_cost", unreadable)
    shown = CliRunner().invoke(app, ["runs", "show", "r0", "--set", f"storage.root={tmp_path}"])
    assert shown.exit_code == 1, shown.output
    assert "run r0: a stage summary in record.json is not readable: FinetuneSummary." in shown.output


def test_empty_lists_say_where_they_looked(tmp_path):
    # They printed an empty table: a mistyped storage.root looked like a store with nothing in it.
    for what, says in (("runs", "no runs under"), ("models", "no models under")):
        listed = CliRunner().invoke(app, [what, "list", "--set", f"storage.root={tmp_path}"])
        assert listed.exit_code == 0 and " ".join(listed.output.split()).startswith(f"{says} {tmp_path}/{what}")
        as_json = CliRunner().invoke(app, [what, "list", "--json", "--set", f"storage.root={tmp_path}"])
        assert as_json.exit_code == 0 and json.loads(as_json.output) == []


READERS_WITHOUT_PREFECT = """
import sys
from typer.testing import CliRunner
from tuneproof.app.cli import app
for args in (["runs", "list"], ["runs", "show", "run-a"], ["runs", "diff", "run-a", "run-b"]):
    result = CliRunner().invoke(app, [*args, "--set", f"storage.root={sys.argv[1]}"])
    assert result.exit_code == 0, (args, result.output)
print(sorted(name for name in sys.modules if name.split(".")[0] == "prefect"))
"""


def test_the_run_readers_start_without_prefect(tmp_path):
    """`runs list|show|diff` read records and the stage table's facts: importing Prefect (seconds, and its
    settings can refuse to load) is not theirs to pay. Run in a fresh interpreter so nothing is preloaded."""
    storage = Storage(str(tmp_path))
    for run_id in ("run-a", "run-b"):
        rec = records.new_record(run_id, PipelineConfig(), records.CodeIdentity(git_sha="abc", dirty=False), None)
        data = DataSummary(dataset_path="datasets/dates/abc", content_hash="abc", dataset_uri=f"{tmp_path}/x")
        rec.stages["data"] = records.StageEntry.succeeded("data", data, "t0")
        records.save(storage, rec)
    ran = subprocess.run(
        [sys.executable, "-c", READERS_WITHOUT_PREFECT, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert ran.returncode == 0, ran.stderr
    assert ran.stdout.splitlines()[-1] == "[]", ran.stdout


def test_only_plans_and_exit_codes():
    assert not table.needs_an_earlier_run(table.plan(["verify", "connectivity"]))
    assert table.needs_an_earlier_run(table.plan(["evaluate", "promote"]))
    assert table.needs_an_earlier_run(table.plan(["promote"]))
    assert run_exit_code({"status": "succeeded", "failure_class": None}) == 0
    assert run_exit_code({"status": "failed", "failure_class": "data"}) == 5
    assert run_exit_code({"status": "failed", "failure_class": None}) == 3
    bad = CliRunner().invoke(app, ["run", "--only", "verify,train"])
    assert bad.exit_code == 3 and "train" in bad.output


def test_run_without_a_prefect_server_says_how_to_start_one():
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from tuneproof.app.local import free_port

    before = signal.getsignal(signal.SIGTERM)
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api"}):
        result = CliRunner().invoke(app, ["run", "--only", "verify"])
    assert result.exit_code == 4
    assert "does not answer" in result.output and "tuneproof local up" in result.output
    # `run` turns SIGTERM into a cancellation only while it runs: the caller's handler is back after it
    # (a test process that kept the raising one would hand it to every process it forks later).
    assert signal.getsignal(signal.SIGTERM) is before


def test_run_compare_and_canary_share_one_in_process_runner_that_runs_nothing_without_the_api():
    """`run`, `compare` and `canary` all start their flow through terminal.run_here: a Prefect API that does not
    answer is an infrastructure failure before the title is said or the flow is called."""
    import contextlib
    import inspect
    from io import StringIO

    from prefect.settings import PREFECT_API_URL, temporary_settings
    from rich.console import Console

    from tuneproof.app import images_cli, terminal

    for runner in (terminal.run_with_display, terminal.run_comparison, images_cli.canary_command):
        source = inspect.getsource(runner)
        assert "run_here(" in source and "return_state" not in source, runner.__name__
    called: list[dict] = []
    out = StringIO()
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:9/api"}):
        result = terminal.run_here(
            Console(file=out), "the title", contextlib.nullcontext(), lambda **kw: called.append(kw), x=1
        )
    assert isinstance(result, terminal.NotRun) and result.failure_class == "infrastructure"
    assert "127.0.0.1:9" in result.cause and not called and "the title" not in out.getvalue()


def test_stopping_a_started_process_stops_its_whole_session_other_process_groups_included():
    # Ray starts some workers in process groups of their own: a Ray Train controller outlived a test session's
    # head by hours when only the head's group was killed.
    from tuneproof.app.local import pid_alive, session_members, stop_group

    worker = "import os, time; os.setpgrp(); print(os.getpid(), flush=True); time.sleep(600)"
    head = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {worker!r}]); time.sleep(600)"
    leader = subprocess.Popen([sys.executable, "-c", head], stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        assert leader.stdout is not None
        child = int(leader.stdout.readline())
        assert child in session_members(leader.pid) and os.getpgid(child) == child != leader.pid
        stop_group(leader.pid, 5)
        assert not pid_alive(leader.pid) and not pid_alive(child)
    finally:
        leader.kill()
        leader.wait()
