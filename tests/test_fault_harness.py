"""The fault harness's own pieces (fast, no cluster): registry, discovery, table, report, the job-side hooks."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from faults import harness
from faults.__main__ import discover, main
from faults.harness import FaultRow, failed_row, ordered, render_table, report, scenario, table_cells, write_report
from training.fault_hooks import BadFaultSpec, FaultPoint, after_step, fault_point, parse_fault_at
from tuneproof.core.config import PROJECT_ROOT


def row(**overrides) -> FaultRow:
    fields = {
        "fault": "worker-sigkill",
        "injected_at": "step 23 of 40",
        "outcome": "survived",
        "failure_class": None,
        "final_loss": 0.123456,
        "weights_sha256": "ab" * 32,
        "same_as_reference": True,
        "same_data_order": True,
        "seconds": 61.24,
        "time_lost_s": 14.0,
        "how": "kill -9 of rank 1's pid",
    }
    return FaultRow(**{**fields, **overrides})


@pytest.fixture
def registry(monkeypatch):
    """An empty registry for the test, the real one back afterwards."""
    monkeypatch.setattr(harness, "SCENARIOS", {})
    return harness.SCENARIOS


def test_scenarios_run_by_order_and_are_picked_by_name(registry):
    for order, name in ((7, "disk-full"), (1, "worker-sigkill"), (2, "checkpoint-sigkill")):
        scenario(order=order, name=name)(lambda lab: row())
    assert [s.name for s in ordered()] == ["worker-sigkill", "checkpoint-sigkill", "disk-full"]
    assert [s.name for s in ordered(["disk-full", "worker-sigkill"])] == ["worker-sigkill", "disk-full"]
    with pytest.raises(KeyError, match="no fault scenario nope; known: checkpoint-sigkill, disk-full, worker-sigkill"):
        ordered(["nope"])


def test_a_name_registered_twice_is_refused(registry):
    scenario(order=1, name="twice")(lambda lab: row())
    with pytest.raises(ValueError, match="'twice' is registered twice"):
        scenario(order=2, name="twice")(lambda lab: row())


def test_every_f_module_is_discovered_and_registers_its_rows():
    modules = discover()
    assert "f_train" in modules and all(name.startswith("f_") for name in modules)
    assert {"worker-sigkill", "checkpoint-sigkill", "s3-down", "disk-full"} <= set(harness.SCENARIOS)
    assert {"preemption-notice", "preemption-no-notice"} <= set(harness.SCENARIOS)
    assert all(sc.run.__module__.startswith("faults.f_") for sc in harness.SCENARIOS.values())


def test_list_prints_the_scenarios_without_running_any(registry, capsys):
    scenario(order=3, name="listed")(lambda lab: row())
    assert main(["--list", "--only", "listed"]) == 0
    assert "listed  (tests.test_fault_harness)" in capsys.readouterr().out
    assert main(["--list", "--only", "no-such-fault"]) == 2
    assert "--only: no fault scenario no-such-fault" in capsys.readouterr().out


def test_table_cells_shorten_the_hash_and_sign_the_time_lost():
    assert table_cells(row()) == [
        "worker-sigkill",
        "step 23 of 40",
        "survived",
        "-",
        "0.1235",
        "abababababab",
        "yes",
        "same",
        "61",
        "+14",
        "kill -9 of rank 1's pid",
    ]
    cells = table_cells(row(outcome="failed-as-expected", failure_class="infrastructure", same_as_reference=None))
    assert cells[2:4] == ["failed-as-expected", "infrastructure"] and cells[6] == "-"
    assert table_cells(row(same_as_reference=False))[6] == "NO"
    assert table_cells(row(same_data_order=False))[7] == "DIFFERS" and table_cells(row(same_data_order=None))[7] == "-"


def test_the_table_shows_every_row_and_the_notes(registry):
    from rich.console import Console

    rows = [
        row(),
        row(fault="disk-full", notes="tmpfs 20 MB [/__w/pair.cc:537]"),
        failed_row(harness.Scenario(9, "x", lambda lab: row()), OSError("boom"), 3),
    ]
    console = Console(width=250, record=True)
    console.print(render_table(rows, 125.0))
    text = console.export_text()
    assert "3 rows in 125 s" in text and "disk-full: tmpfs 20 MB [/__w/pair.cc:537]" in text
    assert "x: scenario raised OSError: boom" in text and "FAILED" in text


def test_the_report_holds_the_rows_total_and_machine(tmp_path):
    out = tmp_path / "out" / "faults.json"
    write_report(out, [row()], 100.04, {"cpus": 2})
    doc = json.loads(out.read_text())
    assert doc == report([row()], 100.04, {"cpus": 2})
    assert doc["total_seconds"] == 100.0 and doc["machine"] == {"cpus": 2}
    assert FaultRow.model_validate(doc["rows"][0]) == row()


def test_a_fault_point_parses_or_names_the_bad_value():
    assert parse_fault_at("checkpoint:30") == FaultPoint("checkpoint", 30)
    assert parse_fault_at(" checkpoint:7 ").spec() == "checkpoint:7"
    for bad in ("checkpoint", "checkpoint:0", "checkpoint:x", "step:3", ""):
        with pytest.raises(BadFaultSpec, match="expected <kind>:<step>"):
            parse_fault_at(bad)
    assert fault_point({}) is None
    assert fault_point({"TUNEPROOF_FAULT_AT": "checkpoint:10"}) == FaultPoint("checkpoint", 10)


def test_the_pid_hook_is_inert_without_its_variable_and_reports_with_it(tmp_path, monkeypatch):
    monkeypatch.delenv("TUNEPROOF_FAULT_PIDS", raising=False)
    after_step(1, 5)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv("TUNEPROOF_FAULT_PIDS", str(tmp_path))
    after_step(1, 5)
    assert json.loads((tmp_path / "rank1.json").read_text())["pid"] == os.getpid()
    assert [p.name for p in tmp_path.iterdir()] == ["rank1.json"]


def test_the_step_hook_sleeps_only_with_its_variable(monkeypatch):
    slept: list[float] = []
    monkeypatch.setattr("training.fault_hooks.time.sleep", slept.append)
    monkeypatch.delenv("TUNEPROOF_FAULT_STEP_S", raising=False)
    after_step(0, 1)
    monkeypatch.setenv("TUNEPROOF_FAULT_STEP_S", "0.5")
    after_step(0, 2)
    assert slept == [0.5]


def test_a_worker_is_found_on_the_node_whose_process_started_it():
    from faults.f_preempt import started_by

    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert started_by(child.pid, os.getpid())  # the raylet's child (a worker) is on that raylet's node
        assert not started_by(os.getpid(), child.pid)
    finally:
        child.kill()
        child.wait()
    assert not started_by(child.pid, os.getpid())  # gone


def test_a_run_that_ends_before_the_workers_reach_the_step_is_named_with_its_log_tail(tmp_path):
    # The waits for a worker's step said only "before the run ended or 600 s passed": why the run ended was
    # in its log, which the row's error did not show.
    import time

    from faults.f_preempt import wait_for_step
    from faults.f_train import kill_at_step
    from faults.harness import RunProcess
    from tuneproof.core.storage import Storage

    log = tmp_path / "run.log"
    log.write_text("Traceback (most recent call last):\nValueError: bad batch\n")
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    run = RunProcess("f1-worker-sigkill", ended, log, Storage(str(tmp_path)), time.monotonic())
    (tmp_path / "rank1.json").write_text(json.dumps({"pid": ended.pid, "step": 3}))
    why = r"(?s)run f1-worker-sigkill ended before .*ValueError: bad batch"
    with pytest.raises(RuntimeError, match=why):
        kill_at_step(run, tmp_path / "rank1.json", 23)
    with pytest.raises(RuntimeError, match=why):
        wait_for_step(run, tmp_path, 13)


def test_the_default_run_deselects_the_fault_tests():
    collect = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", "tests/test_faults.py"]
    plain = subprocess.run(collect, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert "deselected" in plain.stdout and "skipped" not in plain.stdout, plain.stdout
    chosen = subprocess.run([*collect, "-m", "faults"], cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=120)
    assert "test_faults.py::test_fault" in chosen.stdout and "deselected" not in chosen.stdout, chosen.stdout


def test_the_proxy_goes_down_at_the_armed_request_and_comes_back_on_the_same_port():
    import http.client
    import re
    import threading
    import time
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from faults.proxy import FlakyProxy

    class Ok(BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Length", "2")
            self.end_headers()
            self.wfile.write(b"ok")

        do_PUT = do_GET

        def log_message(self, *args):
            pass

    def request(port: int, method: str, path: str) -> int:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            conn.request(method, path, body=b"x" if method == "PUT" else None)
            return conn.getresponse().status
        finally:
            conn.close()

    def wait_outages(proxy: FlakyProxy, count: int, timeout: float) -> bool:
        """True once `count` outages have ended."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if sum(o.ended is not None for o in proxy.outages) >= count:
                return True
            time.sleep(0.2)
        return False

    server = ThreadingHTTPServer(("127.0.0.1", 0), Ok)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        with FlakyProxy(server.server_address[1]) as proxy:
            proxy.arm(re.compile(rb"^PUT \S*/datasets/"), seconds=1.0)
            assert request(proxy.port, "GET", "/bucket/datasets/x") == 200  # not armed for GET
            with pytest.raises((ConnectionError, http.client.RemoteDisconnected)):
                request(proxy.port, "PUT", "/bucket/datasets/x")
            with pytest.raises(ConnectionRefusedError):
                request(proxy.port, "GET", "/during-the-outage")
            assert wait_outages(proxy, 1, timeout=10)
            assert request(proxy.port, "PUT", "/bucket/datasets/x") == 200  # fired once: back, same port
            assert [o.trigger for o in proxy.outages] == ["PUT /bucket/datasets/x HTTP/1.1"]
    finally:
        server.shutdown()
