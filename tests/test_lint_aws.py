"""`tuneproof lint` on the AWS side (tuneproof/app/lint/eks.py): one mutated copy of deployments/ per check.

The committed files pass (tests/test_lint.py), so every error here is the mutation's.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tuneproof.app.lint import lint_paths
from tuneproof.control.kube_canary import CANARY_LABEL, CANARY_NODE_GROUP, canary_manifest
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.findings import Finding, errors

EKS = PROJECT_ROOT / "configs" / "eks.yaml"


@pytest.fixture
def deploy(tmp_path) -> Path:
    shutil.copytree(PROJECT_ROOT / "deployments", tmp_path / "deployments")
    return tmp_path / "deployments"


def lint_errors(deploy: Path) -> list[Finding]:
    return errors(lint_paths([str(deploy)], load_config(EKS, [])))


def edit_yaml(path: Path, change) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        change(doc)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def edit_text(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert old in text, old
    path.write_text(text.replace(old, new))


def addon(config: dict, name: str) -> dict:
    return next(a for a in config["addons"] if a["name"] == name)


def only_error(deploy: Path) -> Finding:
    found = lint_errors(deploy)
    assert len(found) == 1, "\n".join(f.line() for f in found)
    return found[0]


def test_an_add_on_that_calls_aws_needs_an_identity(deploy):
    edit_yaml(deploy / "cluster.yaml", lambda c: addon(c, "aws-fsx-csi-driver").pop("podIdentityAssociations"))
    found = only_error(deploy)
    assert (found.field, found.seen) == ("addons[aws-fsx-csi-driver]", "no identity")
    assert "stays Pending" in found.message


def test_a_pod_identity_association_needs_the_agent_listed_before_it(deploy):
    edit_yaml(deploy / "cluster.yaml", lambda c: c["addons"].remove(addon(c, "eks-pod-identity-agent")))
    found = only_error(deploy)
    assert found.field == "addons[aws-fsx-csi-driver].podIdentityAssociations"
    assert found.expected == "eks-pod-identity-agent listed before aws-fsx-csi-driver"


def test_a_node_group_zone_must_be_one_of_the_clusters(deploy):
    def elsewhere(config: dict) -> None:
        config["managedNodeGroups"][1]["availabilityZones"] = ["us-west-2c"]

    edit_yaml(deploy / "cluster.yaml", elsewhere)
    found = only_error(deploy)
    assert (found.field, found.seen) == ("managedNodeGroups[gpu].availabilityZones", ["us-west-2c"])


def test_the_canary_needs_gpu_capacity_the_standing_cluster_does_not_hold(deploy):
    edit_yaml(deploy / "cluster.yaml", lambda c: c["managedNodeGroups"].pop(2))  # no gpu-canary group
    found = lint_errors(deploy)
    assert [f.seen for f in found] == [
        "0 of 2 pods of the image canary's copy of tuneproof spec.workerGroupSpecs[gpu] fit"
    ]
    assert found[0].field == "managedNodeGroups (none selected)"


def test_an_autoscaling_group_is_fitted_by_count_not_pod_by_pod(deploy):
    # It built one entry per pod: at KubeRay's default maxReplicas (2**31 - 1), a MemoryError (or 199,996 findings).
    def autoscale(doc: dict) -> None:
        if doc.get("kind") == "RayCluster":
            doc["spec"]["enableInTreeAutoscaling"] = True
            doc["spec"]["workerGroupSpecs"][0].update(minReplicas=0, maxReplicas=100_000)

    edit_yaml(deploy / "raycluster.yaml", autoscale)
    found = [f for f in lint_errors(deploy) if f.field.startswith("managedNodeGroups")]
    assert [f.seen for f in found] == [
        "2 of 100000 pods of tuneproof spec.workerGroupSpecs[gpu] fit",
        "2 of 100000 pods of the image canary's copy of tuneproof spec.workerGroupSpecs[gpu] fit",
    ]


def test_the_canary_copy_runs_its_workers_on_their_own_node_group():
    raycluster = yaml.safe_load((PROJECT_ROOT / "deployments" / "raycluster.yaml").read_text())
    copy = canary_manifest(raycluster, "img@sha256:" + "1" * 64, "tuneproof-canary-x", "tuneproof")
    assert copy["spec"]["workerGroupSpecs"][0]["template"]["spec"]["nodeSelector"]["eks.amazonaws.com/nodegroup"] == (
        CANARY_NODE_GROUP
    )
    groups = [copy["spec"]["headGroupSpec"], *copy["spec"]["workerGroupSpecs"]]
    assert all(g["template"]["metadata"]["labels"][CANARY_LABEL] == "true" for g in groups)  # tuneproof-canary-ray
    head = copy["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"]
    assert head == raycluster["spec"]["headGroupSpec"]["template"]["spec"]["nodeSelector"]
    # README's optional GCS fault tolerance stays the standing cluster's: the canary's admission policy refuses it
    raycluster["spec"]["gcsFaultToleranceOptions"] = {"redisAddress": "redis:6379"}
    assert (
        "gcsFaultToleranceOptions" not in canary_manifest(raycluster, "img", "tuneproof-canary-x", "tuneproof")["spec"]
    )


def test_eksctl_installs_the_device_plugins_so_a_script_must_not(deploy):
    edit_text(
        deploy / "eks-up.sh",
        "  helm repo add kuberay",
        "  helm upgrade --install nvdp nvdp/nvidia-device-plugin -n kube-system --version 0.20.0\n  helm repo add kuberay",
    )
    found = only_error(deploy)
    assert found.expected == "no second install of the NVIDIA device plugin" and "two DaemonSets" in found.message


def test_the_fsx_security_group_admits_lustre_from_itself(deploy):
    script = deploy / "eks-up.sh"
    for ports in ("988", "1018-1023"):
        edit_text(
            script,
            f'--protocol tcp --port {ports} --source-group "$FSX_SG"\n',
            "\n",
        )
    found = lint_errors(deploy)
    assert [f.expected for f in found] == [
        "988 from $FSX_SG (the group itself)",
        "1018-1023 from $FSX_SG (the group itself)",
    ]


def test_prefect_commands_come_after_the_api_url_and_credential_are_exported(deploy):
    edit_text(deploy / "eks-up.sh", "export PREFECT_API_URL PREFECT_API_AUTH_STRING AWS_REGION", "export AWS_REGION")
    found = lint_errors(deploy)
    assert [f.seen for f in found] == [
        "PREFECT_API_URL not exported above it",
        "PREFECT_API_AUTH_STRING or PREFECT_API_KEY not exported above it",
    ]
    assert "127.0.0.1" in found[0].message


def test_memory_requests_leave_room_for_efa_huge_pages(deploy):
    def greedy(rc: dict) -> None:
        resources = rc["spec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]["resources"]
        for part in ("requests", "limits"):
            resources[part]["memory"] = "175Gi"  # fits the kubelet's allocatable, not what EFA's huge pages leave

    edit_yaml(deploy / "raycluster.yaml", greedy)
    found = lint_errors(deploy)
    pod = [f for f in found if "RayCluster" in f.subject]
    assert len(pod) == 1 and pod[0].field.endswith("resources.requests[memory]") and pod[0].seen == 175
    assert "EFA's huge pages" in pod[0].message
    # and neither group (the standing one's, the canary's) has a node it fits on
    assert {f.field for f in found if "ClusterConfig" in f.subject} == {
        "managedNodeGroups gpu",
        "managedNodeGroups gpu-canary",
    }


def test_the_flow_run_image_runs_the_clusters_ray(deploy):
    edit_text(deploy / "flow-run-image" / "requirements.txt", "\nray==2.58.0\n", "\nray==2.60.0\n")
    found = only_error(deploy)
    assert (found.field, found.seen, found.expected) == ("ray", "2.60.0", "2.58.0")


def test_canary_pods_may_not_carry_the_flow_run_labels(deploy):
    def as_flow_run(rc: dict) -> None:
        labels = rc["spec"]["workerGroupSpecs"][0]["template"]["metadata"]["labels"]
        labels["app.kubernetes.io/component"] = "flow-run"

    edit_yaml(deploy / "raycluster.yaml", as_flow_run)
    found = only_error(deploy)
    assert found.field == "spec.workerGroupSpecs[gpu].template.metadata.labels"
    assert "reach the standing cluster" in found.message


def test_example_account_subnet_and_group_are_warnings_until_replaced(deploy):
    def warnings() -> set:
        found = lint_paths([str(deploy)], load_config(EKS, []))
        return {f.field for f in found if f.severity == "warning" and f.expected == "your own value"}

    assert warnings() == {
        "metadata.annotations[eks.amazonaws.com/role-arn]",
        "parameters.subnetId",
        "parameters.securityGroupIds",
    }
    for name in ("storage.yaml", "rbac.yaml", "canary.yaml"):
        text = (deploy / name).read_text().replace("123456789012", "210987654321")
        text = text.replace("subnet-0123456789abcdef0", "subnet-0f").replace("sg-0123456789abcdef0", "sg-0f")
        (deploy / name).write_text(text)
    assert warnings() == set()


def test_the_bucket_policy_lets_writers_abort_a_multipart_upload(deploy):
    policy = json.loads((deploy / "s3-policy.json").read_text())
    policy["Statement"][1]["Action"].remove("s3:AbortMultipartUpload")
    (deploy / "s3-policy.json").write_text(json.dumps(policy))
    found = only_error(deploy)
    assert (found.field, found.expected) == ("Statement[objects].Action", "includes s3:AbortMultipartUpload")
