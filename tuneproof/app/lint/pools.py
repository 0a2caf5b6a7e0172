"""The work pools: their base job templates and the prefect.yaml deployments on them.

- a base job template's fixed parts validate as a batch/v1 Job and carry the pod-spec
  parallelism/completions prefect-kubernetes insists on; it mounts the directory of
  cluster.auth_token_file from the RayCluster's token Secret; the service account it runs flows as is
  bound only to read verbs; it pins image, service account and namespace (const), lets no variable name
  a Secret or a cluster, and lists every variable it takes;
- a Prefect project file (prefect.yaml): every deployment on a pool a Kubernetes worker here polls runs
  a non-stock flow-run image pinned by digest, in a namespace the worker's Role covers, as a service
  account with IRSA when its storage root is s3://, with job variables the template's schema accepts.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import PurePosixPath

import jsonschema

from tuneproof.app.lint.admission import admission_policy_findings
from tuneproof.app.lint.canary import (
    CANARY_ACCOUNT,
    CANARY_POOL,
    canary_placement_findings,
    canary_role_findings,
    canary_template_findings,
    pool_template,
    template_pool,
)
from tuneproof.app.lint.documents import (
    PLACEHOLDER_VARIABLE,
    Doc,
    all_containers,
    dotted,
    drop_placeholders,
    pinned_value,
    schema_finding,
    schema_validator,
    template_defaults,
    volume_named,
)
from tuneproof.app.lint.images import flow_run_image_findings
from tuneproof.app.lint.rbac import read_only_findings
from tuneproof.app.lint.security import api_token_findings, pod_security_findings
from tuneproof.app.lint.storage import irsa_findings, mount_for
from tuneproof.app.lint.worker import literal_credential_findings, worker_role_namespaces
from tuneproof.control.kube_canary import CANARY_TOKEN_SECRET
from tuneproof.control.kube_checks import ray_container
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding

PREFECT_POD_FIELDS = {"parallelism": 1, "completions": 1}
"""prefect-kubernetes refuses a job manifest without these in spec.template.spec (its own default template has
them there, though a PodSpec has no such fields; the API server drops them with a warning)."""
PINNED_FIELDS = {
    "image": "image",
    "serviceAccountName": "service account",
    "serviceAccount": "service account",
    "namespace": "namespace",
}
"""Job-manifest fields a work-pool variable may fill only when its schema pins it to one value (const)."""


def prefect_project_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    """Deployments on a pool a Kubernetes worker here polls: flow-run image, namespace, S3 identity."""
    pools = worker_role_namespaces(docs)
    findings = canary_placement_findings(doc)
    for deployment in doc.obj.get("deployments") or []:
        work_pool = deployment.get("work_pool") or {}
        if work_pool.get("name") in pools:
            template = pool_template(docs, work_pool["name"])
            defaults = template_defaults(template) if template else {}
            job_variables = work_pool.get("job_variables") or {}
            findings += _deployment_findings(
                doc, docs, deployment, {**defaults, **job_variables}, pools[work_pool["name"]], config
            )
            subject = f"{doc.file}: deployment {deployment.get('name')}"
            findings += literal_credential_findings(subject, "work_pool.job_variables.env", job_variables.get("env"))
            if template is not None:
                findings += job_variables_schema_findings(subject, job_variables, template)
    return findings


def _deployment_findings(
    doc: Doc, docs: list[Doc], deployment: dict, variables: dict, role_namespaces: set, config: PipelineConfig | None
) -> list[Finding]:
    subject = f"{doc.file}: deployment {deployment.get('name')}"
    field = "work_pool.job_variables"
    findings = flow_run_image_findings(subject, f"{field}.image", variables.get("image"))
    namespace = variables.get("namespace")
    if namespace not in role_namespaces:
        findings.append(
            Finding(
                subject,
                f"{field}.namespace",
                namespace,
                sorted(role_namespaces),
                "the namespaces the worker's Roles cover: it could not create the flow-run Job",
            )
        )
    parameters = deployment.get("parameters") or {}
    storage = (parameters.get("config") or {}).get("storage") or parameters.get("storage") or {}  # rollback: storage
    root = storage.get("root") or (config.storage.root if config else "")
    if str(root).startswith("s3://"):
        findings += irsa_findings(
            subject,
            f"{field}.service_account_name",
            variables.get("service_account_name"),
            namespace,
            docs,
            f"storage.root {root}: the flow writes the run record there",
        )
    return findings


def job_template_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    manifest = (doc.obj.get("job_configuration") or {}).get("job_manifest") or {}
    defaults = template_defaults(doc)
    pod_spec = ((manifest.get("spec") or {}).get("template") or {}).get("spec") or {}
    findings = prefect_pod_field_findings(doc.subject, pod_spec)
    validator = schema_validator("batch/v1", "Job")
    assert validator is not None, "the vendored Kubernetes schemas lack batch/v1 Job"
    findings += [
        schema_finding(doc.subject, e)
        for e in validator.iter_errors(without_prefect_pod_fields(drop_placeholders(manifest)))
    ]
    if defaults.get("image"):  # a default a deployment falls back to: a warning here, an error per deployment
        findings += [
            replace(f, severity="warning")
            for f in flow_run_image_findings(doc.subject, "variables.properties.image.default", defaults["image"])
        ]
    if config is not None and config.cluster.auth_token_file:
        findings += _token_mount_findings(doc, docs, pod_spec, defaults, config.cluster.auth_token_file)
    if config is not None and config.storage.root.startswith("s3://"):
        findings += irsa_findings(
            doc.subject,
            "variables.properties.service_account_name.default",
            defaults.get("service_account_name"),
            defaults.get("namespace"),
            docs,
            f"storage.root {config.storage.root}: the flow writes the run record there",
        )
    account, namespace = defaults.get("service_account_name"), defaults.get("namespace")
    if account == CANARY_ACCOUNT:
        findings += canary_role_findings(doc, docs, account, namespace)
    else:
        findings += read_only_findings(doc, docs, account, namespace)
    findings += canary_template_findings(doc, docs)
    findings += pod_security_findings(doc.subject, "job_manifest spec.template.spec", pod_spec)
    findings += api_token_findings(
        doc.subject,
        "job_manifest spec.template.spec",
        pod_spec,
        "the verify stage reads the RayCluster, pods and nodes",
    )
    findings += pinned_variable_findings(doc)
    findings += admission_policy_findings(doc, docs, pod_spec)
    findings += literal_credential_findings(doc.subject, "variables.properties.env.default", defaults.get("env"))
    for container in all_containers(pod_spec):
        if isinstance(container.get("env"), list):
            findings += literal_credential_findings(
                doc.subject,
                f"job_manifest containers[{container.get('name')}].env",
                {e.get("name"): e.get("value") for e in container["env"] if "value" in e},
            )
    return findings


def prefect_pod_field_findings(subject: str, pod_spec: dict) -> list[Finding]:
    """The worker validates the manifest before creating the Job: without these every submission fails."""
    return [
        Finding(
            subject,
            f"job_manifest spec.template.spec.{key}",
            pod_spec.get(key),
            value,
            "prefect-kubernetes rejects the job manifest without it: every flow-run submission fails",
        )
        for key, value in PREFECT_POD_FIELDS.items()
        if pod_spec.get(key) != value
    ]


def without_prefect_pod_fields(job: dict) -> dict:
    """The Job as the API server keeps it: the PodSpec fields prefect-kubernetes insists on are dropped."""
    pod_spec = ((job.get("spec") or {}).get("template") or {}).get("spec")
    if not isinstance(pod_spec, dict):
        return job
    kept = {k: v for k, v in pod_spec.items() if k not in PREFECT_POD_FIELDS}
    return {**job, "spec": {**job["spec"], "template": {**job["spec"]["template"], "spec": kept}}}


def _token_mount_findings(doc: Doc, docs: list[Doc], pod_spec: dict, defaults: dict, token_file: str) -> list[Finding]:
    """The flow-run pod must carry cluster.auth_token_file, from the Secret the RayCluster uses."""
    container = ray_container(pod_spec)
    mount = mount_for(container, str(PurePosixPath(token_file).parent))
    if mount is None:
        return [
            Finding(
                doc.subject,
                "job_manifest containers[0].volumeMounts",
                None,
                f"a mount at {PurePosixPath(token_file).parent}",
                f"config cluster.auth_token_file {token_file} would not exist in the flow-run pod",
            )
        ]
    volume = volume_named(pod_spec, mount.get("name"))
    secret = _resolve((volume.get("secret") or {}).get("secretName"), defaults)
    wanted: set[str] = {
        name
        for d in docs
        if d.kind == "RayCluster"
        if (name := ((d.obj.get("spec") or {}).get("authOptions") or {}).get("secretName"))
    }
    why = "the RayCluster's spec.authOptions.secretName: the flow would send a token the cluster rejects"
    if template_pool(doc) == CANARY_POOL:  # the canary's flow runs talk to the canary's clusters only
        wanted = {CANARY_TOKEN_SECRET}
        why = (
            "the canary clusters' own token (tuneproof/control/kube_canary.py): the canary cluster rejects any other, "
            "and the standing cluster's would let a candidate's flow run submit jobs to production"
        )
    if wanted and secret not in wanted:
        return [
            Finding(
                doc.subject,
                f"job_manifest volumes[{mount.get('name')}].secret.secretName",
                secret,
                sorted(wanted)[0],
                why,
            )
        ]
    return []


def _resolve(value, defaults: dict):
    if isinstance(value, str) and PLACEHOLDER_VARIABLE.match(value):
        return defaults.get(value.strip("{} "))
    return value


def pinned_variable_findings(doc: Doc) -> list[Finding]:
    """No job variable can name a Secret or a cluster, and image, service account and namespace are pinned."""
    variables = doc.obj.get("variables") or {}
    properties = variables.get("properties") or {}
    findings = []
    if variables.get("additionalProperties") is not False:
        findings.append(
            Finding(
                doc.subject,
                "variables.additionalProperties",
                variables.get("additionalProperties"),
                False,
                "the Prefect server then accepts job variables the schema does not list",
            )
        )
    for path, var in _placeholders(doc.obj.get("job_configuration") or {}, ["job_configuration"]):
        field, key, parent = dotted(path), path[-1], path[-2]
        schema = properties.get(var) or {}
        if var not in properties:
            findings.append(
                Finding(
                    doc.subject,
                    f"variables.properties.{var}",
                    None,
                    "a declared variable",
                    f"{field} uses it: an undeclared variable is never validated",
                )
            )
        if key in ("secretName", "cluster_config") or (key == "name" and parent in ("secretKeyRef", "secretRef")):
            what = (
                "a KubernetesClusterConfig block would point the worker at another cluster with other credentials"
                if key == "cluster_config"
                else "a deployment or flow run could mount any Secret in the namespace"
            )
            findings.append(Finding(doc.subject, field, "{{ " + var + " }}", "a fixed value, no variable", what))
        elif key in PINNED_FIELDS and not _pinned(schema):
            findings.append(
                Finding(
                    doc.subject,
                    f"variables.properties.{var}",
                    schema.get("default"),
                    "const: the one allowed value",
                    f"it fills {field}: a deployment or flow run could name any {PINNED_FIELDS[key]}",
                )
            )
        elif key in PINNED_FIELDS and "default" in schema and schema["default"] != pinned_value(schema):
            findings.append(
                Finding(
                    doc.subject,
                    f"variables.properties.{var}.default",
                    schema["default"],
                    pinned_value(schema),
                    "the Prefect server refuses a work pool whose default breaks its own schema",
                )
            )
    return findings


def _placeholders(node, path: list) -> list[tuple[list, str]]:
    """(path, variable) of every whole-value '{{ variable }}' in a job configuration."""
    if isinstance(node, str) and PLACEHOLDER_VARIABLE.match(node):
        return [(path, node.strip("{} "))]
    if isinstance(node, dict):
        return [found for k, v in node.items() for found in _placeholders(v, [*path, k])]
    if isinstance(node, list):
        return [found for i, v in enumerate(node) for found in _placeholders(v, [*path, i])]
    return []


def _pinned(schema: dict) -> bool:
    return "const" in schema or len(schema.get("enum") or []) == 1


def job_variables_schema_findings(subject: str, job_variables: dict, template: Doc) -> list[Finding]:
    """A deployment's job variables against the template's schema, as the Prefect server checks them on deploy."""
    schema = {
        k: v for k, v in (template.obj.get("variables") or {}).items() if k != "required"
    }  # required: at run time
    validator = jsonschema.Draft202012Validator(schema)
    return [
        Finding(
            subject,
            "work_pool.job_variables" + (f".{dotted(e.absolute_path)}" if e.absolute_path else ""),
            e.instance if not isinstance(e.instance, (dict, list)) else type(e.instance).__name__,
            f"{e.validator}: {json.dumps(e.validator_value)[:120]}",
            f"{template.file}'s variables schema: the Prefect server refuses the deployment (422): {e.message[:200]}",
        )
        for e in validator.iter_errors(job_variables)
    ]
