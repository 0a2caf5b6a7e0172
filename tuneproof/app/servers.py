"""Local servers a test session or the fault harness (`python -m faults`) starts and stops itself.

- `moto_server()`: moto's S3-compatible server on 127.0.0.1 (fake credentials: `FAKE_AWS`).
- `prefect_server(home)`: `prefect server start` (API and UI) with its own home on 127.0.0.1.

Both bind to loopback only, yield their URL and stop exactly the process they started.
tests/conftest.py wraps them as session fixtures; faults/harness.py uses them directly.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

from tuneproof.app.local import free_port, stop_group

OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_EVALUATE_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
}
"""The environment of every process the labs start: nothing reaches a hub, nothing phones home."""
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
"""moto accepts any credentials; these are the ones every client of a moto server is given."""


@contextlib.contextmanager
def environ(values: dict[str, str]) -> Iterator[None]:
    """os.environ with `values` set for the block, restored after."""
    saved = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def wait_http(url: str, timeout: float) -> None:
    """Return once `url` answers HTTP at all (an error status counts as up); TimeoutError otherwise."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except urllib.error.HTTPError:
            return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout}s")


def bin_path(name: str) -> str:
    """A console script of this environment (moto_server, prefect, ray), also when it is not activated."""
    return str(Path(sys.executable).parent / name)


@contextlib.contextmanager
def moto_server(port: int | None = None) -> Iterator[str]:
    """moto in server mode on 127.0.0.1; yields the endpoint URL."""
    port = port or free_port()
    proc = subprocess.Popen(
        [bin_path("moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ},
    )
    url = f"http://127.0.0.1:{port}"
    try:
        wait_http(url, 30)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


@contextlib.contextmanager
def prefect_server(home: Path, port: int | None = None, wait_s: float = 120) -> Iterator[str]:
    """`prefect server start` with PREFECT_HOME=home, logging to home/server.log; yields its URL (no /api).

    A fresh database takes about 15 s on an idle 2-core machine, minutes on a busy one: wait_s bounds it."""
    port = port or free_port()
    url = f"http://127.0.0.1:{port}"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_API_URL": f"{url}/api",
        "PREFECT_UI_API_URL": f"{url}/api",
    }
    home.mkdir(parents=True, exist_ok=True)
    with open(home / "server.log", "wb") as log:
        proc = subprocess.Popen(
            [bin_path("prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            wait_http(f"{url}/api/health", wait_s)
            yield url
        finally:
            stop_group(proc.pid, 10)
