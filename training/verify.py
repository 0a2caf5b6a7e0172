"""The verify stage: every alive Ray node runs what the pipeline expects, and storage works from a worker.

Runs as a Ray job: `python -m training.verify` with TUNEPROOF_JOB set (tasks/jobs.py submits it).
One probe task per alive node, pinned to it, collects versions, GPU counts and an environment
digest; tuneproof.core.checks compares them with cluster.expect and across nodes. A second task, on a
worker node when there is one, writes, reads back and deletes a small object under this stage's
storage prefix with the worker's own identity, and probes that the store honours conditional writes
(a stale If-Match must be rejected: the production pointer's compare-and-swap rests on it; a store
that ignores them is named as an error finding). Any error finding fails the stage as infrastructure.

The Kubernetes half (image digests, pod GPU limits) lives elsewhere and reports Findings the same way.
"""

from __future__ import annotations

import importlib.metadata
import platform
import socket
import time
import uuid
from typing import TYPE_CHECKING, Any, TypeVar

from training.jobkit import JobContext, log, run_stage
from tuneproof.core import cas, forward_env
from tuneproof.core.checks import check_capacity, check_nodes, environment_digest, node_subject, summarize_cluster
from tuneproof.core.config_cluster import StorageConfig
from tuneproof.core.findings import Finding, errors
from tuneproof.core.results import StageFailure, error_line, first_and_more
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ClusterFacts, NodeFacts, StorageProbe, VerifySummary

if TYPE_CHECKING:
    from ray import ObjectRef
    from ray._private.worker import HasOptions  # the protocol Ray's remote functions type .options() with

    Remote = TypeVar("Remote", bound=HasOptions)

HEAD_RESOURCE = "node:__internal_head__"


def verify(ctx: JobContext) -> VerifySummary:
    import ray

    if not ray.is_initialized():
        ray.init()  # inside a Ray job this attaches to the job's cluster
    timeout_s = probe_timeout_s(ctx)
    nodes = alive_nodes()
    log(f"verify: probing {len(nodes)} alive node(s)")
    facts, probe_findings = probe_nodes(nodes, timeout_s)
    storage_probe = probe_storage(ctx.config.storage, ctx.stage_parts(f"probe-{uuid.uuid4().hex}"), nodes, timeout_s)
    findings = probe_findings + check_nodes([f for f in facts if "probe_error" not in f], ctx.config.cluster.expect)
    train = ctx.config.train
    findings += check_capacity(facts, train.num_workers, train.use_gpu, ctx.config.cluster.backend == "local")
    findings += storage_findings(storage_probe)
    summary = VerifySummary(
        nodes=[NodeFacts.model_validate(f) for f in facts],
        findings=findings,
        cluster=ClusterFacts.model_validate(summarize_cluster(facts)),
        storage_probe=StorageProbe.model_validate(storage_probe),
        forwarded_env=forward_env.presence(ctx.config.runtime_env.forward_env),
    )
    fail_on_errors(findings, summary)
    log(f"verify: {len(facts)} node(s) agree with cluster.expect; storage round trip {storage_probe['seconds']:.2f}s")
    return summary


def probe_timeout_s(ctx: JobContext) -> float:
    """Half the stage's budget: a node that cannot run a zero-CPU task by then is not usable."""
    return max(10.0, ctx.config.timeouts.verify / 2)


def alive_nodes() -> list[dict[str, Any]]:
    """Ray's view of each alive node: id, IP, head or not, advertised GPUs and CPUs."""
    import ray

    return [
        {
            "node_id": n["NodeID"],
            "node_ip": n["NodeManagerAddress"],
            "is_head": HEAD_RESOURCE in n["Resources"],
            "alive": True,
            "gpus_advertised": n["Resources"].get("GPU", 0.0),
            "cpus_advertised": n["Resources"].get("CPU", 0.0),
        }
        for n in ray.nodes()
        if n["Alive"]
    ]


def probe_nodes(nodes: list[dict], timeout_s: float) -> tuple[list[dict], list[Finding]]:
    """Run node_facts on every node; a node that errs or does not answer is a finding, not facts."""
    import ray

    remote = ray.remote(node_facts)
    refs = [_pinned(remote, node["node_id"]).remote() for node in nodes]
    ready, _ = ray.wait(refs, num_returns=len(refs), timeout=timeout_s)
    facts, findings = [], []
    for node, ref in zip(nodes, refs):
        error = _probe_error(ref, ready, timeout_s)
        if error:
            facts.append({**node, "probe_error": error})
            findings.append(
                Finding(node_subject(node), "probe", error, "node facts", "the probe task did not complete")
            )
        else:
            probed: dict[str, Any] = ray.get(ref)
            facts.append({**node, **probed})
    return facts, findings


def node_facts() -> dict[str, Any]:
    """What this node runs. Executed inside a Ray task pinned to the node.

    Ray (2.4x on) leaves CUDA_VISIBLE_DEVICES alone for tasks that request no GPU, so torch
    sees every GPU the node (pod) exposes, which is what Ray should be advertising.
    """
    import torch

    return {
        "hostname": socket.gethostname(),
        "ray_version": _dist_version("ray"),
        "python_version": platform.python_version(),
        "torch_version": _dist_version("torch") or torch.__version__,
        "transformers_version": _dist_version("transformers"),
        "cuda_version": torch.version.cuda,
        "nccl_version": nccl_version(),
        "gpus_visible": torch.cuda.device_count(),
        "gpu_memory_bytes": [
            torch.cuda.get_device_properties(i).total_memory for i in range(torch.cuda.device_count())
        ],
        "environment_digest": environment_digest(installed_distributions()),
    }


def nccl_version() -> str | None:
    """NCCL torch was built with, '2.29.7'; None on a CPU build.

    Asked on any CUDA build, not only where a GPU is present, so a GPU-less head running the
    same image reports the same version as its GPU workers.
    """
    import torch

    if torch.version.cuda is None:
        return None
    try:
        version = torch.cuda.nccl.version()
    except (AttributeError, RuntimeError):
        return None
    if isinstance(version, int):  # older torch: 22907 -> (2, 29, 7)
        version = (version // 10000, version // 100 % 100, version % 100)
    return ".".join(str(part) for part in version)


def installed_distributions() -> list[tuple[str, str]]:
    return [(d.metadata["Name"], d.version) for d in importlib.metadata.distributions() if d.metadata["Name"]]


def probe_storage(storage_cfg: StorageConfig, parts: tuple[str, ...], nodes: list[dict], timeout_s: float) -> dict:
    """Round-trip one object from a worker node (the head when there is none), never from the driver."""
    import ray

    storage = Storage.from_config(storage_cfg)
    uri = storage.uri(*parts)
    node = next((n for n in nodes if not n["is_head"]), nodes[0])
    remote = ray.remote(storage_roundtrip)
    ref = _pinned(remote, node["node_id"]).remote(storage_cfg.model_dump(mode="json"), list(parts))
    result = {"uri": uri, "node_ip": node["node_ip"]}
    error = _probe_error(ref, ray.wait([ref], timeout=timeout_s)[0], timeout_s)
    if error:
        return {**result, "ok": False, "error": error, "seconds": None}
    roundtrip: dict[str, Any] = ray.get(ref)
    return {**result, **roundtrip}


def storage_roundtrip(storage_cfg: dict, parts: list[str]) -> dict[str, Any]:
    """Write, read back and delete a small object; raises on any mismatch. Runs as a Ray task."""
    storage = Storage.from_config(StorageConfig.model_validate(storage_cfg))
    payload = f"tuneproof storage probe {uuid.uuid4()}".encode()
    start = time.monotonic()
    storage.write_bytes(payload, *parts)
    read = storage.read_bytes(*parts)
    storage.remove(*parts)
    if read != payload:
        raise OSError(f"read back {len(read)} bytes that differ from the {len(payload)} bytes written")
    if storage.exists(*parts):
        raise OSError("the object still exists after delete")
    seconds = round(time.monotonic() - start, 3)
    ignored = cas.honours_conditional_writes(storage, *parts[:-1], f"{parts[-1]}-cas")
    return {"ok": True, "seconds": seconds, "conditional_writes": ignored or "honoured"}


def storage_findings(probe: dict) -> list[Finding]:
    if probe["ok"]:
        return conditional_write_findings(probe)
    return [
        Finding(
            f"storage {probe['uri']}",
            "write/read/delete",
            probe["error"],
            "ok",
            f"from a task on node {probe['node_ip']}",
        )
    ]


def conditional_write_findings(probe: dict) -> list[Finding]:
    """An error when the store accepted a write it should have refused: compare-and-swap is then a blind write."""
    seen = probe.get("conditional_writes")
    if seen in (None, "honoured"):
        return []
    return [
        Finding(
            f"storage {probe['uri']}",
            "conditional writes",
            seen,
            "honoured",
            "the store ignores If-Match/If-None-Match: two promotions could both move the production pointer; "
            "use a store that honours conditional writes (S3, recent MinIO) or a local/FSx root",
        )
    ]


def fail_on_errors(findings: list[Finding], summary: VerifySummary) -> None:
    errs = errors(findings)
    if errs:
        raise StageFailure("infrastructure", first_and_more([f.line() for f in errs]), summary)


def _pinned(remote: Remote, node_id: str) -> Remote:
    """Hard-pinned to one node, and zero CPUs so it schedules while training holds every CPU."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return remote.options(
        num_cpus=0, max_retries=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)
    )


def _probe_error(ref: ObjectRef[Any], ready: list[ObjectRef[Any]], timeout_s: float) -> str | None:
    """None when the task finished; otherwise one line saying why not."""
    import ray

    if ref not in ready:
        return f"no answer within {timeout_s:.0f}s"
    try:
        ray.get(ref)
    except Exception as e:  # noqa: BLE001 - any task error is the finding itself
        cause = getattr(e, "cause", None) or e
        return error_line(cause)
    return None


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def main() -> None:
    run_stage(verify)


if __name__ == "__main__":
    main()
