"""The images registry: every canary's decision about a candidate image, and the pointer to the adopted one.

Runs on the Prefect side (the image-canary flow, `tuneproof images list|show`, `tuneproof lint`, EKS runs
reading their pinned image). Layout under the storage root:

    images/<decision-id>/decision.json   one canary's decision, written once (exclusive create): history is
                                         append-only, a decision is never rewritten
    images/current.json                  the adopted image, moved by compare-and-swap only on adopt

The pointer moves through tuneproof.core.cas like the model registry's production pointer: the canary
reads it (and its token) before it runs, compares against the decision it names, and moves it only if
it still names that decision; a canary that loses raises ImageConflict and its decision stays in the
history as an adopt that did not become current. Readers see the old pointer or the new one, never a
torn one (cas writes through a temp file + rename locally, one conditional PutObject on S3).

Locally the "image" is the Python environment the Ray nodes run: `local-env@sha256:<environment digest>`,
the digest verify records (tuneproof.core.checks.environment_digest), so the canary has a real identity
to compare and adopt on the embedded cluster too.

The decision (`decide`) and the comparisons it rests on are pure; only the functions under "storage"
do I/O.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import re
import statistics
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, ConfigDict, WithJsonSchema

from tuneproof.control import comparison as cmp
from tuneproof.control.comparison import MetricComparison
from tuneproof.core import cas
from tuneproof.core.checks import environment_digest
from tuneproof.core.config import PipelineConfig
from tuneproof.core.files import read_stored
from tuneproof.core.names import slug_problem
from tuneproof.core.results import Model, one_line
from tuneproof.core.storage import Storage

IMAGES = "images"
DECISION = "decision.json"
CURRENT = "current.json"
MAX_DECISION_BYTES = 16 << 20
"""A decision is kilobytes (metrics of a few repeats, reasons, versions); a bigger one, or a FIFO in its place,
is refused by name instead of read until memory runs out."""
LOCAL_REPOSITORY = "local-env"
"""The repository part of the local profile's "image": the environment verify fingerprints."""
IMAGE_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:-]*@sha256:[0-9a-f]{64}$"
_IMAGE = re.compile(IMAGE_PATTERN)


def image_problem(value: str) -> str | None:
    """Why `value` is not an image pinned by digest (repo[:tag]@sha256:<64 hex>), or None (pure)."""
    if _IMAGE.match(value):
        return None
    if "@sha256:" not in value:
        return "is not pinned by digest: expected repository@sha256:<64 hex> (a tag can move to different bytes)"
    return "is not repository@sha256:<64 lowercase hex>: check the digest's length and characters"


def _checked_image(value: str) -> str:
    if problem := image_problem(value):
        raise ValueError(f"candidate image {value!r} {problem}")
    return value


CandidateImage = Annotated[
    str,
    AfterValidator(_checked_image),
    WithJsonSchema({"type": "string", "pattern": IMAGE_PATTERN, "title": "repository@sha256:<64 hex>"}),
]
"""An image pinned by digest; the Prefect form validates it, and so does the flow."""


def digest_of(image: str) -> str:
    """'sha256:<hex>' of a pinned image reference."""
    return image.rsplit("@", 1)[1]


def release_tag(image: str) -> str | None:
    """The tag between the repository and the digest (repo:tag@sha256:...), when there is one (pure)."""
    name = image.rsplit("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    return last.split(":", 1)[1] if ":" in last else None


def local_image() -> str:
    """This process's environment as an image reference; locally it is what the Ray head and workers run."""
    dists = [(d.metadata["Name"], d.version) for d in importlib.metadata.distributions() if d.metadata["Name"]]
    return local_image_of(environment_digest(dists))


def local_image_of(env_digest: str) -> str:
    return f"{LOCAL_REPOSITORY}@sha256:{env_digest}"


# ---- the decision (pure) -------------------------------------------------------------------------


class ImageVersions(Model):
    """What verify (and connectivity's NCCL log) saw the candidate run."""

    ray: str | None = None
    python: str | None = None
    torch: str | None = None
    transformers: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    efa: str | None = None
    """The aws-ofi-nccl / libfabric version NCCL printed, when it ran over EFA."""
    environment_digest: str | None = None


Verdict = Literal["adopt", "reject"]


class Decision(Model):
    # Finite only: a stored NaN threshold or Infinity metric reached the canary's statistics after all its runs
    # (a math domain error); refused when read, it names the file instead.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    schema_version: int = 1
    decision_id: str
    candidate_image: str
    digest: str
    release_tag: str | None = None
    profile: str
    versions: ImageVersions = ImageVersions()
    baseline_decision: str | None = None
    """The decision images/current.json named when the canary started; None: there was no current image."""
    baseline_image: str | None = None
    baseline_metrics: dict[str, list[float]] = {}
    """The baseline's candidate_metrics, as recorded by the decision that adopted it."""
    candidate_metrics: dict[str, list[float]] = {}
    """Per metric, one value per canary run (the stage table's `runs diff` numbers)."""
    comparison: list[MetricComparison] = []
    threshold: float
    decision: Verdict
    reasons: list[str]
    runs: list[str] = []
    """The canary's pipeline runs (ordinary runs: `tuneproof runs show` explains each)."""
    decided_at: str
    flow_run_id: str | None = None
    flow_run_name: str | None = None


class Pointer(Model):
    decision_id: str
    image: str
    digest: str
    adopted_at: str
    previous_decision: str | None = None


def decide(
    failure: str | None,
    baseline: Decision | None,
    candidate: dict[str, list[float]],
    threshold: float,
) -> tuple[Verdict, list[str], list[MetricComparison]]:
    """Adopt or reject, with one reason per finding (pure).

    A failed canary run rejects. With no baseline the candidate is adopted as the first baseline. Otherwise
    every baseline metric with a better side is compared by the t interval of `tuneproof compare`
    (comparison.compare_metric): a metric that got worse, or that the candidate no longer reports, rejects;
    so does one the repeats cannot resolve ('insufficient repeats', always with one value on either side),
    as a refusal on insufficient evidence, not a finding that the image is worse: "not adopted", with the
    repeats that would tell. So does a baseline with nothing to compare (no metric with values on both
    sides): zero comparisons is no evidence. Adopted only when every metric shows no detectable difference
    or better; a metric only the candidate measured is named in the reasons, not compared.

    Several metrics at once: one decision over m metrics, so each interval is at 1 - 0.05/m (Bonferroni): the
    chance that any of m unchanged metrics is called worse stays under 2.5 %, and that a worse one is found
    "no different" is bounded alike (tests/test_images.py simulates both), at the cost of wider intervals,
    that is, more repeats before a canary can adopt.
    """
    if failure is not None:
        return "reject", [f"the canary failed: {failure}"], []
    if baseline is None:
        return "adopt", ["no current image: this canary's measurements become the baseline"], []
    comparisons = compare_metrics(baseline.candidate_metrics, candidate, threshold)
    reasons = [_reason(m) for m in comparisons if m.verdict == "worse"]
    reasons += [
        f"{name}: measured on the baseline, not by the candidate"
        for name in measured_only(baseline.candidate_metrics, candidate)
    ]
    new = measured_only(candidate, baseline.candidate_metrics)
    uncompared = [f"{name}: measured by the candidate, not on the baseline: not compared" for name in new]
    if reasons:
        return "reject", reasons + uncompared, comparisons
    if not comparisons:
        return "reject", [_nothing_compared(baseline, new)], []
    # A value <= 0 has no logarithm, so no interval: an exact match fallen to 0 must not pass as "no finding".
    unjudged = [_not_judged(m) for m in comparisons if m.verdict == "not enough data"]
    unresolved = [_not_adopted(m, threshold) for m in comparisons if m.verdict == "insufficient repeats"]
    if unjudged or unresolved:
        return "reject", unjudged + unresolved + uncompared, comparisons
    better = sum(m.verdict == "better" for m in comparisons)
    return (
        "adopt",
        [
            f"no metric worse than {baseline.decision_id} ({baseline.candidate_image}) beyond {threshold:.0%}: "
            f"{len(comparisons)} compared, {better} better",
            *uncompared,
        ],
        comparisons,
    )


def measured_only(side: dict[str, list[float]], other: dict[str, list[float]]) -> list[str]:
    """The metrics with a better side that `side` has values of and `other` has none of (pure)."""
    return sorted(
        name for name, values in side.items() if values and not other.get(name) and cmp.direction(name) != "none"
    )


def compare_metrics(
    baseline: dict[str, list[float]], candidate: dict[str, list[float]], threshold: float
) -> list[MetricComparison]:
    """One comparison (A = baseline, B = candidate) per metric both measured that has a better side, each at
    1 - 0.05/m for m such metrics (pure)."""
    names = [
        name
        for name in sorted(set(baseline) & set(candidate))
        if baseline[name] and candidate[name] and cmp.direction(name) != "none"
    ]
    confidence = 1 - 0.05 / max(1, len(names))
    return [cmp.compare_metric(name, baseline[name], candidate[name], threshold, confidence) for name in names]


MAX_REPEATS = 20


MAX_CANARY_STEPS = 100_000


def max_steps_problem(max_steps: int) -> str | None:
    """Why a canary run cannot train `max_steps` steps, or None (pure)."""
    if not 1 <= max_steps <= MAX_CANARY_STEPS:
        return f"max_steps must be between 1 and {MAX_CANARY_STEPS} (got {max_steps})"
    return None


def threshold_problem(threshold: float) -> str | None:
    """Why `threshold` cannot be the smallest relative change that counts as worse, or None (pure; NaN fails)."""
    if not 0 < threshold < 1:
        return f"threshold must be between 0 and 1 (got {threshold})"
    return None


def repeats_problem(repeats: int) -> str | None:
    """Why a canary cannot run `repeats` runs, or None (pure). One run gives one value per metric, which no
    interval stands on: it could never be adopted against a baseline, nor judge the next canary as one."""
    if repeats == 1:
        return (
            "repeats must be at least 2 (got 1): one run gives one value per metric, and one value cannot tell a "
            "change from noise (3 by default)"
        )
    if not 2 <= repeats <= MAX_REPEATS:
        return f"repeats must be between 2 and {MAX_REPEATS} (got {repeats})"
    return None


def _not_adopted(m: MetricComparison, threshold: float) -> str:
    """'not adopted: insufficient repeats for <metric> (need N repeats a side ...)': refused, not found worse."""
    if m.repeats_needed:
        need = f"need {m.repeats_needed} repeats a side at the spread seen"
    elif min(len(m.a.values), len(m.b.values)) == 1:
        side = "the baseline" if len(m.a.values) == 1 else "the candidate"
        need = f"{side} has one value: need 2 or more repeats a side for any interval"
    else:
        need = "more than 1,000 repeats a side at the spread seen"
    ratio = ("no ratio" if m.ratio is None else f"ratio {m.ratio:.3f}") + _interval_text(m)
    return (
        f"not adopted: insufficient repeats for {m.name} to tell a {threshold:.0%} change from noise ({ratio}; {need})"
    )


def _nothing_compared(baseline: Decision, new: list[str]) -> str:
    """'not adopted: nothing compared with <baseline> ...': no metric has values on both sides (the baseline's
    decision.json damaged or hand-edited, or no metric with a better side measured at all)."""
    if new:
        why = f"the baseline has no values of {', '.join(new)}, which the candidate measured"
    else:
        why = "neither the baseline nor the candidate has values of a metric with a better side"
    return (
        f"not adopted: nothing compared with {baseline.decision_id} ({baseline.candidate_image}): {why}; "
        "0 comparisons is no evidence that the image is no worse"
    )


def _not_judged(m: MetricComparison) -> str:
    """'not adopted: <metric> cannot be compared ...': a value <= 0 on either side leaves no ratio interval."""
    return (
        f"not adopted: {m.name} cannot be compared on a ratio scale (baseline {_values(m.a.values)}, candidate "
        f"{_values(m.b.values)}: a value <= 0 has no logarithm)"
    )


def _values(values: list[float]) -> str:
    return "[" + ", ".join(f"{v:.4g}" for v in values) + "]"


def _reason(m: MetricComparison) -> str:
    return f"{m.name}: worse ({m.direction} is better): baseline median {m.a.median:.4g}, candidate median " + (
        f"{m.b.median:.4g} (ratio {m.ratio:.3f}{_interval_text(m)})"
    )


def _interval_text(m: MetricComparison) -> str:
    """', 99.17% CI 0.812..0.953' (Bonferroni over the metrics compared), or '' without an interval."""
    return f", {100 * m.confidence:.4g}% CI {m.ci95[0]:.3f}..{m.ci95[1]:.3f}" if m.ci95 else ""


def metric_values(per_run: list[dict[str, float | None]]) -> dict[str, list[float]]:
    """{metric: [value per run]} from the stage table's per-run metrics, missing and non-finite values left out
    (pure): a NaN eval loss or an overflowed perplexity measured nothing, and a Decision holds finite values only."""
    names = sorted({n for run in per_run for n in run})
    return {n: [float(v) for run in per_run if (v := run.get(n)) is not None and math.isfinite(v)] for n in names}


def medians(metrics: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in metrics.items() if values}


# ---- EKS runs read the pointer -----------------------------------------------------------------

CANARY_STORAGE_DIR = "canary"
"""On eks the canary's runs live under <storage root>/canary/, the only prefix its Ray pods' role may write."""
CANARY_CLUSTER_PREFIX = "tuneproof-canary-"
"""Ephemeral canary RayClusters run their candidate, never the pointer's image."""


def pinned(cfg: PipelineConfig, pointer: Pointer | None) -> PipelineConfig:
    """The config with cluster.expect.image taken from images/current.json (eks runs on the standing cluster).

    A canary's own cluster (named CANARY_CLUSTER_PREFIX...) runs the candidate it was created with, and
    the local profile's "image" is whatever environment the Ray head runs: both are left as they are."""
    if pointer is None or cfg.cluster.backend != "eks":
        return cfg
    if cfg.cluster.kubernetes.raycluster.startswith(CANARY_CLUSTER_PREFIX):
        return cfg
    out = cfg.model_copy(deep=True)
    out.cluster.expect.image = pointer.image
    return out


def pin_from_pointer(storage: Storage, cfg: PipelineConfig) -> PipelineConfig:
    """`pinned` with images/current.json read from the run's storage (read only for eks runs)."""
    if cfg.cluster.backend != "eks":
        return cfg
    return pinned(cfg, read_current(storage)[0])


# ---- storage -------------------------------------------------------------------------------------


class ImagesUnreadable(ValueError):
    """A registry file that exists but cannot be read as one (corrupt, truncated, wrong shape)."""


class ImageConflict(RuntimeError):
    """images/current.json moved while the canary ran: the decision is recorded, the pointer was not moved."""


def read_current(storage: Storage) -> tuple[Pointer | None, str | None]:
    """(pointer, token) of images/current.json, or (None, None) when no image was adopted yet."""
    where = storage.uri(IMAGES, CURRENT)
    try:
        data, token = cas.read_versioned(storage, IMAGES, CURRENT)
    except NotADirectoryError:
        return None, None
    except OSError as e:
        raise ImagesUnreadable(f"{where}: cannot be read as the current-image pointer: {e.strerror or e}") from None
    if data is None:
        return None, None
    try:
        return Pointer.model_validate(json.loads(data)), token
    except (ValueError, RecursionError) as e:
        raise ImagesUnreadable(
            f"{where}: not a current-image pointer ({one_line(str(e), 200)}); restore it from the history "
            "(`tuneproof images list`)"
        ) from None


def create_decision(storage: Storage, decision: Decision) -> bool:
    """Write a decision once; False when its id is taken (history is append-only: never overwritten)."""
    data = json.dumps(decision.to_json(), indent=2).encode()
    return cas.write_if(storage, data, None, IMAGES, decision.decision_id, DECISION)


def adopt(storage: Storage, decision: Decision, expected_token: str | None, adopted_at: str) -> Pointer:
    """Point images/current.json at the decision if it still names the baseline the canary compared against."""
    pointer = Pointer(
        decision_id=decision.decision_id,
        image=decision.candidate_image,
        digest=decision.digest,
        adopted_at=adopted_at,
        previous_decision=decision.baseline_decision,
    )
    data = json.dumps(pointer.model_dump(mode="json"), indent=2, sort_keys=True).encode()
    if cas.write_if(storage, data, expected_token, IMAGES, CURRENT):
        return pointer
    current, _ = read_current(storage)
    if current is not None and current.decision_id == decision.decision_id:
        return current  # a retry whose first write landed
    raise ImageConflict(
        f"{storage.uri(IMAGES, CURRENT)} moved while the canary ran: it now names "
        f"{current.decision_id if current else 'nothing'}, the canary compared against "
        f"{decision.baseline_decision or 'no current image'}; decision {decision.decision_id} is recorded as "
        "adopt but not current: run the canary again against the new current image"
    )


def load_decision(storage: Storage, decision_id: str) -> Decision:
    """One decision; FileNotFoundError naming the known ids, ImagesUnreadable for a corrupt file or one that names
    another decision (as a run record must name its run: tuneproof.control.record.load)."""
    if problem := slug_problem(decision_id):
        raise FileNotFoundError(f"decision id {decision_id!r} {problem}")
    where = storage.uri(IMAGES, decision_id, DECISION)
    if not storage.exists(IMAGES, decision_id, DECISION):
        known = ", ".join(decision_ids(storage)) or "none: run `tuneproof canary` first"
        raise FileNotFoundError(f"no image decision {decision_id!r} under {storage.uri(IMAGES)} (decisions: {known})")
    try:
        data = read_stored(storage, (IMAGES, decision_id, DECISION), MAX_DECISION_BYTES)
    except OSError as e:
        raise ImagesUnreadable(f"{where}: cannot be read as an image decision: {e.strerror or e}") from None
    try:
        decision = Decision.model_validate(json.loads(data))
    except (ValueError, RecursionError) as e:
        raise ImagesUnreadable(f"{where}: not an image decision ({one_line(str(e), 200)})") from None
    if decision.decision_id != decision_id:
        # A copied folder holds the original's decision: read under this name, `images list` showed one id twice
        # and a canary whose pointer names this folder compared against the other decision's numbers.
        raise ImagesUnreadable(
            f"{where}: the decision {decision.decision_id!r}, not {decision_id!r} (a copied decision folder?): "
            "it is not read under this name"
        )
    return decision


def decision_ids(storage: Storage) -> list[str]:
    """Decision ids, oldest first (ids start with their UTC time)."""
    return sorted(d for d in storage.listdir(IMAGES) if storage.exists(IMAGES, d, DECISION))


def history(storage: Storage) -> tuple[list[Decision], list[str]]:
    """(decisions newest first, one problem line per unreadable decision)."""
    decisions, problems = [], []
    for decision_id in reversed(decision_ids(storage)):
        try:
            decisions.append(load_decision(storage, decision_id))
        except ImagesUnreadable as e:
            problems.append(str(e))
    return decisions, problems


def row(decision: Decision, current: Pointer | None) -> dict[str, Any]:
    """The list view of one decision (pure): what `tuneproof images list` shows."""
    return {
        "decision_id": decision.decision_id,
        "current": current is not None and current.decision_id == decision.decision_id,
        "image": decision.candidate_image,
        "digest": decision.digest,
        "release_tag": decision.release_tag,
        "versions": decision.versions.model_dump(mode="json", exclude_none=True),
        "baseline_decision": decision.baseline_decision,
        "baseline_metrics": medians(decision.baseline_metrics),
        "candidate_metrics": medians(decision.candidate_metrics),
        "decision": decision.decision,
        "reasons": decision.reasons,
        "decided_at": decision.decided_at,
    }
