"""The image canary's Kubernetes half over real HTTP: create a RayCluster, wait until it is ready, delete it.

The API server is the one of tests/test_kube_client.py (a ThreadingHTTPServer on 127.0.0.1 driven by the
real `kubernetes` client), here also accepting POST and DELETE of rayclusters; the RayCluster's status and
its pods turn ready after a few reads, as KubeRay's would. Every created object is validated against the
KubeRay CRD's own schema (/work/shared/kuberay, with a copy of the same CRD in the lint schemas).
Whether the API server's admission policy (deployments/canary.yaml) admits the manifest, and refuses its
variants, is tests/test_admission_cel.py's: it evaluates the policy's own CEL.
"""

from __future__ import annotations

import copy
import json
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from tests.test_kube_client import FakeApi, _status, serve
from tuneproof.control.images import CANARY_CLUSTER_PREFIX
from tuneproof.control.kube_canary import canary_manifest, canary_name, ephemeral_raycluster, expected_pods
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.config_cluster import KubernetesConfig
from tuneproof.core.results import FailureClass, StageFailure

CANDIDATE = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2@sha256:" + "b" * 64
RAYCLUSTERS = "/apis/ray.io/v1/namespaces/tuneproof/rayclusters"
# An upper bound only: the fake cluster is ready within a second idle, but it failed once at 10 s under load 11.
READY_WITHIN_S = 120
SHARED_CRD = Path("/work/shared/kuberay/ray.io_rayclusters.yaml")
LINT_CRD = PROJECT_ROOT / "tuneproof" / "app" / "schemas" / "raycluster-v1.json"


@cache
def crd_validator() -> jsonschema.Validator:
    """The v1 RayCluster schema from the KubeRay CRD (the shared copy when present, else lint's strict one)."""
    if SHARED_CRD.exists():
        crd = yaml.load(SHARED_CRD.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
        schema = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")["schema"]["openAPIV3Schema"]
    else:
        schema = json.loads(LINT_CRD.read_text())
    return jsonschema.Draft202012Validator(schema)


class RayClusterApi(FakeApi):
    """FakeApi plus created RayClusters: ready (state and pods) after `ready_after` reads of the object."""

    def __init__(self, ready_after: int = 3):
        super().__init__()
        self.ready_after = ready_after
        self.created: dict[str, dict] = {}
        self.reads: dict[str, int] = {}
        self.deleted: list[str] = []
        self.write_status: dict[tuple[str, str], int] = {}  # (method, path) -> forced HTTP status
        self.calls: list[tuple[str, str]] = []  # (method, path), to check against the canary's RBAC

    def write(self, method: str, path: str, body: dict | None) -> tuple[int, dict]:
        self.calls.append((method, path))
        if (method, path) in self.write_status:
            return self.write_status[method, path], _status(self.write_status[method, path], path)
        if method == "POST" and path == RAYCLUSTERS and body is not None:
            name = body["metadata"]["name"]
            if name in self.created:
                return 409, _status(409, path)
            self.created[name] = copy.deepcopy(body)
            return 201, body
        if method == "DELETE" and path.startswith(RAYCLUSTERS + "/"):
            name = path.rsplit("/", 1)[1]
            if self.created.pop(name, None) is None:
                return 404, _status(404, path)
            self.deleted.append(name)
            return 200, {"kind": "Status", "apiVersion": "v1", "status": "Success"}
        return 405, _status(405, path)

    def answer(self, path: str, query: dict) -> tuple[int, dict]:
        self.calls.append(("GET", path))
        if path in self.status:
            return self.status[path], _status(self.status[path], path)
        if path.startswith(RAYCLUSTERS + "/"):
            name = path.rsplit("/", 1)[1]
            if name not in self.created:
                return 404, _status(404, path)
            self.reads[name] = self.reads.get(name, 0) + 1
            state = "ready" if self.is_ready(name) else None
            return 200, {**self.created[name], "status": {"state": state} if state else {}}
        if path == "/api/v1/namespaces/tuneproof/pods":
            selector = query.get("labelSelector", [""])[0]
            name = selector.partition("=")[2]
            if name in self.created:
                return 200, {"kind": "PodList", "apiVersion": "v1", "items": self.pods_of(name)}
        return super().answer(path, query)

    def is_ready(self, name: str) -> bool:
        return self.reads.get(name, 0) >= self.ready_after

    def pods_of(self, name: str) -> list[dict]:
        """The saved pods, renamed to the canary cluster; Pending until ready, then Running and Ready."""
        pods = copy.deepcopy(self.pods)
        for pod in pods:
            pod["metadata"]["labels"]["ray.io/cluster"] = name
            ready = self.is_ready(name)
            pod["status"]["phase"] = "Running" if ready else "Pending"
            pod["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
        return pods


@pytest.fixture
def k8s(tmp_path):
    with serve(RayClusterApi(), tmp_path) as served:
        yield served


def kcfg(kubeconfig: Path) -> KubernetesConfig:
    return KubernetesConfig(namespace="tuneproof", raycluster="tuneproof", kubeconfig=str(kubeconfig))


def manifest() -> dict:
    return yaml.safe_load((PROJECT_ROOT / "deployments" / "raycluster.yaml").read_text())


def test_the_canary_manifest_is_a_valid_raycluster_running_only_the_candidate():
    body = canary_manifest(manifest(), CANDIDATE, canary_name("20261201-140000-abc123"), "tuneproof")
    assert list(crd_validator().iter_errors(body)) == []
    assert body["metadata"]["name"] == "tuneproof-canary-20261201-140000-abc123"
    assert body["metadata"]["labels"]["tuneproof.io/image-canary"] == "true"
    groups = [body["spec"]["headGroupSpec"], *body["spec"]["workerGroupSpecs"]]
    images = {c["image"] for g in groups for c in g["template"]["spec"]["containers"]}
    assert images == {CANDIDATE}
    # the canary's own token and bucket identity, never the standing cluster's (SECURITY.md, "The image canary")
    assert body["spec"]["authOptions"] == {"mode": "token", "secretName": "tuneproof-canary-ray-auth"}
    assert {g["template"]["spec"]["serviceAccountName"] for g in groups} == {"tuneproof-canary-ray"}
    assert manifest()["metadata"]["name"] == "tuneproof"  # the standing cluster's manifest is untouched
    assert manifest()["spec"]["authOptions"]["secretName"] == "tuneproof-ray-auth"
    assert expected_pods(body) == 3


def test_an_autoscaling_canary_waits_for_the_pods_it_wants_now_not_its_maximum():
    # expected_pods counted maxReplicas under autoscaling: a canary of such a cluster waited for pods that the
    # autoscaler never starts until work asks for them.
    body = canary_manifest(manifest(), CANDIDATE, canary_name("20261201-140000-abc123"), "tuneproof")
    body["spec"]["enableInTreeAutoscaling"] = True
    for group in body["spec"]["workerGroupSpecs"]:
        group.update(minReplicas=1, replicas=1, maxReplicas=50)
    assert expected_pods(body) == 1 + len(body["spec"]["workerGroupSpecs"])


def test_canary_names_are_dns_labels_with_room_for_kuberays_suffixes():
    name = canary_name("A_Very/Long-ID-" + "x" * 80)
    assert name.startswith(CANARY_CLUSTER_PREFIX) and len(name) <= 40
    assert all(c.isalnum() or c == "-" for c in name) and name == name.lower() and not name.endswith("-")


def test_create_wait_until_ready_and_delete(k8s):
    fake, kubeconfig = k8s
    progress: list[str] = []
    with ephemeral_raycluster(
        kcfg(kubeconfig), manifest(), CANDIDATE, "t1", timeout_s=READY_WITHIN_S, poll_s=0.05, log=progress.append
    ) as cluster:
        assert cluster.name == "tuneproof-canary-t1"
        assert cluster.address == "http://tuneproof-canary-t1-head-svc.tuneproof.svc.cluster.local:8265"
        created = fake.created[cluster.name]
        assert list(crd_validator().iter_errors(created)) == []
        assert fake.is_ready(cluster.name) and fake.deleted == []
    assert fake.deleted == ["tuneproof-canary-t1"] and fake.created == {}
    # progress on each change: pending with no pod ready, then ready with all three
    assert any("state pending, 0/3 pods Running and Ready" in line for line in progress)
    assert any("state ready, 3/3 pods Running and Ready" in line for line in progress)
    assert progress[-1] == "deleted RayCluster tuneproof/tuneproof-canary-t1"


def test_a_failure_inside_the_block_still_deletes_the_cluster(k8s):
    fake, kubeconfig = k8s
    with (
        pytest.raises(RuntimeError, match="the stages failed"),
        ephemeral_raycluster(
            kcfg(kubeconfig), manifest(), CANDIDATE, "t2", timeout_s=READY_WITHIN_S, poll_s=0.05, log=print
        ),
    ):
        raise RuntimeError("the stages failed")
    assert fake.deleted == ["tuneproof-canary-t2"]


def test_a_cluster_never_ready_times_out_as_infrastructure_and_is_deleted(k8s):
    fake, kubeconfig = k8s
    fake.ready_after = 10**6
    body_ran = False
    with (
        pytest.raises(StageFailure) as caught,
        ephemeral_raycluster(kcfg(kubeconfig), manifest(), CANDIDATE, "t3", timeout_s=0.3, poll_s=0.05, log=print),
    ):
        body_ran = True
    assert not body_ran
    assert caught.value.failure_class is FailureClass.infrastructure
    assert "tuneproof/tuneproof-canary-t3 not ready after 0s: state pending, 0/3 pods" in caught.value.cause
    assert fake.deleted == ["tuneproof-canary-t3"]


def test_a_refused_create_is_named_with_its_status(k8s):
    fake, kubeconfig = k8s
    fake.write_status["POST", RAYCLUSTERS] = 403
    with (
        pytest.raises(StageFailure) as caught,
        ephemeral_raycluster(kcfg(kubeconfig), manifest(), CANDIDATE, "t4", timeout_s=5, poll_s=0.05, log=print),
    ):
        pass
    assert caught.value.failure_class is FailureClass.infrastructure
    assert "refused creating RayCluster tuneproof/tuneproof-canary-t4: HTTP 403 Forbidden" in caught.value.cause
    assert "runs as tuneproof-canary" in caught.value.cause
    assert "create/get/list/delete on rayclusters.ray.io" in caught.value.cause
    assert fake.created == {}


def test_a_refused_delete_is_logged_and_does_not_mask_the_original_failure(k8s):
    fake, kubeconfig = k8s
    fake.write_status["DELETE", f"{RAYCLUSTERS}/tuneproof-canary-t5"] = 403
    logged: list[str] = []
    with (
        pytest.raises(RuntimeError, match="verify failed"),
        ephemeral_raycluster(
            kcfg(kubeconfig), manifest(), CANDIDATE, "t5", timeout_s=READY_WITHIN_S, poll_s=0.05, log=logged.append
        ),
    ):
        raise RuntimeError("verify failed")
    assert "tuneproof-canary-t5" in fake.created  # still there: the API refused the delete
    assert "could not delete RayCluster tuneproof/tuneproof-canary-t5" in logged[-1]
    assert "HTTP 403" in logged[-1] and "kubectl -n tuneproof delete raycluster tuneproof-canary-t5" in logged[-1]


def rbac_verb(method: str, path: str) -> tuple[str, str, str]:
    """(API group, resource, verb) the API server authorizes a namespaced request as."""
    parts = path.strip("/").split("/")
    group = "" if parts[0] == "api" else parts[1]
    rest = parts[parts.index("namespaces") + 2 :]
    named = len(rest) > 1
    verb = {"POST": "create", "DELETE": "delete", "GET": "get" if named else "list"}[method]
    return group, rest[0], verb


def test_the_canary_role_grants_exactly_what_the_canary_calls(k8s):
    fake, kubeconfig = k8s
    with ephemeral_raycluster(
        kcfg(kubeconfig), manifest(), CANDIDATE, "t6", timeout_s=READY_WITHIN_S, poll_s=0.05, log=print
    ):
        pass
    called = {rbac_verb(method, path) for method, path in fake.calls}
    assert called == {
        ("ray.io", "rayclusters", "create"),
        ("ray.io", "rayclusters", "get"),
        ("", "pods", "list"),
        ("ray.io", "rayclusters", "delete"),
    }
    docs = yaml.safe_load_all((PROJECT_ROOT / "deployments" / "canary.yaml").read_text())
    role = next(d for d in docs if d["kind"] == "Role" and d["metadata"]["name"] == "tuneproof-canary")
    granted = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert called <= granted
    # beyond these calls: list rayclusters and get pods, which verify makes on the canary's cluster; no other write
    assert {(g, r, v) for g, r, v in granted if v not in ("get", "list", "watch")} == {
        ("ray.io", "rayclusters", "create"),
        ("ray.io", "rayclusters", "delete"),
    }
