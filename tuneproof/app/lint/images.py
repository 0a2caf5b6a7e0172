"""Images: pinned by digest, and the Ray version their tags name.

- a RayCluster container's image must be pinned by digest, always: the run record's image identity is the
  digest, and a tag can move under a running pipeline. Other workloads (the Prefect worker) only get a
  warning for a tag, since they never train. The all-zero placeholder digest shipped in deployments/ is a
  warning until it is replaced;
- rayVersion == the Ray version the image tag names (a version-first tag, or a Ray Train DLC
  train-ml-cuda-vX.Y tag looked up in schemas/ray-train-dlc.yaml; a Ray image whose tag maps to no
  version is a warning, never a silent skip) and == config cluster.expect.ray_version;
- the flow-run image a deployment gets: set, not the stock Prefect image, pinned by digest.
"""

from __future__ import annotations

import re
from functools import lru_cache

import yaml

from tuneproof.app.lint.documents import PLACEHOLDER_VARIABLE, SCHEMA_DIR, Doc, all_containers, group_pod_spec, unique
from tuneproof.control.kube_checks import image_digest, image_tag, ray_container
from tuneproof.core.config import PipelineConfig
from tuneproof.core.findings import Finding, Severity

DLC_TABLE = SCHEMA_DIR / "ray-train-dlc.yaml"
PLACEHOLDER_DIGEST = "sha256:" + "0" * 64
"""The digest deployments/ ships with: valid in form, to be replaced by the image's real digest."""
STOCK_PREFECT_REPOSITORIES = ("prefecthq/prefect", "prefecthq/prefect-client")
_VERSION_PREFIX = re.compile(r"^v?(\d+\.\d+\.\d+)")
_DLC_VERSION = re.compile(r"^v(\d+)\.(\d+)(?:\.(\d+))?$")


def ray_image_findings(doc: Doc, where: str, group: dict, config: PipelineConfig | None) -> list[Finding]:
    expected = config.cluster.expect.image if config else None
    findings = []
    for container in all_containers(group_pod_spec(group)):
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


def ray_version_findings(doc: Doc, groups: list[tuple[str, dict]], config: PipelineConfig | None) -> list[Finding]:
    declared = (doc.obj.get("spec") or {}).get("rayVersion")
    findings = []
    for where, group in groups:
        image = ray_container(group_pod_spec(group)).get("image", "")
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
    return unique(findings)


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


def workload_image(subject: str, field: str, image: str) -> list[Finding]:
    if PLACEHOLDER_VARIABLE.match(image):
        return []
    return _digest_findings(subject, field, image, unpinned="warning")


def flow_run_image_findings(subject: str, field: str, image: str | None) -> list[Finding]:
    """The image a flow run gets: set, not the stock Prefect image, pinned by digest."""
    repository = (
        (image or "").split("@", 1)[0].rsplit(":", 1)[0].removeprefix("docker.io/").removeprefix("index.docker.io/")
    )
    if not image:
        why = "unset, the worker runs the stock Prefect image"
    elif repository in STOCK_PREFECT_REPOSITORIES:
        why = (
            "the stock Prefect image has neither this project nor ray, kubernetes and s3fs: "
            "the flow run dies with ModuleNotFoundError"
        )
    else:
        return _digest_findings(subject, field, image)
    return [Finding(subject, field, image, "the flow-run image (deployments/flow-run-image/) by digest", why)]
