"""Static checks of deployment manifests, no cluster needed: `tuneproof lint [PATH...]`.

    tuneproof lint deployments/ [--config configs/eks.yaml]

Reads every *.yaml / *.yml / *.json under the given paths (multi-document YAML, `kind: List`, and
Prefect base job templates) and reports findings that name the file, the object (Kind/name), the
field, and both values:

- schema: core kinds against Kubernetes v1.34's schemas and RayCluster against the KubeRay CRD's
  openAPIV3Schema, both vendored in tuneproof/schemas/ and strict (unknown fields are errors, as
  with `kubectl apply --validate=strict`); a kind with no offline schema is a warning;
- image: a RayCluster container's image must be pinned by digest, always: the run record's image
  identity is the digest, and a tag can move under a running pipeline. Other workloads (the
  Prefect worker, the flow-run image) only get a warning for a tag, since they never train. The
  all-zero placeholder digest shipped in deployments/ is a warning until it is replaced;
- rayVersion == the Ray version in the image tag (when the repository is a Ray image and the tag
  starts with a version) and == config cluster.expect.ray_version;
- per group: an explicit Ray GPU count (rayStartParams num-gpus or resources.GPU) == the Ray
  container's nvidia.com/gpu limit; with a config, GPU worker groups offer cluster.expect.gpus_per_worker
  and an EFA device when cluster.expect.efa; connectivity.expect_transport efa needs NCCL_NET pinned
  to the OFI plugin so a socket fallback fails loudly;
- capacity: train.num_workers (use_gpu) <= sum over worker groups of pods x GPUs per pod;
- storage: with several nodes (head + worker pods), storage.root must be shared: s3:// (or another
  object store), or a path on a volume mounted in every group that is ReadWriteMany / NFS / FSx;
  hostPath, emptyDir, a ReadWriteOnce claim or no volume at all is an error;
- the Prefect base job template: its fixed parts validate as a batch/v1 Job, it mounts the directory
  of cluster.auth_token_file from the RayCluster's token Secret, and the service account it runs
  flows as is bound only to read verbs.

Without a config only the manifest-internal checks run. Pure apart from reading the files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path, PurePosixPath

import jsonschema
import yaml

from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding
from tuneproof.control.kube_checks import (
    EFA_RESOURCE, GPU_RESOURCE, as_count, group_pod_count, image_digest, image_tag, ray_container, ray_gpu_setting,
    resource_count, worker_groups,
)

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
KUBERNETES_SCHEMA = SCHEMA_DIR / "kubernetes-v1.34.json"
RAYCLUSTER_SCHEMA = SCHEMA_DIR / "raycluster-v1.json"
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
"""The digest deployments/ ships with: valid in form, to be replaced by the image's real digest."""
OFI_NET_NAMES = ("libfabric", "aws libfabric", "ofi")
"""NCCL_NET values naming the aws-ofi-nccl plugin (1.12+ reports Libfabric and accepts the other two)."""
READ_VERBS = {"get", "list", "watch"}
SHARED_VOLUME_KEYS = ("nfs",)
SHARED_CSI_DRIVERS = ("fsx.csi.aws.com", "efs.csi.aws.com", "s3.csi.aws.com")
_PLACEHOLDER = re.compile(r"^\{\{\s*[\w.]+\s*\}\}$")
_VERSION_PREFIX = re.compile(r"^v?(\d+\.\d+\.\d+)")


@dataclass(frozen=True)
class Doc:
    """One object read from a file: a Kubernetes object or a Prefect base job template."""

    file: str
    obj: dict

    @property
    def kind(self) -> str:
        return self.obj.get("kind", "") if not is_job_template(self.obj) else "PrefectBaseJobTemplate"

    @property
    def name(self) -> str:
        return (self.obj.get("metadata") or {}).get("name", "?")

    @property
    def subject(self) -> str:
        if is_job_template(self.obj):
            return f"{self.file}: Prefect base job template"
        return f"{self.file}: {self.kind}/{self.name}"


def lint_paths(paths: list[str], config: PipelineConfig | None) -> list[Finding]:
    """Every finding over the manifests under `paths` (files, or folders read recursively)."""
    docs, findings = load_documents(paths)
    for doc in docs:
        schema = schema_findings(doc)
        findings += schema
        if any(f.severity == "error" for f in schema):
            continue  # the other checks read typed fields; a broken object is reported by its schema alone
        if doc.kind == "RayCluster":
            findings += raycluster_findings(doc, docs, config)
        elif doc.kind in ("Deployment", "Job", "Pod"):
            findings += workload_image_findings(doc)
        elif doc.kind == "PrefectBaseJobTemplate":
            findings += job_template_findings(doc, docs, config)
    return findings


# ---------------------------------------------------------------- reading


def load_documents(paths: list[str]) -> tuple[list[Doc], list[Finding]]:
    docs, findings = [], []
    for file in manifest_files(paths):
        try:
            objects = _parse(file)
        except (yaml.YAMLError, json.JSONDecodeError) as e:
            findings.append(Finding(str(file), "content", "unparseable", "YAML or JSON", str(e).splitlines()[0]))
            continue
        for obj in objects:
            if not isinstance(obj, dict) or not (is_job_template(obj) or ("kind" in obj and "apiVersion" in obj)):
                findings.append(Finding(str(file), "document", type(obj).__name__,
                                        "a Kubernetes object (apiVersion, kind) or a Prefect base job template"))
                continue
            docs.append(Doc(str(file), obj))
    return docs, findings


def manifest_files(paths: list[str]) -> list[Path]:
    files = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files += sorted(p for p in path.rglob("*") if p.suffix in MANIFEST_SUFFIXES and p.is_file())
        elif path.exists():
            files.append(path)
        else:
            raise FileNotFoundError(f"lint: no such file or folder: {raw}")
    return files


def _parse(file: Path) -> list:
    text = file.read_text()
    raw = [json.loads(text)] if file.suffix == ".json" else [d for d in yaml.safe_load_all(text) if d is not None]
    objects = []
    for obj in raw:
        is_list = isinstance(obj, dict) and obj.get("kind", "").endswith("List") and "items" in obj
        objects += obj["items"] if is_list else [obj]
    return objects


def is_job_template(obj: dict) -> bool:
    return isinstance(obj, dict) and "job_configuration" in obj and "variables" in obj


# ---------------------------------------------------------------- schemas


def schema_findings(doc: Doc) -> list[Finding]:
    if doc.kind == "PrefectBaseJobTemplate":
        return []  # validated as the Job it renders, in job_template_findings
    validator = schema_validator(doc.obj.get("apiVersion", ""), doc.kind)
    if validator is None:
        return [Finding(doc.subject, "apiVersion/kind", f"{doc.obj.get('apiVersion')}/{doc.kind}",
                        "a kind with an offline schema", "not schema-checked", "warning")]
    return [_schema_finding(doc.subject, e) for e in sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.path))]


@lru_cache(maxsize=None)
def schema_validator(api_version: str, kind: str) -> jsonschema.Draft202012Validator | None:
    if api_version == "ray.io/v1" and kind == "RayCluster":
        return jsonschema.Draft202012Validator(json.loads(RAYCLUSTER_SCHEMA.read_text()))
    bundle = _kubernetes_bundle()
    key = f"{api_version}/{kind}"
    if key not in bundle["$defs"]:
        return None
    pointer = key.replace("~", "~0").replace("/", "~1")
    return jsonschema.Draft202012Validator({**bundle, "$ref": f"#/$defs/{pointer}"})


@lru_cache(maxsize=1)
def _kubernetes_bundle() -> dict:
    return json.loads(KUBERNETES_SCHEMA.read_text())


def _schema_finding(subject: str, error: jsonschema.ValidationError) -> Finding:
    seen = error.instance if not isinstance(error.instance, (dict, list)) else type(error.instance).__name__
    expected = f"{error.validator}: {json.dumps(error.validator_value)[:120]}"
    return Finding(subject, _dotted(error.absolute_path) or "<root>", seen, expected, error.message[:300])


def _dotted(path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


# ---------------------------------------------------------------- RayCluster


def raycluster_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    groups = ray_groups(doc.obj)
    findings = []
    for where, group in groups:
        findings += ray_image_findings(doc, where, group, config)
        findings += gpu_setting_findings(doc, where, group)
    findings += ray_version_findings(doc, groups, config)
    if config is not None:
        findings += worker_expectation_findings(doc, config)
        findings += capacity_findings(doc, config)
        findings += storage_findings(doc, docs, config)
    return findings


def ray_groups(raycluster: dict) -> list[tuple[str, dict]]:
    """(field prefix, group spec) for the head group and every worker group."""
    head = ((raycluster.get("spec") or {}).get("headGroupSpec") or {})
    return [("spec.headGroupSpec", head),
            *((f"spec.workerGroupSpecs[{g.get('groupName')}]", g) for g in worker_groups(raycluster))]


def _pod_spec(group: dict) -> dict:
    return (group.get("template") or {}).get("spec") or {}


def _containers(pod_spec: dict) -> list[dict]:
    return [*(pod_spec.get("initContainers") or []), *(pod_spec.get("containers") or [])]


def ray_image_findings(doc: Doc, where: str, group: dict, config: PipelineConfig | None) -> list[Finding]:
    expected = config.cluster.expect.image if config else None
    findings = []
    for container in _containers(_pod_spec(group)):
        field = f"{where}.template.spec.containers[{container.get('name')}].image"
        findings += _digest_findings(doc.subject, field, container.get("image", ""))
        digest = image_digest(container.get("image"))
        if expected and digest and digest != image_digest(expected):
            findings.append(Finding(doc.subject, field, container.get("image"), expected,
                                    "differs from the config's cluster.expect.image: verify would fail every pod"))
    return findings


def _digest_findings(subject: str, field: str, image: str) -> list[Finding]:
    digest = image_digest(image)
    if digest is None or not image.endswith("@" + digest):
        return [Finding(subject, field, image, f"{image.split('@')[0]}@sha256:<64 hex>",
                        "pin the image by digest: a tag can move to different bytes")]
    if digest == PLACEHOLDER_DIGEST:
        return [Finding(subject, field, digest, "the image's real digest",
                        "placeholder digest: get the real one with `aws ecr describe-images` or `crane digest`",
                        "warning")]
    return []


def gpu_setting_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """An explicit Ray GPU count must equal the Ray container's nvidia.com/gpu limit."""
    setting = ray_gpu_setting(group)
    if setting is None:
        return []  # KubeRay then derives num-gpus from the limit itself
    field, raw = setting
    container = ray_container(_pod_spec(group))
    limit = resource_count(container, GPU_RESOURCE)
    if as_count(raw) == limit:
        return []
    return [Finding(doc.subject, f"{where}.{field}", raw, str(limit),
                    f"the Ray container {container.get('name')}'s {GPU_RESOURCE} limit is {limit}: "
                    "Ray must advertise exactly the GPUs the pod owns")]


def ray_version_findings(doc: Doc, groups: list[tuple[str, dict]], config: PipelineConfig | None) -> list[Finding]:
    declared = (doc.obj.get("spec") or {}).get("rayVersion")
    findings = []
    for where, group in groups:
        image = ray_container(_pod_spec(group)).get("image", "")
        in_tag = ray_version_in_image(image)
        if in_tag and declared != in_tag:
            findings.append(Finding(doc.subject, "spec.rayVersion", declared, in_tag,
                                    f"the Ray version in {where}'s image tag ({image.split('@')[0]})"))
    expected = config.cluster.expect.ray_version if config else None
    if expected and declared != expected:
        findings.append(Finding(doc.subject, "spec.rayVersion", declared, expected,
                                "config cluster.expect.ray_version"))
    return _unique(findings)


def ray_version_in_image(image: str) -> str | None:
    """'.../ray-train:2.58.0-gpu-py313-cu130@sha256:...' -> '2.58.0' (Ray images only, version-first tags)."""
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0]
    match = _VERSION_PREFIX.match(image_tag(image) or "")
    return match.group(1) if match and "ray" in repository.lower() else None


def worker_expectation_findings(doc: Doc, config: PipelineConfig) -> list[Finding]:
    """GPU worker groups offer the expected GPUs per pod, EFA, and NCCL pinned to the OFI plugin."""
    expect = config.cluster.expect
    findings = []
    for group in worker_groups(doc.obj):
        where = f"spec.workerGroupSpecs[{group.get('groupName')}]"
        container = ray_container(_pod_spec(group))
        gpus = resource_count(container, GPU_RESOURCE)
        if not gpus:
            continue
        limits_field = f"{where}.template.spec.containers[{container.get('name')}].resources.limits"
        if expect.gpus_per_worker and gpus != expect.gpus_per_worker:
            findings.append(Finding(doc.subject, f"{limits_field}[{GPU_RESOURCE}]", gpus, expect.gpus_per_worker,
                                    "config cluster.expect.gpus_per_worker"))
        if expect.efa and not resource_count(container, EFA_RESOURCE) and not _pod_spec(group).get("resourceClaims"):
            findings.append(Finding(doc.subject, f"{limits_field}[{EFA_RESOURCE}]", 0, ">= 1 (or a DRA resourceClaim)",
                                    "config cluster.expect.efa: without an EFA device NCCL can only use sockets"))
        if config.connectivity.expect_transport == "efa":
            findings += _nccl_net_findings(doc, where, container)
    return findings


def _nccl_net_findings(doc: Doc, where: str, container: dict) -> list[Finding]:
    env = {e.get("name"): e.get("value") for e in container.get("env") or []}
    if (env.get("NCCL_NET") or "").strip().lower() in OFI_NET_NAMES:
        return []
    return [Finding(doc.subject, f"{where}.template.spec.containers[{container.get('name')}].env[NCCL_NET]",
                    env.get("NCCL_NET"), "Libfabric",
                    "connectivity.expect_transport efa: unpinned, NCCL silently falls back to sockets when the "
                    "OFI plugin fails to load")]


def cluster_gpu_capacity(raycluster: dict) -> int:
    """GPUs the worker groups offer Ray: pods x GPUs per pod (the explicit Ray count, else the limit)."""
    total = 0
    for group in worker_groups(raycluster):
        setting = ray_gpu_setting(group)
        per_pod = as_count(setting[1]) if setting else resource_count(ray_container(_pod_spec(group)), GPU_RESOURCE)
        total += group_pod_count(raycluster, group) * (per_pod or 0)
    return total


def capacity_findings(doc: Doc, config: PipelineConfig) -> list[Finding]:
    train = config.train
    if not train.use_gpu:
        return []
    capacity = cluster_gpu_capacity(doc.obj)
    if train.num_workers <= capacity:
        return []
    return [Finding(doc.subject, "GPUs over workerGroupSpecs (pods x GPUs per pod)", capacity,
                    f">= {train.num_workers}", f"config train.num_workers={train.num_workers} with use_gpu: "
                    "the ScalingConfig asks for more GPU workers than the cluster can place")]


# ---------------------------------------------------------------- storage


def node_count(raycluster: dict) -> int:
    return 1 + sum(group_pod_count(raycluster, g) for g in worker_groups(raycluster))


def storage_findings(doc: Doc, docs: list[Doc], config: PipelineConfig) -> list[Finding]:
    """With several nodes the storage root must be the same place for every one of them."""
    nodes = node_count(doc.obj)
    root = config.storage.root
    if nodes <= 1:
        return []
    if not config.storage.shared:
        return [Finding(doc.subject, "storage.shared", False, True, f"{nodes} nodes need one shared storage root")]
    if "://" in root:
        return []
    return [f for where, group in ray_groups(doc.obj) for f in _group_storage(doc, docs, where, group, root, nodes)]


def _group_storage(doc: Doc, docs: list[Doc], where: str, group: dict, root: str, nodes: int) -> list[Finding]:
    pod_spec = _pod_spec(group)
    container = ray_container(pod_spec)
    mount = _mount_for(container, root)
    field = f"{where}.template.spec.containers[{container.get('name')}].volumeMounts"
    if mount is None:
        return [Finding(doc.subject, field, None, f"a shared volume mounted at a parent of {root}",
                        f"storage.root {root} is on each pod's own disk: {nodes} nodes would each see different files")]
    volume = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == mount.get("name")), {})
    kind, ok, why = _volume_sharing(volume, docs, doc.obj)
    if ok:
        return []
    return [Finding(doc.subject, f"{where}.template.spec.volumes[{mount.get('name')}]", kind,
                    "ReadWriteMany PVC, NFS or FSx/EFS CSI", f"storage.root {root} with {nodes} nodes: {why}",
                    "warning" if ok is None else "error")]


def _mount_for(container: dict, root: str) -> dict | None:
    """The deepest volumeMount whose mountPath is root or a parent of it."""
    mounts = [m for m in container.get("volumeMounts") or []
              if m.get("mountPath") and PurePosixPath(root).is_relative_to(m["mountPath"])]
    return max(mounts, key=lambda m: len(m.get("mountPath", "")), default=None)


def _volume_sharing(volume: dict, docs: list[Doc], raycluster: dict) -> tuple[str, bool | None, str]:
    """(volume type, shared? True/False/None for unknown, why)."""
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"].get("claimName")
        namespace = (raycluster.get("metadata") or {}).get("namespace")
        pvc = next((d.obj for d in docs if d.kind == "PersistentVolumeClaim" and d.name == claim
                    and (d.obj.get("metadata") or {}).get("namespace") in (namespace, None)), None)
        if pvc is None:
            return (f"persistentVolumeClaim {claim}", None,
                    "the claim is not among the linted files, its access mode is unknown")
        modes = (pvc.get("spec") or {}).get("accessModes") or []
        return f"persistentVolumeClaim {claim} {modes}", "ReadWriteMany" in modes, "the claim is not ReadWriteMany"
    if any(key in volume for key in SHARED_VOLUME_KEYS):
        return "nfs", True, ""
    if "csi" in volume:
        driver = volume["csi"].get("driver")
        return f"csi {driver}", driver in SHARED_CSI_DRIVERS, "not a known shared file system driver"
    kind = next((k for k in volume if k != "name"), "unknown")
    return kind, False, f"a {kind} volume is local to one node"


# ---------------------------------------------------------------- other workloads and the Prefect template


def workload_image_findings(doc: Doc) -> list[Finding]:
    """Non-Ray workloads: a tag-only image is a warning (they never train, but they do run code)."""
    spec = doc.obj.get("spec") or {}
    pod_spec = spec if doc.kind == "Pod" else (spec.get("template") or {}).get("spec") or {}
    return [f for c in _containers(pod_spec)
            for f in _tag_only(doc.subject, f"containers[{c.get('name')}].image", c.get("image", ""))]


def _tag_only(subject: str, field: str, image: str) -> list[Finding]:
    if image_digest(image) is not None or _PLACEHOLDER.match(image):
        return []
    return [Finding(subject, field, image, f"{image.split('@')[0]}@sha256:<64 hex>",
                    "tag only: the pod may run different code after a re-push", "warning")]


def job_template_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    manifest = (doc.obj.get("job_configuration") or {}).get("job_manifest") or {}
    defaults = {k: v.get("default") for k, v in ((doc.obj.get("variables") or {}).get("properties") or {}).items()}
    fixed = drop_placeholders(manifest)
    validator = schema_validator("batch/v1", "Job")
    findings = [_schema_finding(doc.subject, e) for e in validator.iter_errors(fixed)]
    pod_spec = ((manifest.get("spec") or {}).get("template") or {}).get("spec") or {}
    findings += _tag_only(doc.subject, "variables.properties.image.default", defaults.get("image") or "{{ image }}")
    if config is not None and config.cluster.auth_token_file:
        findings += _token_mount_findings(doc, docs, pod_spec, defaults, config.cluster.auth_token_file)
    findings += _read_only_findings(doc, docs, defaults.get("service_account_name"), defaults.get("namespace"))
    return findings


def drop_placeholders(node):
    """The template with every whole-value '{{ var }}' removed: what is fixed whatever the variables are."""
    if isinstance(node, dict):
        return {k: drop_placeholders(v) for k, v in node.items() if not (isinstance(v, str) and _PLACEHOLDER.match(v))}
    if isinstance(node, list):
        return [drop_placeholders(x) for x in node if not (isinstance(x, str) and _PLACEHOLDER.match(x))]
    return node


def _token_mount_findings(doc: Doc, docs: list[Doc], pod_spec: dict, defaults: dict, token_file: str) -> list[Finding]:
    """The flow-run pod must carry cluster.auth_token_file, from the Secret the RayCluster uses."""
    container = ray_container(pod_spec)
    mount = _mount_for(container, str(PurePosixPath(token_file).parent))
    if mount is None:
        return [Finding(doc.subject, "job_manifest containers[0].volumeMounts", None,
                        f"a mount at {PurePosixPath(token_file).parent}",
                        f"config cluster.auth_token_file {token_file} would not exist in the flow-run pod")]
    volume = next((v for v in pod_spec.get("volumes") or [] if v.get("name") == mount.get("name")), {})
    secret = _resolve((volume.get("secret") or {}).get("secretName"), defaults)
    wanted = {((d.obj.get("spec") or {}).get("authOptions") or {}).get("secretName")
              for d in docs if d.kind == "RayCluster"} - {None}
    if wanted and secret not in wanted:
        return [Finding(doc.subject, f"job_manifest volumes[{mount.get('name')}].secret.secretName", secret,
                        sorted(wanted)[0], "the RayCluster's spec.authOptions.secretName: the flow would send a token "
                        "the cluster rejects")]
    return []


def _resolve(value, defaults: dict):
    if isinstance(value, str) and _PLACEHOLDER.match(value):
        return defaults.get(value.strip("{} "))
    return value


def _read_only_findings(doc: Doc, docs: list[Doc], account: str | None, namespace: str | None) -> list[Finding]:
    """Roles bound to the flow-run service account grant read verbs only."""
    if not account:
        return []
    findings = []
    for role in _roles_bound_to(docs, account, namespace):
        for i, rule in enumerate(role.obj.get("rules") or []):
            writes = sorted(set(rule.get("verbs") or []) - READ_VERBS)
            if writes:
                findings.append(Finding(role.subject, f"rules[{i}].verbs", writes, sorted(READ_VERBS),
                                        f"bound to {account}, the flow-run service account of {doc.file}: "
                                        "the pipeline only reads the cluster"))
    return findings


def _roles_bound_to(docs: list[Doc], account: str, namespace: str | None) -> list[Doc]:
    refs = set()
    for binding in (d for d in docs if d.kind in ("RoleBinding", "ClusterRoleBinding")):
        if any(s.get("kind") == "ServiceAccount" and s.get("name") == account
               and s.get("namespace", (binding.obj.get("metadata") or {}).get("namespace")) == namespace
               for s in binding.obj.get("subjects") or []):
            ref = binding.obj.get("roleRef") or {}
            refs.add((ref.get("kind"), ref.get("name")))
    return [d for d in docs if (d.kind, d.name) in refs]


def _unique(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))
