"""The embedded default cluster: a Ray head (and a Prefect server + worker) on 127.0.0.1.

`tuneproof local up` starts them as background processes whose pids live in a state
directory (.tuneproof/local/), so `down` stops exactly what `up` started and nothing else
(`ray stop` would kill every Ray process on the machine, including other users' tests).

Ray 2.59+ turns token auth on for new local clusters and would write the token to
~/.ray/auth_token; we generate our own token into the state directory instead and point
Ray at it with RAY_AUTH_TOKEN_PATH, so nothing is left behind in the user's home.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import asdict, dataclass
from pathlib import Path

from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.procs import pid_alive

STATE_DIR = PROJECT_ROOT / ".tuneproof" / "local"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RayHead:
    """A Ray head started by us: its ports, temp dir, token file and the pid of `ray start --block`."""

    pid: int
    dashboard_port: int
    gcs_port: int
    temp_dir: str
    token_file: str
    log_file: str

    @property
    def address(self) -> str:
        return f"http://127.0.0.1:{self.dashboard_port}"

    @property
    def gcs_address(self) -> str:
        return f"127.0.0.1:{self.gcs_port}"

    def token(self) -> str:
        return Path(self.token_file).read_text().strip()

    def alive(self) -> bool:
        return pid_alive(self.pid)

    def stop(self, timeout: float = 5.0) -> None:
        # `ray start --block` can sit in its SIGTERM handler well past the drain; after a
        # short grace period the whole process group is killed (workers die with the raylet).
        stop_group(self.pid, timeout)
        # Ray leaves its session logs and sockets behind; they are ours to remove.
        shutil.rmtree(self.temp_dir, ignore_errors=True)


def ray_env(token_file: str | os.PathLike) -> dict[str, str]:
    """Environment for the head and the drivers that join it: token auth, and loopback addresses
    (otherwise Ray swaps 127.0.0.1 for the machine's address and listens on every interface)."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file), "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def write_token(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)


def start_ray_head(
    state_dir: Path,
    *,
    num_cpus: int | None = None,
    dashboard_port: int,
    gcs_port: int | None = None,
    temp_dir: str | None = None,
    wait_s: float = 120.0,
) -> RayHead:
    """Start `ray start --head --block` bound to 127.0.0.1 and wait until the job API answers."""
    state_dir.mkdir(parents=True, exist_ok=True)
    token_file = state_dir / "ray_auth_token"
    write_token(token_file)
    gcs_port = gcs_port or free_port()
    # Short temp dir: Ray puts unix sockets under it and socket paths are limited to 107 bytes.
    temp_dir = temp_dir or f"/tmp/tp-ray-{gcs_port}"
    ray_bin = str(Path(sys.executable).parent / "ray")
    cmd = [
        ray_bin,
        "start",
        "--head",
        "--block",
        "--disable-usage-stats",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs_port}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dashboard_port}",
        f"--ray-client-server-port={free_port()}",
        f"--dashboard-agent-listen-port={free_port()}",
        f"--dashboard-agent-grpc-port={free_port()}",
        f"--runtime-env-agent-port={free_port()}",
        f"--metrics-export-port={free_port()}",
        f"--temp-dir={temp_dir}",
    ]
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    log_file = state_dir / "ray-head.log"
    # No drain on stop: nothing serves traffic here, and the default drain waits 30 s.
    env = {
        **os.environ,
        **ray_env(token_file),
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0",
        # Ray Train's controller steps its state machine once per health check, 2 s apart by default: a short
        # local run spent seconds starting and ending between checks. At 0.2 s, tests/test_sharding.py and
        # the LoRA fine-tune tests of the time took 87 and 88 s against 110 and 114 s (alternated, 2 idle cores).
        # The environment's own value wins, so the two can still be compared.
        "RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.2"),
        # Job entrypoints run `python -m ...` from PATH: it must be this environment's Python,
        # also when `tuneproof` was started without activating the virtualenv.
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    for attempt in range(1, START_ATTEMPTS + 1):
        offset = log_file.stat().st_size if log_file.exists() else 0
        with open(log_file, "ab") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        head = RayHead(proc.pid, dashboard_port, gcs_port, temp_dir, str(token_file), str(log_file))
        try:
            _wait_for_jobs_api(head, wait_s, offset)
            return head
        except HeadExited:
            head.stop()
            if attempt == START_ATTEMPTS:
                raise
        except BaseException:  # Ctrl-C while waiting too: never leave a half-started head behind
            head.stop()
            raise
    raise AssertionError("unreachable")  # the loop returns or raises


START_ATTEMPTS = 5
"""`ray start` gives its raylet a fixed 30 s to register with the GCS; on a loaded machine it can miss that
and exit after the dashboard already answered. A head that exits during start-up is started again."""
STARTED = "Ray runtime started."
"""What `ray start` prints once its node is registered: until then a dashboard that answers proves nothing."""


class HeadExited(RuntimeError):
    """The Ray head process exited during start-up (its log tail is in the message)."""


def _wait_for_jobs_api(head: RayHead, wait_s: float, log_offset: int = 0) -> None:
    """Until `ray start` says its node started (in its log after `log_offset`) and the job API answers."""
    deadline = time.monotonic() + wait_s
    req = urllib.request.Request(f"{head.address}/api/jobs/", headers={"Authorization": f"Bearer {head.token()}"})
    last = ""
    while time.monotonic() < deadline:
        if not head.alive():
            tail = Path(head.log_file).read_text(errors="replace")[-2000:]
            raise HeadExited(f"ray head exited during start-up; log tail:\n{tail}")
        started = STARTED.encode() in Path(head.log_file).read_bytes()[log_offset:]
        try:
            with urllib.request.urlopen(req, timeout=5) as resp:
                if resp.status == 200 and started:
                    return
                last = "the job API answers; the node has not finished starting"
        except OSError as e:
            last = str(e)
        time.sleep(1.0)
    raise TimeoutError(f"ray dashboard at {head.address} did not answer within {wait_s:.0f}s (last error: {last})")


def stop_group(pid: int, timeout: float) -> None:
    """SIGTERM every process of the session `pid` started (it was started with start_new_session), SIGKILL what
    is left. The session, not only the process group: Ray starts some workers in process groups of their own, and
    a Ray Train controller left that way outlived a test session's head by hours, holding 490 MB."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        groups = {pid}
        for member in session_members(pid):
            with contextlib.suppress(ProcessLookupError):
                groups.add(os.getpgid(member))
        for group in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(group, sig)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, os.WNOHANG)
            if not pid_alive(pid) and not any(pid_alive(p) for p in session_members(pid)):
                return
            time.sleep(0.3)


def session_members(sid: int) -> list[int]:
    """The pids of session `sid`, its leader's included while it lives (Linux /proc; elsewhere none)."""
    members = []
    for entry in Path("/proc").iterdir() if Path("/proc").is_dir() else ():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile, or not ours to read
            continue
        # after the command name, which may hold spaces and parentheses: state, ppid, pgrp, session, ...
        if int(stat.rsplit(")", 1)[1].split()[3]) == sid:
            members.append(int(entry.name))
    return members


def save_state(name: str, obj) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    (STATE_DIR / f"{name}.json").write_text(json.dumps(asdict(obj), indent=2))


def load_state(name: str, cls):
    path = STATE_DIR / f"{name}.json"
    return cls(**json.loads(path.read_text())) if path.exists() else None


def clear_state(name: str) -> None:
    (STATE_DIR / f"{name}.json").unlink(missing_ok=True)
