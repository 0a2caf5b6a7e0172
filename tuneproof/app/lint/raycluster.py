"""The RayCluster's checks, gathered per group, and those that need the pipeline's config.

- per group: an explicit Ray GPU count (rayStartParams num-gpus or resources.GPU) == the Ray
  container's nvidia.com/gpu limit; with a config, GPU worker groups offer cluster.expect.gpus_per_worker
  and an EFA device when cluster.expect.efa; connectivity.expect_transport efa needs NCCL_NET pinned
  to the OFI plugin so a socket fallback fails loudly;
- capacity: train.num_workers (use_gpu) <= sum over worker groups of pods x GPUs per pod;
- every runtime_env.forward_env name reaches every Ray container from a Secret.
"""

from __future__ import annotations

from tuneproof.app.lint.documents import Doc, group_pod_spec, ray_groups
from tuneproof.app.lint.images import ray_image_findings, ray_version_findings
from tuneproof.app.lint.nodes import efa_env_findings, node_fit_findings, shm_findings
from tuneproof.app.lint.security import pod_security_findings, ray_network_findings, ray_token_findings
from tuneproof.app.lint.storage import claim_findings, ray_identity_findings, storage_findings
from tuneproof.control.kube_checks import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    OFI_NET_NAMES,
    as_count,
    group_pod_count,
    ray_container,
    ray_gpu_setting,
    resource_count,
    worker_groups,
)
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding


def raycluster_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    groups = ray_groups(doc.obj)
    findings = []
    for where, group in groups:
        findings += ray_image_findings(doc, where, group, config)
        findings += gpu_setting_findings(doc, where, group)
        findings += shm_findings(doc, where, group)
        findings += node_fit_findings(doc, where, group)
        findings += efa_env_findings(doc, where, group)
        findings += claim_findings(doc, docs, f"{where}.template.spec", group_pod_spec(group))
        findings += pod_security_findings(doc.subject, f"{where}.template.spec", group_pod_spec(group))
        findings += ray_token_findings(doc, where, group)
    findings += ray_version_findings(doc, groups, config)
    findings += ray_network_findings(doc, docs, groups)
    if config is not None:
        findings += worker_expectation_findings(doc, config)
        findings += capacity_findings(doc, config)
        findings += storage_findings(doc, docs, config)
        findings += ray_identity_findings(doc, docs, groups, config)
        findings += forwarded_env_findings(doc, docs, groups, config)
    return findings


def forwarded_env_findings(
    doc: Doc, docs: list[Doc], groups: list[tuple[str, dict]], config: PipelineConfig
) -> list[Finding]:
    """Every runtime_env.forward_env name reaches every Ray container from a Secret: a secretKeyRef, or an
    envFrom secretRef (whose keys are checked when the Secret is among the manifests)."""
    findings = []
    for where, group in groups:
        containers = (group_pod_spec(group).get("containers") or [])[:1]  # the Ray container runs the jobs
        for container in containers:
            provided, unknown = secret_env_names(container, docs)
            missing = [n for n in config.runtime_env.forward_env if n not in provided]
            if missing and not unknown:
                findings.append(
                    Finding(
                        doc.subject,
                        f"{where}.template.spec.containers[{container.get('name')}]",
                        sorted(provided),
                        f"{', '.join(missing)} from a Secret",
                        "runtime_env.forward_env names variables the Ray containers do not get from a Secret: add "
                        "them to the Secret of an envFrom secretRef (deployments/README.md, 'Secrets for jobs')",
                    )
                )
    return findings


def secret_env_names(container: dict, docs: list[Doc]) -> tuple[set[str], bool]:
    """(variable names a container gets from Secrets it references, whether an envFrom Secret is not among
    the manifests, so that its keys cannot be known here)."""
    names = {e.get("name") for e in container.get("env") or [] if (e.get("valueFrom") or {}).get("secretKeyRef")}
    unknown = False
    for source in container.get("envFrom") or []:
        ref = source.get("secretRef") or {}
        secret = next((d for d in docs if d.kind == "Secret" and d.name == ref.get("name")), None)
        if secret is None:
            unknown = True
            continue
        keys = {**(secret.obj.get("data") or {}), **(secret.obj.get("stringData") or {})}
        names |= {f"{source.get('prefix') or ''}{key}" for key in keys}
    return {n for n in names if n}, unknown


def gpu_setting_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """An explicit Ray GPU count must equal the Ray container's nvidia.com/gpu limit."""
    setting = ray_gpu_setting(group)
    if setting is None:
        return []  # KubeRay then derives num-gpus from the limit itself
    field, raw = setting
    container = ray_container(group_pod_spec(group))
    limit = resource_count(container, GPU_RESOURCE)
    if as_count(raw) == limit:
        return []
    return [
        Finding(
            doc.subject,
            f"{where}.{field}",
            raw,
            str(limit),
            f"the Ray container {container.get('name')}'s {GPU_RESOURCE} limit is {limit}: "
            "Ray must advertise exactly the GPUs the pod owns",
        )
    ]


def worker_expectation_findings(doc: Doc, config: PipelineConfig) -> list[Finding]:
    """GPU worker groups offer the expected GPUs per pod, EFA, and NCCL pinned to the OFI plugin."""
    expect = config.cluster.expect
    findings = []
    for group in worker_groups(doc.obj):
        where = f"spec.workerGroupSpecs[{group.get('groupName')}]"
        container = ray_container(group_pod_spec(group))
        gpus = resource_count(container, GPU_RESOURCE)
        if not gpus:
            continue
        limits_field = f"{where}.template.spec.containers[{container.get('name')}].resources.limits"
        if expect.gpus_per_worker and gpus != expect.gpus_per_worker:
            findings.append(
                Finding(
                    doc.subject,
                    f"{limits_field}[{GPU_RESOURCE}]",
                    gpus,
                    expect.gpus_per_worker,
                    "config cluster.expect.gpus_per_worker",
                )
            )
        if (
            expect.efa
            and not resource_count(container, EFA_RESOURCE)
            and not group_pod_spec(group).get("resourceClaims")
        ):
            findings.append(
                Finding(
                    doc.subject,
                    f"{limits_field}[{EFA_RESOURCE}]",
                    0,
                    ">= 1 (or a DRA resourceClaim)",
                    "config cluster.expect.efa: without an EFA device NCCL can only use sockets",
                )
            )
        if config.connectivity.expect_transport == "efa":
            findings += _nccl_net_findings(doc, where, container)
    return findings


def _nccl_net_findings(doc: Doc, where: str, container: dict) -> list[Finding]:
    env = {e.get("name"): e.get("value") for e in container.get("env") or []}
    if (env.get("NCCL_NET") or "").strip().lower() in OFI_NET_NAMES:
        return []
    return [
        Finding(
            doc.subject,
            f"{where}.template.spec.containers[{container.get('name')}].env[NCCL_NET]",
            env.get("NCCL_NET"),
            "Libfabric",
            "connectivity.expect_transport efa: unpinned, NCCL silently falls back to sockets when the "
            "OFI plugin fails to load",
        )
    ]


def cluster_gpu_capacity(raycluster: dict) -> int:
    """GPUs the worker groups offer Ray: pods x GPUs per pod (the explicit Ray count, else the limit)."""
    total = 0
    for group in worker_groups(raycluster):
        setting = ray_gpu_setting(group)
        per_pod = (
            as_count(setting[1]) if setting else resource_count(ray_container(group_pod_spec(group)), GPU_RESOURCE)
        )
        total += group_pod_count(raycluster, group) * (per_pod or 0)
    return total


def capacity_findings(doc: Doc, config: PipelineConfig) -> list[Finding]:
    train = config.train
    if not train.use_gpu:
        return []
    capacity = cluster_gpu_capacity(doc.obj)
    if train.num_workers <= capacity:
        return []
    return [
        Finding(
            doc.subject,
            "GPUs over workerGroupSpecs (pods x GPUs per pod)",
            capacity,
            f">= {train.num_workers}",
            f"config train.num_workers={train.num_workers} with use_gpu: "
            "the ScalingConfig asks for more GPU workers than the cluster can place",
        )
    ]
