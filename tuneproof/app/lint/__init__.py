"""Static checks of deployment manifests, no cluster needed: `tuneproof lint [PATH...]`.

    tuneproof lint deployments/ [--config configs/eks.yaml]

Reads every *.yaml / *.yml / *.json under the given paths (multi-document YAML, `kind: List`, Prefect
base job templates and prefect.yaml) and reports findings that name the file, the object (Kind/name),
the field, and both values. One module per concern, each stating its checks:

    documents   reading, kinds, the offline schemas (Kubernetes v1.34, the KubeRay CRD)
    images      digests, the Ray version a tag names, the flow-run image
    raycluster  a RayCluster's groups: GPU counts, capacity, forwarded Secrets (calls the next three)
    nodes       /dev/shm, requests against the node's allocatable, EFA and NCCL settings
    storage     claims, the shared storage root, FSx, IRSA for s3://
    security    pod security, service-account tokens, NetworkPolicy
    rbac        what bindings grant, which admission policies deny
    worker      the Prefect Kubernetes worker and other workloads, Prefect API credentials
    pools       base job templates and the prefect.yaml deployments on them
    canary      the image canary's pool, account and RayCluster policy
    admission   the admission policy on the flow-run Jobs
    eks         the eksctl config, the bucket policy, the walkthrough script, the flow-run image's Ray

Without a config only the manifest-internal checks run. Pure apart from reading the files.
"""

from __future__ import annotations

from tuneproof.app.lint.canary import canary_bucket_policy_findings, canary_ray_account_findings
from tuneproof.app.lint.documents import Doc, load_documents, schema_findings
from tuneproof.app.lint.eks import (
    canary_label_findings,
    cluster_config_findings,
    iam_policy_findings,
    placeholder_findings,
    ray_skew_findings,
    script_findings,
)
from tuneproof.app.lint.pools import job_template_findings, prefect_project_findings
from tuneproof.app.lint.raycluster import raycluster_findings
from tuneproof.app.lint.security import namespace_findings, network_policy_findings
from tuneproof.app.lint.storage import storage_class_findings
from tuneproof.app.lint.worker import WORKLOAD_KINDS, workload_findings
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding


def lint_paths(paths: list[str], config: PipelineConfig | None) -> list[Finding]:
    """Every finding over the manifests under `paths` (files, or folders read recursively)."""
    docs, findings = load_documents(paths)
    for doc in docs:
        schema = schema_findings(doc)
        findings += schema
        if any(f.severity == "error" for f in schema):
            continue  # the other checks read typed fields; a broken object is reported by its schema alone
        try:
            findings += object_findings(doc, docs, config)
        except (KeyError, TypeError, AttributeError, ValueError, IndexError, OverflowError) as e:
            # A kind without an offline schema (or a template's free-form part) can hold any shape: say so, go on.
            findings.append(Finding(doc.subject, "content", f"{type(e).__name__}: {e}", "the fields this kind has"))
    return findings


def object_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    """The checks for one object, by kind; the other linted objects are its context (claims, roles, the worker)."""
    if doc.kind == "RayCluster":
        return raycluster_findings(doc, docs, config) + canary_label_findings(doc, docs)
    if doc.kind in WORKLOAD_KINDS:
        return workload_findings(doc, docs)
    if doc.kind == "StorageClass":
        return storage_class_findings(doc) + placeholder_findings(doc)
    if doc.kind == "Namespace":
        return namespace_findings(doc)
    if doc.kind == "NetworkPolicy":
        return network_policy_findings(doc, docs)
    if doc.kind == "PrefectBaseJobTemplate":
        return job_template_findings(doc, docs, config)
    if doc.kind == "PrefectProject":
        return prefect_project_findings(doc, docs, config)
    return aws_findings(doc, docs)


def aws_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """The AWS side (eks.py): the eksctl config, the bucket policy, scripts, pins, example values left in place."""
    if doc.kind == "ClusterConfig":
        return cluster_config_findings(doc, docs)
    if doc.kind == "IAMPolicy":
        return iam_policy_findings(doc) + canary_bucket_policy_findings(doc)
    if doc.kind == "ShellScript":
        return script_findings(doc, docs)
    if doc.kind == "Requirements":
        return ray_skew_findings(doc, docs)
    if doc.kind == "ServiceAccount":
        return placeholder_findings(doc) + canary_ray_account_findings(doc, docs)
    return []
