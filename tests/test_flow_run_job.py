"""The Job the Prefect Kubernetes worker would create for an eks-manual (or image-canary) flow run, rendered by its own code.

    python -m pytest -q tests/test_flow_run_job.py

prefect-kubernetes' KubernetesWorkerJobConfiguration renders the work pool's base job template
(deployments/prefect-k8s-base-job-template.json) with the eks-manual deployment's job variables
(prefect.yaml, resolved the way `prefect deploy` resolves them) and prepares it for a flow run,
exactly as the worker does before `create_namespaced_job`. The result must validate against the
vendored Kubernetes schema `tuneproof lint` uses, and run the pinned flow-run image as the
pipeline's service account in a namespace the worker's Role covers. The image-canary deployment's Job,
from its own pool's template (prefect-k8s-canary-job-template.json), runs as tuneproof-canary instead.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid

import pytest
import yaml

from tests.reading import present
from tuneproof.app.lint.documents import load_documents, schema_validator
from tuneproof.app.lint.pools import without_prefect_pod_fields
from tuneproof.app.lint.worker import worker_role_namespaces
from tuneproof.core.config import PROJECT_ROOT, load_config

KubernetesWorkerJobConfiguration = pytest.importorskip("prefect_kubernetes.worker").KubernetesWorkerJobConfiguration

TEMPLATE = PROJECT_ROOT / "deployments" / "prefect-k8s-base-job-template.json"
CANARY_TEMPLATE = PROJECT_ROOT / "deployments" / "prefect-k8s-canary-job-template.json"
DEPLOY_ENV = {"TUNEPROOF_GIT_URL": "https://git.example/tuneproof.git", "TUNEPROOF_GIT_COMMIT": "a" * 40}
"""What the deploying shell exports (deployments/README.md); `prefect deploy` bakes it into the job variables."""


def deployment(name: str) -> dict:
    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    return next(d for d in doc["deployments"] if d["name"] == name)


def eks_manual() -> dict:
    return deployment("eks-manual")


def rendered_job(monkeypatch, name: str = "eks-manual", template_file=TEMPLATE) -> dict:
    from prefect.client.schemas.objects import FlowRun
    from prefect.utilities.templating import apply_values

    for env_name, value in DEPLOY_ENV.items():
        monkeypatch.setenv(env_name, value)
    variables = apply_values(deployment(name)["work_pool"]["job_variables"], dict(os.environ), remove_notset=False)
    template = json.loads(template_file.read_text())
    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(template, variables))
    config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="tireless-otter", flow_id=uuid.uuid4()))
    return config.job_manifest


def test_the_rendered_flow_run_job_validates_and_runs_the_pinned_image(monkeypatch):
    job = rendered_job(monkeypatch)
    # the worker insists on parallelism/completions inside the PodSpec; the API server drops them (with a warning)
    assert {k: job["spec"]["template"]["spec"][k] for k in ("parallelism", "completions")} == {
        "parallelism": 1,
        "completions": 1,
    }
    kept = without_prefect_pod_fields(job)
    problems = [
        f"{list(e.absolute_path)}: {e.message}" for e in present(schema_validator("batch/v1", "Job")).iter_errors(kept)
    ]
    assert problems == []

    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    assert container["image"] == eks_manual()["work_pool"]["job_variables"]["image"]
    assert "@sha256:" in container["image"] and not container["image"].startswith("prefecthq/")
    assert pod["serviceAccountName"] == "tuneproof-pipeline"

    docs, _ = load_documents([str(PROJECT_ROOT / "deployments")])
    assert job["metadata"]["namespace"] == "tuneproof"
    assert job["metadata"]["namespace"] in worker_role_namespaces(docs)["tuneproof-eks"]


def test_the_rendered_job_carries_what_the_pod_needs_to_run_the_flow(monkeypatch):
    job = rendered_job(monkeypatch)
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TUNEPROOF_GIT_COMMIT"] == DEPLOY_ENV["TUNEPROOF_GIT_COMMIT"]  # the pull step clones this commit
    assert env["TUNEPROOF_GIT_URL"] == DEPLOY_ENV["TUNEPROOF_GIT_URL"]
    assert "PREFECT__FLOW_RUN_ID" in env and container["args"][:3] == ["prefect", "flow-run", "execute"]

    token_file = load_config(PROJECT_ROOT / "configs" / "eks.yaml").cluster.auth_token_file
    assert token_file is not None
    mount = next(m for m in container["volumeMounts"] if token_file.startswith(m["mountPath"] + "/"))
    volume = next(v for v in pod["volumes"] if v["name"] == mount["name"])
    assert volume["secret"]["secretName"] == "tuneproof-ray-auth"
    # uid 1000 (the image's user) reads the 0440 token through fsGroup
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsUser"] == 1000
    assert volume["secret"]["defaultMode"] == 0o440
    assert job["spec"]["backoffLimit"] == 0  # Prefect, not Kubernetes, retries: a retry re-attaches to its Ray jobs


def test_the_rendered_canary_job_runs_as_the_canary_on_its_own_pool(monkeypatch):
    canary = deployment("image-canary")
    assert canary["work_pool"]["name"] == "tuneproof-eks-canary"
    job = rendered_job(monkeypatch, "image-canary", CANARY_TEMPLATE)
    kept = without_prefect_pod_fields(job)
    problems = [
        f"{list(e.absolute_path)}: {e.message}" for e in present(schema_validator("batch/v1", "Job")).iter_errors(kept)
    ]
    assert problems == []

    pod = job["spec"]["template"]["spec"]
    assert pod["serviceAccountName"] == "tuneproof-canary"
    assert (
        pod["containers"][0]["image"] == eks_manual()["work_pool"]["job_variables"]["image"]
    )  # the same flow-run image
    docs, _ = load_documents([str(PROJECT_ROOT / "deployments")])
    assert job["metadata"]["namespace"] in worker_role_namespaces(docs)["tuneproof-eks-canary"]

    # the same pod as a pipeline flow run's, but for the account and the Ray token it mounts (the canary's own):
    # hardening, mount paths, Secrets otherwise alike
    pipeline_pod = rendered_job(monkeypatch)["spec"]["template"]["spec"]
    differing = {k for k in pod.keys() | pipeline_pod.keys() if k != "containers" and pod.get(k) != pipeline_pod.get(k)}
    assert differing == {"serviceAccountName", "volumes"}
    secrets = {v.get("secret", {}).get("secretName") for v in pod["volumes"]}
    assert "tuneproof-canary-ray-auth" in secrets and "tuneproof-ray-auth" not in secrets
    assert "tuneproof-ray-auth" in {v.get("secret", {}).get("secretName") for v in pipeline_pod["volumes"]}
    strip = ("env",)  # carries the flow run's own id
    assert [{k: v for k, v in c.items() if k not in strip} for c in pod["containers"]] == [
        {k: v for k, v in c.items() if k not in strip} for c in pipeline_pod["containers"]
    ]
