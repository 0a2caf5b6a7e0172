"""Checks over the facts the verify stage collects from every Ray node (pure, no I/O).

A node's facts are a dict produced by training.verify's probe: node_id, node_ip, is_head, alive,
ray/python/torch/transformers versions, cuda_version and nccl_version (None on CPU), gpus_visible
(what torch sees on the node), gpus_advertised (Ray's 'GPU' resource for the node) and
environment_digest (environment_digest() over the node's installed distributions).

Each check returns a list of Findings naming the node, the field and both values, so the Ray half
and the Kubernetes half of verify can be concatenated and reported the same way.
"""

from __future__ import annotations

import hashlib
import re
from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from tuneproof.core.config_cluster import ClusterExpect
from tuneproof.core.findings import Finding

VERSION_FIELDS = (
    "ray_version",
    "torch_version",
    "python_version",
    "transformers_version",
    "cuda_version",
    "nccl_version",
)
AGREEMENT_FIELDS = VERSION_FIELDS + ("environment_digest",)


def environment_digest(dists: Iterable[tuple[str, str]]) -> str:
    """sha256 of the sorted, de-duplicated 'name==version' lines of installed distributions.

    Names are normalised (case, '-'/'_'/'.') so the same environment hashes the same wherever
    importlib.metadata found it.
    """
    lines = sorted({f"{_normalise_name(name)}=={version}" for name, version in dists})
    return hashlib.sha256("\n".join(lines).encode()).hexdigest()


def node_subject(node: dict) -> str:
    return f"node {node.get('node_ip')} ({str(node.get('node_id', ''))[:8]})"


def check_nodes(nodes: list[dict], expect: ClusterExpect) -> list[Finding]:
    """Every finding over alive nodes: expected versions, GPU counts, cross-node agreement.

    expect.gpus_per_worker 0 skips the worker GPU check. Dead nodes (Ray keeps departed nodes in its
    table) are not checked.
    """
    alive = [n for n in nodes if n.get("alive", True)]
    return (
        check_expected_versions(alive, expect)
        + check_gpus_visible(alive)
        + check_worker_gpus(alive, expect.gpus_per_worker)
        + check_agreement(alive, [f for f in AGREEMENT_FIELDS if getattr(expect, f, None) is None])
    )


def check_capacity(nodes: list[dict], workers: int, use_gpu: bool, fixed_size: bool) -> list[Finding]:
    """Whether the alive nodes can place the Ray Train stages' workers (pure).

    Connectivity, the fine-tune and the resume test each ask Ray Train for train.num_workers workers of
    1 CPU (and 1 GPU with train.use_gpu), each on one node. A cluster that cannot place them all leaves
    the stage "waiting for resources" until its timeout; on a cluster of fixed size (the embedded one)
    that is an error here, and elsewhere a warning, since an autoscaler may add the nodes. Facts
    without Ray's CPU count (a record from before it was read) are not judged.
    """
    alive = [n for n in nodes if n.get("alive", True)]
    if not alive or any(n.get("cpus_advertised") is None for n in alive):
        return []

    def places(node: dict) -> int:
        cpus = int(node["cpus_advertised"])
        return min(cpus, int(node.get("gpus_advertised") or 0)) if use_gpu else cpus

    total = sum(places(n) for n in alive)
    if total >= workers:
        return []
    each = "1 CPU and 1 GPU" if use_gpu else "1 CPU"
    where = "the embedded cluster cannot grow" if fixed_size else "unless an autoscaler adds nodes"
    fix = "lower train.num_workers or add nodes"
    if use_gpu and not any(n.get("gpus_advertised") for n in alive):
        fix = "no node advertises a GPU: set train.use_gpu=false, or add GPU nodes"
    return [
        Finding(
            "cluster",
            "train.num_workers",
            workers,
            f"at most {total}",
            f"the {len(alive)} alive node(s) can place {total} workers of {each} each; {where}, the Ray Train "
            f"stages would wait for resources until their timeouts: {fix}",
            "error" if fixed_size else "warning",
        )
    ]


def check_expected_versions(nodes: list[dict], expect: ClusterExpect) -> list[Finding]:
    findings = []
    for field in VERSION_FIELDS:
        expected = getattr(expect, field)
        if expected is None:
            continue
        same = _MATCHERS.get(field, _exact)
        findings += [
            Finding(node_subject(n), field, n.get(field), expected, "version differs from cluster.expect")
            for n in nodes
            if not same(n.get(field), expected)
        ]
    return findings


def check_gpus_visible(nodes: list[dict]) -> list[Finding]:
    """What torch sees on a node must equal what Ray hands out from it."""
    return [
        Finding(
            node_subject(n),
            "gpus_visible",
            n.get("gpus_visible"),
            n.get("gpus_advertised"),
            "GPUs torch sees on the node differ from the GPUs Ray advertises for it",
        )
        for n in nodes
        if _number(n.get("gpus_visible")) != _number(n.get("gpus_advertised"))
    ]


def check_worker_gpus(nodes: list[dict], gpus_per_worker: int) -> list[Finding]:
    if gpus_per_worker <= 0:
        return []
    workers = [n for n in nodes if not n.get("is_head")]
    if not workers:
        return [
            Finding("cluster", "worker_nodes", 0, ">= 1", f"no alive worker node to advertise {gpus_per_worker} GPU(s)")
        ]
    return [
        Finding(
            node_subject(n),
            "gpus_advertised",
            n.get("gpus_advertised"),
            gpus_per_worker,
            "worker node advertises a different GPU count than cluster.expect.gpus_per_worker",
        )
        for n in workers
        if _number(n.get("gpus_advertised")) != gpus_per_worker
    ]


def check_agreement(nodes: list[dict], fields: Iterable[str] = AGREEMENT_FIELDS) -> list[Finding]:
    """Each node whose value differs from the majority; ties go to the head node's value."""
    findings = []
    for field in fields:
        reference = _majority(nodes, field)
        findings += [
            Finding(
                node_subject(n),
                field,
                n.get(field),
                reference,
                f"differs from the other nodes ({_count(nodes, field, reference)} of {len(nodes)} report the expected value)",
            )
            for n in nodes
            if n.get(field) != reference
        ]
    return findings


def summarize_cluster(nodes: list[dict]) -> dict[str, Any]:
    """The cluster facts for the run record: versions, nodes, one environment digest if all agree."""
    alive = [n for n in nodes if n.get("alive", True)]
    digests = {n.get("environment_digest") for n in alive}
    head = next((n for n in alive if n.get("is_head")), alive[0] if alive else {})
    return {
        "ray_version": head.get("ray_version"),
        "nodes": [
            {
                k: n.get(k)
                for k in ("node_id", "node_ip", "is_head", "alive", "gpus_advertised", "gpus_visible", *VERSION_FIELDS)
            }
            for n in nodes
        ],
        "environment_digest": (
            digests.pop() if len(digests) == 1 else {node_subject(n): n.get("environment_digest") for n in alive}
        ),
    }


def _normalise_name(name: str) -> str:
    """PEP 503 normalisation: 'Foo_Bar.baz' -> 'foo-bar-baz'."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _exact(seen: Any, expected: str) -> bool:
    return seen == expected


def _without_local_tag(seen: Any, expected: str) -> bool:
    """torch: '2.13.0+cpu' and '2.13.0+cu130' both match '2.13.0'."""
    return seen is not None and str(seen).split("+", 1)[0] == expected.split("+", 1)[0]


def _dotted_prefix(seen: Any, expected: str) -> bool:
    """'3.13' matches '3.13.1' (but not '3.1'); a full version must match exactly."""
    return seen is not None and (str(seen) == expected or str(seen).startswith(expected + "."))


_MATCHERS: dict[str, Callable[[Any, str], bool]] = {
    "torch_version": _without_local_tag,
    "python_version": _dotted_prefix,
    "cuda_version": _dotted_prefix,
    "nccl_version": _dotted_prefix,
}


def _majority(nodes: list[dict], field: str) -> Any:
    counts = Counter(n.get(field) for n in nodes)
    if not counts:
        return None
    top = max(counts.values())
    leaders = [value for value, c in counts.items() if c == top]
    head_value = next((n.get(field) for n in nodes if n.get("is_head")), None)
    return head_value if head_value in leaders else leaders[0]


def _count(nodes: list[dict], field: str, value: Any) -> int:
    return sum(1 for n in nodes if n.get(field) == value)


def _number(value: Any) -> float | None:
    return None if value is None else float(value)
