"""Shared fixtures. Servers bind to 127.0.0.1 only, and every fixture stops what it starts.

- `ray_head`: a real local Ray head (dashboard + job API, token auth on) for the session.
- `s3_endpoint`: a real S3-compatible server (moto's server mode) on 127.0.0.1, with a bucket.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tuneproof.app.local import free_port, ray_env, start_ray_head

# Never reach a hub from tests; fail loudly instead of hanging on a network call.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_EVALUATE_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

TEST_BUCKET = "tuneproof-test"


@pytest.fixture(scope="session")
def ray_head(tmp_path_factory):
    """A Ray head on 127.0.0.1 with free ports; its token is in head.token_file."""
    state = tmp_path_factory.mktemp("ray-state")
    head = start_ray_head(state, num_cpus=4, dashboard_port=free_port())
    try:
        yield head
    finally:
        head.stop()


@contextlib.contextmanager
def ray_driver(head, **init_kwargs):
    """This process as a Ray driver of `head` (stage bodies then call ray.init() as a no-op)."""
    import ray
    from ray._private import ray_constants
    from ray._raylet import Config

    with pytest.MonkeyPatch.context() as mp:
        for key, value in ray_env(head.token_file).items():
            mp.setenv(key, value)
        # Both settings are read when ray is first imported, possibly before they were in the environment.
        mp.setattr(ray_constants, "ENABLE_RAY_CLUSTER", False)
        Config.initialize("")
        ray.init(address=head.gcs_address, **init_kwargs)
        try:
            yield head
        finally:
            ray.shutdown()


@pytest.fixture(scope="session")
def s3_endpoint():
    """moto in server mode on 127.0.0.1; yields the endpoint URL. Credentials are fakes in env."""
    port = free_port()
    env = {**os.environ}
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    saved = {k: os.environ.get(k) for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1")
    try:
        _wait_http(url, 30)
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=TEST_BUCKET)
        yield url
    finally:
        proc.terminate()
        proc.wait(10)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _wait_http(url: str, timeout: float) -> None:
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
