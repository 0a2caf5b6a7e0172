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
  Prefect worker) only get a warning for a tag, since they never train. The all-zero placeholder
  digest shipped in deployments/ is a warning until it is replaced;
- rayVersion == the Ray version the image tag names (a version-first tag, or a Ray Train DLC
  train-ml-cuda-vX.Y tag looked up in schemas/ray-train-dlc.yaml; a Ray image whose tag maps to no
  version is a warning, never a silent skip) and == config cluster.expect.ray_version;
- Ray pods: /dev/shm is a memory-backed emptyDir of 30-50% of the container's memory limit; on the
  instance type a group selects (schemas/eks-instance-types.yaml) the requests fit its estimated
  allocatable and FI_EFA_USE_DEVICE_RDMA=1 needs GPUDirect RDMA; a group with an EFA device sets
  FI_PROVIDER=efa; NCCL_SOCKET_IFNAME never names the loopback interface;
- claims: every persistentVolumeClaim a pod mounts is among the linted objects, in its namespace;
  an FSx for Lustre StorageClass mounts with `flock` (the Hugging Face cache locks files);
- per group: an explicit Ray GPU count (rayStartParams num-gpus or resources.GPU) == the Ray
  container's nvidia.com/gpu limit; with a config, GPU worker groups offer cluster.expect.gpus_per_worker
  and an EFA device when cluster.expect.efa; connectivity.expect_transport efa needs NCCL_NET pinned
  to the OFI plugin so a socket fallback fails loudly;
- capacity: train.num_workers (use_gpu) <= sum over worker groups of pods x GPUs per pod;
- storage: with several nodes (head + worker pods), storage.root must be shared: s3:// (or another
  object store), or a path on a volume mounted in every group that is ReadWriteMany / NFS / FSx;
  hostPath, emptyDir, a ReadWriteOnce claim or no volume at all is an error, and so is the S3 CSI
  driver (Mountpoint: no rename, no append, which checkpoints and completion markers need). An
  s3:// root needs an IRSA-annotated service account for every Ray group and for flow runs;
- the Prefect base job template: its fixed parts validate as a batch/v1 Job and carry the pod-spec
  parallelism/completions prefect-kubernetes insists on, it mounts the directory of
  cluster.auth_token_file from the RayCluster's token Secret, and the service account it runs flows
  as is bound only to read verbs;
- a Prefect Kubernetes worker bound only by namespaced Roles sets PREFECT_KUBERNETES_CLUSTER_UID and
  PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES (covering the flow-run namespace), and its
  Roles cover the namespace the flow-run Jobs are created in;
- a Prefect project file (prefect.yaml): every deployment on a pool such a worker polls runs a
  non-stock flow-run image pinned by digest, in a namespace the worker's Role covers, as a service
  account with IRSA when its storage root is s3://, with job variables the template's schema accepts;
- hardening (SECURITY.md): a Namespace enforces, audits and warns the restricted Pod Security profile,
  and every container of every pod spec here (Ray groups, workloads, the job template) passes it
  (non-root, no privilege escalation, capabilities dropped, RuntimeDefault seccomp, no host namespaces,
  ports or hostPath); Ray pods mount no service-account token, the worker and flow-run pods keep theirs;
  a NetworkPolicy limits ingress to every Ray group's pods, and every policy selecting them admits only
  the RayCluster's own pods or the flow-run pods; the job template pins image, service account and
  namespace (const), lets no variable name a Secret or a cluster, and lists every variable it takes;
  a Prefect Kubernetes worker takes its API credential from a secretKeyRef and names that Secret for
  the flow runs, and no credential is written as a value in the worker, the template or job variables;
  with such a worker linted, a ValidatingAdmissionPolicy bound with Deny holds the Jobs its service
  account creates to the template's pinned image and account and to the Secrets the flow runs use;
- the image canary (SECURITY.md, "The image canary"): image-canary, and no other deployment, runs on the
  tuneproof-eks-canary pool, whose template (prefect-k8s-canary-job-template.json) pins tuneproof-canary
  and equals the pipeline's template but for that account; no other template pins it; the roles bound to
  tuneproof-canary write nothing but create/delete on rayclusters and grant every call the canary makes;
  the admission policy maps each worker's account to its own pool's account, and no worker account polls
  two pools; a Deny-bound policy holds the canary's RayCluster creates and deletes to its name prefix and
  to raycluster.yaml's service account and token Secret.

Without a config only the manifest-internal checks run. Pure apart from reading the files.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, replace
from functools import cache, lru_cache
from pathlib import Path, PurePosixPath

import jsonschema
import yaml

from tuneproof.control.images import CANARY_CLUSTER_PREFIX
from tuneproof.control.kube_checks import (
    EFA_RESOURCE,
    GPU_RESOURCE,
    as_count,
    group_pod_count,
    image_digest,
    image_tag,
    ray_container,
    ray_gpu_setting,
    resource_count,
    worker_groups,
)
from tuneproof.core.config import PipelineConfig
from tuneproof.core.files import parse_yaml_all, read_regular
from tuneproof.core.findings import Finding, Severity

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"
KUBERNETES_SCHEMA = SCHEMA_DIR / "kubernetes-v1.34.json"
RAYCLUSTER_SCHEMA = SCHEMA_DIR / "raycluster-v1.json"
DLC_TABLE = SCHEMA_DIR / "ray-train-dlc.yaml"
INSTANCE_TABLE = SCHEMA_DIR / "eks-instance-types.yaml"
MANIFEST_SUFFIXES = (".yaml", ".yml", ".json")
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
"""The digest deployments/ ships with: valid in form, to be replaced by the image's real digest."""
OFI_NET_NAMES = ("libfabric", "aws libfabric", "ofi")
"""NCCL_NET values naming the aws-ofi-nccl plugin (1.12+ reports Libfabric and accepts the other two)."""
READ_VERBS = {"get", "list", "watch"}
SHARED_VOLUME_KEYS = ("nfs",)
SHARED_CSI_DRIVERS = ("fsx.csi.aws.com", "efs.csi.aws.com")
S3_CSI_DRIVER = "s3.csi.aws.com"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
MOUNTPOINT_WHY = (
    "the S3 CSI driver (Mountpoint for Amazon S3) supports no rename and no append: checkpoints, "
    "completion markers and the record's atomic writes need both; use s3:// or FSx/EFS"
)
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"
DAEMONSET_ALLOWANCE = (0.5, 1.0)
"""(cores, GiB) kept on every node for the EKS add-on DaemonSets (aws-node, kube-proxy, CSI node plugins,
the NVIDIA and EFA device plugins) when checking that a Ray pod fits its node."""
SHM_FRACTION = (0.3, 0.5)
"""/dev/shm sizeLimit as a share of the Ray container's memory limit: at least Ray's default object store
(30% of memory), at most half, since tmpfs pages count against the same limit."""
STOCK_PREFECT_REPOSITORIES = ("prefecthq/prefect", "prefecthq/prefect-client")
CLUSTER_UID_ENV = "PREFECT_KUBERNETES_CLUSTER_UID"
OBSERVER_NAMESPACES_ENV = "PREFECT_INTEGRATIONS_KUBERNETES_OBSERVER_NAMESPACES"
PLACEHOLDER_UID = "00000000-0000-0000-0000-000000000000"
"""The cluster UID deployments/prefect-worker.yaml ships with, to be replaced by kube-system's UID."""
WORKLOAD_KINDS = ("Deployment", "Job", "Pod")
PREFECT_POD_FIELDS = {"parallelism": 1, "completions": 1}
"""prefect-kubernetes refuses a job manifest without these in spec.template.spec (its own default template has
them there, though a PodSpec has no such fields; the API server drops them with a warning)."""
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
PINNED_FIELDS = {
    "image": "image",
    "serviceAccountName": "service account",
    "serviceAccount": "service account",
    "namespace": "namespace",
}
"""Job-manifest fields a work-pool variable may fill only when its schema pins it to one value (const)."""
PREFECT_CREDENTIALS = ("PREFECT_API_KEY", "PREFECT_API_AUTH_STRING", "PREFECT_SERVER_API_AUTH_STRING")
CREDENTIAL_SECRET_SETTINGS = {
    "PREFECT_API_AUTH_STRING": "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_AUTH_STRING_SECRET",
    "PREFECT_API_KEY": "PREFECT_INTEGRATIONS_KUBERNETES_WORKER_API_KEY_SECRET",
}
"""prefect-kubernetes (0.8.0) rewrites a flow-run Job's credential into a secretKeyRef when the worker has <setting>_NAME
and <setting>_KEY; otherwise it copies the worker's own value into the Job manifest."""
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
_ACCOUNT_MAP_ENTRY = re.compile(r"'(system:serviceaccount:[^':]+:[^']+)'\s*:\s*'([^']+)'")
_PLACEHOLDER = re.compile(r"^\{\{\s*[\w.]+\s*\}\}$")
_VERSION_PREFIX = re.compile(r"^v?(\d+\.\d+\.\d+)")
_DLC_VERSION = re.compile(r"^v(\d+)\.(\d+)(?:\.(\d+))?$")
_QUANTITY = re.compile(r"^(\d+(?:\.\d+)?)([a-zA-Z]*)$")
_MEMORY_UNITS = {"": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}


@dataclass(frozen=True)
class Doc:
    """One object read from a file: a Kubernetes object or a Prefect base job template."""

    file: str
    obj: dict

    @property
    def kind(self) -> str:
        if is_job_template(self.obj):
            return "PrefectBaseJobTemplate"
        return "PrefectProject" if is_prefect_project(self.obj) else self.obj.get("kind", "")

    @property
    def metadata(self) -> dict:
        meta = self.obj.get("metadata")
        return meta if isinstance(meta, dict) else {}  # a malformed one is the schema check's to report

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", "?"))

    @property
    def namespace(self) -> str | None:
        return self.metadata.get("namespace")

    @property
    def subject(self) -> str:
        if self.kind.startswith("Prefect"):
            return f"{self.file}: " + ("Prefect base job template" if is_job_template(self.obj) else "Prefect project")
        return f"{self.file}: {self.kind}/{self.name}"


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
        return raycluster_findings(doc, docs, config)
    if doc.kind in WORKLOAD_KINDS:
        return workload_findings(doc, docs)
    if doc.kind == "StorageClass":
        return storage_class_findings(doc)
    if doc.kind == "Namespace":
        return namespace_findings(doc)
    if doc.kind == "NetworkPolicy":
        return network_policy_findings(doc, docs)
    if doc.kind == "PrefectBaseJobTemplate":
        return job_template_findings(doc, docs, config)
    if doc.kind == "PrefectProject":
        return prefect_project_findings(doc, docs, config)
    return []


# ---------------------------------------------------------------- reading


MAX_MANIFEST_BYTES = 16 << 20
"""Kubernetes refuses objects over about 1.5 MB; a file past this (or a device, a FIFO) is no manifest."""


def load_documents(paths: list[str]) -> tuple[list[Doc], list[Finding]]:
    docs, findings = [], []
    for file in manifest_files(paths):
        try:
            objects = _parse(file)
        except (yaml.YAMLError, json.JSONDecodeError, RecursionError) as e:
            findings.append(Finding(str(file), "content", "unparseable", "YAML or JSON", str(e).splitlines()[0]))
            continue
        except UnicodeDecodeError as e:
            findings.append(Finding(str(file), "content", f"not UTF-8 (byte {e.start})", "UTF-8 YAML or JSON"))
            continue
        except OSError as e:
            findings.append(Finding(str(file), "file", f"unreadable: {e.strerror or e}", "a readable file"))
            continue
        for obj in objects:
            if isinstance(obj, dict) and str(obj.get("kind", "")).endswith("List") and "items" in obj:
                # _parse expands every well-formed List: one left over has items that are not a list.
                findings.append(
                    Finding(str(file), "items", type(obj["items"]).__name__, "a list of Kubernetes objects")
                )
                continue
            typed = (
                isinstance(obj, dict) and isinstance(obj.get("kind"), str) and isinstance(obj.get("apiVersion"), str)
            )
            known = is_job_template(obj) or is_prefect_project(obj) or typed
            if not isinstance(obj, dict) or not known:
                findings.append(
                    Finding(
                        str(file),
                        "document",
                        type(obj).__name__,
                        "a Kubernetes object (apiVersion, kind), a Prefect base job template or a Prefect project file",
                    )
                )
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
    text = read_regular(file, MAX_MANIFEST_BYTES).decode("utf-8")
    raw = [json.loads(text)] if file.suffix == ".json" else [d for d in parse_yaml_all(text) if d is not None]
    objects: list = []
    for obj in raw:
        kind = obj.get("kind") if isinstance(obj, dict) else None
        is_list = isinstance(kind, str) and kind.endswith("List") and isinstance(obj.get("items"), list)
        objects += obj["items"] if is_list else [obj]
    return objects


def is_job_template(obj: dict) -> bool:
    return isinstance(obj, dict) and "job_configuration" in obj and "variables" in obj


def is_prefect_project(obj: dict) -> bool:
    """prefect.yaml: a deployments list and no Kubernetes kind."""
    return isinstance(obj, dict) and isinstance(obj.get("deployments"), list) and "kind" not in obj


# ---------------------------------------------------------------- schemas


def schema_findings(doc: Doc) -> list[Finding]:
    if doc.kind.startswith("Prefect"):
        return []  # a base job template is validated as the Job it renders, in job_template_findings
    validator = schema_validator(doc.obj.get("apiVersion", ""), doc.kind)
    if validator is None:
        return [
            Finding(
                doc.subject,
                "apiVersion/kind",
                f"{doc.obj.get('apiVersion')}/{doc.kind}",
                "a kind with an offline schema",
                "not schema-checked",
                "warning",
            )
        ]
    return [_schema_finding(doc.subject, e) for e in sorted(validator.iter_errors(doc.obj), key=lambda e: list(e.path))]


@cache
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
        findings += shm_findings(doc, where, group)
        findings += node_fit_findings(doc, where, group)
        findings += efa_env_findings(doc, where, group)
        findings += claim_findings(doc, docs, f"{where}.template.spec", _pod_spec(group))
        findings += pod_security_findings(doc.subject, f"{where}.template.spec", _pod_spec(group))
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
        containers = (_pod_spec(group).get("containers") or [])[:1]  # the Ray container runs the jobs
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


def ray_groups(raycluster: dict) -> list[tuple[str, dict]]:
    """(field prefix, group spec) for the head group and every worker group."""
    head = (raycluster.get("spec") or {}).get("headGroupSpec") or {}
    return [
        ("spec.headGroupSpec", head),
        *((f"spec.workerGroupSpecs[{g.get('groupName')}]", g) for g in worker_groups(raycluster)),
    ]


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
            findings.append(
                Finding(
                    doc.subject,
                    field,
                    container.get("image"),
                    expected,
                    "differs from the image EKS runs pin (cluster.expect.image, or images/current.json once a "
                    "canary adopted one): verify would fail every pod",
                )
            )
    return findings


def _digest_findings(subject: str, field: str, image: str, unpinned: Severity = "error") -> list[Finding]:
    digest = image_digest(image)
    if digest is None or not image.endswith("@" + digest):
        return [
            Finding(
                subject,
                field,
                image,
                f"{image.split('@')[0]}@sha256:<64 hex>",
                "pin the image by digest: a tag can move to different bytes",
                unpinned,
            )
        ]
    if digest == PLACEHOLDER_DIGEST:
        return [
            Finding(
                subject,
                field,
                digest,
                "the image's real digest",
                'placeholder digest: put the real one here (deployments/README.md, "The two images")',
                "warning",
            )
        ]
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


def ray_version_findings(doc: Doc, groups: list[tuple[str, dict]], config: PipelineConfig | None) -> list[Finding]:
    declared = (doc.obj.get("spec") or {}).get("rayVersion")
    findings = []
    for where, group in groups:
        image = ray_container(_pod_spec(group)).get("image", "")
        in_tag, why_not = image_ray_version(image)
        if in_tag and declared != in_tag:
            findings.append(
                Finding(
                    doc.subject,
                    "spec.rayVersion",
                    declared,
                    in_tag,
                    f"the Ray version in {where}'s image tag ({image.split('@')[0]})",
                )
            )
        elif why_not:
            findings.append(
                Finding(
                    doc.subject,
                    f"{where}.template.spec.containers[0].image tag",
                    image_tag(image),
                    "a tag naming a Ray version (X.Y.Z-..., or train-ml-cuda-vX.Y)",
                    f"{why_not}: rayVersion {declared} is not checked against the image",
                    "warning",
                )
            )
    expected = config.cluster.expect.ray_version if config else None
    if expected and declared != expected:
        findings.append(
            Finding(doc.subject, "spec.rayVersion", declared, expected, "config cluster.expect.ray_version")
        )
    return _unique(findings)


def ray_version_in_image(image: str) -> str | None:
    """'.../ray-train:2.58.0-gpu-py313-cu130@sha256:...' -> '2.58.0'; '.../ray:train-ml-cuda-v1.1' -> '2.58.0'."""
    return image_ray_version(image)[0]


def image_ray_version(image: str) -> tuple[str | None, str]:
    """(the Ray version the image's tag names, or None and why not; '' when it is not a Ray image)."""
    repository = image.split("@", 1)[0].rsplit("/", 1)[-1].split(":", 1)[0].lower()
    tag = image_tag(image) or ""
    if "ray" not in repository:
        return None, ""
    if match := _VERSION_PREFIX.match(tag):
        return match.group(1), ""
    table = ray_train_dlc()
    if tag.startswith(table["tag_prefix"]):
        return dlc_ray_version(tag, table)
    if not tag:
        return None, "no tag, only a digest"
    return None, f"tag {tag!r} names no Ray version tuneproof can read"


def dlc_ray_version(tag: str, table: dict) -> tuple[str | None, str]:
    """A Ray Train DLC tag's Ray version from the changelog table; floating and unknown tags say why not."""
    if tag in table["floating"]:
        return None, f"{tag} is a floating DLC tag (it follows the newest release)"
    match = _DLC_VERSION.match(tag.removeprefix(table["tag_prefix"] + "-"))
    if match is None:
        return None, f"{tag} is not a versioned DLC tag ({table['tag_prefix']}-vX.Y[.Z])"
    major, minor, patch = match.groups()
    wanted = f"v{major}.{minor}." + (patch or "")
    rays = {r["ray"] for v, r in table["releases"].items() if (v == wanted if patch else v.startswith(wanted))}
    if len(rays) == 1:
        return rays.pop(), ""
    return None, f"{tag} is not in {DLC_TABLE.name}: add its release from the DLC changelog"


@lru_cache(maxsize=1)
def ray_train_dlc() -> dict:
    return yaml.safe_load(DLC_TABLE.read_text())


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
            findings.append(
                Finding(
                    doc.subject,
                    f"{limits_field}[{GPU_RESOURCE}]",
                    gpus,
                    expect.gpus_per_worker,
                    "config cluster.expect.gpus_per_worker",
                )
            )
        if expect.efa and not resource_count(container, EFA_RESOURCE) and not _pod_spec(group).get("resourceClaims"):
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


# ---------------------------------------------------------------- Ray pods on their nodes


def shm_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """/dev/shm is a memory-backed emptyDir of 30-50% of the Ray container's memory limit."""
    pod_spec = _pod_spec(group)
    container = ray_container(pod_spec)
    mount = next((m for m in container.get("volumeMounts") or [] if m.get("mountPath") == "/dev/shm"), None)
    if mount is None:
        return [
            Finding(
                doc.subject,
                f"{where}.template.spec.containers[{container.get('name')}].volumeMounts",
                None,
                "an emptyDir with medium Memory mounted at /dev/shm",
                "the runtime's 64 MiB /dev/shm pushes "
                "Ray's object store to disk and starves NCCL's shared-memory transport",
            )
        ]
    volume = _volume(pod_spec, mount.get("name"))
    field = f"{where}.template.spec.volumes[{mount.get('name')}]"
    empty_dir = volume.get("emptyDir")
    if empty_dir is None or empty_dir.get("medium") != "Memory":
        return [
            Finding(
                doc.subject,
                field,
                _volume_kind(volume) if empty_dir is None else empty_dir,
                "emptyDir medium: Memory",
                "/dev/shm must be memory-backed: on disk, Ray's object store and NCCL's SHM transport crawl",
            )
        ]
    return _shm_size_findings(doc.subject, f"{field}.emptyDir.sizeLimit", empty_dir.get("sizeLimit"), container)


def _shm_size_findings(subject: str, field: str, size_limit, container: dict) -> list[Finding]:
    limit = memory_gib(((container.get("resources") or {}).get("limits") or {}).get("memory"))
    size, (low, high) = memory_gib(size_limit), SHM_FRACTION
    if limit is None:
        return []  # no memory limit: nothing to size against (Guaranteed QoS is the manifests' own choice)
    wanted = f"{low * limit:.1f}Gi to {high * limit:.1f}Gi (30-50% of the {limit:g}Gi memory limit)"
    if size is None:
        return [Finding(subject, field, size_limit, wanted, "an unbounded tmpfs can fill the whole memory limit")]
    if low * limit <= size <= high * limit:
        return []
    why = (
        "below Ray's default object store (30% of memory): Ray spills it to disk"
        if size < low * limit
        else "tmpfs pages count against the memory limit: more leaves Ray's processes too little"
    )
    return [Finding(subject, field, size_limit, wanted, why)]


def node_fit_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """The group's pod fits the allocatable of the instance type its nodeSelector names."""
    pod_spec = _pod_spec(group)
    instance_type = (pod_spec.get("nodeSelector") or {}).get(INSTANCE_TYPE_LABEL)
    if instance_type is None:
        return []
    instance = eks_instance_types().get(instance_type)
    field = f"{where}.template.spec.nodeSelector[{INSTANCE_TYPE_LABEL}]"
    if instance is None:
        return [
            Finding(
                doc.subject,
                field,
                instance_type,
                f"a type in {INSTANCE_TABLE.name}",
                "unknown instance type: requests not checked against its allocatable",
                "warning",
            )
        ]
    requests = pod_requests(pod_spec)
    where_requests = f"{where}.template.spec.containers[*].resources.requests"
    return [
        *_fit(
            doc.subject,
            where_requests,
            instance_type,
            "cpu",
            requests["cpu"],
            allocatable(instance)[0],
            DAEMONSET_ALLOWANCE[0],
            "cores",
        ),
        *_fit(
            doc.subject,
            where_requests,
            instance_type,
            "memory",
            requests["memory"],
            allocatable(instance)[1],
            DAEMONSET_ALLOWANCE[1],
            "GiB",
        ),
        *_fit(
            doc.subject, where_requests, instance_type, GPU_RESOURCE, requests[GPU_RESOURCE], instance["gpus"], 0, ""
        ),
        *_fit(doc.subject, where_requests, instance_type, EFA_RESOURCE, requests[EFA_RESOURCE], instance["efa"], 0, ""),
    ]


def _fit(
    subject: str, field: str, instance_type: str, resource: str, need: float, have: float, kept: float, unit: str
) -> list[Finding]:
    if need <= have - kept:
        return []
    kept_note = f", {kept:g} {unit} of it kept for the node's DaemonSets" if kept else ""
    return [
        Finding(
            subject,
            f"{field}[{resource}]",
            round(need, 2),
            f"<= {have - kept:.2f}",
            f"{instance_type} offers about {have:.2f} {unit or resource} to pods{kept_note}: "
            "the pod would stay Pending",
        )
    ]


def pod_requests(pod_spec: dict) -> dict[str, float]:
    """Summed container requests (limits where a request is unset, as the API server defaults them)."""
    total = {"cpu": 0.0, "memory": 0.0, GPU_RESOURCE: 0.0, EFA_RESOURCE: 0.0}
    for container in pod_spec.get("containers") or []:
        resources = container.get("resources") or {}
        wanted = {**(resources.get("limits") or {}), **(resources.get("requests") or {})}
        total["cpu"] += cpu_cores(wanted.get("cpu")) or 0.0
        total["memory"] += memory_gib(wanted.get("memory")) or 0.0
        for extended in (GPU_RESOURCE, EFA_RESOURCE):
            total[extended] += resource_count(container, extended)
    return total


def allocatable(instance: dict) -> tuple[float, float]:
    """(cores, GiB) an EKS AMI node of this type offers pods: the kubelet's reservations (see the table's header)."""
    cores = instance["vcpu"]
    reserved_milli = 60 + 10 * min(max(cores - 1, 0), 1) + 5 * min(max(cores - 2, 0), 2) + 2.5 * max(cores - 4, 0)
    memory_mib = instance["memory_gib"] * 1024 * 0.96 - (255 + 11 * instance["max_pods"]) - 100
    return cores - reserved_milli / 1000, memory_mib / 1024


@lru_cache(maxsize=1)
def eks_instance_types() -> dict[str, dict]:
    return yaml.safe_load(INSTANCE_TABLE.read_text())


def cpu_cores(quantity) -> float | None:
    """'44' -> 44.0, '500m' -> 0.5; None when unset or not a quantity."""
    match = _QUANTITY.match(str(quantity)) if quantity is not None else None
    if match is None or match.group(2) not in ("", "m"):
        return None
    return float(match.group(1)) / (1000 if match.group(2) == "m" else 1)


def memory_gib(quantity) -> float | None:
    """'170Gi' -> 170.0, '512Mi' -> 0.5; None when unset or not a quantity."""
    match = _QUANTITY.match(str(quantity)) if quantity is not None else None
    if match is None or match.group(2) not in _MEMORY_UNITS:
        return None
    return float(match.group(1)) * _MEMORY_UNITS[match.group(2)] / 2**30


def efa_env_findings(doc: Doc, where: str, group: dict) -> list[Finding]:
    """EFA and NCCL settings that break a multi-node run whatever the config expects."""
    pod_spec = _pod_spec(group)
    container = ray_container(pod_spec)
    env = _env(container)
    field = f"{where}.template.spec.containers[{container.get('name')}].env"
    findings = _device_rdma_findings(
        doc.subject, field, env, (pod_spec.get("nodeSelector") or {}).get(INSTANCE_TYPE_LABEL)
    )
    has_efa = resource_count(container, EFA_RESOURCE) > 0 or bool(pod_spec.get("resourceClaims"))
    if has_efa and (env.get("FI_PROVIDER") or "").strip() != "efa":
        findings.append(
            Finding(
                doc.subject,
                f"{field}[FI_PROVIDER]",
                env.get("FI_PROVIDER"),
                "efa",
                "the pod owns an EFA device: any other libfabric provider (tcp, shm) leaves it unused",
            )
        )
    ifname = env.get("NCCL_SOCKET_IFNAME")
    if ifname and names_loopback(ifname):
        findings.append(
            Finding(
                doc.subject,
                f"{field}[NCCL_SOCKET_IFNAME]",
                ifname,
                "eth0 (the pod's VPC CNI interface)",
                "NCCL would bootstrap over loopback: ranks on other nodes can never connect",
            )
        )
    return findings


def _device_rdma_findings(subject: str, field: str, env: dict, instance_type: str | None) -> list[Finding]:
    if (env.get("FI_EFA_USE_DEVICE_RDMA") or "").strip() != "1":
        return []
    instance = eks_instance_types().get(instance_type or "")
    if instance is None:
        return [
            Finding(
                subject,
                f"{field}[FI_EFA_USE_DEVICE_RDMA]",
                "1",
                "1 only on GPUDirect RDMA instance types",
                f"cannot tell whether {instance_type or 'an unselected node type'} has GPUDirect RDMA",
                "warning",
            )
        ]
    if instance["gpudirect_rdma"]:
        return []
    return [
        Finding(
            subject,
            f"{field}[FI_EFA_USE_DEVICE_RDMA]",
            "1",
            "unset (or 0)",
            f"{instance_type} has EFA but no GPUDirect RDMA (p4d/p5 class do): libfabric cannot register GPU "
            "memory with the NIC and NCCL's EFA transport fails",
        )
    ]


def names_loopback(ifname: str) -> bool:
    """NCCL_SOCKET_IFNAME selects a loopback interface: 'lo', '=lo', 'lo,eth0' (not an exclusion '^lo,docker')."""
    value = ifname.strip()
    return not value.startswith("^") and any(item.strip().lstrip("=").startswith("lo") for item in value.split(","))


def _env(container: dict) -> dict:
    return {e.get("name"): e.get("value") for e in container.get("env") or []}


def _volume(pod_spec: dict, name: str | None) -> dict:
    return next((v for v in pod_spec.get("volumes") or [] if v.get("name") == name), {})


def _volume_kind(volume: dict) -> str:
    return next((k for k in volume if k != "name"), "unknown")


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
        return [
            Finding(
                doc.subject,
                field,
                None,
                f"a shared volume mounted at a parent of {root}",
                f"storage.root {root} is on each pod's own disk: {nodes} nodes would each see different files",
            )
        ]
    volume = _volume(pod_spec, mount.get("name"))
    kind, ok, why = _volume_sharing(volume, docs, doc.obj)
    if ok:
        return []
    return [
        Finding(
            doc.subject,
            f"{where}.template.spec.volumes[{mount.get('name')}]",
            kind,
            "ReadWriteMany PVC, NFS or FSx/EFS CSI",
            f"storage.root {root} with {nodes} nodes: {why}",
            "warning" if ok is None else "error",
        )
    ]


def _mount_for(container: dict, root: str) -> dict | None:
    """The deepest volumeMount whose mountPath is root or a parent of it."""
    mounts = [
        m
        for m in container.get("volumeMounts") or []
        if m.get("mountPath") and PurePosixPath(root).is_relative_to(m["mountPath"])
    ]
    return max(mounts, key=lambda m: len(m.get("mountPath", "")), default=None)


def _volume_sharing(volume: dict, docs: list[Doc], raycluster: dict) -> tuple[str, bool | None, str]:
    """(volume type, shared? True/False/None for unknown, why)."""
    if "persistentVolumeClaim" in volume:
        claim = volume["persistentVolumeClaim"].get("claimName")
        pvc = find_claim(docs, claim, (raycluster.get("metadata") or {}).get("namespace"))
        if pvc is None:
            return (
                f"persistentVolumeClaim {claim}",
                None,
                "the claim is not among the linted files, its access mode is unknown",
            )
        modes = (pvc.obj.get("spec") or {}).get("accessModes") or []
        driver = claim_driver(pvc, docs)
        if driver == S3_CSI_DRIVER:
            return f"persistentVolumeClaim {claim} (csi {driver})", False, MOUNTPOINT_WHY
        return f"persistentVolumeClaim {claim} {modes}", "ReadWriteMany" in modes, "the claim is not ReadWriteMany"
    if any(key in volume for key in SHARED_VOLUME_KEYS):
        return "nfs", True, ""
    if "csi" in volume:
        driver = volume["csi"].get("driver")
        why = MOUNTPOINT_WHY if driver == S3_CSI_DRIVER else "not a known shared file system driver"
        return f"csi {driver}", driver in SHARED_CSI_DRIVERS, why
    kind = _volume_kind(volume)
    return kind, False, f"a {kind} volume is local to one node"


def find_claim(docs: list[Doc], claim: str | None, namespace: str | None) -> Doc | None:
    return next(
        (d for d in docs if d.kind == "PersistentVolumeClaim" and d.name == claim and d.namespace in (namespace, None)),
        None,
    )


def claim_driver(pvc: Doc, docs: list[Doc]) -> str | None:
    """The CSI driver behind a claim: its bound PersistentVolume's, else its StorageClass's provisioner."""
    spec = pvc.obj.get("spec") or {}
    for pv in (d for d in docs if d.kind == "PersistentVolume"):
        claim_ref = (pv.obj.get("spec") or {}).get("claimRef") or {}
        if pv.name == spec.get("volumeName") or (
            claim_ref.get("name") == pvc.name and claim_ref.get("namespace") in (pvc.namespace, None)
        ):
            return ((pv.obj.get("spec") or {}).get("csi") or {}).get("driver")
    storage_class = next((d for d in docs if d.kind == "StorageClass" and d.name == spec.get("storageClassName")), None)
    return storage_class.obj.get("provisioner") if storage_class else None


def claim_findings(doc: Doc, docs: list[Doc], where: str, pod_spec: dict) -> list[Finding]:
    """Every claim a pod mounts exists in its namespace, and names a StorageClass that exists."""
    findings = []
    for volume in pod_spec.get("volumes") or []:
        claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
        if claim is None:
            continue
        field = f"{where}.volumes[{volume.get('name')}].persistentVolumeClaim.claimName"
        pvc = find_claim(docs, claim, doc.namespace)
        if pvc is None:
            findings.append(
                Finding(
                    doc.subject,
                    field,
                    claim,
                    f"a PersistentVolumeClaim {claim} in namespace {doc.namespace} among the linted files",
                    "the pod would stay Pending",
                )
            )
            continue
        findings += _storage_class_exists(pvc, docs)
    return _unique(findings)


def _storage_class_exists(pvc: Doc, docs: list[Doc]) -> list[Finding]:
    name = (pvc.obj.get("spec") or {}).get("storageClassName")
    if not name or any(d.kind == "StorageClass" and d.name == name for d in docs):
        return []
    return [
        Finding(
            pvc.subject,
            "spec.storageClassName",
            name,
            "a StorageClass among the linted files",
            "not linted here: it must exist in the cluster, or the claim stays Pending",
            "warning",
        )
    ]


def storage_class_findings(doc: Doc) -> list[Finding]:
    """FSx for Lustre mounts need `flock`: the Hugging Face cache (HF_HOME on FSx) locks its files."""
    if doc.obj.get("provisioner") != FSX_CSI_DRIVER or "flock" in (doc.obj.get("mountOptions") or []):
        return []
    return [
        Finding(
            doc.subject,
            "mountOptions",
            doc.obj.get("mountOptions"),
            ["flock"],
            "without it Lustre answers flock() with ENOSYS: the first Hugging Face download on the volume fails",
        )
    ]


# ---------------------------------------------------------------- identities for s3:// storage


def ray_identity_findings(
    doc: Doc, docs: list[Doc], groups: list[tuple[str, dict]], config: PipelineConfig
) -> list[Finding]:
    """With an s3:// root, every Ray group runs as a service account with an IAM role (IRSA)."""
    root = config.storage.root
    if not root.startswith("s3://"):
        return []
    return [
        f
        for where, group in groups
        for f in irsa_findings(
            doc.subject,
            f"{where}.template.spec.serviceAccountName",
            _pod_spec(group).get("serviceAccountName") or "default",
            doc.namespace,
            docs,
            f"storage.root {root}: the Ray pods read and write it",
        )
    ]


def irsa_findings(
    subject: str, field: str, account: str | None, namespace: str | None, docs: list[Doc], why: str
) -> list[Finding]:
    """The service account exists among the linted files with the IRSA role annotation."""
    sa = next(
        (d for d in docs if d.kind == "ServiceAccount" and d.name == account and d.namespace in (namespace, None)), None
    )
    annotations = ((sa.obj.get("metadata") or {}).get("annotations") or {}) if sa else {}
    if annotations.get(IRSA_ANNOTATION):
        return []
    seen = f"{account} (not among the linted files)" if sa is None else f"{account} (no {IRSA_ANNOTATION} annotation)"
    return [
        Finding(
            subject,
            field,
            seen,
            f"a service account annotated {IRSA_ANNOTATION}",
            f"{why}, and without an IAM role (IRSA) the pods have no S3 credentials",
        )
    ]


# ---------------------------------------------------------------- other workloads and the Prefect template


def workload_findings(doc: Doc, docs: list[Doc]) -> list[Finding]:
    """Non-Ray workloads: pinned images (a tag is a warning: they never train), claims, a Prefect worker's settings."""
    pod_spec = workload_pod_spec(doc)
    where = "spec" if doc.kind == "Pod" else "spec.template.spec"
    findings = [
        f
        for c in _containers(pod_spec)
        for f in _workload_image(doc.subject, f"containers[{c.get('name')}].image", c.get("image", ""))
    ]
    findings += claim_findings(doc, docs, where, pod_spec)
    findings += pod_security_findings(doc.subject, where, pod_spec)
    return findings + prefect_worker_findings(doc, docs)


def workload_pod_spec(doc: Doc) -> dict:
    spec = doc.obj.get("spec") or {}
    return spec if doc.kind == "Pod" else (spec.get("template") or {}).get("spec") or {}


def _workload_image(subject: str, field: str, image: str) -> list[Finding]:
    if _PLACEHOLDER.match(image):
        return []
    return _digest_findings(subject, field, image, unpinned="warning")


# ---------------------------------------------------------------- the Prefect Kubernetes worker


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
    if _bound_cluster_wide(docs, account, doc.namespace):
        return auth  # cluster-wide rights: it may read kube-system and watch every namespace itself
    role_namespaces = {r.namespace for r in _roles_bound_to(docs, account, doc.namespace) if r.kind == "Role"}
    findings = []
    for container in workers:
        field = f"spec.template.spec.containers[{container.get('name')}].env"
        findings += _cluster_uid_findings(doc.subject, field, _env(container).get(CLUSTER_UID_ENV))
        findings += _observer_findings(
            doc.subject, field, _env(container).get(OBSERVER_NAMESPACES_ENV), role_namespaces
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


def _bound_cluster_wide(docs: list[Doc], account: str, namespace: str | None) -> bool:
    return any(d.kind == "ClusterRoleBinding" and _binds(d, account, namespace) for d in docs)


def worker_role_namespaces(docs: list[Doc]) -> dict[str, set]:
    """{work pool: namespaces of the Roles bound to the Kubernetes worker polling it}."""
    pools: dict[str, set] = {}
    for doc in (d for d in docs if d.kind in WORKLOAD_KINDS):
        pod_spec = workload_pod_spec(doc)
        account = pod_spec.get("serviceAccountName") or "default"
        for container in pod_spec.get("containers") or []:
            if pool := kubernetes_worker_pool(container):
                roles = _roles_bound_to(docs, account, doc.namespace)
                pools.setdefault(pool, set()).update(r.namespace for r in roles if r.kind == "Role")
    return pools


# ---------------------------------------------------------------- prefect.yaml


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
    root = (((deployment.get("parameters") or {}).get("config") or {}).get("storage") or {}).get("root") or (
        config.storage.root if config else ""
    )
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


def flow_run_image_findings(subject: str, field: str, image: str | None) -> list[Finding]:
    """The image a flow run gets: set, not the stock Prefect image, pinned by digest."""
    if not image:
        return [
            Finding(
                subject,
                field,
                image,
                "the flow-run image (deployments/flow-run-image/) by digest",
                "unset, the worker runs the stock Prefect image",
            )
        ]
    repository = image.split("@", 1)[0].rsplit(":", 1)[0].removeprefix("docker.io/").removeprefix("index.docker.io/")
    if repository in STOCK_PREFECT_REPOSITORIES:
        return [
            Finding(
                subject,
                field,
                image,
                "the flow-run image (deployments/flow-run-image/) by digest",
                "the stock Prefect image has neither this project nor ray, kubernetes and s3fs: "
                "the flow run dies with ModuleNotFoundError",
            )
        ]
    return _digest_findings(subject, field, image)


# ---------------------------------------------------------------- the Prefect base job template


def job_template_findings(doc: Doc, docs: list[Doc], config: PipelineConfig | None) -> list[Finding]:
    manifest = (doc.obj.get("job_configuration") or {}).get("job_manifest") or {}
    defaults = template_defaults(doc)
    pod_spec = ((manifest.get("spec") or {}).get("template") or {}).get("spec") or {}
    findings = prefect_pod_field_findings(doc.subject, pod_spec)
    validator = schema_validator("batch/v1", "Job")
    assert validator is not None, "the vendored Kubernetes schemas lack batch/v1 Job"
    findings += [
        _schema_finding(doc.subject, e)
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
        findings += _read_only_findings(doc, docs, account, namespace)
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
    for container in _containers(pod_spec):
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


def template_defaults(doc: Doc) -> dict:
    """The base job template's variable defaults: what a deployment gets for what it does not set."""
    return {k: v.get("default") for k, v in ((doc.obj.get("variables") or {}).get("properties") or {}).items()}


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
        return [
            Finding(
                doc.subject,
                "job_manifest containers[0].volumeMounts",
                None,
                f"a mount at {PurePosixPath(token_file).parent}",
                f"config cluster.auth_token_file {token_file} would not exist in the flow-run pod",
            )
        ]
    volume = _volume(pod_spec, mount.get("name"))
    secret = _resolve((volume.get("secret") or {}).get("secretName"), defaults)
    wanted: set[str] = {
        name
        for d in docs
        if d.kind == "RayCluster"
        if (name := ((d.obj.get("spec") or {}).get("authOptions") or {}).get("secretName"))
    }
    if wanted and secret not in wanted:
        return [
            Finding(
                doc.subject,
                f"job_manifest volumes[{mount.get('name')}].secret.secretName",
                secret,
                sorted(wanted)[0],
                "the RayCluster's spec.authOptions.secretName: the flow would send a token the cluster rejects",
            )
        ]
    return []


def _resolve(value, defaults: dict):
    if isinstance(value, str) and _PLACEHOLDER.match(value):
        return defaults.get(value.strip("{} "))
    return value


def _read_only_findings(doc: Doc, docs: list[Doc], account: str | None, namespace: str | None) -> list[Finding]:
    """Roles bound to the flow-run service account grant read verbs only."""
    if not account:
        return []
    why = f"bound to {account}, the flow-run service account of {doc.file}: the pipeline only reads the cluster"
    return _write_findings(docs, account, namespace, {}, sorted(READ_VERBS), why)[0]


def _write_findings(
    docs: list[Doc], account: str, namespace: str | None, allowed: dict, expected, why: str
) -> tuple[list[Finding], set[tuple[str, str, str]]]:
    """(a finding per rule bound to `account` granting a write not in `allowed` {(group, resource): verbs},
    every (group, resource, verb) granted)."""
    findings, granted = [], set()
    for role in _roles_bound_to(docs, account, namespace):
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


def _roles_bound_to(docs: list[Doc], account: str, namespace: str | None) -> list[Doc]:
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


def _unique(findings: list[Finding]) -> list[Finding]:
    return list(dict.fromkeys(findings))


# ---------------------------------------------------------------- the image canary's pool and identity


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
    account = _pinned_value(properties.get("service_account_name") or {})
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
    if differences:
        findings.append(
            Finding(
                doc.subject,
                f"differences from {pipeline.file if pipeline else ''}",
                differences[:5],
                "none but the service account (and descriptions)",
                "the canary's flow-run pod is the pipeline's (image, namespace, hardening, Secrets) under another "
                "identity: change both templates together",
            )
        )
    return findings


def canary_raycluster_policy_findings(doc: Doc, docs: list[Doc], account: str, namespace: str | None) -> list[Finding]:
    """The API server holds the canary's RayClusters to raycluster.yaml's identity and Secrets, and its own names.

    The KubeRay operator, not the canary, creates the pods: the canary's RBAC does not bound what they run as.
    """
    user = f"system:serviceaccount:{namespace}:{account}"
    policies = _denying_policies(docs, user, "ray.io", "rayclusters", ("CREATE", "DELETE"))
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
    text = " ".join(
        str(v.get("expression")) for p in policies for v in (p.obj.get("spec") or {}).get("validations") or []
    )
    wanted = {CANARY_CLUSTER_PREFIX: "the canary's name prefix (tuneproof/control/kube_canary.py)"}  # value: why
    for raycluster in (d for d in docs if d.kind == "RayCluster"):
        if secret := ((raycluster.obj.get("spec") or {}).get("authOptions") or {}).get("secretName"):
            wanted.setdefault(secret, f"{raycluster.subject}'s token Secret")
        for where, group in ray_groups(raycluster.obj):
            if ray_account := _pod_spec(group).get("serviceAccountName"):
                wanted.setdefault(ray_account, f"{raycluster.subject} {where}'s service account")
    return [
        Finding(
            policies[0].subject,
            "spec.validations",
            f"no expression naming '{value}'",
            value,
            f"{what}: the canary's RayClusters must keep to it",
        )
        for value, what in wanted.items()
        if f"'{value}'" not in text
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
    findings, granted = _write_findings(
        docs,
        account,
        namespace,
        CANARY_WRITES,
        "create and delete on ray.io rayclusters, read verbs elsewhere",
        f"bound to {account}, the canary's account ({doc.file}): it creates and deletes its own RayCluster "
        "and writes nothing else",
    )
    findings += canary_raycluster_policy_findings(doc, docs, account, namespace)
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


# ---------------------------------------------------------------- pod security and service-account tokens


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
        Finding(subject, f"{where}.volumes[{v.get('name')}]", _volume_kind(v), list(RESTRICTED_VOLUMES), RESTRICTED_WHY)
        for v in pod_spec.get("volumes") or []
        if _volume_kind(v) not in RESTRICTED_VOLUMES
    ]
    pod_context = pod_spec.get("securityContext") or {}
    for container in _containers(pod_spec):
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
    seen = _pod_spec(group).get("automountServiceAccountToken")
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


# ---------------------------------------------------------------- the Ray ports: NetworkPolicy


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


# ---------------------------------------------------------------- work-pool job variables and Prefect credentials


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
        field, key, parent = _dotted(path), path[-1], path[-2]
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
        elif key in PINNED_FIELDS and "default" in schema and schema["default"] != _pinned_value(schema):
            findings.append(
                Finding(
                    doc.subject,
                    f"variables.properties.{var}.default",
                    schema["default"],
                    _pinned_value(schema),
                    "the Prefect server refuses a work pool whose default breaks its own schema",
                )
            )
    return findings


def _placeholders(node, path: list) -> list[tuple[list, str]]:
    """(path, variable) of every whole-value '{{ variable }}' in a job configuration."""
    if isinstance(node, str) and _PLACEHOLDER.match(node):
        return [(path, node.strip("{} "))]
    if isinstance(node, dict):
        return [found for k, v in node.items() for found in _placeholders(v, [*path, k])]
    if isinstance(node, list):
        return [found for i, v in enumerate(node) for found in _placeholders(v, [*path, i])]
    return []


def _pinned(schema: dict) -> bool:
    return "const" in schema or len(schema.get("enum") or []) == 1


def _pinned_value(schema: dict):
    return schema["const"] if "const" in schema else (schema.get("enum") or [None])[0]


def job_variables_schema_findings(subject: str, job_variables: dict, template: Doc) -> list[Finding]:
    """A deployment's job variables against the template's schema, as the Prefect server checks them on deploy."""
    schema = {
        k: v for k, v in (template.obj.get("variables") or {}).items() if k != "required"
    }  # required: at run time
    validator = jsonschema.Draft202012Validator(schema)
    return [
        Finding(
            subject,
            "work_pool.job_variables" + (f".{_dotted(e.absolute_path)}" if e.absolute_path else ""),
            e.instance if not isinstance(e.instance, (dict, list)) else type(e.instance).__name__,
            f"{e.validator}: {json.dumps(e.validator_value)[:120]}",
            f"{template.file}'s variables schema: the Prefect server refuses the deployment (422): {e.message[:200]}",
        )
        for e in validator.iter_errors(job_variables)
    ]


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
            p.name: p for user in sorted(users) for p in _denying_policies(docs, user, "batch", "jobs", ("CREATE",))
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
    text = " ".join(
        str(v.get("expression")) for p in policies for v in (p.obj.get("spec") or {}).get("validations") or []
    )
    pins = _flow_run_pins(doc, docs, pod_spec)
    account = pins.pop("service account")
    findings = [
        Finding(
            policies[0].subject,
            "spec.validations",
            f"no expression naming '{value}'",
            value,
            f"{doc.file} pins the flow runs' {what} to it: the policy must admit exactly that",
        )
        for what, value in pins.items()
        if value and f"'{value}'" not in text
    ]
    return (
        findings
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


def _matches_job_creation(policy: Doc) -> bool:
    return _matches(policy, "batch", "jobs", "CREATE")


def _matches(policy: Doc, group: str, resource: str, operation: str) -> bool:
    rules = (((policy.obj.get("spec") or {}).get("matchConstraints") or {}).get("resourceRules")) or []
    return any(
        {group, "*"} & set(r.get("apiGroups") or [])
        and {resource, "*"} & set(r.get("resources") or [])
        and {operation, "*"} & set(r.get("operations") or [])
        for r in rules
    )


def _denying_policies(docs: list[Doc], user: str, group: str, resource: str, operations: tuple[str, ...]) -> list[Doc]:
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


def _flow_run_pins(doc: Doc, docs: list[Doc], pod_spec: dict) -> dict[str, str | None]:
    """What a flow-run Job may run and reference: the pinned image and account, the fixed Secrets."""
    properties = (doc.obj.get("variables") or {}).get("properties") or {}
    secrets = {
        f"Secret of volume {v.get('name')}": v["secret"]["secretName"]
        for v in pod_spec.get("volumes") or []
        if isinstance((v.get("secret") or {}).get("secretName"), str)
        and not _PLACEHOLDER.match(v["secret"]["secretName"])
    }
    auth = [
        _env(c).get(f"{setting}_NAME")
        for w in docs
        if w.kind in WORKLOAD_KINDS
        for c in workload_pod_spec(w).get("containers") or []
        if kubernetes_worker_pool(c)
        for setting in CREDENTIAL_SECRET_SETTINGS.values()
    ]
    return {
        "service account": _pinned_value(properties.get("service_account_name") or {}),
        "image": _pinned_value(properties.get("image") or {}),
        **secrets,
        "Prefect API credential Secret": next((a for a in auth if a), None),
    }
