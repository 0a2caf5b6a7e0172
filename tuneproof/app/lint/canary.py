"""The image canary's pool and identity (SECURITY.md, "The image canary").

- image-canary, and no other deployment, runs on the tuneproof-eks-canary pool, whose template
  (prefect-k8s-canary-job-template.json) pins tuneproof-canary and equals the pipeline's template but for
  that account; no other template pins it;
- the roles bound to tuneproof-canary write nothing but create/delete on rayclusters and grant every call
  the canary makes;
- a Deny-bound policy holds the canary's RayCluster creates and deletes to its name prefix and to the
  canary's own service account and token Secret (tuneproof/control/kube_canary.py), never naming the standing
  RayCluster's;
- the canary's identity is its own: its template mounts the canary's token Secret, never a RayCluster's
  (tuneproof.app.lint.pools), its Ray pods' account carries another IAM role than the standing Ray pods', and
  the canary's bucket policy (s3-canary-policy.json) writes nothing outside the canary prefix.
"""

from __future__ import annotations

from pathlib import Path, PurePosixPath

from tuneproof.app.lint.documents import Doc, as_list, group_pod_spec, pinned_value, ray_groups
from tuneproof.app.lint.rbac import denying_policies, unnamed_findings, validation_text, write_findings
from tuneproof.app.lint.storage import IRSA_ANNOTATION, irsa_findings
from tuneproof.control.images import CANARY_CLUSTER_PREFIX, CANARY_STORAGE_DIR
from tuneproof.control.kube_canary import CANARY_RAY_ACCOUNT, CANARY_TOKEN_SECRET
from tuneproof.core.findings import Finding

PIPELINE_POOL = "tuneproof-eks"
CANARY_POOL = "tuneproof-eks-canary"
CANARY_DEPLOYMENT = "image-canary"
CANARY_ACCOUNT = "tuneproof-canary"
POOL_TEMPLATES = {
    PIPELINE_POOL: "prefect-k8s-base-job-template.json",
    CANARY_POOL: "prefect-k8s-canary-job-template.json",
}
"""Each Kubernetes work pool's base job template, by file name: the pairs `prefect work-pool create POOL
--base-job-template deployments/FILE` makes (deployments/README.md). A template named otherwise serves the pipeline's pool."""
CANARY_WRITES = {("ray.io", "rayclusters"): {"create", "delete"}}
"""The only writes the canary's account may hold: it creates its ephemeral RayCluster and deletes it (no patch, no update)."""
CANARY_NEEDS = {
    ("ray.io", "rayclusters"): {"create", "get", "list", "delete"},
    ("", "pods"): {"get", "list"},
    ("", "nodes"): {"get", "list"},
    ("resource.k8s.io", "resourceslices"): {"get", "list"},
}
"""What tuneproof/control/kube_canary.py and the verify stage call as the canary: without one, the canary gets 403."""


def template_pool(doc: Doc) -> str:
    """The work pool a base job template serves, by its file name (POOL_TEMPLATES); otherwise the pipeline's."""
    name = PurePosixPath(Path(doc.file).as_posix()).name
    return next((pool for pool, file in POOL_TEMPLATES.items() if file == name), PIPELINE_POOL)


def pool_template(docs: list[Doc], pool: str) -> Doc | None:
    return next((d for d in docs if d.kind == "PrefectBaseJobTemplate" and template_pool(d) == pool), None)


def canary_placement_findings(doc: Doc) -> list[Finding]:
    """image-canary, and only it, deploys on the canary's pool: that pool's account may write RayClusters."""
    findings = []
    for deployment in doc.obj.get("deployments") or []:
        name, pool = deployment.get("name"), (deployment.get("work_pool") or {}).get("name")
        subject = f"{doc.file}: deployment {name}"
        if name == CANARY_DEPLOYMENT and pool != CANARY_POOL:
            findings.append(
                Finding(
                    subject,
                    "work_pool.name",
                    pool,
                    CANARY_POOL,
                    "the canary creates and deletes its RayCluster: elsewhere it runs as an account that may not (403)",
                )
            )
        elif name != CANARY_DEPLOYMENT and pool == CANARY_POOL:
            findings.append(
                Finding(
                    subject,
                    "work_pool.name",
                    pool,
                    f"any pool but {CANARY_POOL}",
                    f"only {CANARY_DEPLOYMENT} may run as {CANARY_ACCOUNT}, which creates RayClusters: "
                    "any flow on that pool gets the same right",
                )
            )
    return findings


def canary_template_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The canary pool's template pins tuneproof-canary and equals the pipeline's but for it; no other pins it."""
    properties = (doc.obj.get("variables") or {}).get("properties") or {}
    account = pinned_value(properties.get("service_account_name") or {})
    field = "variables.properties.service_account_name.const"
    if template_pool(doc) != CANARY_POOL:
        if account != CANARY_ACCOUNT:
            return []
        why = f"only the {CANARY_POOL} pool ({POOL_TEMPLATES[CANARY_POOL]}) runs as the canary's account, which creates RayClusters"
        return [Finding(doc.subject, field, account, f"any account but {CANARY_ACCOUNT}", why)]
    findings = []
    if account != CANARY_ACCOUNT:
        why = f"{CANARY_DEPLOYMENT} creates and deletes RayClusters, which only {CANARY_ACCOUNT} may (deployments/canary.yaml)"
        findings.append(Finding(doc.subject, field, account, CANARY_ACCOUNT, why))
    pipeline = pool_template(docs, PIPELINE_POOL)
    differences = _differences(_but_the_account(pipeline.obj), _but_the_account(doc.obj)) if pipeline else []
    # The canary's flow runs hold the canary's token (checked by pools._token_mount_findings), not the pipeline's.
    differences = [d for d in differences if not d.endswith(".secret.secretName")]
    if differences:
        findings.append(
            Finding(
                doc.subject,
                f"differences from {pipeline.file if pipeline else ''}",
                differences[:5],
                "none but the service account and the Ray token Secret (and descriptions)",
                "the canary's flow-run pod is the pipeline's (image, namespace, hardening, Secrets) under another "
                "identity: change both templates together",
            )
        )
    return findings


def canary_raycluster_policy_findings(doc: Doc, docs: list[Doc], account: str, namespace: str | None) -> list[Finding]:
    """The API server holds the canary's RayClusters to the canary's own identity and Secrets, and its own names.

    The KubeRay operator, not the canary, creates the pods: the canary's RBAC does not bound what they run as.
    """
    user = f"system:serviceaccount:{namespace}:{account}"
    policies = denying_policies(docs, user, "ray.io", "rayclusters", ("CREATE", "DELETE"))
    if not policies:
        return [
            Finding(
                doc.subject,
                "ValidatingAdmissionPolicy for the canary's RayClusters",
                None,
                f"a policy bound with validationActions [Deny] matching ray.io rayclusters CREATE and DELETE by {user}",
                "without it the canary's deployment can create Ray pods that run as any account of the namespace or "
                "mount any Secret there (KubeRay creates them), and delete the standing RayCluster",
            )
        ]
    text = validation_text(policies)
    wanted = {  # value: why
        CANARY_CLUSTER_PREFIX: "the canary's name prefix (tuneproof/control/kube_canary.py)",
        CANARY_TOKEN_SECRET: "the canary clusters' own token Secret (tuneproof/control/kube_canary.py)",
        CANARY_RAY_ACCOUNT: "the canary clusters' pods' own service account (tuneproof/control/kube_canary.py)",
    }
    must_name = {value: f"{what}: the canary's RayClusters must keep to it" for value, what in wanted.items()}
    return unnamed_findings(policies[0], text, must_name) + [
        Finding(
            policies[0].subject,
            "spec.validations",
            f"an expression naming '{value}'",
            f"none naming {value}",
            f"{what}: a candidate image given it could submit jobs to the standing cluster or write its runs, "
            "models and pointers in the bucket",
        )
        for value, what in _standing_identity(docs).items()
        if f"'{value}'" in text
    ]


def _standing_identity(docs: list[Doc]) -> dict[str, str]:
    """The standing RayClusters' token Secrets and pod service accounts: value -> what it is."""
    found: dict[str, str] = {}
    for raycluster in (d for d in docs if d.kind == "RayCluster"):
        if secret := ((raycluster.obj.get("spec") or {}).get("authOptions") or {}).get("secretName"):
            found.setdefault(secret, f"{raycluster.subject}'s token Secret")
        for where, group in ray_groups(raycluster.obj):
            if ray_account := group_pod_spec(group).get("serviceAccountName"):
                found.setdefault(ray_account, f"{raycluster.subject} {where}'s service account")
    return found


def canary_ray_account_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The canary clusters' account has an IAM role (IRSA) of its own, not the standing Ray pods' one."""
    if doc.name != CANARY_RAY_ACCOUNT:
        return []
    field = f"metadata.annotations[{IRSA_ANNOTATION}]"
    role = ((doc.obj.get("metadata") or {}).get("annotations") or {}).get(IRSA_ANNOTATION)
    standing = _standing_identity(docs)
    shared = [
        d.name
        for d in docs
        if d.kind == "ServiceAccount" and d.name in standing and d.name != doc.name and _role(d) == role
    ]
    if role and not shared:
        return []
    return [
        Finding(
            doc.subject,
            field,
            role if role else None,
            "an IAM role of its own" + (f", not {shared[0]}'s" if shared else ""),
            "a candidate image runs as this account: with the standing Ray pods' role it could overwrite any run, "
            "model or pointer in the bucket (SECURITY.md, 'The image canary'); without one it has no S3 credentials",
        )
    ]


def _role(doc: Doc) -> str | None:
    return ((doc.obj.get("metadata") or {}).get("annotations") or {}).get(IRSA_ANNOTATION)


CANARY_POLICY_FILE = "s3-canary-policy.json"
"""The canary Ray role's bucket policy (deployments/eks-up.sh attaches it to tuneproof-canary-ray-s3)."""
WRITE_ACTIONS = ("s3:PutObject", "s3:DeleteObject", "s3:AbortMultipartUpload", "s3:*", "*")


def canary_bucket_policy_findings(doc: Doc) -> list[Finding]:
    """The canary Ray role's policy writes objects only under <storage root>/canary/ (flows/canary.py's runs)."""
    if PurePosixPath(Path(doc.file).as_posix()).name != CANARY_POLICY_FILE:
        return []
    return [
        Finding(
            doc.subject,
            f"Statement[{s.get('Sid') or i}].Resource",
            resource,
            f"arn:aws:s3:::<bucket>/<storage root>/{CANARY_STORAGE_DIR}/*",
            "a candidate image writes with this policy: outside the canary prefix it could overwrite production's "
            "runs, models or the image and model pointers",
        )
        for i, s in enumerate(doc.obj.get("Statement") or [])
        if isinstance(s, dict)
        and s.get("Effect") == "Allow"
        and any(a in WRITE_ACTIONS or str(a).endswith("*") for a in as_list(s.get("Action")))
        for resource in as_list(s.get("Resource"))
        if not str(resource).endswith(f"/{CANARY_STORAGE_DIR}/*")
    ]


def _but_the_account(node, key: str = ""):
    """A template without its descriptions and the service account's pinned value: what the two pools share."""
    if isinstance(node, dict):
        kept = {k: _but_the_account(v, k) for k, v in node.items() if k != "description"}
        if key == "service_account_name":
            kept = {k: v for k, v in kept.items() if k not in ("const", "default", "enum")}
        return kept
    if isinstance(node, list):
        return [_but_the_account(x) for x in node]
    return node


def _differences(a, b, path: str = "") -> list[str]:
    """Dotted paths where two JSON values differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        return [
            d for k in sorted(a.keys() | b.keys(), key=str) for d in _differences(a.get(k), b.get(k), f"{path}.{k}")
        ]
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        return [d for i, (x, y) in enumerate(zip(a, b)) for d in _differences(x, y, f"{path}[{i}]")]
    return [] if a == b else [path.lstrip(".")]


def canary_role_findings(doc: Doc, docs: list[Doc], account: str, namespace: str | None) -> list[Finding]:
    """The canary's roles write nothing but create/delete on rayclusters, and grant everything the canary calls."""
    findings, granted = write_findings(
        docs,
        account,
        namespace,
        CANARY_WRITES,
        "create and delete on ray.io rayclusters, read verbs elsewhere",
        f"bound to {account}, the canary's account ({doc.file}): it creates and deletes its own RayCluster "
        "and writes nothing else",
    )
    findings += canary_raycluster_policy_findings(doc, docs, account, namespace)
    findings += irsa_findings(
        doc.subject,
        f"the canary clusters' service account {CANARY_RAY_ACCOUNT}",
        CANARY_RAY_ACCOUNT,
        namespace,
        docs,
        "tuneproof/control/kube_canary.py runs every canary Ray pod as it (deployments/canary.yaml)",
    )
    missing = [
        f"{verb} {resource}" + (f".{group}" if group else "")
        for (group, resource), verbs in CANARY_NEEDS.items()
        for verb in sorted(verbs)
        if not any(g in (group, "*") and r in (resource, "*") and v in (verb, "*") for g, r, v in granted)
    ]
    if missing:
        findings.append(
            Finding(
                doc.subject,
                f"roles bound to {account}",
                f"missing {missing}",
                "each granted",
                "the canary calls them (tuneproof/control/kube_canary.py and the verify stage): the API server answers 403",
            )
        )
    return findings
