"""An ephemeral RayCluster for the image canary: created with the candidate image, waited on, always deleted.

    with ephemeral_raycluster(kcfg, manifest, candidate, decision_id, timeout_s=1200, log=print) as cluster:
        ... run stages against cluster.address ...

The manifest is deployments/raycluster.yaml with every container of the head and worker groups set to
the candidate image, a unique name (tuneproof-canary-<short id>), and the worker groups on the node group
`gpu-canary` (deployments/cluster.yaml: scaled to 2 nodes for a canary, 0 between), so the canary never
touches the standing cluster or waits for GPUs it holds. The copy runs with the canary's own identity, never
production's: Ray token auth from the Secret `tuneproof-canary-ray-auth` (the canary's flow-run pod mounts the
same Secret, prefect-k8s-canary-job-template.json) and every pod as `tuneproof-canary-ray`, whose IRSA role
writes only the canary prefix of the bucket (deployments/canary.yaml, s3-canary-policy.json). Ready means what verify needs: the RayCluster's status.state is `ready` AND every pod
the spec asks for (head + worker replicas) is Running with its Ready condition true; the wait is bounded
and reports progress on each change. The cluster is deleted when the block ends, whatever happened: a
deletion error is logged, never raised over the block's own outcome (the original failure is the one
that explains the canary).

Uses the official `kubernetes` client with the same credentials as the verify stage (tuneproof.control.kube).
On EKS that is the pod's service account, `tuneproof-canary` (deployments/canary.yaml): the `image-canary`
deployment runs on its own work pool `tuneproof-eks-canary`, whose base job template pins that account and
whose worker's Jobs flow-run-admission.yaml holds to it. Its Role grants exactly create/get/list/delete on
rayclusters.ray.io and get/list on pods in the namespace (plus the pipeline's cluster-wide node and
ResourceSlice reads for verify); the pipeline's own account stays read-only, and lint fails if either
gains a write it should not have. A refusal (a cluster set up without canary.yaml) is named with its
HTTP status and the rights missing.
"""

from __future__ import annotations

import copy
import json
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import urllib3
from kubernetes import client
from kubernetes.client.exceptions import ApiException

from tuneproof.control.images import CANARY_CLUSTER_PREFIX
from tuneproof.control.kube import TIMEOUT_S, api_client, unreachable
from tuneproof.control.kube_checks import CLUSTER_LABEL, group_desired_pods, worker_groups
from tuneproof.core.config_cluster import KubernetesConfig
from tuneproof.core.results import FailureClass, StageFailure

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayclusters"
CANARY_LABEL = "tuneproof.io/image-canary"
NODE_GROUP_LABEL = "eks.amazonaws.com/nodegroup"
CANARY_NODE_GROUP = "gpu-canary"
"""The EKS managed node group the canary's Ray workers run on (deployments/cluster.yaml), apart from the standing cluster's."""
CANARY_TOKEN_SECRET = "tuneproof-canary-ray-auth"
"""The canary clusters' Ray token: a candidate image never sees the standing cluster's (deployments/canary.yaml)."""
CANARY_RAY_ACCOUNT = "tuneproof-canary-ray"
"""The canary clusters' pods' service account: its IRSA role writes the bucket's canary prefix only."""
DASHBOARD_PORT = 8265
Log = Callable[[str], None]


@dataclass(frozen=True)
class CanaryCluster:
    name: str
    namespace: str
    image: str

    @property
    def address(self) -> str:
        """The dashboard at KubeRay's head service (<name>-head-svc), as the flow-run pod reaches it."""
        return f"http://{self.name}-head-svc.{self.namespace}.svc.cluster.local:{DASHBOARD_PORT}"


def canary_name(short_id: str) -> str:
    """tuneproof-canary-<id>, cut to a valid DNS label (63 characters, KubeRay appends -head-svc etc.)."""
    tail = "".join(c if c.isalnum() else "-" for c in short_id.lower()).strip("-")
    return (CANARY_CLUSTER_PREFIX + tail)[:40].rstrip("-")


def canary_manifest(manifest: dict, image: str, name: str, namespace: str) -> dict:
    """The RayCluster manifest renamed, running `image` in every head and worker container, under the canary's
    own token Secret and service account (pure)."""
    out = copy.deepcopy(manifest)
    meta = out.setdefault("metadata", {})
    for server_side in ("resourceVersion", "uid", "creationTimestamp", "generation", "managedFields"):
        meta.pop(server_side, None)
    out.pop("status", None)
    # A candidate's short-lived cluster needs no GCS fault tolerance, must not share the standing cluster's Redis,
    # and the canary's admission policy refuses the field (deployments/canary.yaml).
    (out.get("spec") or {}).pop("gcsFaultToleranceOptions", None)
    meta["name"], meta["namespace"] = name, namespace
    meta["labels"] = {**(meta.get("labels") or {}), CANARY_LABEL: "true"}
    spec = out.get("spec") or {}
    if spec.get("authOptions"):  # a candidate holding production's token could submit jobs to the standing cluster
        spec["authOptions"] = {**spec["authOptions"], "secretName": CANARY_TOKEN_SECRET}
    for group in [spec.get("headGroupSpec") or {}, *worker_groups(out)]:
        template = group.setdefault("template", {})
        pod_spec = template.get("spec") or {}
        for container in pod_spec.get("containers") or []:
            container["image"] = image
        if pod_spec:  # production's account carries the role that writes every run and model in the bucket
            pod_spec["serviceAccountName"] = CANARY_RAY_ACCOUNT
        # networkpolicy.yaml's tuneproof-canary-ray selects the canary's pods by it: their ports open to each other only
        metadata = template.setdefault("metadata", {})
        metadata["labels"] = {**(metadata.get("labels") or {}), CANARY_LABEL: "true"}
    for group in worker_groups(out):
        pod_spec = group.setdefault("template", {}).setdefault("spec", {})
        # The standing cluster fills its GPU group: the canary's workers go to their own (deployments/cluster.yaml).
        pod_spec["nodeSelector"] = {**(pod_spec.get("nodeSelector") or {}), NODE_GROUP_LABEL: CANARY_NODE_GROUP}
    return out


def expected_pods(raycluster: dict) -> int:
    """The head plus every worker pod the spec asks for now: under autoscaling, `replicas` within its bounds, not
    maxReplicas, which a canary cluster would wait for in vain."""
    return 1 + sum(group_desired_pods(g) for g in worker_groups(raycluster))


def readiness(raycluster: dict, pods: list[dict]) -> tuple[bool, str]:
    """(ready, one line saying where it stands) from the RayCluster and its pods (pure)."""
    state = (raycluster.get("status") or {}).get("state") or "pending"
    ready = [p for p in pods if _pod_ready(p)]
    wanted = expected_pods(raycluster)
    line = f"state {state}, {len(ready)}/{wanted} pods Running and Ready"
    return state == "ready" and len(ready) >= wanted, line


def _pod_ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    conditions = {c.get("type"): c.get("status") for c in status.get("conditions") or []}
    return status.get("phase") == "Running" and conditions.get("Ready") == "True"


@contextmanager
def ephemeral_raycluster(
    kcfg: KubernetesConfig,
    manifest: dict,
    image: str,
    short_id: str,
    *,
    timeout_s: float,
    poll_s: float = 5.0,
    log: Log = print,
) -> Iterator[CanaryCluster]:
    """Create the canary RayCluster, wait until it is ready, yield it; delete it on the way out, always."""
    name = canary_name(short_id)
    body = canary_manifest(manifest, image, name, kcfg.namespace)
    api = api_client(kcfg)
    cluster = CanaryCluster(name=name, namespace=kcfg.namespace, image=image)
    try:
        create(api, body)
        log(f"created RayCluster {kcfg.namespace}/{name} with {image}")
        try:
            wait_ready(api, kcfg.namespace, name, timeout_s, poll_s, log)
            yield cluster
        finally:
            delete(api, kcfg.namespace, name, log)
    finally:
        api.close()


def create(api: client.ApiClient, body: dict) -> None:
    meta = body["metadata"]
    try:
        client.CustomObjectsApi(api).create_namespaced_custom_object(
            GROUP, VERSION, meta["namespace"], PLURAL, body, _request_timeout=TIMEOUT_S
        )
    except ApiException as e:
        raise _refused(f"creating RayCluster {meta['namespace']}/{meta['name']}", e) from e
    except urllib3.exceptions.HTTPError as e:
        raise unreachable(api, e) from e


def wait_ready(api: client.ApiClient, namespace: str, name: str, timeout_s: float, poll_s: float, log: Log) -> None:
    """Poll until ready; StageFailure(infrastructure) naming where it stood when the time ran out."""
    deadline = time.monotonic() + timeout_s
    started, last = time.monotonic(), ""
    while True:
        ready, line = readiness(*_observe(api, namespace, name))
        if line != last:
            log(f"RayCluster {namespace}/{name}: {line} ({time.monotonic() - started:.0f}s)")
            last = line
        if ready:
            return
        if time.monotonic() + poll_s > deadline:
            raise StageFailure(
                FailureClass.infrastructure,
                f"RayCluster {namespace}/{name} not ready after {timeout_s:.0f}s: {line}; "
                f"see `kubectl -n {namespace} describe raycluster {name}` and its pods' events",
            )
        time.sleep(poll_s)


def _observe(api: client.ApiClient, namespace: str, name: str) -> tuple[dict, list[dict]]:
    try:
        raycluster = _body(
            client.CustomObjectsApi(api).get_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL, name, _preload_content=False, _request_timeout=TIMEOUT_S
            )
        )
        pods = _body(
            client.CoreV1Api(api).list_namespaced_pod(
                namespace, label_selector=f"{CLUSTER_LABEL}={name}", _preload_content=False, _request_timeout=TIMEOUT_S
            )
        )
    except ApiException as e:
        raise _refused(f"reading RayCluster {namespace}/{name} and its pods", e) from e
    except urllib3.exceptions.HTTPError as e:
        raise unreachable(api, e) from e
    return raycluster, pods.get("items") or []


def _body(response: Any) -> dict:
    """The API's own JSON (read unparsed: the client's models would drop fields it does not know)."""
    return json.loads(response.data)


def delete(api: client.ApiClient, namespace: str, name: str, log: Log) -> bool:
    """Delete the canary cluster (foreground: its pods go with it). Errors are logged, never raised:
    the caller's own outcome is what explains the canary, and a leftover cluster is named for cleanup."""
    try:
        client.CustomObjectsApi(api).delete_namespaced_custom_object(
            GROUP,
            VERSION,
            namespace,
            PLURAL,
            name,
            body=client.V1DeleteOptions(propagation_policy="Foreground"),
            _request_timeout=TIMEOUT_S,
        )
    except ApiException as e:
        if e.status == 404:
            return True  # already gone
        log(
            f"could not delete RayCluster {namespace}/{name}: {_refused('deleting it', e).cause}; "
            f"delete it by hand: kubectl -n {namespace} delete raycluster {name}"
        )
        return False
    except (urllib3.exceptions.HTTPError, OSError) as e:
        log(
            f"could not delete RayCluster {namespace}/{name}: {e}; delete it by hand: "
            f"kubectl -n {namespace} delete raycluster {name}"
        )
        return False
    log(f"deleted RayCluster {namespace}/{name}")
    return True


def _refused(what: str, e: ApiException) -> StageFailure:
    hint = (
        " (the canary runs as tuneproof-canary, deployments/canary.yaml: create/get/list/delete on rayclusters.ray.io"
        " and get/list on pods in the namespace; is the image-canary deployment on the tuneproof-eks-canary pool?)"
        if e.status in (401, 403)
        else ""
    )
    return StageFailure(FailureClass.infrastructure, f"Kubernetes API refused {what}: HTTP {e.status} {e.reason}{hint}")
