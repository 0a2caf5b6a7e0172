"""`tuneproof local up|down|status`: the embedded default on loopback.

up: the tiny base model (created locally, never downloaded), the storage root, a Ray head (its
dashboard/job API at the profile's cluster.address, token auth with the token kept under
.tuneproof/local), a Prefect server (SQLite, at the API URL Prefect's settings name: prefect.toml)
and a process worker on the `local-process` pool. No address is written here: they come from the
profile and from Prefect's settings, so changing a port is one edit. Pids and ports live in
.tuneproof/local/*.json so `down` stops exactly what `up` started.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from rich.console import Console

from tuneproof.app import local
from tuneproof.app.local import STATE_DIR, RayHead
from tuneproof.core.config import PROJECT_ROOT, load_config

WORK_POOL = "local-process"
POOLS = (
    (WORK_POOL, "process", None),
    ("tuneproof-eks", "kubernetes", "deployments/prefect-k8s-base-job-template.json"),
    ("tuneproof-eks-canary", "kubernetes", "deployments/prefect-k8s-canary-job-template.json"),
)
"""(name, type, base job template) of each work pool prefect.yaml's deployments name (tests/test_readme.py
checks the list against prefect.yaml)."""
PREFECT_HOME = STATE_DIR / "prefect"


@dataclass
class Proc:
    pid: int
    log_file: str

    def alive(self) -> bool:
        return local.pid_alive(self.pid)


def prefect_api() -> str:
    """The Prefect API URL from Prefect's own settings (prefect.toml in the project root)."""
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        raise SystemExit("PREFECT_API_URL is not set: prefect.toml names the local API (api.url)")
    return url.rstrip("/")


def loopback_endpoint(url: str, what: str) -> tuple[str, int]:
    """(host, port) of an http URL on this machine; the embedded default never listens elsewhere."""
    parsed = urlparse(url)
    if parsed.hostname not in ("127.0.0.1", "localhost") or parsed.port is None:
        raise SystemExit(f"{what} is {url!r}: the embedded default needs http://127.0.0.1:<port>")
    return "127.0.0.1", parsed.port


def prefect_env() -> dict[str, str]:
    """Environment for the Prefect processes we start: our own home, analytics off, our API."""
    api = prefect_api()
    return {
        **os.environ,
        "PREFECT_HOME": str(PREFECT_HOME),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_UI_API_URL": api,
        # prefect.yaml's pull step runs flows in "{{ $PWD }}": the worker's, i.e. the project root.
        "PWD": str(PROJECT_ROOT),
    }


def up(console: Console) -> int:
    cfg = load_config()
    prepare_model_and_storage(cfg, console)
    start_ray(console, cfg.cluster.address)
    start_prefect(console)
    console.print(
        f"[green]ready[/]: Ray dashboard {cfg.cluster.address}, Prefect UI {prefect_api().removesuffix('/api')}"
    )
    return 0


def prepare_model_and_storage(cfg, console: Console) -> None:
    from tuneproof.app.tiny_model import ensure_tiny_model

    Path(cfg.storage.root).mkdir(parents=True, exist_ok=True)
    if ensure_tiny_model(cfg.model.source, cfg.data.source):
        facts = json.loads((Path(cfg.model.source) / "base.json").read_text())
        console.print(
            f"placed the pre-trained tiny base at {cfg.model.source} (content hash {facts['content_hash'][:12]}, "
            f"skills exact match {facts['skills_exact_match']})"
        )


def start_ray(console: Console, address: str) -> None:
    head = local.load_state("ray", RayHead)
    if head and head.alive():
        console.print(f"Ray head already running (pid {head.pid}) at {head.address}")
        return
    _, port = loopback_endpoint(address, "cluster.address")
    console.print(f"starting the Ray head at {address} …")
    # One CPU more than the training workers need: the job drivers and probes share the node.
    head = local.start_ray_head(STATE_DIR, num_cpus=max(os.cpu_count() or 2, 4), dashboard_port=port)
    local.save_state("ray", head)


def start_prefect(console: Console) -> None:
    server = local.load_state("prefect-server", Proc)
    if not (server and server.alive()):
        host, port = loopback_endpoint(prefect_api(), "PREFECT_API_URL")
        console.print(f"starting the Prefect server at {prefect_api()} …")
        server = spawn("prefect-server", [prefect_bin(), "server", "start", "--host", host, "--port", str(port)])
        wait_http(f"{prefect_api()}/health", 90, server)
    ensure_work_pools()
    worker = local.load_state("prefect-worker", Proc)
    if not (worker and worker.alive()):
        console.print(f"starting a Prefect process worker on pool {WORK_POOL} …")
        spawn("prefect-worker", [prefect_bin(), "worker", "start", "--pool", WORK_POOL, "--type", "process"])


def ensure_work_pools(env: dict[str, str] | None = None) -> None:
    """Every pool prefect.yaml names (POOLS), so the README's `prefect --no-prompt deploy --all` works here too:
    the EKS pools get the base job templates they have on EKS, and no worker here (their runs wait for EKS's).
    `env`: the Prefect environment to create them in (default: the local server's)."""
    for name, kind, template in POOLS:
        args = [name, "--type", kind, *(["--base-job-template", str(PROJECT_ROOT / template)] if template else [])]
        # Exits non-zero when the pool already exists, which is fine.
        subprocess.run(
            [prefect_bin(), "--no-prompt", "work-pool", "create", *args],
            env=env or prefect_env(),
            capture_output=True,
            cwd=PROJECT_ROOT,
        )


def prefect_bin() -> str:
    return str(Path(sys.executable).parent / "prefect")


def spawn(name: str, cmd: list[str]) -> Proc:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    log_file = STATE_DIR / f"{name}.log"
    with open(log_file, "ab") as log:
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=prefect_env(), cwd=PROJECT_ROOT, start_new_session=True
        )
    state = Proc(proc.pid, str(log_file))
    local.save_state(name, state)
    return state


def wait_http(url: str, timeout: float, proc: Proc) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not proc.alive():
            raise RuntimeError(f"process {proc.pid} exited during start-up; see {proc.log_file}")
        try:
            with urllib.request.urlopen(url, timeout=3):
                return
        except OSError:
            time.sleep(1)
    raise TimeoutError(f"{url} did not answer within {timeout:.0f}s; see {proc.log_file}")


def down(console: Console) -> int:
    for name in ("prefect-worker", "prefect-server"):
        proc = local.load_state(name, Proc)
        if proc and proc.alive():
            local.stop_group(proc.pid, 10)
            console.print(f"stopped {name} (pid {proc.pid})")
        local.clear_state(name)
    head = local.load_state("ray", RayHead)
    if head and head.alive():
        head.stop()
        console.print(f"stopped the Ray head (pid {head.pid})")
    local.clear_state("ray")
    return 0


def status(console: Console) -> int:
    head = local.load_state("ray", RayHead)
    rows = [("ray head", head.alive() if head else False, head.address if head else "-")]
    for name, where in (("prefect-server", prefect_api()), ("prefect-worker", f"pool {WORK_POOL}")):
        proc = local.load_state(name, Proc)
        rows.append((name, proc.alive() if proc else False, where))
    for name, alive, where in rows:
        console.print(f"{name:15} {'[green]running[/]' if alive else '[red]stopped[/]'}  {where}")
    return 0 if all(alive for _, alive, _ in rows) else 1
