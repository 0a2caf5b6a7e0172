"""Ray pods on their nodes: /dev/shm, requests against the instance type's allocatable, EFA and NCCL settings.

- /dev/shm is a memory-backed emptyDir of 30-50% of the container's memory limit; on the instance type
  a group selects (schemas/eks-instance-types.yaml) the requests fit its estimated allocatable and
  FI_EFA_USE_DEVICE_RDMA=1 needs GPUDirect RDMA; a group with an EFA device sets FI_PROVIDER=efa;
  NCCL_SOCKET_IFNAME never names the loopback interface.
"""

from __future__ import annotations

from functools import lru_cache

import yaml

from tuneproof.app.lint.documents import SCHEMA_DIR, Doc, env_values, group_pod_spec, volume_kind, volume_named
from tuneproof.control.kube_checks import EFA_RESOURCE, GPU_RESOURCE, quantity, ray_container, resource_count
from tuneproof.core.findings import Finding

INSTANCE_TABLE = SCHEMA_DIR / "eks-instance-types.yaml"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
DAEMONSET_ALLOWANCE = (0.5, 1.0)
"""(cores, GiB) kept on every node for the EKS add-on DaemonSets (aws-node, kube-proxy, CSI node plugins,
the NVIDIA and EFA device plugins) when checking that a Ray pod fits its node."""
EFA_HUGEPAGES_GIB = 5128 * 2 / 1024
"""Huge pages the EFA installer of EKS's accelerated AMIs reserves on an EFA instance (5128 x 2 MiB, for libfabric's
buffers; EKS's EFA guide has pods request hugepages-2Mi: 5120Mi): the kubelet takes them out of allocatable memory."""
SHM_FRACTION = (0.3, 0.5)
"""/dev/shm sizeLimit as a share of the Ray container's memory limit: at least Ray's default object store
(30% of memory), at most half, since tmpfs pages count against the same limit."""


def shm_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """/dev/shm is a memory-backed emptyDir of 30-50% of the Ray container's memory limit."""
    pod_spec = group_pod_spec(group)
    container = ray_container(pod_spec)
    mount = next((m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    if mount is None:
        return [
            Finding(
                doc.subject,
                f"{where}.template.spec.containers[{container.get('name')}].volumeMounts",
                None,
                "an emptyDir with medium Memory mounted at /dev/shm",
                "the runtime's 64 MiB /dev/shm pushes "
                "Ray's object store to disk and starves NCCL's shared-memory transport",
            )
        ]
    volume = volume_named(pod_spec, mount.get("name"))
    field = f"{where}.template.spec.volumes[{mount.get('name')}]"
    empty_dir = volume.get("emptyDir")
    if empty_dir is None or empty_dir.get("medium") != "Memory":
        return [
            Finding(
                doc.subject,
                field,
                volume_kind(volume) if empty_dir is None else empty_dir,
                "emptyDir medium: Memory",
                "/dev/shm must be memory-backed: on disk, Ray's object store and NCCL's SHM transport crawl",
            )
        ]
    return _shm_size_findings(doc.subject, f"{field}.emptyDir.sizeLimit", empty_dir.get("sizeLimit"), container)


def _shm_size_findings(subject: str, field: str, size_limit, container: dict) -> list[Finding]:
    limit = memory_gib(((container.get("resources") or {}).get("limits") or {}).get("memory"))
    size, (low, high) = memory_gib(size_limit), SHM_FRACTION
    if limit is None:
        return []  # no memory limit: nothing to size against (Guaranteed QoS is the manifests' own choice)
    wanted = f"{low * limit:.1f}Gi to {high * limit:.1f}Gi (30-50% of the {limit:g}Gi memory limit)"
    if size is None:
        return [Finding(subject, field, size_limit, wanted, "an unbounded tmpfs can fill the whole memory limit")]
    if low * limit <= size <= high * limit:
        return []
    why = (
        "below Ray's default object store (30% of memory): Ray spills it to disk"
        if size < low * limit
        else "tmpfs pages count against the memory limit: more leaves Ray's processes too little"
    )
    return [Finding(subject, field, size_limit, wanted, why)]


def node_fit_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """The group's pod fits the allocatable of the instance type its nodeSelector names."""
    pod_spec = group_pod_spec(group)
    instance_type = (pod_spec.get("nodeSelector") or {}).get(INSTANCE_TYPE_LABEL)
    if instance_type is None:
        return []
    instance = eks_instance_types().get(instance_type)
    field = f"{where}.template.spec.nodeSelector[{INSTANCE_TYPE_LABEL}]"
    if instance is None:
        return [
            Finding(
                doc.subject,
                field,
                instance_type,
                f"a type in {INSTANCE_TABLE.name}",
                "unknown instance type: requests not checked against its allocatable",
                "warning",
            )
        ]
    requests = pod_requests(pod_spec)
    where_requests = f"{where}.template.spec.containers[*].resources.requests"
    return [
        *_fit(
            doc.subject,
            where_requests,
            instance_type,
            "cpu",
            requests["cpu"],
            allocatable(instance)[0],
            DAEMONSET_ALLOWANCE[0],
            "cores",
        ),
        *_fit(
            doc.subject,
            where_requests,
            instance_type,
            "memory",
            requests["memory"],
            allocatable(instance)[1],
            DAEMONSET_ALLOWANCE[1] + efa_hugepages_gib(instance),
            "GiB",
        ),
        *_fit(
            doc.subject, where_requests, instance_type, GPU_RESOURCE, requests[GPU_RESOURCE], instance["gpus"], 0, ""
        ),
        *_fit(doc.subject, where_requests, instance_type, EFA_RESOURCE, requests[EFA_RESOURCE], instance["efa"], 0, ""),
    ]


def _fit(
    subject: str, field: str, instance_type: str, resource: str, need: float, have: float, kept: float, unit: str
) -> list[Finding]:
    if need <= have - kept:
        return []
    kept_note = f", {kept:g} {unit} of it kept for the node's DaemonSets" if kept else ""
    if resource == "memory" and kept > DAEMONSET_ALLOWANCE[1]:
        kept_note += " and EFA's huge pages"
    return [
        Finding(
            subject,
            f"{field}[{resource}]",
            round(need, 2),
            f"<= {have - kept:.2f}",
            f"{instance_type} offers about {have:.2f} {unit or resource} to pods{kept_note}: "
            "the pod would stay Pending",
        )
    ]


def efa_hugepages_gib(instance: dict) -> float:
    """GiB of memory an instance type's EFA setup holds as huge pages, out of the pods' reach."""
    return EFA_HUGEPAGES_GIB if instance["efa"] else 0.0


def pod_requests(pod_spec: dict) -> dict[str, float]:
    """Summed container requests (limits where a request is unset, as the API server defaults them)."""
    total = {"cpu": 0.0, "memory": 0.0, GPU_RESOURCE: 0.0, EFA_RESOURCE: 0.0}
    for container in pod_spec.get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        total["cpu"] += cpu_cores(wanted.get("cpu")) or 0.0
        total["memory"] += memory_gib(wanted.get("memory")) or 0.0
        for extended in (GPU_RESOURCE, EFA_RESOURCE):
            total[extended] += resource_count(container, extended)
    return total


def allocatable(instance: dict) -> tuple[float, float]:
    """(cores, GiB) an EKS AMI node of this type offers pods: the kubelet's reservations (see the table's header)."""
    cores = instance["vcpu"]
    reserved_milli = 60 + 10 * min(max(cores - 1, 0), 1) + 5 * min(max(cores - 2, 0), 2) + 2.5 * max(cores - 4, 0)
    memory_mib = instance["memory_gib"] * 1024 * 0.96 - (255 + 11 * instance["max_pods"]) - 100
    return cores - reserved_milli / 1000, memory_mib / 1024


@lru_cache(maxsize=1)
def eks_instance_types() -> dict[str, dict]:
    return yaml.safe_load(INSTANCE_TABLE.read_text())


def cpu_cores(raw: str | float | None) -> float | None:
    """'44' -> 44.0, '500m' -> 0.5; None when unset or not a Kubernetes quantity."""
    value = quantity(str(raw)) if raw is not None else None
    return None if value is None else float(value)


def memory_gib(raw: str | float | None) -> float | None:
    """'170Gi' -> 170.0, '512Mi' -> 0.5; None when unset or not a Kubernetes quantity."""
    value = quantity(str(raw)) if raw is not None else None
    return None if value is None else float(value) / 2**30


def efa_env_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """EFA and NCCL settings that break a multi-node run whatever the config expects."""
    pod_spec = group_pod_spec(group)
    container = ray_container(pod_spec)
    env = env_values(container)
    field = f"{where}.template.spec.containers[{container.get('name')}].env"
    findings = _device_rdma_findings(
        doc.subject, field, env, (pod_spec.get("nodeSelector") or {}).get(INSTANCE_TYPE_LABEL)
    )
    has_efa = resource_count(container, EFA_RESOURCE) > 0 or bool(pod_spec.get("resourceClaims"))
    if has_efa and (env.get("FI_PROVIDER") or "").strip() != "efa":
        findings.append(
            Finding(
                doc.subject,
                f"{field}[FI_PROVIDER]",
                env.get("FI_PROVIDER"),
                "efa",
                "the pod owns an EFA device: any other libfabric provider (tcp, shm) leaves it unused",
            )
        )
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and names_loopback(ifname):
        findings.append(
            Finding(
                doc.subject,
                f"{field}[NCCL_SOCKET_IFNAME]",
                ifname,
                "eth0 (the pod's VPC CNI interface)",
                "NCCL would bootstrap over loopback: ranks on other nodes can never connect",
            )
        )
    return findings


def _device_rdma_findings(subject: str, field: str, env: dict, instance_type: str | None) -> list[Finding]:
    if (env.get("FI_EFA_USE_DEVICE_RDMA") or "").strip() != "1":
        return []
    instance = eks_instance_types().get(instance_type or "")
    if instance is None:
        return [
            Finding(
                subject,
                f"{field}[FI_EFA_USE_DEVICE_RDMA]",
                "1",
                "1 only on GPUDirect RDMA instance types",
                f"cannot tell whether {instance_type or 'an unselected node type'} has GPUDirect RDMA",
                "warning",
            )
        ]
    if instance["gpudirect_rdma"]:
        return []
    return [
        Finding(
            subject,
            f"{field}[FI_EFA_USE_DEVICE_RDMA]",
            "1",
            "unset (or 0)",
            f"{instance_type} has EFA but no GPUDirect RDMA (p4d/p5 class do): libfabric cannot register GPU "
            "memory with the NIC and NCCL's EFA transport fails",
        )
    ]


def names_loopback(ifname: str) -> bool:
    """NCCL_SOCKET_IFNAME selects a loopback interface: 'lo', '=lo', 'lo,eth0' (not an exclusion '^lo,docker')."""
    value = ifname.strip()
    return not value.startswith("^") and any(item.strip().lstrip("=").startswith("lo") for item in value.split(","))
