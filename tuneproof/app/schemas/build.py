"""Regenerate the offline schemas in this folder (run by hand when Kubernetes or KubeRay moves).

    pip download --no-deps -d /tmp/kv kubernetes-validate==1.37.0 && unzip -q /tmp/kv/*.whl -d /tmp/kv/x
    python -m tuneproof.app.schemas.build /tmp/kv/x/kubernetes_validate/kubernetes-json-schema/v1.34.0-local-strict \
        /path/to/ray.io_rayclusters.yaml

Without the CRD path only kubernetes-v1.34.json is rewritten (adding a core kind needs no KubeRay checkout).

Writes two self-contained JSON Schemas (draft 2020-12), descriptions stripped to keep them small:
- kubernetes-v1.34.json: the core kinds our manifests use, from kubernetes-validate's
  "local-strict" schemas (generated from the Kubernetes OpenAPI; unknown fields are errors).
  Each kind's root is `$defs["<apiVersion>/<Kind>"]`; shared types are the other `$defs`.
- raycluster-v1.json: the KubeRay CRD's `ray.io/v1` openAPIV3Schema, made strict the way
  `kubectl apply --validate=strict` is (unknown fields are errors, except where the CRD
  preserves them) and with OpenAPI's `nullable` turned into a JSON Schema null type. What the API
  server does beyond JSON Schema is carried over where it can be: a CEL rule `self in [...]` becomes
  an `enum`, and a field it defaults is not `required` (defaults are applied before validation).
  Its list-type map keys stay markers, checked by lint (documents.list_key_findings).
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import yaml

HERE = Path(__file__).resolve().parent
KUBERNETES_VERSION = "v1.34"
KINDS = {
    # apiVersion/Kind -> file name in the kubernetes-validate schema folder
    "v1/Namespace": "namespace-v1.json",
    "v1/ServiceAccount": "serviceaccount-v1.json",
    "v1/Service": "service-v1.json",
    "v1/ConfigMap": "configmap-v1.json",
    "v1/Secret": "secret-v1.json",
    "v1/Pod": "pod-v1.json",
    "v1/PersistentVolume": "persistentvolume-v1.json",
    "v1/PersistentVolumeClaim": "persistentvolumeclaim-v1.json",
    "apps/v1/Deployment": "deployment-apps-v1.json",
    "batch/v1/Job": "job-batch-v1.json",
    "rbac.authorization.k8s.io/v1/Role": "role-rbac-v1.json",
    "rbac.authorization.k8s.io/v1/ClusterRole": "clusterrole-rbac-v1.json",
    "rbac.authorization.k8s.io/v1/RoleBinding": "rolebinding-rbac-v1.json",
    "rbac.authorization.k8s.io/v1/ClusterRoleBinding": "clusterrolebinding-rbac-v1.json",
    "storage.k8s.io/v1/StorageClass": "storageclass-storage-v1.json",
    "networking.k8s.io/v1/NetworkPolicy": "networkpolicy-networking-v1.json",
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicy": "validatingadmissionpolicy-admissionregistration-v1.json",
    "admissionregistration.k8s.io/v1/ValidatingAdmissionPolicyBinding":
        "validatingadmissionpolicybinding-admissionregistration-v1.json",
}


def build_kubernetes(schema_dir: Path) -> dict:
    """Bundle the kinds above with the definitions they reach, refs rewritten to '#/$defs/...'."""
    definitions = json.loads((schema_dir / "_definitions.json").read_text())["$defs"]
    bundle: dict = {}
    for key, filename in KINDS.items():
        root = json.loads((schema_dir / filename).read_text())
        for meta in ("$schema", "$id"):
            root.pop(meta, None)
        bundle[key] = _rewrite_refs(root)
    pending = [ref for root in bundle.values() for ref in _refs(root)]
    while pending:
        name = pending.pop()
        if name not in bundle:
            bundle[name] = _rewrite_refs(definitions[name])
            pending.extend(_refs(bundle[name]))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"Kubernetes {KUBERNETES_VERSION} kinds from kubernetes-validate 1.37.0 (local-strict); "
                    "regenerate with python -m tuneproof.app.schemas.build",
        "$defs": {name: _strip_descriptions(bundle[name]) for name in sorted(bundle)},
    }


def build_raycluster(crd_path: Path) -> dict:
    crd = yaml.safe_load(crd_path.read_text())
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    schema = _strict(_strip_descriptions(version["schema"]["openAPIV3Schema"]))
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$comment": f"KubeRay RayCluster ray.io/v1 openAPIV3Schema from {crd_path.name} (Apache-2.0), strict; "
                    "regenerate with python -m tuneproof.app.schemas.build",
        **schema,
    }


def _rewrite_refs(node):
    if isinstance(node, dict):
        return {k: ("#" + v.split("#", 1)[1] if k == "$ref" else _rewrite_refs(v)) for k, v in node.items()}
    if isinstance(node, list):
        return [_rewrite_refs(x) for x in node]
    return node


def _refs(node) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"].removeprefix("#/$defs/")] if "$ref" in node else []
        return found + [r for v in node.values() for r in _refs(v)]
    if isinstance(node, list):
        return [r for x in node for r in _refs(x)]
    return []


def _strip_descriptions(node):
    if isinstance(node, dict):
        return {k: _strip_descriptions(v) for k, v in node.items() if not (k == "description" and isinstance(v, str))}
    if isinstance(node, list):
        return [_strip_descriptions(x) for x in node]
    return node


def _strict(node):
    """Unknown fields become errors where the CRD lists the fields; `nullable` admits null; a field the API server
    defaults is not required; a `self in [...]` rule is an enum."""
    if isinstance(node, list):
        return [_strict(x) for x in node]
    if not isinstance(node, dict):
        return node
    out = {k: (v if k == "properties" else _strict(v)) for k, v in node.items()}
    if "properties" in node:
        out["properties"] = {name: _strict(sub) for name, sub in node["properties"].items()}
        if "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            out["additionalProperties"] = False
    if out.pop("nullable", False) and isinstance(out.get("type"), str):
        out["type"] = [out["type"], "null"]
    if isinstance(node.get("required"), list):
        # The API server applies a CRD's defaults before it validates: a defaulted field is never missing.
        defaulted = {name for name, sub in (node.get("properties") or {}).items() if "default" in sub}
        required = [name for name in node["required"] if name not in defaulted]
        if required:
            out["required"] = required
        else:
            out.pop("required")
    for rule in node.get("x-kubernetes-validations") or []:
        values = _ONE_OF_RULE.match(rule.get("rule", ""))
        if values:
            out["enum"] = re.findall(r"'([^']*)'", values.group(1))
    return out


_ONE_OF_RULE = re.compile(r"^self in \[((?:\s*'[^']*'\s*,?)+)\]$")
"""A CEL rule that admits listed strings (spec.managedBy's): JSON Schema's enum says the same."""


def main(argv: list[str]) -> None:
    outputs = {f"kubernetes-{KUBERNETES_VERSION}.json": build_kubernetes(Path(argv[0]))}
    if len(argv) > 1:
        outputs["raycluster-v1.json"] = build_raycluster(Path(argv[1]))
    for name, schema in outputs.items():
        (HERE / name).write_text(json.dumps(schema, indent=None, separators=(",", ":"), sort_keys=True) + "\n")
        print(f"wrote {HERE / name}")


if __name__ == "__main__":
    main(sys.argv[1:])
