"""What each stage proves, as typed data: one summary model per stage.

A job builds its stage's summary (training/verify.py builds a VerifySummary, and so on) and its
harness writes it into result.json; the task that submitted the job reads it back with the same
model, and every reader after that (the flow, the record, the CLI, artifacts, promotion) gets these
types instead of digging through dicts. The stage table (tuneproof/control/stages.py) names each stage's model.

This module holds the base (Summary), the pieces every stage shares and the cluster checks' models
(verify, connectivity); the other stages' models live beside it: summaries_data.py (data),
summaries_training.py (finetune, resume) and summaries_eval.py (evaluate, promote).

Fields a failed stage may not have reached are optional; everything else is required, and unknown
fields are errors, so a job that writes the wrong thing fails loudly at the boundary.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from tuneproof.core.findings import Finding
from tuneproof.core.results import Model


class Summary(Model):
    """Base of every stage summary: strict, and JSON-ready with `to_json()` (core.results.Model)."""


# ---- shared pieces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its step and where it lives (a local path or s3:// URI)."""

    step: int
    uri: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- verify ----------------------------------------------------------------------------------


class NodeFacts(Summary):
    """What one Ray node runs, as its probe saw it (Ray's view of the node plus the probe's facts)."""

    node_id: str
    node_ip: str
    is_head: bool
    alive: bool = True
    gpus_advertised: float = 0.0
    """Ray's 'GPU' resource for the node."""
    cpus_advertised: float | None = None
    """Ray's 'CPU' resource for the node (None in records from before it was read)."""
    probe_error: str | None = None
    """Why the probe did not return facts; the version fields are then empty."""
    hostname: str | None = None
    ray_version: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    cuda_version: str | None = None
    nccl_version: str | None = None
    gpus_visible: int | None = None
    """GPUs torch sees on the node."""
    gpu_memory_bytes: list[int] = []
    """Total memory of each GPU torch sees on the node (what a fine-tune's fit estimate is compared with)."""
    environment_digest: str | None = None
    """sha256 over the node's installed distributions (name==version)."""


DigestOrMap = str | dict[str, str | None] | None
"""One digest when every node/pod agrees, else a map from node/pod to its digest."""


class ClusterFacts(Summary):
    """The cluster's identity for the run record: Ray version, nodes, environment and image digests."""

    ray_version: str | None = None
    nodes: list[NodeFacts] = []
    environment_digest: DigestOrMap = None
    image_digest: DigestOrMap = None
    """The digest every Ray pod runs (eks); None on the local profile."""


class StorageProbe(Summary):
    uri: str
    node_ip: str
    ok: bool
    error: str | None = None
    seconds: float | None = None
    conditional_writes: str | None = None
    """'honoured', or what the store got wrong (a stale If-Match accepted, ...); None when not probed."""


class VerifySummary(Summary):
    nodes: list[NodeFacts]
    findings: list[Finding]
    cluster: ClusterFacts
    storage_probe: StorageProbe | None = None
    kubernetes: dict[str, Any] | None = None
    """The Kubernetes half on eks: its findings and a summary of the RayCluster, pods and nodes."""
    forwarded_env: dict[str, bool] = {}
    """runtime_env.forward_env names, each with whether the job saw a value (never the value)."""


# ---- connectivity ----------------------------------------------------------------------------


class RankStatus(Summary):
    rank: int
    node_ip: str | None = None
    pid: int | None = None
    started: str | None = None
    joined: str | None = None
    finished: str | None = None


class AllreduceRow(Summary):
    size_bytes: int
    time_ms: float
    algbw_GBps: float
    busbw_GBps: float
    """algbw x 2(n-1)/n: the ring all-reduce's traffic per link (nccl-tests' definition)."""


class FsdpProbe(Summary):
    steps: int
    losses: list[float]


TransportKind = Literal["efa", "socket-fallback", "inconclusive", "gloo"]


class TransportVerdict(Summary):
    kind: TransportKind
    evidence: list[str]
    """The log lines that decided it."""


class ConnectivitySummary(Summary):
    backend: str
    world_size: int
    ranks: list[RankStatus]
    allreduce: list[AllreduceRow]
    fsdp: FsdpProbe
    transport: TransportVerdict
