"""Storage: claims, the shared storage root, the FSx StorageClass, and IRSA for s3:// roots.

- every persistentVolumeClaim a pod mounts is among the linted objects, in its namespace; an FSx for
  Lustre StorageClass mounts with `flock` (the Hugging Face cache locks files);
- with several nodes (head + worker pods), storage.root must be shared: s3:// (or another object
  store), or a path on a volume mounted in every group that is ReadWriteMany / NFS / FSx; hostPath,
  emptyDir, a ReadWriteOnce claim or no volume at all is an error, and so is the S3 CSI driver
  (Mountpoint: no rename, no append, which checkpoints and completion markers need). An s3:// root
  needs an IRSA-annotated service account for every Ray group and for flow runs.
"""

from __future__ import annotations

from pathlib import PurePosixPath

from tuneproof.app.lint.documents import Doc, group_pod_spec, ray_groups, unique, volume_kind, volume_named
from tuneproof.control.kube_checks import group_pod_count, ray_container, worker_groups
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding

SHARED_VOLUME_KEYS = ("nfs",)
SHARED_CSI_DRIVERS = ("fsx.csi.aws.com", "efs.csi.aws.com")
S3_CSI_DRIVER = "s3.csi.aws.com"
FSX_CSI_DRIVER = "fsx.csi.aws.com"
MOUNTPOINT_WHY = (
    "the S3 CSI driver (Mountpoint for Amazon S3) supports no rename and no append: checkpoints, "
    "completion markers and the record's atomic writes need both; use s3:// or FSx/EFS"
)
IRSA_ANNOTATION = "eks.amazonaws.com/role-arn"


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
    pod_spec = group_pod_spec(group)
    container = ray_container(pod_spec)
    mount = mount_for(container, root)
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
    volume = volume_named(pod_spec, mount.get("name"))
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


def mount_for(container: dict, root: str) -> dict | None:
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
    kind = volume_kind(volume)
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
    return unique(findings)


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
            group_pod_spec(group).get("serviceAccountName") or "default",
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
