"""The Kubernetes half of verify: checks over fetched objects (pure: plain dicts in, findings out).

Input is the dict that tuneproof.control.kube.fetch_cluster_objects (live) or load_objects_from_dir
(saved `kubectl get -o json` output) returns:

    raycluster      the RayCluster object, or None when it does not exist
    rayclusters     saved files only: every RayCluster saved (the checks pick the one the profile names)
    pods            the RayCluster's pods (label ray.io/cluster=<name>)
    nodes           every node
    resourceslices  DRA ResourceSlices, or None when the API is not served / not readable
    ray_nodes       Ray's node list (`ray list nodes --format json`, the dashboard's
                    /nodes?view=summary answer, or the verify stage's node facts), or None
    operator        the KubeRay operator Deployment or Pod, or None when not readable

What must hold: the RayCluster is ready; every head and worker pod runs the pinned image digest
(status.containerStatuses[].imageID); per worker group rayStartParams num-gpus == the pod's
nvidia.com/gpu limit == the GPUs Ray advertises on that pod (Ray node matched by pod IP); every GPU
pod's node has that many allocatable GPUs and, when EFA is expected, an EFA device, either the
device plugin's vpc.amazonaws.com/efa or a dra.net ResourceSlice device with dra.net/rdma true; and,
when EFA is expected, each GPU worker pod's Ray container is given EFA (the device plugin's resource
or a DRA claim), asks for huge pages and does not point NCCL or libfabric away from it: a node with
EFA says nothing about the pods on it. The KubeRay operator version is noted. The manifest helpers
here are shared with `tuneproof lint`.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from tuneproof.core.checks import check_capacity
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding

GPU_RESOURCE = "nvidia.com/gpu"
EFA_RESOURCE = "vpc.amazonaws.com/efa"
EFA_DRA_DRIVERS = ("dra.net",)
"""ResourceSlice drivers that publish EFA devices: DRANET, which carries AWS's EFA DRA driver."""
DRA_RDMA_ATTRIBUTE = "dra.net/rdma"
"""DRANET publishes every network interface, plain ENIs too; only a device with this attribute true is RDMA
(on AWS, EFA)."""
HUGEPAGES_RESOURCES = ("hugepages-2Mi", "hugepages-1Gi")
OFI_NET_NAMES = ("libfabric", "aws libfabric", "ofi")
"""NCCL_NET values naming the aws-ofi-nccl plugin (1.12+ reports Libfabric and accepts the other two)."""
KUBERAY_VERSION_ANNOTATION = "ray.io/kuberay-version"
CLUSTER_LABEL, NODE_TYPE_LABEL, GROUP_LABEL = "ray.io/cluster", "ray.io/node-type", "ray.io/group"
HEAD_GROUP = "headgroup"
"""The ray.io/group label KubeRay puts on the head pod."""
_DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
_QUANTITY = re.compile(r"^([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)$")
_QUANTITY_SUFFIXES = {
    **{"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"), "k": Decimal(10**3)},
    **{"M": Decimal(10**6), "G": Decimal(10**9), "T": Decimal(10**12), "P": Decimal(10**15), "E": Decimal(10**18)},
    **{"Ki": Decimal(2**10), "Mi": Decimal(2**20), "Gi": Decimal(2**30), "Ti": Decimal(2**40), "Pi": Decimal(2**50)},
    "Ei": Decimal(2**60),
}
"""Kubernetes quantity suffixes (k8s.io/apimachinery resource.Quantity): decimal SI and binary."""
MAX_REPLICAS = 2**31 - 1
"""The CRD's default maxReplicas."""


# ---------------------------------------------------------------- manifest helpers (shared with lint)


def image_digest(ref: str | None) -> str | None:
    """'repo:tag@sha256:<hex>' -> 'sha256:<hex>'; also finds the digest inside a pod's imageID."""
    match = _DIGEST.search(ref or "")
    return match.group(0) if match else None


def image_tag(ref: str) -> str | None:
    name = ref.split("@", 1)[0].rsplit("/", 1)[-1]
    return name.partition(":")[2] or None


def ray_container(pod_spec: dict) -> dict:
    """KubeRay requires the Ray container to be the first container of a head or worker pod."""
    containers = pod_spec.get("containers") or [{}]
    return containers[0]


def resource_count(container: dict, resource: str) -> int:
    """An extended resource's count (limits, else requests; extended resources cannot overcommit)."""
    resources = container.get("resources") or {}
    value = (resources.get("limits") or {}).get(resource, (resources.get("requests") or {}).get(resource, 0))
    return as_count(str(value)) or 0


def ray_gpu_setting(group: dict) -> tuple[str, str] | None:
    """The group's explicit Ray GPU count as (field, raw value): spec resources.GPU, else num-gpus."""
    if "GPU" in (group.get("resources") or {}):
        return "resources.GPU", str(group["resources"]["GPU"])
    if "num-gpus" in (group.get("rayStartParams") or {}):
        return "rayStartParams.num-gpus", str(group["rayStartParams"]["num-gpus"])
    return None


def quantity(raw: str) -> Decimal | None:
    """A Kubernetes quantity's value: '500m' -> 0.5, '4k' -> 4000, '1Ki' -> 1024, '2e3' -> 2000. None for anything
    else (text, an unknown suffix, inf, past 64 bits): the schema check or the finding that compares it names the
    raw value."""
    match = _QUANTITY.match(raw.strip())
    if match is None:
        return None
    number, suffix = match.groups()
    if suffix not in _QUANTITY_SUFFIXES:
        return None
    try:
        value = Decimal(number) * _QUANTITY_SUFFIXES[suffix]
    except ArithmeticError:  # decimal's Overflow: '1e999999999999999999' is no quantity
        return None
    # Kubernetes bounds a quantity to 64 bits; bounding it here also keeps int() off a '1e999999' of digits.
    return value if abs(value) < 2**63 else None


def as_count(raw: str) -> int | None:
    """A Kubernetes quantity that is a whole number, as an int: '4', '4.0', '4k' (4000), '1Ki' (1024), '2e3'.
    None for anything else (a fraction such as '500m', and whatever `quantity` refuses)."""
    value = quantity(raw)
    if value is None or value != value.to_integral_value():
        return None
    return int(value)


def worker_groups(raycluster: dict) -> list[dict]:
    return (raycluster.get("spec") or {}).get("workerGroupSpecs") or []


def group_pod_count(raycluster: dict, group: dict) -> int:
    """Pods a worker group may run: maxReplicas when autoscaling may grow it, else what it wants now (lint's
    capacity: the most the cluster can place)."""
    if (raycluster.get("spec") or {}).get("enableInTreeAutoscaling") and not group.get("suspend"):
        return group.get("maxReplicas", MAX_REPLICAS) * group.get("numOfHosts", 1)
    return group_desired_pods(group)


def group_desired_pods(group: dict) -> int:
    """Pods a worker group wants now, as KubeRay counts status.desiredWorkerReplicas (that field is the sum over
    groups): replicas clamped to [minReplicas, maxReplicas] times numOfHosts, 0 when suspended. The autoscaler
    moves `replicas` within the bounds, so a cluster below maxReplicas is not short of pods."""
    if group.get("suspend"):
        return 0
    low, high = group.get("minReplicas", 0), group.get("maxReplicas", MAX_REPLICAS)
    return min(max(group.get("replicas", low), low), high) * group.get("numOfHosts", 1)


def group_spec(raycluster: dict, group_name: str) -> dict | None:
    spec = raycluster.get("spec") or {}
    if group_name == HEAD_GROUP:
        return spec.get("headGroupSpec")
    return next((g for g in worker_groups(raycluster) if g.get("groupName") == group_name), None)


# ---------------------------------------------------------------- the checks


def check_cluster(objects: dict, cfg: PipelineConfig) -> list[Finding]:
    """Every finding about the running RayCluster the profile names, its pods and their nodes."""
    kcfg = cfg.cluster.kubernetes
    objects, repeats = named_cluster(objects, kcfg.namespace, kcfg.raycluster)
    raycluster = objects.get("raycluster")
    if raycluster is None:
        return [
            *repeats,
            Finding(
                f"RayCluster {kcfg.namespace}/{kcfg.raycluster}",
                "metadata.name",
                objects.get("other_clusters") or None,
                kcfg.raycluster,
                "not found: apply deployments/raycluster.yaml or fix cluster.kubernetes",
            ),
        ]
    pods = objects.get("pods") or []
    return [
        *repeats,
        *readiness(raycluster),
        *pod_presence(raycluster, pods),
        *ray_containers_ready(pods),
        *image_digests(raycluster, pods, cfg.cluster.expect.image),
        *gpu_agreement(raycluster, pods, objects.get("ray_nodes"), cfg.cluster.expect.gpus_per_worker),
        *node_devices(pods, objects.get("nodes") or [], objects.get("resourceslices"), cfg.cluster.expect.efa),
        *(pod_efa(pods) if cfg.cluster.expect.efa else []),
        *capacity(objects.get("ray_nodes"), cfg),
        operator_finding(raycluster, pods, objects.get("operator")),
    ]


def capacity(ray_nodes: list | dict | None, cfg: PipelineConfig) -> list[Finding]:
    """Whether the saved Ray nodes can place train.num_workers workers, as the live verify judges it: a warning
    here, since the cluster may scale (tuneproof.core.checks.check_capacity). Without Ray's node list, nothing."""
    if ray_nodes is None:
        return []
    nodes = [{"cpus_advertised": n["cpus"], "gpus_advertised": n["gpus"]} for n in normalize_ray_nodes(ray_nodes)]
    return check_capacity(nodes, cfg.train.num_workers, cfg.train.use_gpu, fixed_size=False)


def named_cluster(objects: dict, namespace: str, name: str) -> tuple[dict, list[Finding]]:
    """(the objects of RayCluster namespace/name alone, a finding per object listed more than once).

    Saved files can hold several RayClusters (`kubectl get raycluster -A -o json`) and their pods; only the
    named one is judged, all of it. A listing never repeats an object, so a repeated pod (which would hide a
    missing one from a count) or node is an error, not a detail."""
    raycluster = objects.get("raycluster")
    clusters = (objects.get("rayclusters") or [raycluster]) if raycluster else []
    mine = [c for c in clusters if _name(c) == name and _namespace(c, namespace) == namespace]
    pods = [
        p
        for p in objects.get("pods") or []
        if _labels(p).get(CLUSTER_LABEL) == name and _namespace(p, namespace) == namespace
    ]
    repeats = [*_repeated("RayCluster", mine), *_repeated("pod", pods), *_repeated("node", objects.get("nodes") or [])]
    others = ", ".join(f"{_namespace(c, '?')}/{_name(c)}" for c in clusters if c not in mine)
    return {**objects, "raycluster": mine[0] if mine else None, "pods": pods, "other_clusters": others}, repeats


def _repeated(kind: str, items: list[dict]) -> list[Finding]:
    counts: dict[tuple[str, str], int] = {}
    for item in items:
        key = (_namespace(item, ""), _name(item))
        counts[key] = counts.get(key, 0) + 1
    return [
        Finding(
            f"{kind} {'/'.join(part for part in key if part)}",
            "entries in the saved objects",
            count,
            1,
            "a listing never repeats an object, and a repeat could stand in for a missing one: save it again",
        )
        for key, count in counts.items()
        if count > 1
    ]


def readiness(raycluster: dict) -> list[Finding]:
    """The RayCluster is ready, and its head pod is, when KubeRay says (state 'ready' stays once reached: it
    does not fall back when the head crash-loops, while the HeadPodReady condition does)."""
    status = raycluster.get("status") or {}
    conditions = {c.get("type"): c for c in status.get("conditions") or []}
    head = conditions.get("HeadPodReady")
    if head is not None and head.get("status") != "True":
        why = f"{head.get('reason') or ''} {head.get('message') or ''}".strip()
        return [Finding(_rc_subject(raycluster), "status.conditions[HeadPodReady]", head.get("status"), "True", why)]
    provisioned = all(conditions.get(t, {}).get("status") == "True" for t in ("RayClusterProvisioned", "HeadPodReady"))
    if status.get("state") == "ready" or provisioned:
        return []
    why = "; ".join(
        f"{t}={c.get('status')} {c.get('reason', '')}".strip()
        for t, c in conditions.items()
        if c.get("status") != "True"
    )
    return [Finding(_rc_subject(raycluster), "status.state", status.get("state"), "ready", why)]


def pod_presence(raycluster: dict, pods: list[dict]) -> list[Finding]:
    """Every pod Running and not being deleted; the head and each group's desired workers among them. A pod being
    deleted (scale-down, eviction, a node drain) keeps phase Running and a ready container until it exits, and a
    worker that joins the job there is lost with it."""
    findings = [
        Finding(f"pod {_name(p)}", "status.phase", p.get("status", {}).get("phase"), "Running")
        for p in pods
        if p.get("status", {}).get("phase") != "Running"
    ]
    findings += [
        Finding(
            f"pod {_name(p)}",
            "metadata.deletionTimestamp",
            p["metadata"]["deletionTimestamp"],
            None,
            "the pod is being deleted (scale-down, eviction or a node drain): wait until it is gone and its group is "
            "whole again",
        )
        for p in pods
        if (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    running = [
        p
        for p in pods
        if p.get("status", {}).get("phase") == "Running" and not (p.get("metadata") or {}).get("deletionTimestamp")
    ]
    if not any(_labels(p).get(NODE_TYPE_LABEL) == "head" for p in running):
        findings.append(Finding(_rc_subject(raycluster), "head pod", "none running", "1 running"))
    for group in worker_groups(raycluster):
        desired = group_desired_pods(group)
        have = sum(1 for p in running if _labels(p).get(GROUP_LABEL) == group.get("groupName"))
        if have < desired:
            findings.append(
                Finding(
                    _rc_subject(raycluster),
                    f"workerGroupSpecs[{group.get('groupName')}] running pods",
                    have,
                    desired,
                    "fewer worker pods than the group asks for",
                )
            )
    return findings


def ray_containers_ready(pods: list[dict]) -> list[Finding]:
    """Each running pod's Ray container is ready: the pod's phase stays Running while the container crash-loops
    (CrashLoopBackOff) or fails its readiness probe, and then no Ray node serves from it."""
    findings = []
    for pod in pods:
        container = ray_container(pod.get("spec") or {})
        status = _container_status(pod, container.get("name"))
        if (pod.get("status") or {}).get("phase") != "Running" or status is None:
            continue  # pod_presence names the phase; image_digests a Ray container that has not started
        field = f"status.containerStatuses[{container.get('name')}]"
        waiting = (status.get("state") or {}).get("waiting")
        if waiting is not None:
            last = ((status.get("lastState") or {}).get("terminated") or {}).get("reason")
            why = f"{waiting.get('message') or 'not running'}; restarts {status.get('restartCount', 0)}"
            findings.append(
                Finding(
                    f"pod {_name(pod)}",
                    f"{field}.state",
                    f"waiting: {waiting.get('reason')}",
                    "running",
                    why + (f", last exit {last}" if last else ""),
                )
            )
        elif status.get("ready") is not True:
            findings.append(
                Finding(
                    f"pod {_name(pod)}",
                    f"{field}.ready",
                    status.get("ready"),
                    True,
                    "the Ray container is not ready: its readiness probe (Ray's health check) fails",
                )
            )
    return findings


def image_digests(raycluster: dict, pods: list[dict], expected_image: str | None) -> list[Finding]:
    """Each pod's Ray container runs the pinned digest: the config's, else the one its own spec pins."""
    findings = []
    for pod in pods:
        container = ray_container(pod.get("spec") or {})
        expected = image_digest(expected_image) or image_digest(container.get("image"))
        status = _container_status(pod, container.get("name"))
        field = f"status.containerStatuses[{container.get('name')}].imageID"
        if expected is None:
            findings.append(
                Finding(
                    f"pod {_name(pod)}",
                    f"spec.containers[{container.get('name')}].image",
                    container.get("image"),
                    "an image pinned by digest (repo@sha256:...)",
                )
            )
        elif status is None or not status.get("imageID"):
            findings.append(Finding(f"pod {_name(pod)}", field, None, expected, "the Ray container has not started"))
        elif image_digest(status["imageID"]) != expected:
            # 'sha256:<hex>' alone is the local image's own ID (its config digest), which the runtime reports
            # for an image it holds without a repository digest (preloaded, imported): no registry digest to compare.
            why = (
                "the pod runs a different image than the pinned digest"
                if "@" in status["imageID"]
                else "the runtime reports a bare image ID, not a repository digest (repo@sha256:...): the pinned "
                "digest cannot be confirmed; pull the image by its digest instead of preloading it"
            )
            findings.append(Finding(f"pod {_name(pod)}", field, status["imageID"], expected, why))
    return findings


def gpu_agreement(
    raycluster: dict, pods: list[dict], ray_nodes: list | dict | None, gpus_per_worker: int
) -> list[Finding]:
    """rayStartParams num-gpus == pod nvidia.com/gpu limit == GPUs the Ray node on the pod advertises."""
    by_ip = {n["ip"]: n for n in normalize_ray_nodes(ray_nodes)} if ray_nodes is not None else None
    findings = []
    for pod in pods:
        group_name = _labels(pod).get(GROUP_LABEL, HEAD_GROUP)
        limit = resource_count(ray_container(pod.get("spec") or {}), GPU_RESOURCE)
        findings += _spec_vs_limit(pod, group_spec(raycluster, group_name), group_name, limit)
        if gpus_per_worker and _labels(pod).get(NODE_TYPE_LABEL) == "worker" and limit and limit != gpus_per_worker:
            findings.append(
                Finding(
                    f"pod {_name(pod)}",
                    f"{GPU_RESOURCE} limit",
                    limit,
                    gpus_per_worker,
                    "cluster.expect.gpus_per_worker",
                )
            )
        if by_ip is not None:
            findings += _ray_node_vs_limit(pod, by_ip, limit)
    if gpus_per_worker and not any(
        _labels(p).get(NODE_TYPE_LABEL) == "worker" and resource_count(ray_container(p.get("spec") or {}), GPU_RESOURCE)
        for p in pods
    ):
        findings.append(Finding(_rc_subject(raycluster), "worker pods with GPUs", 0, f">= 1 with {gpus_per_worker}"))
    return findings


def _spec_vs_limit(pod: dict, group: dict | None, group_name: str, limit: int) -> list[Finding]:
    setting = ray_gpu_setting(group or {})
    if setting is None or as_count(setting[1]) == limit:
        return []
    field, raw = setting
    return [
        Finding(
            f"pod {_name(pod)} (group {group_name})",
            f"{GPU_RESOURCE} limit",
            limit,
            raw,
            f"the RayCluster's {field} for this group",
        )
    ]


def _ray_node_vs_limit(pod: dict, by_ip: dict, limit: int) -> list[Finding]:
    ip = (pod.get("status") or {}).get("podIP")
    node = by_ip.get(ip)
    if node is None:
        return [Finding(f"pod {_name(pod)}", "Ray node on the pod IP", None, ip, "no alive Ray node runs on this pod")]
    if node["gpus"] != limit:
        return [
            Finding(
                f"Ray node {ip} (pod {_name(pod)})",
                "resources_total.GPU",
                node["gpus"],
                limit,
                f"the pod's {GPU_RESOURCE} limit: Ray advertises GPUs the pod does not own",
            )
        ]
    return []


def node_devices(
    pods: list[dict], nodes: list[dict], resourceslices: list[dict] | None, expect_efa: bool
) -> list[Finding]:
    """Each GPU pod's node offers the GPUs it uses and, when expected, EFA (device plugin or DRA)."""
    by_name = {_name(n): n for n in nodes}
    findings, seen = [], set()
    for pod in pods:
        limit = resource_count(ray_container(pod.get("spec") or {}), GPU_RESOURCE)
        node_name = (pod.get("spec") or {}).get("nodeName")
        if not limit or node_name in seen:
            continue
        seen.add(node_name)
        node = by_name.get(node_name) if node_name else None
        if node is None:
            findings.append(Finding(f"pod {_name(pod)}", "spec.nodeName", node_name, "a node in the node list"))
            continue
        findings += _node_gpus(node, limit)
        if expect_efa:
            findings += _node_efa(node, resourceslices)
    return findings


def _node_gpus(node: dict, needed: int) -> list[Finding]:
    have = _allocatable(node, GPU_RESOURCE)
    if have >= needed:
        return []
    return [
        Finding(
            f"node {_name(node)}",
            f"status.allocatable[{GPU_RESOURCE}]",
            have,
            f">= {needed}",
            "the NVIDIA device plugin does not offer the GPUs the pod uses",
        )
    ]


def _node_efa(node: dict, resourceslices: list[dict] | None) -> list[Finding]:
    if _allocatable(node, EFA_RESOURCE) > 0 or efa_dra_slices(resourceslices or [], _name(node)):
        return []
    unread = " (ResourceSlices could not be read, so a DRA-published EFA is unknown)" if resourceslices is None else ""
    return [
        Finding(
            f"node {_name(node)}",
            f"status.allocatable[{EFA_RESOURCE}] or an EFA ResourceSlice",
            0,
            ">= 1",
            f"cluster.expect.efa: no EFA device on this GPU node (a dra.net device counts only with "
            f"{DRA_RDMA_ATTRIBUTE} true)" + unread,
        )
    ]


def efa_dra_slices(resourceslices: list[dict], node_name: str) -> list[dict]:
    """ResourceSlices the EFA DRA driver published for the node with at least one RDMA device."""
    return [
        s
        for s in resourceslices
        if (s.get("spec") or {}).get("nodeName") == node_name
        and (s.get("spec") or {}).get("driver") in EFA_DRA_DRIVERS
        and any(_is_rdma(device) for device in (s.get("spec") or {}).get("devices") or [])
    ]


def _is_rdma(device: dict) -> bool:
    return ((device.get("attributes") or {}).get(DRA_RDMA_ATTRIBUTE) or {}).get("bool") is True


def pod_efa(pods: list[dict]) -> list[Finding]:
    """Each GPU worker pod uses the node's EFA (cluster.expect.efa): its Ray container is given an EFA device
    and huge pages, and its env does not send NCCL or libfabric elsewhere. Missing EFA or a wrong setting is an
    error; an unset setting a warning, since the image or an envFrom Secret may set it (connectivity decides)."""
    findings = []
    for pod in pods:
        container = ray_container(pod.get("spec") or {})
        if _labels(pod).get(NODE_TYPE_LABEL) != "worker" or not resource_count(container, GPU_RESOURCE):
            continue
        subject, where = f"pod {_name(pod)}", f"spec.containers[{container.get('name')}]"
        if not resource_count(container, EFA_RESOURCE) and not _claims(pod, container):
            findings.append(
                Finding(
                    subject,
                    f"{where}.resources[{EFA_RESOURCE}] or .resources.claims",
                    0,
                    ">= 1 (or a DRA resource claim the pod declares)",
                    "cluster.expect.efa: the pod was given no EFA device, so NCCL can only use sockets "
                    "(deployments/raycluster.yaml asks vpc.amazonaws.com/efa)",
                )
            )
        if not any(resource_count(container, r) for r in HUGEPAGES_RESOURCES):
            findings.append(
                Finding(
                    subject,
                    f"{where}.resources[hugepages-2Mi]",
                    0,
                    "> 0",
                    "cluster.expect.efa: libfabric's EFA provider wants huge pages for its buffers (EKS's EFA guide)",
                    "warning",
                )
            )
        findings += _efa_env(subject, where, container)
    return findings


def _claims(pod: dict, container: dict) -> list[str]:
    """The DRA claims the container uses that its pod declares (a claim's device class is not read here)."""
    declared = {c.get("name") for c in (pod.get("spec") or {}).get("resourceClaims") or []}
    used = [c.get("name") for c in (container.get("resources") or {}).get("claims") or []]
    return [name for name in used if name in declared]


def _efa_env(subject: str, where: str, container: dict) -> list[Finding]:
    env = {e.get("name"): e.get("value") for e in container.get("env") or [] if "value" in e}
    wanted = [
        ("NCCL_NET", "Libfabric", OFI_NET_NAMES, "NCCL uses another network, or falls back to sockets unseen"),
        ("FI_PROVIDER", "efa", ("efa",), "libfabric picks another provider (tcp, shm) and leaves EFA unused"),
    ]
    findings = []
    for name, expected, accepted, why in wanted:
        value = env.get(name)
        if value is not None and value.strip().lower() in accepted:
            continue
        unset = value is None
        findings.append(
            Finding(
                subject,
                f"{where}.env[{name}]",
                value,
                expected,
                f"cluster.expect.efa: {'unset in the pod spec (the image or an envFrom Secret may set it)' if unset else why}",
                "warning" if unset else "error",
            )
        )
    return findings


def operator_finding(raycluster: dict, pods: list[dict], operator: dict | None) -> Finding:
    version, source = operator_version(raycluster, pods, operator)
    return Finding("KubeRay operator", "version", version, "any (recorded)", f"from {source}", "info")


def operator_version(raycluster: dict, pods: list[dict], operator: dict | None) -> tuple[str, str]:
    """The KubeRay version: its annotation on the RayCluster or a pod, else the operator's image tag."""
    for obj in [raycluster, *pods]:
        version = ((obj.get("metadata") or {}).get("annotations") or {}).get(KUBERAY_VERSION_ANNOTATION)
        if version:
            return version, f"{obj.get('kind', 'Pod')} {_name(obj)} annotation {KUBERAY_VERSION_ANNOTATION}"
    if operator:
        spec = operator.get("spec") or {}
        image = ray_container((spec.get("template") or {}).get("spec") or spec).get("image", "")
        tag = image_tag(image)
        if tag:
            return tag, f"operator image {image}"
    return "unknown", "no annotation and no readable operator Deployment"


# ---------------------------------------------------------------- Ray's node list


def normalize_ray_nodes(data: list | dict) -> list[dict]:
    """Alive Ray nodes as {ip, gpus, cpus, node_id, is_head} from any of Ray's node listings (cpus None where
    the listing does not say).

    `ray list nodes --format json`: a list of {node_ip, resources_total, state, is_head_node, ...}.
    The dashboard's GET /nodes?view=summary: {"data": {"summary": [{"raylet": {nodeManagerAddress,
    resourcesTotal, state, nodeId, isHeadNode}}]}}. The verify stage's node facts (tuneproof.core.checks):
    a list of {node_ip, gpus_advertised, alive, is_head, node_id}.
    """
    rows = data.get("data", {}).get("summary", []) if isinstance(data, dict) else data
    return [node for node in map(_ray_node, rows) if node is not None]


def _ray_node(row: dict) -> dict | None:
    raylet = row.get("raylet", row)
    alive = (raylet.get("state") or row.get("state")) == "ALIVE" or row.get("alive") is True
    if not alive:
        return None
    resources = raylet.get("resourcesTotal") or row.get("resources_total")
    if resources is None:  # the verify stage's node facts
        resources = {"GPU": row.get("gpus_advertised") or 0, "CPU": row.get("cpus_advertised")}
    cpus = resources.get("CPU")
    return {
        "ip": raylet.get("nodeManagerAddress") or row.get("node_ip"),
        "gpus": int(_resource_count(resources.get("GPU", 0), "GPU")),
        "cpus": _resource_count(cpus, "CPU") if cpus is not None else None,
        "node_id": raylet.get("nodeId") or row.get("node_id"),
        "is_head": bool(raylet.get("isHeadNode", row.get("is_head_node", row.get("is_head", False)))),
    }


def _resource_count(raw: Any, resource: str) -> float:
    """A Ray node's advertised count of `resource`. Anything else (text, a negative or non-finite number: JSON's
    1e400 reads as inf) raises ValueError, which verify --from-files reports as an unexpected shape."""
    count = float(raw)
    if not math.isfinite(count) or count < 0:
        raise ValueError(f"resources_total.{resource} is {raw!r}, not a count")
    return count


# ---------------------------------------------------------------- summary for the run record


def summarize(objects: dict, cfg: PipelineConfig | None = None) -> dict[str, Any]:
    """What the run record keeps: image digest per pod, operator version, worker groups, GPU nodes."""
    if cfg is not None:
        objects, _ = named_cluster(objects, cfg.cluster.kubernetes.namespace, cfg.cluster.kubernetes.raycluster)
    raycluster = objects.get("raycluster") or {}
    pods = objects.get("pods") or []
    version, source = operator_version(raycluster, pods, objects.get("operator"))
    return {
        "raycluster": _cluster_summary(raycluster),
        "operator_version": version,
        "operator_version_source": source,
        "expected_image": cfg.cluster.expect.image if cfg else None,
        "image_digests": {
            _name(p): image_digest(
                (_container_status(p, ray_container(p.get("spec") or {}).get("name")) or {}).get("imageID")
            )
            for p in pods
        },
        "pods": [_pod_summary(p) for p in pods],
        "nodes": [
            _node_summary(n, objects.get("resourceslices"))
            for n in objects.get("nodes") or []
            if _allocatable(n, GPU_RESOURCE)
        ],
        "ray_nodes": normalize_ray_nodes(objects["ray_nodes"]) if objects.get("ray_nodes") is not None else None,
    }


def _cluster_summary(raycluster: dict) -> dict:
    spec = raycluster.get("spec") or {}
    return {
        "name": _name(raycluster),
        "namespace": (raycluster.get("metadata") or {}).get("namespace"),
        "state": (raycluster.get("status") or {}).get("state"),
        "ray_version": spec.get("rayVersion"),
        "worker_groups": [
            {
                "name": g.get("groupName"),
                "pods": group_pod_count(raycluster, g),
                "ray_gpus": (ray_gpu_setting(g) or (None, None))[1],
                "gpu_limit": resource_count(ray_container((g.get("template") or {}).get("spec") or {}), GPU_RESOURCE),
                "efa_limit": resource_count(ray_container((g.get("template") or {}).get("spec") or {}), EFA_RESOURCE),
                "image": ray_container((g.get("template") or {}).get("spec") or {}).get("image"),
            }
            for g in worker_groups(raycluster)
        ],
    }


def _pod_summary(pod: dict) -> dict:
    container = ray_container(pod.get("spec") or {})
    return {
        "name": _name(pod),
        "node_type": _labels(pod).get(NODE_TYPE_LABEL),
        "group": _labels(pod).get(GROUP_LABEL),
        "node": (pod.get("spec") or {}).get("nodeName"),
        "ip": (pod.get("status") or {}).get("podIP"),
        "phase": (pod.get("status") or {}).get("phase"),
        "image": container.get("image"),
        "image_id": (_container_status(pod, container.get("name")) or {}).get("imageID"),
        "gpu_limit": resource_count(container, GPU_RESOURCE),
    }


def _node_summary(node: dict, resourceslices: list[dict] | None) -> dict:
    labels = _labels(node)
    return {
        "name": _name(node),
        "instance_type": labels.get("node.kubernetes.io/instance-type"),
        "gpu_allocatable": _allocatable(node, GPU_RESOURCE),
        "efa_allocatable": _allocatable(node, EFA_RESOURCE),
        "efa_dra_slices": len(efa_dra_slices(resourceslices or [], _name(node))),
    }


# ---------------------------------------------------------------- small accessors


def _name(obj: dict) -> str:
    return (obj.get("metadata") or {}).get("name", "?")


def _namespace(obj: dict, default: str) -> str:
    return (obj.get("metadata") or {}).get("namespace") or default


def _labels(obj: dict) -> dict:
    return (obj.get("metadata") or {}).get("labels") or {}


def _rc_subject(raycluster: dict) -> str:
    return f"RayCluster {(raycluster.get('metadata') or {}).get('namespace')}/{_name(raycluster)}"


def _container_status(pod: dict, container_name: str | None) -> dict | None:
    statuses = (pod.get("status") or {}).get("containerStatuses") or []
    return next((s for s in statuses if s.get("name") == container_name), None)


def _allocatable(node: dict, resource: str) -> int:
    return as_count(str(((node.get("status") or {}).get("allocatable") or {}).get(resource, 0))) or 0
