"""The image canary: try a candidate image on the production workload, then adopt it or reject it, on evidence.

    tuneproof canary --candidate-image repo@sha256:<64 hex> --config configs/eks.yaml   (or the image-canary deployment)
    tuneproof canary                                   locally: the candidate is this environment

On eks it creates an ephemeral RayCluster from deployments/raycluster.yaml running the candidate
(tuneproof.control.kube_canary: deleted at the end whatever happened). Locally the "image" is the Python
environment the embedded Ray head runs (local-env@sha256:<the environment digest verify records>), and
the cluster is the embedded one. Either way each repeat is an ordinary pipeline run (verify ->
connectivity -> data -> a short fine-tune -> evaluate, with its own run id and record) of the production
model's workload; the flow compares their metrics with those the current image's decision recorded
(tuneproof.control.images.decide), writes images/<decision-id>/decision.json, and on adopt moves
images/current.json by compare-and-swap. A first canary, with no current image, becomes the baseline.
"""

from __future__ import annotations

import re

import yaml
from prefect import flow, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed, Failed, State

from flows.compare import read_record
from flows.pipeline import pipeline, publish, refused
from tasks import image_artifacts
from tuneproof.control import images, registry
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.control.images import CandidateImage, Decision, ImageVersions
from tuneproof.control.kube_canary import ephemeral_raycluster
from tuneproof.control.record import RunRecord
from tuneproof.core.checks import VERSION_FIELDS
from tuneproof.core.config import PROJECT_ROOT, ConfigError, PipelineConfig
from tuneproof.core.config_base import MAX_TIMEOUT_S
from tuneproof.core.files import (
    MAX_MANIFEST_BYTES,
    DuplicateKey,
    FileRefused,
    NumberRefused,
    decode_text,
    parse_yaml_all,
    read_regular,
)
from tuneproof.core.names import slug_problem
from tuneproof.core.results import StageFailure, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ConnectivitySummary, VerifySummary

CANARY_STAGES = ["verify", "connectivity", "data", "finetune", "evaluate"]
"""What a canary run proves about an image: it is what runs, its ranks talk, it trains and evaluates."""
OFI_VERSION = re.compile(r"(?:aws-ofi-nccl|NET/OFI)\D*?(\d+\.\d+(?:\.\d+)?)", re.IGNORECASE)


@flow(name="tuneproof-image-canary", log_prints=True)
def image_canary(
    candidate_image: CandidateImage | None = None,
    config: PipelineConfig = PipelineConfig(),
    max_steps: int = 60,
    # Three, and never one: single values are one draw of the noise (the same local environment was once
    # rejected for a 0.81 bus bandwidth ratio that way). Metrics compare by the t interval on log values, as
    # `tuneproof compare` does; one the repeats cannot resolve withholds adoption, naming the repeats needed.
    repeats: int = 3,
    threshold: float = 0.10,
    decision_id: str | None = None,
    manifest: str = "deployments/raycluster.yaml",
    ready_timeout_s: float = 1200.0,
) -> State:
    """Run the production workload (short) on `candidate_image`; compare with the current image; adopt or reject.

    candidate_image: repo@sha256:<64 hex>; required on eks, locally the current environment by default."""
    # A deployment's parameters reach here unchecked: a config that fails only once resolved is refused, not raised.
    try:
        cfg = config.resolved()
    except ConfigError as e:
        return refused(e)
    problem = request_problem(cfg, candidate_image, max_steps, repeats, threshold, decision_id, ready_timeout_s)
    if problem:
        return refused(problem)
    storage = Storage.from_config(cfg.storage)
    candidate = candidate_image or images.local_image()
    decision_id = decision_id or records.make_run_id()
    if storage.exists(images.IMAGES, decision_id, images.DECISION):
        return refused(f"image decision {decision_id} already exists: give another id (or none)")
    try:
        pointer, token = images.read_current(storage)
        baseline = images.load_decision(storage, pointer.decision_id) if pointer else None
        workload = canary_workload(cfg, storage, candidate, max_steps)
        body = read_manifest(manifest) if cfg.cluster.backend == "eks" else {}
    except (images.ImagesUnreadable, FileNotFoundError, ConfigError, ValueError) as e:
        return refused(e)
    logger = get_run_logger()
    logger.info(
        f"image canary {decision_id}: {candidate} on {cfg.profile}, {repeats} run(s) of {', '.join(CANARY_STAGES)} "
        f"({workload.train.max_steps} steps); baseline: {baseline.decision_id if baseline else 'none (first canary)'}"
    )
    runs, failure = run_canary(workload, candidate, decision_id, repeats, body, ready_timeout_s)
    decision = judge(cfg, candidate, decision_id, runs, failure, baseline, threshold)
    return record_decision(storage, decision, token)


def request_problem(
    cfg: PipelineConfig,
    candidate: str | None,
    max_steps: int,
    repeats: int,
    threshold: float,
    decision_id: str | None,
    ready_timeout_s: float,
) -> str | None:
    """Why the request cannot run, naming the bad value (pure)."""
    if decision_id is not None and (problem := slug_problem(decision_id)):
        return f"decision id {decision_id!r} {problem}"
    if cfg.cluster.backend == "eks" and candidate is None:
        return "candidate_image is required on eks: give the image to try as repo@sha256:<64 hex>"
    if candidate is not None and (problem := images.image_problem(candidate)):
        return f"candidate image {candidate!r} {problem}"
    return (
        images.max_steps_problem(max_steps)
        or images.repeats_problem(repeats)
        or images.threshold_problem(threshold)
        or ready_timeout_problem(ready_timeout_s)
    )


def ready_timeout_problem(ready_timeout_s: float) -> str | None:
    """Why the canary cannot wait `ready_timeout_s` for its RayCluster, or None (pure; NaN fails). NaN or inf
    waited forever with the cluster up; 0 or less gave up at once and recorded a reject on no evidence."""
    if not 1 <= ready_timeout_s <= MAX_TIMEOUT_S:
        return f"ready_timeout_s must be between 1 and {MAX_TIMEOUT_S} seconds (got {ready_timeout_s})"
    return None


def canary_workload(cfg: PipelineConfig, storage: Storage, candidate: str, max_steps: int) -> PipelineConfig:
    """The production model's workload (the config of the run that produced it, else `cfg`), shortened.

    The cluster and storage stay the profile's, less its version expectations; the fine-tune is cut to max_steps
    with no resume test and no regression suites; every gate only asks that its metric was computed, and cut-off
    answers are counted but not capped (eval.max_truncated_fraction 1): a canary judges the image against the
    baseline image's measurements, not the short model against the production gates. On eks the runs' storage
    root is <root>/canary: the canary's Ray pods run the candidate image under a role that writes only there
        (deployments/s3-canary-policy.json), so `tuneproof runs show` finds them with --set storage.root=<root>/canary.
    """
    data = production_config(storage, cfg.model.name) or cfg.model_dump(mode="json")
    data.update(cluster=cfg.cluster.model_dump(mode="json"), storage=cfg.storage.model_dump(mode="json"))
    if cfg.cluster.backend == "eks":
        data["storage"]["root"] = f"{cfg.storage.root.rstrip('/')}/{images.CANARY_STORAGE_DIR}"
    expect = data["cluster"]["expect"]
    expect["image"] = candidate if cfg.cluster.backend == "eks" else None
    # A candidate brings its own versions: verify records them (and still requires every node to agree
    # and, on eks, every pod to run the candidate's digest) instead of holding them to the current image's.
    for field in VERSION_FIELDS:
        expect[field] = None
    train = data["train"]
    train["max_steps"] = min(train["max_steps"], max_steps)
    train["checkpoint_every"] = min(train["checkpoint_every"], train["max_steps"])
    train["warmup_steps"] = min(train["warmup_steps"], train["max_steps"] // 2)
    data["resume"]["enabled"] = False
    data["eval"]["gates"] = {name: computed_gate(gate) for name, gate in data["eval"]["gates"].items()}
    # A short fine-tune has not yet relearned the skills it rehearses: the production model's regression suites
    # judge models, and a canary judges the image, so they are left out (as the gates are only asked to compute).
    data["eval"]["suites"] = {}
    # A short fine-tune need not have learned to end its answers: counted, not held to the cap, as its gates.
    data["eval"]["max_truncated_fraction"] = 1.0
    return PipelineConfig.model_validate(data).resolved()


def computed_gate(gate: dict) -> dict:
    """A gate any computed value passes (a missing or NaN one still fails): the metric is measured, not judged."""
    higher = gate.get("higher_is_better", True)
    return {"min": -1e300 if higher else 1e300, "higher_is_better": higher}


def production_config(storage: Storage, model: str) -> dict | None:
    """The config of the run behind the production model, when there is one and its record is readable."""
    pointer, _ = registry.read_pointer(storage, model)
    rec = read_record(storage, pointer.run_id) if pointer else None
    return dict(rec.config) if rec is not None and rec.config else None


MANIFESTS = PROJECT_ROOT / "deployments"
"""Where a canary's manifest may come from: the checkout's manifests, the ones lint checks against the canary's
admission policy. Any other path would let whoever fills the form probe files on the worker."""


def read_manifest(manifest: str) -> dict:
    """The RayCluster manifest the canary copies, a file under deployments/ (relative paths are relative to the
    project root). ValueError names the file and what is wrong with it, never what it holds: the message is
    published in the Prefect UI."""
    try:
        path = (PROJECT_ROOT / manifest).resolve()  # an absolute `manifest` replaces the root; links are followed
    except ValueError:  # os.path.realpath's answer to a NUL byte
        raise ValueError(f"manifest {manifest!r} is not a path: it holds a NUL byte") from None
    if not path.is_relative_to(MANIFESTS.resolve()):
        raise ValueError(
            f"manifest {manifest!r} is not under {MANIFESTS}: the canary copies only a manifest lint checks "
            "there (deployments/raycluster.yaml by default)"
        )
    try:
        documents = [d for d in parse_yaml_all(decode_text(read_regular(path, MAX_MANIFEST_BYTES))) if d is not None]
    except FileRefused as e:
        raise ValueError(f"manifest {path} {e.strerror}") from None
    except OSError as e:
        raise ValueError(f"manifest {path}: cannot be read ({e.strerror or e}); pass manifest=") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"manifest {path}: not UTF-8 text (byte {e.start})") from None
    except (yaml.YAMLError, RecursionError) as e:
        raise ValueError(f"manifest {path}: {yaml_problem(e)}") from None
    if len(documents) != 1 or not isinstance(documents[0], dict) or documents[0].get("kind") != "RayCluster":
        raise ValueError(f"manifest {path} {manifest_shape(documents)}")
    return documents[0]


def yaml_problem(e: Exception) -> str:
    """Where the YAML broke, without the parser's message: that quotes the file (a token, a key, a snippet)."""
    if isinstance(e, DuplicateKey):
        return "names a key twice in one mapping"
    if isinstance(e, NumberRefused):
        return "holds an integer of over 4,300 digits, more than Python reads"
    mark = e.problem_mark if isinstance(e, yaml.MarkedYAMLError) else None
    return f"not valid YAML at line {mark.line + 1}, column {mark.column + 1}" if mark else "not valid YAML"


def manifest_shape(documents: list) -> str:
    """What the file holds instead of one RayCluster, by its shape alone (pure)."""
    if len(documents) != 1:
        return f"holds {len(documents)} YAML documents, expected one RayCluster object"
    if isinstance(documents[0], dict):
        return "holds an object whose kind is not RayCluster"
    return f"holds a YAML {type(documents[0]).__name__}, expected one RayCluster object"


def run_canary(
    workload: PipelineConfig, candidate: str, decision_id: str, repeats: int, body: dict, ready_timeout_s: float
) -> tuple[list[RunRecord], str | None]:
    """(the runs' records, the failure that ends the canary or None): on eks inside an ephemeral RayCluster."""
    if workload.cluster.backend != "eks":
        return run_repeats(workload, candidate, decision_id, repeats)
    logger = get_run_logger()
    try:
        with ephemeral_raycluster(
            workload.cluster.kubernetes, body, candidate, decision_id, timeout_s=ready_timeout_s, log=logger.info
        ) as cluster:
            on_canary = workload.model_copy(deep=True)
            on_canary.cluster.address = cluster.address
            on_canary.cluster.kubernetes.raycluster = cluster.name
            return run_repeats(on_canary, candidate, decision_id, repeats)
    except StageFailure as e:
        return [], f"the canary RayCluster: {e.failure_class.value}: {e.cause}"


def run_repeats(
    workload: PipelineConfig, candidate: str, decision_id: str, repeats: int
) -> tuple[list[RunRecord], str | None]:
    """Each repeat an ordinary pipeline run, <decision-id>-r<N>; the first that fails ends the canary."""
    storage = Storage.from_config(workload.storage)
    out: list[RunRecord] = []
    for repeat in range(1, repeats + 1):
        run_id = f"{decision_id}-r{repeat}"
        state = pipeline(config=workload, run_id=run_id, only=list(CANARY_STAGES), return_state=True)
        rec = read_record(storage, run_id)
        if rec is None:
            return out, f"{run_id}: {state.message or 'the run ended before writing a record'}"
        out.append(rec)
        if rec.status != "succeeded":
            return out, f"{run_id}: {rec.cause}"
        if problem := ran_elsewhere(workload, candidate, rec):
            return out, f"{run_id}: {problem}"
        get_run_logger().info(f"{run_id} succeeded")
    return out, None


def ran_elsewhere(workload: PipelineConfig, candidate: str, rec: RunRecord) -> str | None:
    """Locally, why the run's environment is not the candidate (verify checks image digests itself on eks)."""
    if workload.cluster.backend == "eks":
        return None
    seen = rec.cluster.environment_digest if rec.cluster else None
    if isinstance(seen, str) and images.local_image_of(seen) == candidate:
        return None
    return (
        f"the embedded cluster runs environment {seen}, not the candidate {candidate}: "
        "locally a canary can only try the environment the Ray head runs (restart it in the candidate's)"
    )


def judge(
    cfg: PipelineConfig,
    candidate: str,
    decision_id: str,
    runs: list[RunRecord],
    failure: str | None,
    baseline: Decision | None,
    threshold: float,
) -> Decision:
    measured = images.metric_values([table.diff_metrics(r) for r in runs if r.status == "succeeded"])
    verdict, reasons, compared = images.decide(failure, baseline, measured, threshold)
    return Decision(
        decision_id=decision_id,
        candidate_image=candidate,
        digest=images.digest_of(candidate),
        release_tag=images.release_tag(candidate),
        profile=cfg.profile,
        versions=versions_seen(runs),
        baseline_decision=baseline.decision_id if baseline else None,
        baseline_image=baseline.candidate_image if baseline else None,
        baseline_metrics=baseline.candidate_metrics if baseline else {},
        candidate_metrics=measured,
        comparison=compared,
        threshold=threshold,
        decision=verdict,
        reasons=reasons,
        runs=[r.run_id for r in runs],
        decided_at=now_iso(),
        flow_run_id=str(flow_run.get_id()),
        flow_run_name=flow_run.get_name(),
    )


def versions_seen(runs: list[RunRecord]) -> ImageVersions:
    """Ray/Python/torch/CUDA/NCCL as verify saw them on the first run's head (or first) node; EFA from NCCL's log."""
    verify = runs[0].summary("verify", VerifySummary) if runs else None
    if verify is None or not verify.nodes:
        return ImageVersions()
    node = next((n for n in verify.nodes if n.is_head and n.ray_version), verify.nodes[0])
    conn = runs[0].summary("connectivity", ConnectivitySummary)
    efa = (
        next((m.group(1) for line in conn.transport.evidence if (m := OFI_VERSION.search(line))), None)
        if conn
        else None
    )
    env = verify.cluster.environment_digest
    return ImageVersions(
        ray=node.ray_version,
        python=node.python_version,
        torch=node.torch_version,
        transformers=node.transformers_version,
        cuda=node.cuda_version,
        nccl=node.nccl_version,
        efa=efa,
        environment_digest=env if isinstance(env, str) else None,
    )


def record_decision(storage: Storage, decision: Decision, token: str | None) -> State:
    """Write the decision (once), move the pointer on adopt, publish the artifact; the state says which."""
    logger = get_run_logger()
    if not images.create_decision(storage, decision):
        return Failed(message=f"image decision {decision.decision_id} was written meanwhile by another canary")
    where = storage.uri(images.IMAGES, decision.decision_id, images.DECISION)
    publish(image_artifacts.publish, decision)
    for reason in decision.reasons:
        logger.info(f"{decision.decision}: {reason}")
    if decision.decision == "reject":
        return Failed(message=f"rejected {decision.candidate_image}: {'; '.join(decision.reasons)} ({where})")
    try:
        images.adopt(storage, decision, token, now_iso())
    except images.ImageConflict as e:
        return Failed(message=str(e))
    logger.info(f"adopted {decision.candidate_image}: {storage.uri(images.IMAGES, images.CURRENT)} names {where}")
    return Completed(message=f"adopted {decision.candidate_image} ({where})", data=decision.to_json())
