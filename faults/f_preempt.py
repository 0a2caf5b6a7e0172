"""Issue 28, item 6: a node of the fine-tune drained with a deadline, as a spot reclaim's notice is.

    python -m faults --only preemption-notice,preemption-no-notice

The lab's head gets a second raylet (`ray start --address`, 1 CPU, its own ports and temp dir, stopped at
the end whatever happens). While the fine-tune's 2 workers are placed, a placement group holds 3 of the
head's 4 CPUs, so one worker runs on each node. After step DRAIN_AT (not a checkpoint step) the hold is let
go, so the group Ray Train restarts fits on the head, and the second node is drained for preemption with a
deadline of DEADLINE_STEPS steps; after the deadline the second raylet's processes are SIGKILLed (the node is gone). Each step sleeps STEP_S
(TUNEPROOF_FAULT_STEP_S) so that a deadline of seconds falls mid-run. The two rows:

preemption-notice     train.checkpoint_on_preemption=true and Ray Train's preemption watcher on: the loop
                      saves a checkpoint at the notice and waits; Ray Train restarts the group at the
                      deadline from it. Lost steps 0; the reference's weights
preemption-no-notice  the local profile as it is (the watcher off, checkpoint_on_preemption false): Ray Train
                      reacts to the lost actor when the raylet is killed and restarts from the last periodic
                      checkpoint. Lost steps at most one checkpoint interval; the reference's weights

The watcher polls Ray's drain state every POLL_S seconds (RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, 5 by default).
`python -m faults.f_preempt hold <gcs> <node-manager-port> <cpus>` is the harness's own Ray driver: it holds
the CPUs on the head, then lets them go and drains the second node when told (the GCS call `ray drain-node
--node-id X --reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds N` makes; the CLI took
4 s to start here).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from faults.f_flow import wait_for
from faults.f_train import MAX_STEPS, describe, reported, restarts_of, survived
from faults.harness import WORKLOAD, FaultRow, Lab, RunProcess, scenario
from training.fault_hooks import FAULT_PIDS, FAULT_STEP_S
from tuneproof.app.local import free_port, ray_env, stop_group
from tuneproof.core.config_base import PREEMPTION_WATCHER

CHECKPOINT_EVERY = int(next(s for s in WORKLOAD if s.startswith("train.checkpoint_every=")).split("=")[1])
DRAIN_AT = 13
"""The step the second node is drained after: past checkpoint 10, before the notice can come."""
STEP_S = 0.5
"""TUNEPROOF_FAULT_STEP_S: each step of these runs sleeps this long (the reference's take 0.09 s here):
without it the 27 steps after the drain end in under 3 s, before any deadline the notice fits in."""
DEADLINE_STEPS = 10
"""The drain's deadline, in steps (the reference's median plus STEP_S), at least MIN_DEADLINE_S: the notice
(a poll, then the loop's next ask) and its checkpoint fit well inside, and the run cannot finish before it."""
MIN_DEADLINE_S = 5
POLL_S = "1"
HEAD_CPUS_HELD = 3
"""Of the lab head's 4 CPUs: one stays free for a worker, the second node's 1 CPU takes the other."""
POLL_ENV = "RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S"


@dataclass
class SecondNode:
    """A raylet joined to the lab's head: the `ray start --block` process (its own process group)."""

    proc: subprocess.Popen
    node_manager_port: int
    temp_dir: str
    log: Path

    def kill(self) -> None:
        """SIGKILL the raylet and everything it started: a reclaimed node runs no handler."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        stop_group(self.proc.pid, 5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)  # Ray leaves its session logs and sockets behind


@contextlib.contextmanager
def second_node(lab: Lab) -> Iterator[SecondNode]:
    """`ray start --address=<head> --num-cpus=1` on its own ports; killed on the way out, whatever happened."""
    port = free_port()
    temp_dir = f"/tmp/tp-ray-node2-{port}"
    log = lab.workdir / "logs" / f"ray-node2-{port}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable, "-m", "faults.f_preempt", "node", "--block", "--disable-usage-stats",
        f"--address={lab.head.gcs_address}",
        "--node-ip-address=127.0.0.1", "--num-cpus=1", f"--node-manager-port={port}",
        f"--object-manager-port={free_port()}", f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}", f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}", f"--temp-dir={temp_dir}",
    ]  # fmt: skip
    env = {**lab.env(), **ray_env(lab.head.token_file), "RAY_USAGE_STATS_ENABLED": "0"}
    with open(log, "ab") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    node = SecondNode(proc, port, temp_dir, log)
    try:
        deadline = time.monotonic() + 300
        while "Ray runtime started" not in log.read_text(errors="replace"):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the second raylet did not start; log tail:\n{log.read_text()[-1500:]}")
            time.sleep(1)
        yield node
    finally:
        node.kill()


@contextlib.contextmanager
def head_cpus_held(lab: Lab, node: SecondNode) -> Iterator[subprocess.Popen]:
    """HEAD_CPUS_HELD CPUs of the head held by this module's `hold` driver, which drains the second node when
    told (`drain`); it is ended on the way out in any case (`release`)."""
    args = [sys.executable, "-m", "faults.f_preempt", "hold", lab.head.gcs_address, str(node.node_manager_port)]
    env = {**lab.env(), **ray_env(lab.head.token_file)}
    proc = subprocess.Popen(
        [*args, str(HEAD_CPUS_HELD)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
    )
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line.startswith("{"):
            raise RuntimeError(f"the CPU hold did not start (exit {proc.poll()}): {line!r}")
        yield proc
    finally:
        release(proc)


def release(proc: subprocess.Popen) -> None:
    if proc.stdin and not proc.stdin.closed:
        proc.stdin.close()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def wait_for_step(run: RunProcess, pids: Path, step: int) -> dict[int, dict[str, int]]:
    """Every rank's {pid, step} once each reports `step` or later."""

    def every_rank_there() -> dict[int, dict[str, int]] | None:
        seen = [reported(pids / f"rank{rank}.json", step) for rank in (0, 1)]
        return {rank: s for rank, s in enumerate(seen) if s} if all(seen) else None

    return wait_for(f"every worker at step {step}", every_rank_there, run)


def drain(hold: subprocess.Popen, deadline_s: int) -> None:
    """Let the held CPUs go and drain the second node, through the `hold` driver (connected already: the
    `ray drain-node` CLI took 4 s to start here, 7 steps). The same GCS call as the CLI makes."""
    assert hold.stdin is not None and hold.stdout is not None
    hold.stdin.write(f"drain {deadline_s}\n")
    hold.stdin.flush()
    answer = hold.stdout.readline()
    if not answer.startswith("{") or not json.loads(answer)["accepted"]:
        raise RuntimeError(f"the drain was not accepted (driver exit {hold.poll()}): {answer!r}")


def deadline_s(lab: Lab) -> int:
    """DEADLINE_STEPS of the reference run's median seconds per step (its metrics rows' times) plus STEP_S."""
    from statistics import median

    from tuneproof.core.rowlog import read_rows

    ref = lab.reference()
    summary = ref.finetune
    assert summary is not None and summary.metrics_path
    times = [r["time"] for r in read_rows(ref.storage, summary.metrics_path)]
    per_step = median(b - a for a, b in zip(times, times[1:]))
    return max(MIN_DEADLINE_S, round(DEADLINE_STEPS * (per_step + STEP_S)))


def preempted(lab: Lab, name: str, on_notice: bool) -> FaultRow:
    ref = lab.reference()
    deadline = deadline_s(lab)
    run_id = f"f28-{name}"
    data = lab.run(run_id, only=("data",))
    if data.exit_code != 0:
        raise RuntimeError(f"the data stage failed (exit {data.exit_code}):\n{data.tail()}")
    pids = lab.workdir / "pids" / name
    pids.mkdir(parents=True, exist_ok=True)
    sets = [
        f"runtime_env.forward_env=[{FAULT_PIDS},{FAULT_STEP_S},{POLL_ENV}]",
        f"train.checkpoint_on_preemption={str(on_notice).lower()}",
        # configs/local.yaml turns Ray Train's preemption watcher off (one machine, no spot nodes).
        *([f'runtime_env.env_vars.{PREEMPTION_WATCHER}="1"'] if on_notice else []),
    ]
    with second_node(lab) as node, head_cpus_held(lab, node) as hold:
        run = lab.start(
            run_id,
            only=("finetune",),
            sets=sets,
            env={FAULT_PIDS: str(pids), FAULT_STEP_S: str(STEP_S), POLL_ENV: POLL_S},
        )
        seen = wait_for_step(run, pids, DRAIN_AT)
        on_node2 = [rank for rank, s in seen.items() if started_by(s["pid"], node.proc.pid)]
        issued_at = max(s["step"] for s in seen.values())
        drain(hold, deadline)  # the held CPUs go first: the group Ray Train restarts fits on the head
        drained_at = max(s["step"] for s in wait_for_step(run, pids, 0).values())
        time.sleep(deadline + 1)
        node.kill()
        out = run.wait()
    compared = lab.compare(out)
    seconds = data.seconds + out.seconds  # as the reference: data, then the fine-tune
    restarts = restarts_of(out)
    first = restarts[0] if restarts else None
    if on_notice:
        expected = first is not None and first.notice_step is not None and first.lost_steps == 0
    else:
        expected = first is not None and first.notice_step is None and (first.lost_steps or 0) <= CHECKPOINT_EVERY
    expected = expected and len(restarts) == 1 and len(on_node2) == 1
    return FaultRow(
        fault=name,
        injected_at=f"drain issued after step {issued_at}, accepted by step {drained_at} of {MAX_STEPS}; deadline "
        f"{deadline} s",
        outcome=survived(out, compared, expected),
        how=f"second raylet (1 CPU) joined to the head, rank {on_node2} on it; drained (the GCS call of ray drain-node "
        f"--reason DRAIN_NODE_REASON_PREEMPTION --deadline-remaining-seconds {deadline}), SIGKILL of its raylet "
        f"{deadline + 1} s after the drain; {FAULT_STEP_S}={STEP_S}; train.checkpoint_on_preemption={str(on_notice).lower()}, {POLL_ENV}={POLL_S}",
        notes=(describe(restarts) or f"no restart in the record; exit {out.exit_code}: {out.tail(300)}")
        + "".join(f"; notice checkpoint at step {r.notice_step}" for r in restarts if r.notice_step is not None),
        **{**compared, "seconds": round(seconds, 1), "time_lost_s": round(seconds - ref.seconds, 1)},
    )


def started_by(pid: int, ancestor: int, depth: int = 8) -> bool:
    """Whether `ancestor` started `pid` (its parent, the parent's parent, ...): a Ray worker is the child of
    its node's raylet, in a process group of its own. False when pid is gone."""
    for _ in range(depth):
        try:
            pid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            return False
        if pid == ancestor:
            return True
        if pid <= 1:
            return False
    return False


@scenario(order=12, name="preemption-notice")
def preemption_notice(lab: Lab) -> FaultRow:
    return preempted(lab, "preemption-notice", on_notice=True)


@scenario(order=13, name="preemption-no-notice")
def preemption_no_notice(lab: Lab) -> FaultRow:
    return preempted(lab, "preemption-no-notice", on_notice=False)


def hold(gcs: str, node_manager_port: int, cpus: int) -> None:
    """Connect to the cluster, hold `cpus` CPUs in a placement group on one node (only the head has that
    many), print {"node_id"} of the node on node_manager_port. On a line `drain <seconds>`: let the CPUs go,
    drain that node for preemption with that deadline (what `ray drain-node` does), print {"accepted"}.
    Ends when stdin closes."""
    import ray
    from ray.core.generated import autoscaler_pb2
    from ray.util.placement_group import placement_group, remove_placement_group

    ray.init(address=gcs, logging_level=logging.ERROR, log_to_driver=False)
    node_id = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerPort"] == node_manager_port)
    group = placement_group([{"CPU": cpus}], strategy="STRICT_PACK")
    ray.get(group.ready(), timeout=120)
    print(json.dumps({"node_id": node_id}), flush=True)
    for line in sys.stdin:
        command, _, seconds = line.partition(" ")
        if command == "drain":
            remove_placement_group(group)
            deadline_ms = time.time_ns() // 1_000_000 + int(seconds) * 1000
            # Compiled and generated modules, without type stubs: what ray/scripts/scripts.py drain_node calls.
            client = ray._raylet.GcsClient(address=gcs)  # type: ignore[attr-defined]
            reason = autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION")  # type: ignore[attr-defined]
            accepted, why = client.drain_node(node_id, reason, "fault row: spot reclaim", deadline_ms)
            print(json.dumps({"accepted": accepted, "why": why, "deadline_ms": deadline_ms}), flush=True)
    ray.shutdown()


def start_node(args: list[str]) -> None:
    """`ray start <args>` of a second node on loopback. ray_env's RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 keeps the
    head on 127.0.0.1, and Ray's CLI then refuses to start a second node; with 1 it swaps 127.0.0.1 in
    --address for the machine's address, where the head does not listen. Only this process is patched:
    the node's own processes keep the variable at 0, as the head's do."""
    from ray._private import ray_constants, services
    from ray.scripts.scripts import main

    ray_constants.ENABLE_RAY_CLUSTER = True
    services.get_node_ip_address = lambda address=None: "127.0.0.1"
    sys.argv = ["ray", "start", *args]
    main()


if __name__ == "__main__" and sys.argv[1:2] == ["hold"]:
    hold(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
elif __name__ == "__main__" and sys.argv[1:2] == ["node"]:
    start_node(sys.argv[2:])
