"""The admission policy on the flow-run Jobs (SECURITY.md, "Work-pool job variables").

- with a Prefect Kubernetes worker linted, a ValidatingAdmissionPolicy bound with Deny holds the Jobs its
  service account creates to the template's pinned image and account and to the Secrets the flow runs use;
- it maps each worker's account to its own pool's account, and no worker account polls two pools.
"""

from __future__ import annotations

import re

from tuneproof.app.lint.canary import PIPELINE_POOL, template_pool
from tuneproof.app.lint.documents import PLACEHOLDER_VARIABLE, Doc, env_values, pinned_value
from tuneproof.app.lint.rbac import denying_policies, unnamed_findings, validation_text
from tuneproof.app.lint.worker import (
    CREDENTIAL_SECRET_SETTINGS,
    WORKLOAD_KINDS,
    kubernetes_worker_pool,
    worker_users,
    workload_pod_spec,
)
from tuneproof.core.findings import Finding

_ACCOUNT_MAP_ENTRY = re.compile(r"'(system:serviceaccount:[^':]+:[^']+)'\s*:\s*'([^']+)'")


def admission_policy_findings(doc: Doc, docs: list[Doc], pod_spec: dict) -> list[Finding]:
    """A ValidatingAdmissionPolicy, bound with Deny, holds the worker's Jobs to what the template pins.

    The Prefect server checks deployments and a deployment's flow runs against the variables schema, but
    not a flow run created directly, and whoever holds the API credential can rewrite the work pool: only
    the API server can refuse a Job that runs another image, as another account, with other Secrets.
    """
    workers = worker_users(docs)
    pool = template_pool(doc)
    users = {user for user, pools in workers.items() if pool in pools}
    if not users and pool != PIPELINE_POOL:
        return []  # no worker here polls this pool: nothing linted creates its Jobs
    users = users or set(workers)  # a worker polling a renamed pipeline pool is still held
    if not users:
        return []  # no worker among the linted files: whose Jobs to hold is unknown
    policies = list(
        {
            p.name: p for user in sorted(users) for p in denying_policies(docs, user, "batch", "jobs", ("CREATE",))
        }.values()
    )
    if not policies:
        return [
            Finding(
                doc.subject,
                "ValidatingAdmissionPolicy for the worker's Jobs",
                None,
                f"a policy bound with validationActions [Deny] matching batch/v1 jobs CREATE by {sorted(users)[0]}",
                "without it a flow run created directly through the Prefect API (POST /flow_runs/, which the "
                "server does not check against the variables schema) can choose any image, account or Secret",
            )
        ]
    text = validation_text(policies)
    read = " ".join(  # a name in a variable a validation reads is admitted as if it were in the validation
        str(v.get("expression"))
        for p in policies
        for v in (p.obj.get("spec") or {}).get("variables") or []
        if f"variables.{v.get('name')}" in text
    )
    pins = _flow_run_pins(doc, docs, pod_spec)
    account = pins.pop("service account")
    must_name = {
        value: f"{doc.file} pins the flow runs' {what} to it: the policy must admit exactly that"
        for what, value in pins.items()
        if value
    }
    return (
        unnamed_findings(policies[0], f"{text} {read}", must_name)
        + _admitted_account_findings(doc, policies, users, account, text)
        + _shared_worker_findings(doc, workers, users)
    )


def _admitted_account_findings(
    doc: Doc, policies: list[Doc], users: set[str], account: str | None, text: str
) -> list[Finding]:
    """The policy holds each worker's Jobs to its own pool's account: a table worker -> account, or the one name."""
    if not account:
        return []
    variables = [v for p in policies for v in (p.obj.get("spec") or {}).get("variables") or []]
    tables = [v for v in variables if _ACCOUNT_MAP_ENTRY.search(str(v.get("expression")))]
    table = {user: admitted for v in tables for user, admitted in _ACCOUNT_MAP_ENTRY.findall(str(v.get("expression")))}
    if not table:  # one worker, one account, named in a validation
        seen = f"no expression naming '{account}'"
        return (
            [] if f"'{account}'" in text else [_admission_finding(policies[0], "spec.validations", seen, account, doc)]
        )
    findings = [
        _admission_finding(policies[0], f"spec.variables[{user}]", table.get(user), account, doc)
        for user in sorted(users)
        if table.get(user) != account
    ]
    read = [f"variables.{v.get('name')}" for v in tables if f"variables.{v.get('name')}" in text]
    if not read:  # a table no validation reads holds nothing
        seen = f"no use of variables.{tables[0].get('name')}"
        findings.append(_admission_finding(policies[0], "spec.validations", seen, account, doc))
    return findings


def _admission_finding(policy: Doc, field: str, seen, account: str, doc: Doc) -> Finding:
    return Finding(
        policy.subject,
        field,
        seen,
        account,
        f"{doc.file} pins the flow runs' service account to it: a Job its worker creates must run as exactly that, "
        "or a flow run could take another pool's identity",
    )


def _shared_worker_findings(doc: Doc, workers: dict[str, set], users: set[str]) -> list[Finding]:
    """A worker account polling two pools: the policy cannot tell their Jobs apart, so neither pool's identity holds."""
    return [
        Finding(
            doc.subject,
            f"workers polling {template_pool(doc)}",
            f"{user} polls {sorted(workers[user])}",
            "one service account per worker, each polling one pool",
            "flow-run-admission.yaml binds a Job's account to the worker that created it: a worker account shared "
            "by two pools lets either pool's flow runs run as the other's account",
        )
        for user in sorted(users)
        if len(workers.get(user, ())) > 1
    ]


def _flow_run_pins(doc: Doc, docs: list[Doc], pod_spec: dict) -> dict[str, str | None]:
    """What a flow-run Job may run and reference: the pinned image and account, the fixed Secrets."""
    properties = (doc.obj.get("variables") or {}).get("properties") or {}
    secrets = {
        f"Secret of volume {v.get('name')}": v["secret"]["secretName"]
        for v in pod_spec.get("volumes") or []
        if isinstance((v.get("secret") or {}).get("secretName"), str)
        and not PLACEHOLDER_VARIABLE.match(v["secret"]["secretName"])
    }
    auth = [
        env_values(c).get(f"{setting}_NAME")
        for w in docs
        if w.kind in WORKLOAD_KINDS
        for c in workload_pod_spec(w).get("containers") or []
        if kubernetes_worker_pool(c)
        for setting in CREDENTIAL_SECRET_SETTINGS.values()
    ]
    return {
        "service account": pinned_value(properties.get("service_account_name") or {}),
        "image": pinned_value(properties.get("image") or {}),
        **secrets,
        "Prefect API credential Secret": next((a for a in auth if a), None),
    }
