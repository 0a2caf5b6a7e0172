"""The flow-run pod's Python environment, built the way the image and the pull step build it, runs the flow.

    python -m pytest -q -m integration tests/test_flow_run_env.py

A fresh venv gets deployments/flow-run-image/install.sh, the file the Dockerfile runs; then the
eks-manual deployment's own pull steps (prefect.yaml) run in that venv through Prefect's step
runner, as `prefect flow-run execute` runs them in the pod: a git clone of this repository at HEAD,
the editable install with --no-deps, the working directory. From there the venv must import the flow
and the Ray job client, without torch, and the run record's code identity must be the clone's commit.
Building the venv downloads the pinned wheels (pip's cache makes reruns faster): a few minutes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tuneproof.core.config import PROJECT_ROOT

IMAGE_DIR = PROJECT_ROOT / "deployments" / "flow-run-image"

pytestmark = pytest.mark.integration

# Run by the venv's own Python in an empty directory, like the flow-run pod: the pull steps, then
# the imports the flow needs, then a report on stdout.
POD_SCRIPT = """
import asyncio, importlib.util, json, os, sys
from prefect.deployments.steps.core import run_steps
asyncio.run(run_steps(json.loads(sys.argv[1])))
import flows.pipeline, tasks.rayjob, tasks.jobs
from tuneproof.control.identity import git_identity
print(json.dumps({
    "cwd": os.getcwd(),
    "pipeline_file": flows.pipeline.__file__,
    "git": git_identity(),
    "training_stack": [m for m in ("torch", "transformers", "datasets", "pyarrow") if importlib.util.find_spec(m)],
}))
"""


def eks_pull_steps() -> list[dict]:
    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    return next(d for d in doc["deployments"] if d["name"] == "eks-manual")["pull"]


def dockerfile_python() -> str:
    """The Python version of the Dockerfile's base image: 'python:3.11-slim-bookworm' -> '3.11'."""
    match = re.search(r"^ARG PYTHON_IMAGE=python:(\d+\.\d+)", (IMAGE_DIR / "Dockerfile").read_text(), re.M)
    assert match, "the Dockerfile's base must be a python:<major.minor> image"
    return match.group(1)


def run(cmd: list[str], env: dict, cwd: Path) -> str:
    out = subprocess.run(cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=900)
    assert out.returncode == 0, (
        f"{' '.join(cmd)} failed ({out.returncode}):\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    )
    return out.stdout


def pod_report(tmp_path: Path) -> tuple[str, Path, dict]:
    """Build the venv as the image does, run the pull steps in it as the pod does: HEAD, the pod's working
    directory and its report.

    The session starts this in a thread of its own at its first integration test (tests/conftest.py,
    SessionStart.flow_run_env): run in its turn it took 86 s with 42 % of the 2 cores idle (sampled every 5 s,
    2026-12-06), time the Ray tests beside it now fill."""
    head = run(["git", "rev-parse", "HEAD"], dict(os.environ), PROJECT_ROOT).strip()
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], dict(os.environ), tmp_path)
    env = {
        **os.environ,
        "PATH": f"{venv / 'bin'}:{os.environ['PATH']}",
        "VIRTUAL_ENV": str(venv),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        # the worker gives every flow-run pod an API URL; these steps name no block or variable, so the
        # step runner never calls it (unset, it would start a temporary server instead)
        "PREFECT_API_URL": "http://127.0.0.1:9/api",
        "TUNEPROOF_GIT_URL": str(PROJECT_ROOT),
        "TUNEPROOF_GIT_COMMIT": head,
        # Both installs without byte-compiling (pip's --compile off; PIP_NO_COMPILE=1 would turn it on): .pyc
        # files for ~160 packages are a cache, not what this test is about (an import compiles what it loads).
        # What is installed, and by which commands, is unchanged.
        "PIP_COMPILE": "0",
    }
    env.pop("PYTHONPATH", None)  # nothing of this checkout may leak in: the clone is the only source

    run(["sh", str(IMAGE_DIR / "install.sh")], env, tmp_path)  # the Dockerfile's RUN
    pod = tmp_path / "pod"
    pod.mkdir()
    report = json.loads(
        run([str(venv / "bin" / "python"), "-c", POD_SCRIPT, json.dumps(eks_pull_steps())], env, pod)
        .strip()
        .splitlines()[-1]
    )
    return head, pod, report


def test_the_pull_step_builds_a_flow_run_environment_that_imports_the_flow(session_start):
    assert f"{sys.version_info.major}.{sys.version_info.minor}" == dockerfile_python(), (
        "build the venv with the interpreter the image uses"
    )
    head, pod, report = session_start.flow_run_env().result()
    clone = Path(report["cwd"])
    assert clone.parent == pod and (clone / "flows" / "pipeline.py").is_file()
    assert Path(report["pipeline_file"]).resolve() == (clone / "flows" / "pipeline.py").resolve()
    assert report["git"] == {"git_sha": head, "dirty": False}
    assert report["training_stack"] == [], "the flow-run image must not carry the training stack"
