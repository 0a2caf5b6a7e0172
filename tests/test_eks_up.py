"""deployments/eks-up.sh, the EKS walkthrough as a script: its calls in order, twice, against stub commands.

Each stub (aws, eksctl, kubectl, helm, crane, docker, openssl, prefect, tuneproof) appends its argv and the
Prefect settings it was called with to one log, answers the questions the script asks (is the cluster
there? the VPC? the security group?) from a fresh account or from one where everything exists, and does
nothing else. `shellcheck` must pass the script as it is.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tuneproof.core.config import PROJECT_ROOT

SCRIPT = PROJECT_ROOT / "deployments" / "eks-up.sh"
TOOLS = ("aws", "eksctl", "kubectl", "helm", "crane", "docker", "openssl")
STUB = r"""#!/usr/bin/env bash
# Record the call (argv, one field per line, and the Prefect settings it ran with), answer, do nothing.
name=${0##*/}
piped=""
if [ ! -t 0 ] && { [ "$name" = kubectl ] || [ "$name" = docker ]; }; then piped=$(cat); fi   # a piped manifest
{ printf '%s\n' "--- $name" "api_url=${PREFECT_API_URL-}" "auth=${PREFECT_API_AUTH_STRING-}"; printf 'arg=%s\n' "$@"
  printf '%s\n' "$piped" | sed -n 's/^kind: */kind=/p'; } >>"$STUB_LOG"
case " $* " in
  *" get cluster "*|*" head-bucket "*|*" get-policy "*|*" get-role "*|*" describe-repositories "*|*" work-pool inspect "*|*" get secret "*)
    [ "$STUB_EXISTS" = 1 ]; exit ;;
  *" describe-cluster "*) echo vpc-0test ;;
  *" describe-subnets "*) echo subnet-0test ;;
  *" create-security-group "*) echo sg-0fsx ;;
  *" describe-security-groups "*) if [ "$STUB_EXISTS" = 1 ]; then echo sg-0fsx; else echo None; fi ;;
  *" digest "*) echo "sha256:$(printf 'a%.0s' $(seq 64))" ;;
  *" rand "*) echo 0000 ;;
esac
exit 0
"""


@pytest.fixture
def stubs(tmp_path) -> Path:
    bin_dir = tmp_path / "bin"
    venv_bin = tmp_path / "venv" / "bin"
    for folder, names in ((bin_dir, TOOLS), (venv_bin, ("prefect", "tuneproof"))):
        folder.mkdir(parents=True)
        for name in names:
            (folder / name).write_text(STUB)
            (folder / name).chmod(0o755)
    return tmp_path


def run_script(stubs: Path, exists: bool, **env: str) -> list[dict]:
    log = stubs / f"calls-{exists}.jsonl"
    environment = {
        "PATH": f"{stubs / 'bin'}:{os.environ['PATH']}",
        "HOME": str(stubs),
        "STUB_LOG": str(log),
        "STUB_EXISTS": "1" if exists else "0",
        "VENV": str(stubs / "venv"),
        "PREFECT_API_URL": "https://prefect.example.com/api",
        "PREFECT_API_AUTH_STRING": "admin:secret",
        "TUNEPROOF_GIT_URL": "https://example.com/tuneproof.git",
        **env,
    }
    done = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=PROJECT_ROOT,
        env=environment,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return parse_log(log.read_text())


def parse_log(text: str) -> list[dict]:
    """The stubs' records: one per call, {cmd, args, kinds (of a manifest piped to kubectl), api_url, auth}."""
    calls: list[dict] = []
    for line in text.splitlines():
        if line.startswith("--- "):
            calls.append({"cmd": line[4:], "args": [], "kinds": []})
        else:
            key, _, value = line.partition("=")
            if key in ("arg", "kind"):
                calls[-1].setdefault(key + "s", []).append(value)
            else:
                calls[-1][key] = value
    return calls


def index(calls: list[dict], cmd: str, *words: str) -> int:
    """The position of the first call of `cmd` whose argv holds every word (a word may be a path's tail)."""
    for i, call in enumerate(calls):
        if call["cmd"] == cmd and all(any(a == w or a.endswith("/" + w) for a in call["args"]) for w in words):
            return i
    raise AssertionError(f"no {cmd} call with {words}: {[(c['cmd'], c['args'][:3]) for c in calls]}")


def applied(calls: list[dict], kind: str) -> int:
    """The position of the first `kubectl apply` whose piped manifest holds an object of this kind."""
    return next(i for i, c in enumerate(calls) if c["cmd"] == "kubectl" and kind in c["kinds"])


def test_a_fresh_account_is_built_in_order(stubs):
    calls = run_script(stubs, exists=False)
    first = {cmd: next(i for i, c in enumerate(calls) if c["cmd"] == cmd) for cmd in ("kubectl", "helm", "prefect")}
    cluster = index(calls, "eksctl", "create", "cluster")
    assert cluster < min(first.values()), "the cluster comes before anything that talks to it"
    # The FSx security group admits Lustre from itself and from the nodes before storage.yaml names it.
    rules = [c["args"] for c in calls if "authorize-security-group-ingress" in c["args"]]
    assert {(r[r.index("--port") + 1], r[r.index("--source-group") + 1]) for r in rules} == {
        ("988", "sg-0fsx"),
        ("1018-1023", "sg-0fsx"),
        ("988", "vpc-0test"),
        ("1018-1023", "vpc-0test"),
    }
    assert index(calls, "aws", "create-security-group") < applied(calls, "StorageClass")
    assert index(calls, "aws", "create-policy") < index(calls, "eksctl", "iamserviceaccount")
    # The namespace first; the Ray token and the NetworkPolicy before the RayCluster.
    secret_ray = next(i for i, c in enumerate(calls) if "tuneproof-ray-auth" in c["args"] and "create" in c["args"])
    assert applied(calls, "Namespace") < secret_ray < applied(calls, "RayCluster")
    assert applied(calls, "NetworkPolicy") < applied(calls, "RayCluster")
    # Every prefect call runs with the cluster's API and its auth string, never prefect.toml's 127.0.0.1.
    prefect_calls = [c for c in calls if c["cmd"] == "prefect"]
    assert prefect_calls and all(c["api_url"] == "https://prefect.example.com/api" for c in prefect_calls)
    assert all(c["auth"] == "admin:secret" for c in prefect_calls)
    # The API credential, then the pools, then the workers that poll them; lint before deploy.
    auth_secret = next(i for i, c in enumerate(calls) if "prefect-api-auth" in c["args"])
    pipeline_pool = index(calls, "prefect", "create", "tuneproof-eks")
    canary_pool = index(calls, "prefect", "create", "tuneproof-eks-canary")
    workers = applied(calls, "Deployment")  # prefect-worker.yaml, then canary.yaml's worker
    assert auth_secret < pipeline_pool < canary_pool < workers
    assert index(calls, "tuneproof", "lint") < index(calls, "prefect", "deploy")
    # eksctl installs both device plugins: nothing installs them again.
    helm = [" ".join(c["args"]) for c in calls if c["cmd"] == "helm"]
    assert not [h for h in helm if "device-plugin" in h], helm
    build = index(calls, "docker", "buildx")
    assert calls[build]["args"][calls[build]["args"].index("--platform") + 1] == "linux/amd64"


def test_a_second_run_creates_nothing_again(stubs):
    calls = run_script(stubs, exists=True)
    creates = [c for c in calls if "create" in c["args"] and "--dry-run=client" not in c["args"]]
    assert not creates, [(c["cmd"], c["args"][:4]) for c in creates]
    assert index(calls, "prefect", "update", "tuneproof-eks") < index(
        calls, "prefect", "update", "tuneproof-eks-canary"
    )
    assert not [c for c in calls if "authorize-security-group-ingress" in c["args"]]


def test_the_script_refuses_to_start_without_the_prefect_api(stubs):
    environment = {"PATH": f"{stubs / 'bin'}:{os.environ['PATH']}", "STUB_LOG": str(stubs / "none.jsonl")}
    done = subprocess.run(["bash", str(SCRIPT)], cwd=PROJECT_ROOT, env=environment, capture_output=True, text=True)
    assert done.returncode != 0 and "PREFECT_API_URL" in done.stderr
    assert not (stubs / "none.jsonl").exists(), "nothing ran before the API was known"


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed (make shellcheck)")
def test_shellcheck_passes_the_script():
    done = subprocess.run(["shellcheck", "--severity=style", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_the_canary_gets_its_own_token_and_a_role_limited_to_its_prefix(stubs):
    calls = run_script(stubs, exists=False)
    roles = {
        c["args"][c["args"].index("--name") + 1]: (
            c["args"][c["args"].index("--role-name") + 1],
            c["args"][c["args"].index("--attach-policy-arn") + 1].rsplit("/", 1)[-1],
        )
        for c in calls
        if "iamserviceaccount" in c["args"]
    }
    assert roles["tuneproof-canary-ray"] == ("tuneproof-canary-ray-s3", "tuneproof-canary-s3")
    assert roles["tuneproof-ray"] == ("tuneproof-ray-s3", "tuneproof-s3")
    documents = {
        c["args"][c["args"].index("--policy-name") + 1]: c["args"][c["args"].index("--policy-document") + 1]
        for c in calls
        if "create-policy" in c["args"]
    }
    assert documents["tuneproof-canary-s3"].endswith("/s3-canary-policy.json"), documents
    tokens = {
        c["args"][c["args"].index("generic") + 1]: next(a for a in c["args"] if a.startswith("--from-literal="))
        for c in calls
        if "generic" in c["args"] and "auth_token" in " ".join(c["args"])
    }
    assert set(tokens) == {"tuneproof-ray-auth", "tuneproof-canary-ray-auth"}
    assert len([c for c in calls if c["cmd"] == "openssl" and "rand" in c["args"]]) == 2, "each its own random token"
    assert max(index(calls, "kubectl", "tuneproof-canary-ray-auth"), index(calls, "kubectl", "tuneproof-ray-auth")) < (
        applied(calls, "RayCluster")
    )
