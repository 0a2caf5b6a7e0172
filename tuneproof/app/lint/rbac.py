"""RBAC: what a service account's bindings grant, and which admission policies deny a user's writes."""

from __future__ import annotations

from tuneproof.app.lint.documents import Doc
from tuneproof.core.findings import Finding

READ_VERBS = {"get", "list", "watch"}


def bound_cluster_wide(docs: list[Doc], account: str, namespace: str | None) -> bool:
    return any(d.kind == "ClusterRoleBinding" and _binds(d, account, namespace) for d in docs)


def read_only_findings(doc: Doc, docs: list[Doc], account: str | None, namespace: str | None) -> list[Finding]:
    """Roles bound to the flow-run service account grant read verbs only."""
    if not account:
        return []
    why = f"bound to {account}, the flow-run service account of {doc.file}: the pipeline only reads the cluster"
    return write_findings(docs, account, namespace, {}, sorted(READ_VERBS), why)[0]


def write_findings(
    docs: list[Doc], account: str, namespace: str | None, allowed: dict, expected, why: str
) -> tuple[list[Finding], set[tuple[str, str, str]]]:
    """(a finding per rule bound to `account` granting a write not in `allowed` {(group, resource): verbs},
    every (group, resource, verb) granted)."""
    findings, granted = [], set()
    for role in roles_bound_to(docs, account, namespace):
        for i, rule in enumerate(role.obj.get("rules") or []):
            verbs = set(rule.get("verbs") or [])
            targets = [(g, r) for g in rule.get("apiGroups") or [] for r in rule.get("resources") or []]
            granted |= {(g, r, v) for g, r in targets for v in verbs}
            writes = sorted(
                v for v in verbs - READ_VERBS if not targets or any(v not in allowed.get(t, ()) for t in targets)
            )
            if writes:
                findings.append(Finding(role.subject, f"rules[{i}].verbs", writes, expected, why))
    return findings, granted


def roles_bound_to(docs: list[Doc], account: str, namespace: str | None) -> list[Doc]:
    refs = set()
    for binding in (
        d for d in docs if d.kind in ("RoleBinding", "ClusterRoleBinding") and _binds(d, account, namespace)
    ):
        ref = binding.obj.get("roleRef") or {}
        # a RoleBinding grants its Role in the binding's own namespace
        refs.add((ref.get("kind"), ref.get("name"), binding.namespace if binding.kind == "RoleBinding" else None))
    return [d for d in docs if (d.kind, d.name, d.namespace if d.kind == "Role" else None) in refs]


def _binds(binding: Doc, account: str, namespace: str | None) -> bool:
    return any(
        s.get("kind") == "ServiceAccount"
        and s.get("name") == account
        and s.get("namespace", binding.namespace) == namespace
        for s in binding.obj.get("subjects") or []
    )


def _matches(policy: Doc, group: str, resource: str, operation: str) -> bool:
    rules = (((policy.obj.get("spec") or {}).get("matchConstraints") or {}).get("resourceRules")) or []
    return any(
        {group, "*"} & set(r.get("apiGroups") or [])
        and {resource, "*"} & set(r.get("resources") or [])
        and {operation, "*"} & set(r.get("operations") or [])
        for r in rules
    )


def denying_policies(docs: list[Doc], user: str, group: str, resource: str, operations: tuple[str, ...]) -> list[Doc]:
    """ValidatingAdmissionPolicies bound with Deny that match every one of `operations` on the resource by `user`."""
    denied = {
        (b.obj.get("spec") or {}).get("policyName")
        for b in docs
        if b.kind == "ValidatingAdmissionPolicyBinding"
        and "Deny" in ((b.obj.get("spec") or {}).get("validationActions") or [])
    }
    return [
        d
        for d in docs
        if d.kind == "ValidatingAdmissionPolicy"
        and d.name in denied
        and all(_matches(d, group, resource, op) for op in operations)
        and f"'{user}'" in str((d.obj.get("spec") or {}).get("matchConditions"))
    ]


def validation_text(policies: list[Doc]) -> str:
    """The policies' validation expressions, joined: a name they admit stands in it quoted ('name')."""
    return " ".join(
        str(v.get("expression")) for p in policies for v in (p.obj.get("spec") or {}).get("validations") or []
    )


def unnamed_findings(policy: Doc, text: str, must_name: dict[str, str]) -> list[Finding]:
    """A finding on the policy for each value (value -> why) that its expressions' `text` does not name."""
    return [
        Finding(policy.subject, "spec.validations", f"no expression naming '{value}'", value, why)
        for value, why in must_name.items()
        if f"'{value}'" not in text
    ]
