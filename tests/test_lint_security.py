"""`tuneproof lint`: the deployment-hardening checks (SECURITY.md), one mutated copy per check.

    python -m pytest -q tests/test_lint_security.py

As in tests/test_lint_eks.py: each test copies deployments/ and prefect.yaml, weakens one boundary the
way an engineer could, and asserts exit code 1 and the finding that names it. The committed files
lint clean, so every failure here is the mutation's.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tests.test_lint_eks import (
    edit,
    eks_deployment,
    gpu_group,
    head,
    in_raycluster,
    lint,
    lint_failed,
    project,
    ray_container,
    set_job_variables,
)
from tuneproof.app.lint.security import selects
from tuneproof.core.config import PROJECT_ROOT

__all__ = ["project"]  # the fixture, shared with tests/test_lint_eks.py

TEMPLATE = "prefect-k8s-base-job-template.json"


def deploy(project: Path, name: str) -> Path:
    return project / "deployments" / name


def template_pod(template: dict) -> dict:
    return template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]


def worker_container(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]["containers"][0]


def in_worker(change):
    return lambda doc: change(doc) if doc.get("kind") == "Deployment" else None


def in_policy(change):
    return lambda doc: change(doc) if doc.get("kind") == "NetworkPolicy" else None


# ---------------------------------------------------------------- pod security


def test_the_namespace_enforces_the_restricted_profile(project, capsys):
    edit(
        deploy(project, "namespace.yaml"), lambda ns: ns["metadata"]["labels"].pop("pod-security.kubernetes.io/enforce")
    )
    out = lint_failed(project, capsys)
    assert (
        "Namespace/tuneproof: metadata.labels[pod-security.kubernetes.io/enforce] is None, expected 'restricted'" in out
    )
    assert "admits a root or privileged pod" in out


def test_ray_containers_pass_the_restricted_profile(project, capsys):
    def add_ipc_lock(rc):
        ray_container(gpu_group(rc))["securityContext"]["capabilities"]["add"] = ["IPC_LOCK"]
        head(rc)["template"]["spec"]["securityContext"].pop("runAsNonRoot")

    edit(deploy(project, "raycluster.yaml"), in_raycluster(add_ipc_lock))
    out = lint_failed(project, capsys)
    assert (
        "workerGroupSpecs[gpu].template.spec.containers[ray-worker].securityContext.capabilities.add is "
        "['IPC_LOCK'], expected 'nothing but NET_BIND_SERVICE'"
    ) in out
    assert "headGroupSpec.template.spec.containers[ray-head].securityContext.runAsNonRoot is None, expected True" in out
    assert "the API server refuses the pod" in out


def test_the_worker_and_flow_run_containers_pass_the_restricted_profile(project, capsys):
    edit(
        deploy(project, "prefect-worker.yaml"),
        in_worker(lambda d: worker_container(d)["securityContext"].update(allowPrivilegeEscalation=True)),
    )
    edit(deploy(project, TEMPLATE), lambda t: template_pod(t)["securityContext"].pop("seccompProfile"))
    out = lint_failed(project, capsys)
    assert "containers[prefect-worker].securityContext.allowPrivilegeEscalation is True, expected False" in out
    assert (
        "job_manifest spec.template.spec.containers[prefect-job].securityContext.seccompProfile.type is None, "
        "expected 'RuntimeDefault'"
    ) in out


def test_host_path_volumes_break_the_profile(project, capsys):
    def host_tmp(rc):
        gpu_group(rc)["template"]["spec"]["volumes"][1] = {"name": "ray-tmp", "hostPath": {"path": "/tmp/ray"}}

    edit(deploy(project, "raycluster.yaml"), in_raycluster(host_tmp))
    out = lint_failed(project, capsys)
    assert "workerGroupSpecs[gpu].template.spec.volumes[ray-tmp] is 'hostPath', expected ['configMap'" in out


# ---------------------------------------------------------------- service-account tokens


def test_ray_pods_mount_no_service_account_token(project, capsys):
    edit(
        deploy(project, "raycluster.yaml"),
        in_raycluster(lambda rc: gpu_group(rc)["template"]["spec"].pop("automountServiceAccountToken")),
    )
    out = lint_failed(project, capsys)
    assert "workerGroupSpecs[gpu].template.spec.automountServiceAccountToken is None, expected False" in out
    assert "Ray never calls the Kubernetes API" in out

    def autoscaling_head(rc):  # the in-tree autoscaler on the head does call the API: its token is allowed
        rc["spec"]["enableInTreeAutoscaling"] = True
        head(rc)["template"]["spec"].pop("automountServiceAccountToken")

    edit(deploy(project, "raycluster.yaml"), in_raycluster(autoscaling_head))
    assert "headGroupSpec.template.spec.automountServiceAccountToken" not in lint(project, capsys)[1]


def test_pods_that_call_the_api_keep_their_token(project, capsys):
    edit(deploy(project, TEMPLATE), lambda t: template_pod(t).update(automountServiceAccountToken=False))
    out = lint_failed(project, capsys)
    assert "job_manifest spec.template.spec.automountServiceAccountToken is False, expected True" in out
    assert "the verify stage reads the RayCluster, pods and nodes" in out


# ---------------------------------------------------------------- the Ray ports


def test_a_network_policy_must_limit_ingress_to_the_ray_pods(project, capsys):
    deploy(project, "networkpolicy.yaml").unlink()
    out = lint_failed(project, capsys)
    assert "spec.workerGroupSpecs[gpu] pods (ray.io/cluster=tuneproof) is None" in out
    assert "spec.headGroupSpec pods (ray.io/cluster=tuneproof) is None" in out
    assert "open to every pod in the cluster" in out


def test_an_egress_only_policy_does_not_count(project, capsys):
    edit(deploy(project, "networkpolicy.yaml"), in_policy(lambda p: p["spec"].update(policyTypes=["Egress"])))
    out = lint_failed(project, capsys)
    assert "pods (ray.io/cluster=tuneproof) is None, expected 'a NetworkPolicy" in out


def test_the_ray_policy_admits_only_the_pipelines_pods(project, capsys):
    def widen(policy):
        policy["spec"]["ingress"][1]["from"][0]["podSelector"] = {
            "matchLabels": {"app.kubernetes.io/part-of": "tuneproof"}
        }

    edit(deploy(project, "networkpolicy.yaml"), in_policy(widen))
    out = lint_failed(project, capsys)
    assert "NetworkPolicy/tuneproof-ray: spec.ingress[1].from[0].podSelector is" in out
    assert "to pods that are not the pipeline's" in out  # part-of alone also selects the Prefect worker

    edit(
        deploy(project, "networkpolicy.yaml"),
        in_policy(lambda p: p["spec"]["ingress"][0]["from"][0].update(namespaceSelector={})),
    )
    out = lint_failed(project, capsys)
    assert "spec.ingress[0].from[0] is" in out and "to addresses or other namespaces" in out


def test_policies_add_up_so_an_open_one_elsewhere_is_named(project, capsys):
    deploy(project, "allow-all.yaml").write_text(
        "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
        "metadata: {name: allow-all, namespace: tuneproof}\n"
        "spec: {podSelector: {}, ingress: [{}]}\n"
    )
    out = lint_failed(project, capsys)
    assert "NetworkPolicy/allow-all: spec.ingress[0].from is None" in out and "to every source" in out


def test_label_selectors_match_as_kubernetes_does():
    labels = {"ray.io/cluster": "tuneproof", "ray.io/node-type": "worker"}
    assert selects({}, labels) and selects({"matchLabels": {"ray.io/cluster": "tuneproof"}}, labels)
    assert not selects({"matchLabels": {"ray.io/cluster": "other"}}, labels)
    assert selects({"matchExpressions": [{"key": "ray.io/node-type", "operator": "In", "values": ["worker"]}]}, labels)
    assert not selects({"matchExpressions": [{"key": "ray.io/group", "operator": "Exists"}]}, labels)


# ---------------------------------------------------------------- work-pool job variables


def test_job_variables_cannot_name_another_account_secret_or_cluster(project, capsys):
    def loosen(template):
        variables = template["variables"]
        variables["properties"]["service_account_name"].pop("const")
        variables.pop("additionalProperties")
        variables["properties"]["ray_auth_secret"] = {"type": "string", "default": "tuneproof-ray-auth"}
        template_pod(template)["volumes"][0]["secret"]["secretName"] = "{{ ray_auth_secret }}"
        template["job_configuration"]["cluster_config"] = "{{ cluster_config }}"

    edit(deploy(project, TEMPLATE), loosen)
    out = lint_failed(project, capsys)
    assert (
        "variables.properties.service_account_name is 'tuneproof-pipeline', expected 'const: the one allowed value'"
    ) in out and "could name any service account" in out
    assert "volumes[0].secret.secretName is '{{ ray_auth_secret }}', expected 'a fixed value, no variable'" in out
    assert "could mount any Secret in the namespace" in out
    assert "job_configuration.cluster_config is '{{ cluster_config }}'" in out and "another cluster" in out
    assert "variables.properties.cluster_config is None, expected 'a declared variable'" in out
    assert "variables.additionalProperties is None, expected False" in out


def test_eks_deployments_obey_the_templates_variables_schema(project, capsys):
    set_job_variables(project, service_account_name="prefect-worker")
    out = lint_failed(project, capsys)
    assert (
        "deployment eks-manual: work_pool.job_variables.service_account_name is 'prefect-worker', expected "
        "'const: \"tuneproof-pipeline\"'" in out
    )
    assert "the Prefect server refuses the deployment (422)" in out


# ---------------------------------------------------------------- Prefect API credentials


def test_the_worker_authenticates_from_a_secret_and_passes_a_reference_on(project, capsys):
    def literal(doc):
        env = worker_container(doc)["env"]
        auth = next(e for e in env if e["name"] == "PREFECT_API_AUTH_STRING")
        auth.pop("valueFrom")
        auth["value"] = "admin:hunter2"

    edit(deploy(project, "prefect-worker.yaml"), in_worker(literal))
    out = lint_failed(project, capsys)
    assert "env[PREFECT_API_AUTH_STRING] is 'a literal value (not shown)', expected 'valueFrom.secretKeyRef'" in out
    assert "hunter2" not in out

    def no_reference(doc):
        worker_container(doc)["env"] = [
            e for e in worker_container(doc)["env"] if not e["name"].endswith("API_AUTH_STRING_SECRET_NAME")
        ]

    shutil.copy(PROJECT_ROOT / "deployments" / "prefect-worker.yaml", deploy(project, "prefect-worker.yaml"))
    edit(deploy(project, "prefect-worker.yaml"), in_worker(no_reference))
    out = lint_failed(project, capsys)
    assert (
        "env[PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET_NAME] is None, expected 'prefect-api-auth'"
    ) in out and "as a literal into every flow-run Job manifest" in out


def test_an_unauthenticated_worker_is_an_error(project, capsys):
    def no_auth(doc):
        worker_container(doc)["env"] = [e for e in worker_container(doc)["env"] if "AUTH_STRING" not in e["name"]]

    edit(deploy(project, "prefect-worker.yaml"), in_worker(no_auth))
    out = lint_failed(project, capsys)
    assert "env[PREFECT_API_AUTH_STRING] is None" in out and "the Prefect API runs code on this cluster" in out


def test_no_prefect_credential_in_job_variables(project, capsys):
    edit(
        project / "prefect.yaml",
        lambda doc: eks_deployment(doc)["work_pool"]["job_variables"]["env"].update(PREFECT_API_KEY="pnu_literal"),
    )
    out = lint_failed(project, capsys)
    assert "deployment eks-manual: work_pool.job_variables.env[PREFECT_API_KEY] is 'a literal value (not shown)'" in out
    assert "pnu_literal" not in out


# ---------------------------------------------------------------- the cluster-side admission policy


def test_the_worker_s_jobs_are_held_by_an_admission_policy(project, capsys):
    deploy(project, "flow-run-admission.yaml").unlink()
    out = lint_failed(project, capsys)
    assert "Prefect base job template: ValidatingAdmissionPolicy for the worker's Jobs is None" in out
    assert "POST /flow_runs/" in out

    shutil.copy(PROJECT_ROOT / "deployments" / "flow-run-admission.yaml", deploy(project, "flow-run-admission.yaml"))
    edit(
        deploy(project, "flow-run-admission.yaml"),
        lambda d: d["spec"].update(validationActions=["Audit"]) if d["kind"].endswith("Binding") else None,
    )
    assert (
        "ValidatingAdmissionPolicy for the worker's Jobs is None" in lint(project, capsys)[1]
    )  # audit refuses nothing


def test_the_admission_policy_follows_the_pinned_image(project, capsys):
    new = "123456789012.dkr.ecr.us-west-2.amazonaws.com/tuneproof-flow-run:0.2.0@sha256:" + "1" * 64

    def repin(template):
        template["variables"]["properties"]["image"].update(const=new, default=new)

    edit(deploy(project, TEMPLATE), repin)
    for name in ("eks-manual", "eks-nightly"):
        set_job_variables(project, name, image=new)
    out = lint_failed(project, capsys)
    assert (
        f"ValidatingAdmissionPolicy/tuneproof-flow-run-jobs: spec.validations is \"no expression naming '{new}'\""
        in out
    )
    assert "pins the flow runs' image to it" in out
