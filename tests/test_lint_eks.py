"""`tuneproof lint`: what would break a real EKS run, one mutated copy per check.

    python -m pytest -q tests/test_lint_eks.py

Each test copies deployments/ and prefect.yaml into tmp_path, breaks one thing the way an engineer
could, and asserts lint's exit code and the finding it names. The committed files lint clean
(tests/test_lint.py), so every failure here is the mutation's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tuneproof.app.cli_eks import lint_command, with_prefect_project
from tuneproof.app.lint.nodes import allocatable, eks_instance_types, memory_gib, names_loopback
from tuneproof.core.config import PROJECT_ROOT

EKS = PROJECT_ROOT / "configs" / "eks.yaml"
STOCK_PREFECT = "prefecthq/prefect:3.9.1-python3.13"


@pytest.fixture
def project(tmp_path) -> Path:
    """A copy of deployments/ and prefect.yaml: lint reads the copy's prefect.yaml, not the project's."""
    shutil.copytree(PROJECT_ROOT / "deployments", tmp_path / "deployments")
    shutil.copy(PROJECT_ROOT / "prefect.yaml", tmp_path / "prefect.yaml")
    return tmp_path


def lint(project: Path, capsys, *sets: str) -> tuple[int, str]:
    code = lint_command([str(project / "deployments"), str(project / "prefect.yaml")], str(EKS), list(sets))
    return code, capsys.readouterr().out


def lint_failed(project: Path, capsys, *sets: str) -> str:
    """lint's output for the mutated copy, once its exit code 1 is asserted: every mutation here breaks a check."""
    code, out = lint(project, capsys, *sets)
    assert code == 1, out
    return out


def edit(path: Path, change) -> None:
    """Apply `change` to every YAML document of the file (a JSON file is one document)."""
    if path.suffix == ".json":
        obj = json.loads(path.read_text())
        change(obj)
        path.write_text(json.dumps(obj))
        return
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        change(doc)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def in_raycluster(change):
    return lambda doc: change(doc) if doc.get("kind") == "RayCluster" else None


def head(rc: dict) -> dict:
    return rc["spec"]["headGroupSpec"]


def gpu_group(rc: dict) -> dict:
    return rc["spec"]["workerGroupSpecs"][0]


def ray_container(group: dict) -> dict:
    return group["template"]["spec"]["containers"][0]


def set_env(container: dict, name: str, value: str | None) -> None:
    container["env"] = [e for e in container.get("env") or [] if e["name"] != name]
    if value is not None:
        container["env"].append({"name": name, "value": value})


def eks_deployment(doc: dict, name: str = "eks-manual") -> dict:
    return next(d for d in doc["deployments"] if d["name"] == name)


def set_job_variables(project: Path, deployment: str = "eks-manual", **values: object) -> None:
    """Set job variables of one deployment in the copy's prefect.yaml."""
    edit(
        project / "prefect.yaml",
        lambda doc: eks_deployment(doc, deployment)["work_pool"]["job_variables"].update(values),
    )


def test_the_committed_files_lint_clean(project, capsys):
    code, out = lint(project, capsys)
    assert code == 0 and "0 errors" in out
    assert with_prefect_project([str(PROJECT_ROOT / "deployments")])[-1] == str(PROJECT_ROOT / "prefect.yaml")


# ---------------------------------------------------------------- the flow-run image


def test_eks_deployments_need_a_non_stock_digest_pinned_flow_run_image(project, capsys):
    set_job_variables(project, image=STOCK_PREFECT)
    out = lint_failed(project, capsys)
    assert "deployment eks-manual: work_pool.job_variables.image is 'prefecthq/prefect:3.9.1-python3.13'" in out
    assert "stock Prefect image has neither this project nor ray, kubernetes and s3fs" in out

    tagged = "123456789012.dkr.ecr.us-west-2.amazonaws.com/tuneproof-flow-run:0.1.0"
    set_job_variables(project, image=tagged)
    out = lint_failed(project, capsys)
    assert f"image is '{tagged}'" in out and "pin the image by digest" in out


# ---------------------------------------------------------------- the worker


def test_a_namespaced_worker_needs_the_cluster_uid_and_observer_namespaces(project, capsys):
    def drop(doc):
        if doc["kind"] == "Deployment":
            container = doc["spec"]["template"]["spec"]["containers"][0]
            set_env(container, "PREFECT_KUBERNETES_CLUSTER_UID", None)
            set_env(container, "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES", None)

    edit(project / "deployments" / "prefect-worker.yaml", drop)
    out = lint_failed(project, capsys)
    assert "env[PREFECT_KUBERNETES_CLUSTER_UID] is None" in out and "cannot read the kube-system namespace" in out
    assert "env[PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES] is None, expected 'tuneproof'" in out
    assert "watches pods and jobs cluster-wide" in out


def test_flow_runs_go_where_the_workers_role_is(project, capsys):
    set_job_variables(project, namespace="default")
    out = lint_failed(project, capsys)
    assert "job_variables.namespace is 'default', expected ['tuneproof']" in out
    assert "could not create the flow-run Job" in out


def test_the_base_job_template_carries_what_the_worker_validates(project, capsys):
    def drop(template):
        template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"].pop("completions")

    edit(project / "deployments" / "prefect-k8s-base-job-template.json", drop)
    out = lint_failed(project, capsys)
    assert "job_manifest spec.template.spec.completions is None, expected 1" in out
    assert "prefect-kubernetes rejects the job manifest" in out


# ---------------------------------------------------------------- Ray pods


def test_ray_pods_need_a_memory_backed_dev_shm_of_a_sane_size(project, capsys):
    rc = project / "deployments" / "raycluster.yaml"
    edit(rc, in_raycluster(lambda doc: head(doc)["template"]["spec"]["volumes"][0]["emptyDir"].pop("medium")))
    out = lint_failed(project, capsys)
    assert "spec.headGroupSpec.template.spec.volumes[shm]" in out and "must be memory-backed" in out

    shutil.copy(PROJECT_ROOT / "deployments" / "raycluster.yaml", rc)
    edit(
        rc,
        in_raycluster(
            lambda doc: gpu_group(doc)["template"]["spec"]["volumes"][0]["emptyDir"].update(sizeLimit="160Gi")
        ),
    )
    out = lint_failed(project, capsys)
    assert "emptyDir.sizeLimit is '160Gi', expected '48.0Gi to 80.0Gi" in out
    assert "count against the memory limit" in out


@pytest.mark.parametrize(
    ("name", "value", "said"),
    [
        (
            "FI_EFA_USE_DEVICE_RDMA",
            "1",
            [
                "env[FI_EFA_USE_DEVICE_RDMA] is '1', expected 'unset (or 0)'",
                "g6.12xlarge has EFA but no GPUDirect RDMA",
            ],
        ),
        ("FI_PROVIDER", "tcp", ["env[FI_PROVIDER] is 'tcp', expected 'efa'", "leaves it unused"]),
        ("NCCL_SOCKET_IFNAME", "lo", ["env[NCCL_SOCKET_IFNAME] is 'lo'", "bootstrap over loopback"]),
    ],
)
def test_the_gpu_workers_network_env_is_checked(project, capsys, name: str, value: str, said: list[str]):
    edit(
        project / "deployments" / "raycluster.yaml",
        in_raycluster(lambda doc: set_env(ray_container(gpu_group(doc)), name, value)),
    )
    out = lint_failed(project, capsys)
    assert all(s in out for s in said), out


def test_device_rdma_is_fine_on_instance_types_with_gpudirect(project, capsys):
    def rdma_on_p5(doc):
        set_env(ray_container(gpu_group(doc)), "FI_EFA_USE_DEVICE_RDMA", "1")
        gpu_group(doc)["template"]["spec"]["nodeSelector"]["node.kubernetes.io/instance-type"] = "p5.48xlarge"

    edit(project / "deployments" / "raycluster.yaml", in_raycluster(rdma_on_p5))
    assert "FI_EFA_USE_DEVICE_RDMA" not in lint(project, capsys)[1]


def test_names_loopback_reads_nccls_interface_list():
    assert names_loopback("=lo") and names_loopback("eth0,lo0")
    assert not names_loopback("^lo,docker") and not names_loopback("eth0")


def test_requests_must_fit_the_instance_types_allocatable(project, capsys):
    def greedy_head(doc):
        resources = ray_container(head(doc))["resources"]
        for part in ("requests", "limits"):
            resources[part]["cpu"] = "8"

    edit(project / "deployments" / "raycluster.yaml", in_raycluster(greedy_head))
    out = lint_failed(project, capsys)
    assert "resources.requests[cpu] is 8.0, expected '<= 7.41'" in out
    assert "m7i.2xlarge offers about 7.91 cores to pods" in out and "would stay Pending" in out


@pytest.mark.parametrize("cpu", ["8e0", "0.008k"])
def test_a_request_in_any_quantity_form_is_checked(project, capsys, cpu: str):
    # Kubernetes reads both as 8 cores: lint must parse quantities as verify does, not skip a form as unset (0).
    def greedy_head(doc):
        resources = ray_container(head(doc))["resources"]
        for part in ("requests", "limits"):
            resources[part]["cpu"] = cpu

    edit(project / "deployments" / "raycluster.yaml", in_raycluster(greedy_head))
    assert "resources.requests[cpu] is 8.0, expected '<= 7.41'" in lint_failed(project, capsys)


def test_allocatable_estimates_follow_the_eks_ami_reservations():
    cores, gib = allocatable(eks_instance_types()["m7i.2xlarge"])
    assert round(cores, 2) == 7.91 and 29 < gib < 30.5
    cores, gib = allocatable(eks_instance_types()["g6.12xlarge"])
    assert round(cores, 2) == 47.81 and 180 < gib < 182
    assert memory_gib("512Mi") == 0.5 and memory_gib("170Gi") == 170 and memory_gib("lots") is None


def test_every_mounted_claim_resolves(project, capsys):
    edit(
        project / "deployments" / "raycluster.yaml",
        in_raycluster(
            lambda doc: gpu_group(doc)["template"]["spec"]["volumes"][2]["persistentVolumeClaim"].update(
                claimName="tuneproof-fxs"
            )
        ),
    )
    out = lint_failed(project, capsys)
    assert "volumes[fsx].persistentVolumeClaim.claimName is 'tuneproof-fxs'" in out and "would stay Pending" in out


# ---------------------------------------------------------------- storage and identities


def test_an_s3_root_needs_irsa_for_every_ray_group_and_for_flow_runs(project, capsys):
    def no_role(doc):
        if doc["kind"] == "ServiceAccount":
            doc["metadata"].pop("annotations")

    edit(project / "deployments" / "storage.yaml", no_role)
    out = lint_failed(project, capsys)
    assert (
        "spec.workerGroupSpecs[gpu].template.spec.serviceAccountName is 'tuneproof-ray (no eks.amazonaws.com/role-arn"
        in out
    )
    assert "spec.headGroupSpec.template.spec.serviceAccountName" in out and "no S3 credentials" in out

    shutil.copy(PROJECT_ROOT / "deployments" / "storage.yaml", project / "deployments" / "storage.yaml")
    edit(project / "deployments" / "rbac.yaml", no_role)
    out = lint_failed(project, capsys)
    assert "deployment eks-manual: work_pool.job_variables.service_account_name is 'tuneproof-pipeline" in out
    assert "the flow writes the run record there" in out
    assert lint(project, capsys, "storage.root=/mnt/fsx/tuneproof")[0] == 1  # the deployments still carry s3:// roots


def test_the_s3_csi_driver_is_refused_as_checkpoint_storage(project, capsys):
    def mountpoint(doc):
        if doc["kind"] == "StorageClass":
            doc["provisioner"] = "s3.csi.aws.com"
            doc["parameters"] = {}
            doc.pop("mountOptions")

    edit(project / "deployments" / "storage.yaml", mountpoint)
    out = lint_failed(project, capsys, "storage.root=/mnt/fsx/tuneproof")
    assert "(csi s3.csi.aws.com)" in out and "supports no rename and no append" in out


def test_fsx_storage_class_mounts_with_flock(project, capsys):
    edit(
        project / "deployments" / "storage.yaml",
        lambda doc: doc.pop("mountOptions") if doc["kind"] == "StorageClass" else None,
    )
    out = lint_failed(project, capsys)
    assert "StorageClass/tuneproof-fsx: mountOptions is None, expected ['flock']" in out
    assert "ENOSYS" in out
