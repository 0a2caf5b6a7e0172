"""Faults of the flow around the jobs (issue 11 rows 3, 5, 6): a stopped job, a restarted Ray head, a killed
flow process. Each run is the pipeline through the fine-tune (`--until finetune`: verify, connectivity, data,
finetune; the stages after it add minutes and nothing these faults touch), interrupted, then continued with
`tuneproof run --run-id X --until finetune`: the record must show what was kept, what reran and why, and the
continued fine-tune must export the reference's weights (CPU fp32 replays exactly).

    python -m faults --only job-stopped,only-data-finetune,head-restarted,flow-sigkill,flow-sigterm
"""

from __future__ import annotations

import atexit
import json
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from ray.job_submission import JobSubmissionClient

from faults.harness import FaultRow, Lab, RunOutcome, RunProcess, scenario, start_head
from tuneproof.control import record as records
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.rowlog import read_rows
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

FLOW: tuple[str, ...] = (
    "eval.max_examples=60",
    # 40 steps teach the tiny model little: a gate every candidate passes keeps the run's end about the
    # fault, not about the model (the gates have their own tests).
    "eval.gates={exact_match: {min: 0.0}}",
    # ... and need not have taught it to end its answers: counted, not held to the cap (eval/selftest.py).
    "eval.max_truncated_fraction=1.0",
    # The resume test checkpoints every extra_steps from a main-run checkpoint (here a multiple of 10) and
    # must hold on one: with the default 4, seed 30 + 4 = 34 is no multiple of 4 and its job is refused.
    "resume.extra_steps=5",
)
"""`--set` overrides of the pipeline runs of these rows and of the load row, on top of the harness's WORKLOAD."""
STOP_AFTER_STEP = 23
"""Interrupt once this step is logged: checkpoint 20 is complete, 3 steps past it are lost and replayed."""


UNTIL = "finetune"
"""Where these rows' runs stop: the faults hit the fine-tune, and what runs after it is not in question."""


def start(lab: Lab, run_id: str, sets: tuple[str, ...] = ()) -> RunProcess:
    return lab.start(run_id, only=None, until=UNTIL, sets=[*FLOW, *sets])


def continue_run(lab: Lab, run_id: str, sets: tuple[str, ...] = ()) -> RunOutcome:
    """`tuneproof run --run-id X --until finetune` with the same config: the continuation."""
    return lab.run(run_id, only=None, until=UNTIL, sets=[*FLOW, *sets])


def wait_for(what: str, check: Callable[[], Any], proc: RunProcess, timeout: float = 600) -> Any:
    """Poll `check` until it returns something truthy; fails naming `what` (and the run's log tail)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = check()
        if found:
            return found
        if not proc.alive():
            raise RuntimeError(f"run {proc.run_id} ended before {what}:\n{proc.log.read_text()[-1500:]}")
        time.sleep(0.05)
    raise TimeoutError(f"run {proc.run_id}: no {what} within {timeout:.0f}s")


def logged_step(storage: Storage, run_id: str, job: str = "finetune") -> int:
    """The last step the fine-tune job logged to its metrics.jsonl (0 before the first)."""
    rows = read_rows(storage, "runs", run_id, "stages", job, "metrics.jsonl")
    return rows[-1]["step"] if rows else 0


def ray_client(lab: Lab) -> JobSubmissionClient:
    return JobSubmissionClient(lab.head.address, headers={"Authorization": f"Bearer {lab.head.token()}"})


def row_for(
    lab: Lab, name: str, injected_at: str, how: str, first: RunOutcome, cont: RunOutcome, problems: list[str]
) -> FaultRow:
    """The row: the continuation compared with the reference; seconds are both invocations together."""
    rec = cont.record
    compared = lab.compare(cont)
    compared["failure_class"] = first.failure_class  # how the interrupted invocation ended
    compared["seconds"] = round(first.seconds + cont.seconds, 1)
    compared["time_lost_s"] = round(first.seconds + cont.seconds - lab.reference().seconds, 1)
    if cont.exit_code != 0:
        problems.append(f"the continuation exited {cont.exit_code}: {cont.tail(600)}")
    if compared["same_as_reference"] is not True:
        problems.append("the continued fine-tune's export differs from the reference's")
    if compared["same_data_order"] is False:
        problems.append("the continued fine-tune trained on other samples than the reference (data-order ledger)")
    notes = "; ".join(problems) if problems else continuation_note(rec)
    return FaultRow(
        fault=name,
        injected_at=injected_at,
        outcome="FAILED" if problems else "survived",
        how=how,
        notes=notes,
        **compared,
    )


def continuation_note(rec: records.RunRecord | None) -> str:
    """'kept verify, connectivity, data; reran finetune (...); finetune restored step 20'."""
    if rec is None:
        return "no record"
    last = rec.invocations[-1]
    tuned = rec.summary("finetune", FinetuneSummary)
    if tuned and attached_to_running_job(rec):  # one job ran the whole fine-tune
        restored = f"; attached to the interrupted invocation's fine-tune job, still running ({tuned.steps} final)"
    else:
        restored = f"; fine-tune started at step {tuned.start_step} ({tuned.steps} final)" if tuned else ""
    reran = ", ".join(f"{k} ({v})" for k, v in last.reran.items())
    return f"kept {', '.join(last.kept) or 'nothing'}; reran {reran or 'nothing'}{restored}"


def attached_to_running_job(rec: records.RunRecord) -> bool:
    """The continuation followed the interrupted attempt's fine-tune job, which never stopped."""
    entry = rec.stages.get("finetune")
    return bool(entry and entry.jobs and entry.jobs[0].attached)


def check_resumed(
    rec: records.RunRecord | None,
    problems: list[str],
    at_least: int,
    kept: tuple[str, ...] = ("verify", "connectivity", "data"),
) -> None:
    """The continued fine-tune restored a checkpoint (never from zero), or attached to the interrupted
    attempt's job that was still running; the earlier stages (`kept`) were kept."""
    if rec is None:
        problems.append("the continuation left no record")
        return
    last = rec.invocations[-1]
    for stage in kept:
        if stage not in last.kept:
            problems.append(f"{stage} was not kept: {last.reran.get(stage)}")
    tuned = rec.summary("finetune", FinetuneSummary)
    if tuned is not None and attached_to_running_job(rec):
        return  # the interrupted attempt's job never stopped: the continuation followed it to its end
    if tuned is None or tuned.start_step < at_least or tuned.restored_from is None:
        start_step = tuned.start_step if tuned else None
        problems.append(f"the continued fine-tune started at step {start_step}, not from a checkpoint >= {at_least}")


# ---------------------------------------------------------------- row 3: ray job stop


@scenario(order=30, name="job-stopped")
def job_stopped(lab: Lab) -> FaultRow:
    """`ray job stop` of the fine-tune mid-run, then `run --run-id X`: resumes from checkpoint 20."""
    lab.reference()
    run_id = "flow-job-stopped"
    proc = start(lab, run_id)
    step = wait_for(f"fine-tune step {STOP_AFTER_STEP}", lambda: logged_step(proc.storage, run_id) >= STOP_AFTER_STEP and logged_step(proc.storage, run_id), proc)  # fmt: skip
    ray_client(lab).stop_job(f"{run_id}-finetune")
    first = proc.wait()
    problems = stop_problems(first)
    cont = continue_run(lab, run_id)
    check_resumed(cont.record, problems, 20)
    return row_for(
        lab, "job-stopped", f"step {step} of 40 (fine-tune)", "JobSubmissionClient.stop_job(<run>-finetune)",
        first, cont, problems,
    )  # fmt: skip


def stop_problems(first: RunOutcome) -> list[str]:
    """A run whose fine-tune job was stopped must fail as infrastructure (exit 4), naming the stop."""
    entry = first.record.stages.get("finetune") if first.record else None
    if first.exit_code == 4 and entry is not None and entry.failure_class and "STOPPED" in (entry.cause or ""):
        return []
    cause = entry.cause if entry else None
    return [f"the stopped run should fail as infrastructure (exit 4), got {first.exit_code}: {cause}"]


# ---------------------------------------------------------------- issue 28 item 8: continued with --only


@scenario(order=31, name="only-data-finetune")
def only_data_finetune(lab: Lab) -> FaultRow:
    """`ray job stop` of the fine-tune mid-run, then `run --only data,finetune --run-id X` (same settings): data
    reruns to the same content hash, so the fine-tune's inputs are unchanged and it resumes from checkpoint 20
    instead of training again from step 0."""
    lab.reference()
    run_id = "flow-only-data-finetune"
    proc = lab.start(run_id)  # the harness's stages: data, finetune
    step = wait_for(f"fine-tune step {STOP_AFTER_STEP}", lambda: logged_step(proc.storage, run_id) >= STOP_AFTER_STEP and logged_step(proc.storage, run_id), proc)  # fmt: skip
    ray_client(lab).stop_job(f"{run_id}-finetune")
    first = proc.wait()
    problems = stop_problems(first)
    cont = lab.run(run_id)
    check_resumed(cont.record, problems, 20, kept=())
    problems += same_dataset(cont.record)
    return row_for(
        lab, "only-data-finetune", f"step {step} of 40 (fine-tune)",
        "JobSubmissionClient.stop_job(<run>-finetune), then run --only data,finetune --run-id X",
        first, cont, problems,
    )  # fmt: skip


def same_dataset(rec: records.RunRecord | None) -> list[str]:
    """The continuation's data stage reran (invocation 2) to the content hash the interrupted fine-tune used."""
    if rec is None or "data" not in rec.stages:
        return ["the continuation has no data stage"]
    hashes = [
        e.summary.get("content_hash") for e in [*rec.superseded, rec.stages["data"]] if e.stage == "data" and e.summary
    ]
    if rec.stages["data"].invocation != 2 or len(set(hashes)) != 1:
        return [f"data should rerun to one content hash, got invocation {rec.stages['data'].invocation}: {hashes}"]
    return []


# ---------------------------------------------------------------- row 5: Ray head restarted between stages


@scenario(order=50, name="head-restarted")
def head_restarted(lab: Lab) -> FaultRow:
    """The Ray head stopped once data has succeeded and started again (same ports, same token) 20 s later: the
    fine-tune's submission waits for the dashboard and the run finishes; `run --run-id X` then keeps it all."""
    lab.reference()
    run_id = "flow-head-restarted"
    proc = start(lab, run_id)
    wait_for("a succeeded data stage", lambda: data_done(proc.storage, run_id), proc)
    proc.proc.send_signal(signal.SIGSTOP)  # hold the flow between the two stages while the head goes
    try:
        submitted = [j.submission_id for j in ray_client(lab).list_jobs() if j.submission_id == f"{run_id}-finetune"]
        old = lab.head
        old.stop()
    finally:
        proc.proc.send_signal(signal.SIGCONT)
    time.sleep(20)  # the flow's next submission finds the dashboard gone: it waits and retries
    lab.head = start_head(lab.workdir / "ray-state", dashboard_port=old.dashboard_port, gcs_port=old.gcs_port)
    # The lab stops the head it started, not this one (harness.lab holds its own reference): stop it at exit.
    atexit.register(lab.head.stop)
    first = proc.wait()
    problems = []
    log = first.output
    if "is unreachable; retrying" not in log and not submitted:
        problems.append("the submission after the restart showed no wait for the dashboard")
    if first.exit_code != 0:
        problems.append(f"the run after the head restart exited {first.exit_code}: {first.tail(600)}")
    cont = continue_run(lab, run_id)
    rec = cont.record
    if rec is not None and rec.invocations[-1].reran:
        problems.append(f"a continuation of a finished run reran {rec.invocations[-1].reran}")
    when = "after data, before finetune" + (" (finetune already submitted)" if submitted else "")
    return row_for(
        lab, "head-restarted", when, "SIGSTOP the flow, stop the Ray head, SIGCONT, start it again on the same ports 20 s later",
        first, cont, problems,
    )  # fmt: skip


def data_done(storage: Storage, run_id: str) -> bool:
    try:
        rec = records.load(storage, run_id)
    except (FileNotFoundError, records.RecordUnreadable):  # not yet written, or caught mid-write
        return False
    return rec.passed("data")


# ---------------------------------------------------------------- row 6: the flow's process killed


def runs_status(lab: Lab, run_id: str) -> str:
    """What `tuneproof runs list --json` says of the run."""
    args = [sys.executable, "-m", "tuneproof.app.cli", "runs", "list", "--json"]
    for s in lab.sets():
        args += ["--set", s]
    out = subprocess.run(args, cwd=PROJECT_ROOT, env=lab.env(), capture_output=True, text=True, timeout=120)
    rows = {row["run_id"]: row for row in json.loads(out.stdout)}
    return str(rows.get(run_id, {}).get("status"))


def killed_flow(lab: Lab, name: str, sig: signal.Signals, expect_status: str) -> FaultRow:
    lab.reference()
    run_id = f"flow-{name}"
    proc = start(lab, run_id)
    step = wait_for(f"fine-tune step {STOP_AFTER_STEP}", lambda: logged_step(proc.storage, run_id) >= STOP_AFTER_STEP and logged_step(proc.storage, run_id), proc)  # fmt: skip
    proc.proc.send_signal(sig)
    first = proc.wait()
    problems = []
    shown = runs_status(lab, run_id)
    if shown != expect_status:
        problems.append(f"`runs list` showed {shown} after {sig.name}, not {expect_status}")
    cont = continue_run(lab, run_id)
    rec = cont.record
    check_resumed(rec, problems, 20)
    if rec is not None and rec.invocations[0].status != expect_status:
        problems.append(f"invocation 1 is recorded {rec.invocations[0].status}, not {expect_status}")
    return row_for(lab, name, f"step {step} of 40 (fine-tune)", f"{sig.name} to `tuneproof run`", first, cont, problems)


@scenario(order=60, name="flow-sigkill")
def flow_sigkill(lab: Lab) -> FaultRow:
    """kill -9 of `tuneproof run` mid-fine-tune: `runs list` shows it crashed (its lease's pid is gone); the
    continuation takes the lease over, records invocation 1 crashed, and attaches to the fine-tune job that
    kept running (or resumes it from its checkpoint if it ended)."""
    return killed_flow(lab, "flow-sigkill", signal.SIGKILL, "crashed")


@scenario(order=61, name="flow-sigterm")
def flow_sigterm(lab: Lab) -> FaultRow:
    """SIGTERM to `tuneproof run` mid-fine-tune: it stops its Ray job and ends `cancelled`; the continuation
    resumes the fine-tune from checkpoint 20."""
    return killed_flow(lab, "flow-sigterm", signal.SIGTERM, "cancelled")
