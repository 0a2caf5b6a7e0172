"""The Prefect Kubernetes worker and other non-Ray workloads.

- workloads: images pinned (a tag is a warning), claims, the restricted profile;
- a worker bound only by namespaced Roles sets PREFECT_KUBERNETES_CLUSTER_UID and
  PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES (covering the flow-run namespace), and its Roles
  cover the namespace the flow-run Jobs are created in;
- it takes its API credential from a secretKeyRef and names that Secret for the flow runs; no
  credential is written as a value in the worker, the template or job variables.
"""

from __future__ import annotations

from tuneproof.app.lint.documents import Doc, all_containers, env_values, template_defaults
from tuneproof.app.lint.images import workload_image
from tuneproof.app.lint.rbac import bound_cluster_wide, roles_bound_to
from tuneproof.app.lint.security import api_token_findings, pod_security_findings
from tuneproof.app.lint.storage import claim_findings
from tuneproof.core.findings import Finding

CLUSTER_UID_ENV = "PREFECT_KUBERNETES_CLUSTER_UID"
OBSERVER_NAMESPACES_ENV = "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
"""The cluster UID deployments/prefect-worker.yaml ships with, to be replaced by kube-system's UID."""
WORKLOAD_KINDS = ("Deployment", "Job", "Pod")
PREFECT_CREDENTIALS = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING")
CREDENTIAL_SECRET_SETTINGS = {
    "PREFECT_API_AUTH_STRING": "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET",
    "PREFECT_API_KEY": "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_KEY_SECRET",
}
"""prefect-kubernetes (0.8.0) rewrites a flow-run Job's credential into a secretKeyRef when the worker has <setting>_NAME
and <setting>_KEY; otherwise it copies the worker's own value into the Job manifest."""


def workload_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """Non-Ray workloads: pinned images (a tag is a warning: they never train), claims, a Prefect worker's settings."""
    pod_spec = workload_pod_spec(doc)
    where = "spec" if doc.kind == "Pod" else "spec.template.spec"
    findings = [
        f
        for c in all_containers(pod_spec)
        for f in workload_image(doc.subject, f"containers[{c.get('name')}].image", c.get("image", ""))
    ]
    findings += claim_findings(doc, docs, where, pod_spec)
    findings += pod_security_findings(doc.subject, where, pod_spec)
    return findings + prefect_worker_findings(doc, docs)


def workload_pod_spec(doc: Doc) -> dict:
    spec = doc.obj.get("spec") or {}
    return spec if doc.kind == "Pod" else (spec.get("template") or {}).get("spec") or {}


def kubernetes_worker_pool(container: dict) -> str | None:
    """The work pool a `prefect worker start --type kubernetes --pool P` container polls, else None."""
    words = [str(w) for w in [*(container.get("command") or []), *(container.get("args") or [])]]
    options = {words[i]: words[i + 1] for i in range(len(words) - 1) if words[i].startswith("-")}
    if "worker" not in words or "start" not in words:
        return None
    if options.get("--type", options.get("-t")) != "kubernetes":
        return None
    return options.get("--pool", options.get("-p"))


def prefect_worker_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """A worker bound only by namespaced Roles: cluster UID and observer namespaces set, Roles where the Jobs go."""
    pod_spec = workload_pod_spec(doc)
    account = pod_spec.get("serviceAccountName") or "default"
    workers = [c for c in pod_spec.get("containers") or [] if kubernetes_worker_pool(c)]
    if not workers:
        return []
    auth = [
        f
        for c in workers
        for f in prefect_auth_findings(doc.subject, f"spec.template.spec.containers[{c.get('name')}].env", c)
    ]
    auth += api_token_findings(doc.subject, "spec.template.spec", pod_spec, "the worker creates and watches Jobs")
    if bound_cluster_wide(docs, account, doc.namespace):
        return auth  # cluster-wide rights: it may read kube-system and watch every namespace itself
    role_namespaces = {r.namespace for r in roles_bound_to(docs, account, doc.namespace) if r.kind == "Role"}
    findings = []
    for container in workers:
        field = f"spec.template.spec.containers[{container.get('name')}].env"
        findings += _cluster_uid_findings(doc.subject, field, env_values(container).get(CLUSTER_UID_ENV))
        findings += _observer_findings(
            doc.subject, field, env_values(container).get(OBSERVER_NAMESPACES_ENV), role_namespaces
        )
    findings += _job_namespace_findings(doc, docs, account, role_namespaces)
    return auth + findings


def _cluster_uid_findings(subject: str, field: str, uid: str | None) -> list[Finding]:
    expected = "kube-system's UID: kubectl get namespace kube-system -o jsonpath='{.metadata.uid}'"
    if not uid:
        return [
            Finding(
                subject,
                f"{field}[{CLUSTER_UID_ENV}]",
                None,
                expected,
                "a namespaced worker cannot read the kube-system namespace: prefect-kubernetes versions that "
                "build a run's infrastructure id from it fail every submission with 403",
            )
        ]
    if uid == PLACEHOLDER_UID:
        return [
            Finding(
                subject,
                f"{field}[{CLUSTER_UID_ENV}]",
                uid,
                expected,
                "placeholder UID: two clusters with the same UID could cancel each other's flow runs",
                "warning",
            )
        ]
    return []


def _observer_findings(subject: str, field: str, raw: str | None, role_namespaces: set) -> list[Finding]:
    watched = {n.strip() for n in (raw or "").split(",") if n.strip()}
    if role_namespaces <= watched and watched:
        return []
    expected = ",".join(sorted(role_namespaces)) or "the flow-run namespace"
    why = (
        (
            "unset, the observer watches pods and jobs cluster-wide, which a namespaced Role forbids (403): crashed "
            "flow runs are never marked"
        )
        if not watched
        else "the observer must watch every namespace the worker's Roles cover"
    )
    return [Finding(subject, f"{field}[{OBSERVER_NAMESPACES_ENV}]", raw, expected, why)]


def _job_namespace_findings(doc: Doc, docs: list[Doc], account: str, role_namespaces: set) -> list[Finding]:
    """The base job template's namespace, where the worker creates flow-run Jobs, has one of its Roles."""
    findings = []
    for template in (d for d in docs if d.kind == "PrefectBaseJobTemplate"):
        namespace = template_defaults(template).get("namespace")
        if namespace and namespace not in role_namespaces:
            findings.append(
                Finding(
                    doc.subject,
                    f"Roles bound to {account}",
                    sorted(role_namespaces),
                    namespace,
                    f"{template.file} creates flow-run Jobs in {namespace}: the worker gets 403 there",
                )
            )
    return findings


def worker_role_namespaces(docs: list[Doc]) -> dict[str, set]:
    """{work pool: namespaces of the Roles bound to the Kubernetes worker polling it}."""
    pools: dict[str, set] = {}
    for doc in (d for d in docs if d.kind in WORKLOAD_KINDS):
        pod_spec = workload_pod_spec(doc)
        account = pod_spec.get("serviceAccountName") or "default"
        for container in pod_spec.get("containers") or []:
            if pool := kubernetes_worker_pool(container):
                roles = roles_bound_to(docs, account, doc.namespace)
                pools.setdefault(pool, set()).update(r.namespace for r in roles if r.kind == "Role")
    return pools


def literal_credential_findings(subject: str, field: str, env) -> list[Finding]:
    """A Prefect API credential written as a value, where anyone who can read the object reads it."""
    if not isinstance(env, dict):
        return []
    return [
        Finding(
            subject,
            f"{field}[{name}]",
            "a literal value (not shown)",
            "valueFrom.secretKeyRef",
            "a credential in a manifest or job variables is readable by whoever can read the object (the "
            "built-in view role reads pods, Jobs and Deployments but not Secrets)",
        )
        for name in PREFECT_CREDENTIALS
        if name in env
    ]


def prefect_auth_findings(subject: str, field: str, container: dict) -> list[Finding]:
    """The worker authenticates from a Secret, and hands flow runs a reference to that Secret, not its value."""
    env = {e.get("name"): e for e in container.get("env") or []}
    findings = literal_credential_findings(subject, field, {n: e["value"] for n, e in env.items() if "value" in e})
    refs = {name: ((env.get(name) or {}).get("valueFrom") or {}).get("secretKeyRef") for name in PREFECT_CREDENTIALS}
    if refs["PREFECT_SERVER_API_AUTH_STRING"]:
        findings.append(
            Finding(
                subject,
                f"{field}[PREFECT_SERVER_API_AUTH_STRING]",
                "set",
                None,
                "the server's setting: prefect-kubernetes copies every Prefect setting the worker has "
                "into each flow-run Job's env as a literal",
            )
        )
    if not any(refs[name] for name in CREDENTIAL_SECRET_SETTINGS) and not findings:
        findings.append(
            Finding(
                subject,
                f"{field}[PREFECT_API_AUTH_STRING]",
                None,
                "valueFrom.secretKeyRef (or PREFECT_API_KEY from one, for Prefect Cloud)",
                "the Prefect API runs code on this cluster: the worker and the server must authenticate",
            )
        )
    for name, setting in CREDENTIAL_SECRET_SETTINGS.items():
        ref = refs[name] or {}
        for suffix, wanted in (("NAME", ref.get("name")), ("KEY", ref.get("key"))):
            seen = (env.get(f"{setting}_{suffix}") or {}).get("value")
            if ref and seen != wanted:
                findings.append(
                    Finding(
                        subject,
                        f"{field}[{setting}_{suffix}]",
                        seen,
                        wanted,
                        f"unset, prefect-kubernetes writes the worker's {name} as a literal into every "
                        "flow-run Job manifest instead of a secretKeyRef to the same Secret",
                    )
                )
    return findings


def worker_users(docs: list[Doc]) -> dict[str, set]:
    """{the API user a Kubernetes worker creates Jobs as: the pools it polls}."""
    users: dict[str, set] = {}
    for w in (d for d in docs if d.kind in WORKLOAD_KINDS):
        pod_spec = workload_pod_spec(w)
        pools = {p for c in pod_spec.get("containers") or [] if (p := kubernetes_worker_pool(c))}
        if pools:
            user = f"system:serviceaccount:{w.namespace}:{pod_spec.get('serviceAccountName') or 'default'}"
            users.setdefault(user, set()).update(pools)
    return users
