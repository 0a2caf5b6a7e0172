"""What Prefect itself does with the work pool's boundaries (SECURITY.md, "The Prefect API").

    python -m pytest -q tests/test_work_pool_security.py            # the integration tests start a Prefect server

prefect-kubernetes (the worker's own code) turns the worker's Prefect credential into a secretKeyRef in
every flow-run Job when the worker names the Secret, which deployments/prefect-worker.yaml does, and
otherwise writes the credential's value into the Job manifest. The Prefect server checks deployments and
a deployment's flow runs against the base job template's variables schema, so the pinned image, service
account and namespace cannot be overridden there; a flow run created directly (POST /flow_runs/ naming the
work pool) is not checked, and the worker renders whatever it carries. The last test pins that gap, so a
Prefect release that closes it shows up here.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from types import SimpleNamespace
from typing import Any

import pytest
import yaml

from tuneproof.core.config import PROJECT_ROOT

kubernetes_worker = pytest.importorskip("prefect_kubernetes.worker")

TEMPLATE = json.loads((PROJECT_ROOT / "deployments" / "prefect-k8s-base-job-template.json").read_text())
AUTH = "PREFECT_API_AUTH_STRING"
DEPLOY_ENV = {"TUNEPROOF_GIT_URL": "https://git.example/tuneproof.git", "TUNEPROOF_GIT_COMMIT": "a" * 40}


def worker_env() -> dict[str, dict]:
    """The Prefect worker container's env entries in deployments/prefect-worker.yaml, by name."""
    docs = yaml.safe_load_all((PROJECT_ROOT / "deployments" / "prefect-worker.yaml").read_text())
    deployment = next(d for d in docs if d["kind"] == "Deployment")
    return {e["name"]: e for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


def created_job_env(monkeypatch, worker_settings: dict[str, str]) -> dict[str, dict]:
    """The env of the flow-run Job the worker would send to the API server, given the worker's settings."""
    from prefect.client.schemas.objects import FlowRun
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings

    sent: dict = {}

    class BatchApi:  # stands in for the Kubernetes API: records the Job instead of creating it
        def __init__(self, client):
            pass

        async def create_namespaced_job(self, namespace, manifest):
            sent["job"] = manifest
            return SimpleNamespace(metadata=SimpleNamespace(name="job", namespace=namespace, uid="uid"))

    monkeypatch.setattr(kubernetes_worker, "BatchV1Api", BatchApi)
    for name in [n for n in os.environ if n.startswith("PREFECT_INTEGRATIONS_KUBERNETES_WORKER_")]:
        monkeypatch.delenv(name)
    for name, value in worker_settings.items():
        monkeypatch.setenv(name, value)

    async def create() -> None:
        config = await kubernetes_worker.KubernetesWorkerJobConfiguration.from_template_and_values(TEMPLATE, {})
        config.prepare_for_flow_run(FlowRun(id=uuid.uuid4(), name="tireless-otter", flow_id=uuid.uuid4()))
        await kubernetes_worker.KubernetesWorker(work_pool_name="tuneproof-eks")._create_job(config, client=None)

    with temporary_settings(
        {PREFECT_API_AUTH_STRING: "admin:not-in-any-manifest"}
    ):  # what the worker read from its Secret
        asyncio.run(create())
    return {e["name"]: e for e in sent["job"]["spec"]["template"]["spec"]["containers"][0]["env"]}


def test_the_worker_hands_flow_runs_a_reference_to_its_auth_secret(monkeypatch):
    shipped = {
        name: e["value"]
        for name, e in worker_env().items()
        if name.startswith("PREFECT_INTEGRATIONS_KUBERNETES_WORKER_")
    }
    env = created_job_env(monkeypatch, shipped)
    assert "value" not in env[AUTH]
    assert env[AUTH]["valueFrom"] == worker_env()[AUTH]["valueFrom"]  # the same Secret and key the worker reads

    # without the two settings prefect-kubernetes writes the value itself into the Job (what lint refuses)
    assert created_job_env(monkeypatch, {})[AUTH] == {"name": AUTH, "value": "admin:not-in-any-manifest"}


# ---------------------------------------------------------------- the Prefect server and the variables schema


async def _eks_pool_and_deployment(client) -> tuple:
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.utilities.templating import apply_values

    pool = f"tuneproof-eks-{uuid.uuid4().hex[:8]}"
    await client.create_work_pool(WorkPoolCreate(name=pool, type="kubernetes", base_job_template=TEMPLATE))
    flow_id = await client.create_flow_from_name("tuneproof-pipeline")
    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    variables = next(d for d in doc["deployments"] if d["name"] == "eks-manual")["work_pool"]["job_variables"]
    variables = apply_values(variables, DEPLOY_ENV, remove_notset=False)  # as `prefect deploy` resolves them
    deployment_id = await client.create_deployment(
        flow_id=flow_id, name="eks-manual", work_pool_name=pool, job_variables=variables
    )
    return pool, flow_id, deployment_id


OVERRIDES: list[dict[str, Any]] = [
    {"service_account_name": "prefect-worker"},
    {"image": "attacker.example/image:latest"},
    {"namespace": "default"},
    {"env": {AUTH: "admin:guess"}},
    {"labels": {"ray.io/cluster": "tuneproof"}},
    {"cluster_config": {"config": {}, "context_name": "elsewhere"}},
]


@pytest.mark.integration
def test_the_server_holds_deployments_and_their_runs_to_the_pinned_variables(prefect_server):
    from prefect import get_client
    from prefect.exceptions import PrefectHTTPStatusError

    async def check() -> None:
        async with get_client() as client:
            pool, flow_id, deployment_id = await _eks_pool_and_deployment(client)  # prefect.yaml's variables pass
            await client.create_flow_run_from_deployment(deployment_id)
            for override in OVERRIDES:
                with pytest.raises(PrefectHTTPStatusError, match="422"):
                    await client.create_flow_run_from_deployment(deployment_id, job_variables=override)
                with pytest.raises(PrefectHTTPStatusError, match="422"):
                    await client.create_deployment(
                        flow_id=flow_id, name="other", work_pool_name=pool, job_variables=override
                    )

    asyncio.run(check())


@pytest.mark.integration
def test_a_flow_run_created_directly_is_not_held_to_the_schema(prefect_server):
    from prefect import get_client

    async def check() -> dict:
        async with get_client() as client:
            pool, _, _ = await _eks_pool_and_deployment(client)
            flow = SimpleNamespace(name="tuneproof-pipeline", version=None, retries=0, retry_delay_seconds=0)
            direct = await client.create_flow_run(
                flow=flow,  # type: ignore[arg-type]  # the fields create_flow_run reads, not a Flow
                work_pool_name=pool,
                job_variables={"service_account_name": "prefect-worker"},
            )
            config = await kubernetes_worker.KubernetesWorkerJobConfiguration.resolve_for_flow_run(
                direct, client=client, work_pool=await client.read_work_pool(pool), worker_name="worker"
            )
            return config.job_manifest["spec"]["template"]["spec"]

    pod = asyncio.run(check())
    assert pod["serviceAccountName"] == "prefect-worker"  # only the cluster side bounds this (SECURITY.md)
