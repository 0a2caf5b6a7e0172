"""Hardening (SECURITY.md): pod security, service-account tokens, and the NetworkPolicy on the Ray ports.

- a Namespace enforces, audits and warns the restricted Pod Security profile, and every container of
  every pod spec here (Ray groups, workloads, the job template) passes it (non-root, no privilege
  escalation, capabilities dropped, RuntimeDefault seccomp, no host namespaces, ports or hostPath);
- Ray pods mount no service-account token, the worker and flow-run pods keep theirs;
- a NetworkPolicy limits ingress to every Ray group's pods, and every policy selecting them admits only
  the RayCluster's own pods or the flow-run pods.
"""

from __future__ import annotations

from tuneproof.app.lint.documents import Doc, all_containers, drop_placeholders, group_pod_spec, ray_groups, volume_kind
from tuneproof.core.findings import Finding

RESTRICTED = "restricted"
PSA_LABELS = {
    "pod-security.kubernetes.io/enforce": "unenforced, the API server admits a root or privileged pod into the namespace",
    "pod-security.kubernetes.io/audit": "a violation (e.g. in a Job template) leaves no audit record",
    "pod-security.kubernetes.io/warn": "kubectl apply gives no warning for a workload the profile refuses",
}
RESTRICTED_VOLUMES = (
    "configMap",
    "csi",
    "downwardAPI",
    "emptyDir",
    "ephemeral",
    "persistentVolumeClaim",
    "projected",
    "secret",
)
RESTRICTED_WHY = (
    "the restricted pod security profile (pod or container securityContext; namespace.yaml enforces it): "
    "the API server refuses the pod"
)
RAY_CLUSTER_LABEL = "ray.io/cluster"


def namespace_findings(doc: Doc) -> list[Finding]:
    """The namespace holds every pod to the restricted Pod Security Standard (enforce, audit and warn)."""
    labels = (doc.obj.get("metadata") or {}).get("labels") or {}
    return [
        Finding(doc.subject, f"metadata.labels[{key}]", labels.get(key), RESTRICTED, why)
        for key, why in PSA_LABELS.items()
        if labels.get(key) != RESTRICTED
    ]


def pod_security_findings(subject: str, where: str, pod_spec: dict) -> list[Finding]:
    """Every container passes the restricted Pod Security Standard, as far as the manifest shows it."""
    findings = [
        Finding(subject, f"{where}.{key}", True, False, RESTRICTED_WHY)
        for key in ("hostNetwork", "hostPID", "hostIPC")
        if pod_spec.get(key) is True
    ]
    findings += [
        Finding(subject, f"{where}.volumes[{v.get('name')}]", volume_kind(v), list(RESTRICTED_VOLUMES), RESTRICTED_WHY)
        for v in pod_spec.get("volumes") or []
        if volume_kind(v) not in RESTRICTED_VOLUMES
    ]
    pod_context = pod_spec.get("securityContext") or {}
    for container in all_containers(pod_spec):
        findings += _container_security(subject, f"{where}.containers[{container.get('name')}]", container, pod_context)
    return findings


def _container_security(subject: str, field: str, container: dict, pod_context: dict) -> list[Finding]:
    """The restricted profile's container rules; runAsNonRoot, runAsUser and seccomp may come from the pod."""
    own = container.get("securityContext") or {}
    effective = {key: own.get(key, pod_context.get(key)) for key in ("runAsNonRoot", "runAsUser", "seccompProfile")}
    capabilities = own.get("capabilities") or {}
    seccomp = (effective["seccompProfile"] or {}).get("type")
    checks = [  # (field under securityContext, seen, expected, passes)
        ("runAsNonRoot", effective["runAsNonRoot"], True, effective["runAsNonRoot"] is True),
        ("runAsUser", effective["runAsUser"], "a non-zero uid", effective["runAsUser"] != 0),
        (
            "allowPrivilegeEscalation",
            own.get("allowPrivilegeEscalation"),
            False,
            own.get("allowPrivilegeEscalation") is False,
        ),
        ("privileged", own.get("privileged"), False, own.get("privileged") is not True),
        ("capabilities.drop", capabilities.get("drop"), ["ALL"], "ALL" in (capabilities.get("drop") or [])),
        (
            "capabilities.add",
            capabilities.get("add"),
            "nothing but NET_BIND_SERVICE",
            set(capabilities.get("add") or []) <= {"NET_BIND_SERVICE"},
        ),
        ("seccompProfile.type", seccomp, "RuntimeDefault", seccomp in ("RuntimeDefault", "Localhost")),
    ]
    findings = [
        Finding(subject, f"{field}.securityContext.{name}", seen, expected, RESTRICTED_WHY)
        for name, seen, expected, passes in checks
        if not passes
    ]
    findings += [
        Finding(subject, f"{field}.ports[{p.get('containerPort')}].hostPort", p["hostPort"], None, RESTRICTED_WHY)
        for p in container.get("ports") or []
        if p.get("hostPort")
    ]
    return findings


def ray_token_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """Ray pods never call the Kubernetes API (only the in-tree autoscaler on the head would): no token mounted."""
    autoscaler = where == "spec.headGroupSpec" and bool((doc.obj.get("spec") or {}).get("enableInTreeAutoscaling"))
    seen = group_pod_spec(group).get("automountServiceAccountToken")
    if autoscaler or seen is False:
        return []
    return [
        Finding(
            doc.subject,
            f"{where}.template.spec.automountServiceAccountToken",
            seen,
            False,
            "Ray never calls the Kubernetes API: a mounted token hands the service account's Kubernetes "
            "identity to the code of every Ray job (IRSA's STS token is a separate volume and stays)",
        )
    ]


def api_token_findings(subject: str, where: str, pod_spec: dict, why: str) -> list[Finding]:
    """A pod that does call the Kubernetes API keeps its service-account token."""
    if pod_spec.get("automountServiceAccountToken") is not False:
        return []
    return [
        Finding(
            subject,
            f"{where}.automountServiceAccountToken",
            False,
            True,
            f"{why} with its service-account token: without it every such call fails",
        )
    ]


def ray_pod_labels(raycluster: Doc, where: str, group: dict) -> dict[str, str]:
    """The labels a group's pods carry: the template's, plus those KubeRay sets on every Ray pod."""
    head = where == "spec.headGroupSpec"
    labels = dict(((group.get("template") or {}).get("metadata") or {}).get("labels") or {})
    labels.update(
        {
            RAY_CLUSTER_LABEL: raycluster.name,
            "ray.io/node-type": "head" if head else "worker",
            "ray.io/group": "headgroup" if head else str(group.get("groupName")),
        }
    )
    return labels


def selects(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) matches these labels; an empty selector matches all."""
    selector = selector or {}
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for expression in selector.get("matchExpressions") or []:
        key, values = expression.get("key"), expression.get("values") or []
        outcome = {
            "In": labels.get(key) in values,
            "NotIn": labels.get(key) not in values,
            "Exists": key in labels,
            "DoesNotExist": key not in labels,
        }
        if not outcome.get(expression.get("operator"), False):
            return False
    return True


def _limits_ingress(policy: Doc) -> bool:
    types = (policy.obj.get("spec") or {}).get("policyTypes")
    return types is None or "Ingress" in types  # unset, Kubernetes counts the policy as an Ingress policy


def ray_network_findings(doc: Doc, docs: list[Doc], groups: list[tuple[str, dict]]) -> list[Finding]:
    """Some NetworkPolicy limits ingress to every group's pods (what it admits: network_policy_findings)."""
    policies = [d for d in docs if d.kind == "NetworkPolicy" and d.namespace == doc.namespace and _limits_ingress(d)]
    return [
        Finding(
            doc.subject,
            f"{where} pods ({RAY_CLUSTER_LABEL}={doc.name})",
            None,
            f"a NetworkPolicy in namespace {doc.namespace} whose podSelector matches them, limiting Ingress",
            "without one every Ray port (GCS 6379, dashboard and job API 8265, client 10001, raylets, object "
            "managers, metrics) is open to every pod in the cluster",
        )
        for where, group in groups
        if not any(
            selects((p.obj.get("spec") or {}).get("podSelector"), ray_pod_labels(doc, where, group)) for p in policies
        )
    ]


def network_policy_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """A policy that selects Ray pods admits only the pipeline's pods: the RayCluster's own and the flow runs'."""
    spec = doc.obj.get("spec") or {}
    clusters = [
        d
        for d in docs
        if d.kind == "RayCluster"
        and d.namespace == doc.namespace
        and any(selects(spec.get("podSelector"), ray_pod_labels(d, w, g)) for w, g in ray_groups(d.obj))
    ]
    if not clusters or not _limits_ingress(doc):
        return []
    allowed = [{RAY_CLUSTER_LABEL: c.name} for c in clusters] + flow_run_pod_labels(docs)
    expected = " or ".join(f"podSelector.matchLabels including {labels}" for labels in allowed)
    why = f"policies add up: this one opens the Ray ports of {', '.join(c.subject for c in clusters)}"
    findings = []
    for i, rule in enumerate(spec.get("ingress") or []):
        peers = rule.get("from") or []
        if not peers:
            findings.append(
                Finding(
                    doc.subject,
                    f"spec.ingress[{i}].from",
                    None,
                    expected,
                    f"{why} to every source, in the cluster or outside it",
                )
            )
        for j, peer in enumerate(peers):
            labels = (peer.get("podSelector") or {}).get("matchLabels") or {}
            if "ipBlock" in peer or "namespaceSelector" in peer:
                findings.append(
                    Finding(
                        doc.subject,
                        f"spec.ingress[{i}].from[{j}]",
                        peer,
                        expected,
                        f"{why} to addresses or other namespaces",
                    )
                )
            elif not any(all(labels.get(k) == v for k, v in wanted.items()) for wanted in allowed):
                findings.append(
                    Finding(
                        doc.subject,
                        f"spec.ingress[{i}].from[{j}].podSelector",
                        peer.get("podSelector"),
                        expected,
                        f"{why} to pods that are not the pipeline's",
                    )
                )
    return findings


def flow_run_pod_labels(docs: list[Doc]) -> list[dict]:
    """The fixed labels of the flow-run pods each Prefect base job template creates."""
    found = []
    for template in (d for d in docs if d.kind == "PrefectBaseJobTemplate"):
        manifest = (template.obj.get("job_configuration") or {}).get("job_manifest") or {}
        labels = drop_placeholders(
            ((((manifest.get("spec") or {}).get("template") or {}).get("metadata") or {}).get("labels")) or {}
        )
        if isinstance(labels, dict) and labels:
            found.append(labels)
    return found
