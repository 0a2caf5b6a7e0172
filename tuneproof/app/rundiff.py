"""`tuneproof runs diff A B`: which choices changed between two runs, and how the results moved.

Pure over two run records; each stage's metrics come from the stage table. Choices: image digest, per-node Ray/torch/CUDA/NCCL/Python versions,
environment digest, cluster configuration, code SHA + dirty flag, working_dir hash, every config
field (dotted names), runtime_env additions, dataset hash, each regression suite's file hash (a suite edited
in place keeps its config). Results: throughput, final loss, eval
metrics, bus bandwidth, each gate's verdict with its interval and item count (a gate that moved from pass
to insufficient evidence on fewer items is not a worse model), and what each run cost (seconds per stage,
resource-seconds, money with a price table) — so a team can tell which change explains a different result.
"""

from __future__ import annotations

import math
from typing import Any

from tuneproof.control import cost
from tuneproof.control.record import RunRecord
from tuneproof.control.stages import diff_metrics
from tuneproof.core.summaries import NodeFacts
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import ROLES, EvaluateSummary, SuiteRow

NODE_FIELDS = (
    "ray_version",
    "torch_version",
    "cuda_version",
    "nccl_version",
    "python_version",
    "transformers_version",
    "environment_digest",
    "gpus_advertised",
)


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; lists stay whole values."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: obj}


def identity(record: RunRecord) -> dict[str, Any]:
    """The choices behind a run, flattened to dotted names."""
    cluster, code, data = record.cluster, record.code, record.data
    facts: dict[str, Any] = {
        "image_digest": cluster.image_digest if cluster else None,
        "environment_digest": cluster.environment_digest if cluster else None,
        "code.git_sha": code.git_sha,
        "code.dirty": code.dirty,
        "code.working_dir_hash": code.working_dir_hash,
        "data.content_hash": data.content_hash if data else None,
    }
    for role, node in nodes_by_role(cluster.nodes if cluster else []).items():
        for field in NODE_FIELDS:
            facts[f"nodes.{role}.{field}"] = getattr(node, field)
    facts.update(flatten(record.runtime_env_additions.model_dump(), "runtime_env"))
    facts.update(flatten(record.config, "config"))
    facts.update(suite_hashes(record))
    return facts


def suite_hashes(record: RunRecord) -> dict[str, str]:
    """'suites.<name>.sha256' -> the hash of the suite file's bytes: a suite edited in place keeps its path and
    config, so only its hash says its items changed. The evaluate stage's, which names what was scored; a run
    not evaluated yet has the data stage's, which names what was checked for overlap."""
    evaluated = record.summary("evaluate", EvaluateSummary)
    if evaluated is not None:
        return {f"suites.{suite.name}.sha256": suite.sha256 for suite in evaluated.suites}
    prepared = record.summary("data", DataSummary)
    return {f"suites.{suite.name}.sha256": suite.sha256 for suite in prepared.suites} if prepared else {}


def nodes_by_role(nodes: list[NodeFacts]) -> dict[str, NodeFacts]:
    """Name nodes by role and order (head, worker-0, ...) so runs on different IPs compare."""
    head = [n for n in nodes if n.is_head]
    workers = sorted((n for n in nodes if not n.is_head), key=lambda n: str(n.node_ip))
    named = {"head": head[0]} if head else {}
    named.update({f"worker-{i}": n for i, n in enumerate(workers)})
    return named


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def diff_records(a: RunRecord, b: RunRecord) -> dict[str, Any]:
    """Changed choices and metric deltas; the metrics are each stage's own (tuneproof.control.stages.diff_metrics)."""
    ida, idb = identity(a), identity(b)
    changes = [
        {"field": k, "a": ida.get(k), "b": idb.get(k)}
        for k in sorted(set(ida) | set(idb))
        if not _same(ida.get(k), idb.get(k))
    ]
    ma, mb = {**diff_metrics(a), **cost.diff_numbers(a)}, {**diff_metrics(b), **cost.diff_numbers(b)}
    deltas = []
    for name in sorted(set(ma) | set(mb)):
        va, vb = ma.get(name), mb.get(name)
        delta = vb - va if va is not None and vb is not None else None
        deltas.append({"metric": name, "a": va, "b": vb, "delta": delta})
    return {
        "a": a.run_id,
        "b": b.run_id,
        "changed": bool(changes),
        "changes": changes,
        "metrics": deltas,
        "gates": gate_pairs(a, b),
        "suites": suite_pairs(a, b),
    }


def gate_verdicts(record: RunRecord) -> dict[str, str]:
    """'exact_match min' -> 'pass [0.95, 0.99] n=300' for each gate verdict of the run's evaluation."""
    summary = record.summary("evaluate", EvaluateSummary)
    if summary is None:
        return {}
    verdicts = {f"{v.metric} {v.gate}": v.brief() for v in summary.gates.verdicts}
    verdicts.update(
        {f"suite {s.name}: {v.metric} {v.gate}": v.brief() for s in summary.suites for v in s.gates.verdicts}
    )
    return verdicts


def suite_rows(record: RunRecord) -> dict[str, SuiteRow]:
    """'<suite> <metric>' -> its row of the suites x models table (the task's split included); {} without suites."""
    summary = record.summary("evaluate", EvaluateSummary)
    if summary is None or not summary.suites:
        return {}
    return {f"{row.suite} {row.metric}": row for row in summary.suite_rows()}


def suite_pairs(a: RunRecord, b: RunRecord) -> list[dict[str, Any]]:
    """The suites x models table of both runs side by side: each model's value in a and in b, per suite."""
    ra, rb = suite_rows(a), suite_rows(b)
    return [
        {"suite": name, **{role: [_value(ra.get(name), role), _value(rb.get(name), role)] for role in ROLES}}
        for name in sorted(set(ra) | set(rb), key=lambda n: (not n.startswith("task "), n))
    ]


def _value(row: SuiteRow | None, role: str) -> float | None:
    return getattr(row, role) if row else None


def gate_pairs(a: RunRecord, b: RunRecord) -> list[dict[str, str | None]]:
    va, vb = gate_verdicts(a), gate_verdicts(b)
    return [{"gate": name, "a": va.get(name), "b": vb.get(name)} for name in sorted(set(va) | set(vb))]


def render_diff(result: dict[str, Any]) -> str:
    lines = [f"runs diff {result['a']} -> {result['b']}"]
    if not result["changed"]:
        lines.append("nothing changed: same image, cluster, code, config, dependencies and data")
    else:
        lines.append(f"{len(result['changes'])} change(s):")
        lines += [f"  {c['field']}: {c['a']!r} -> {c['b']!r}" for c in result["changes"]]
    lines.append("metrics (a -> b, delta):")
    for m in result["metrics"]:
        if m["a"] is None and m["b"] is None:
            continue
        delta = "" if m["delta"] is None else f"  ({m['delta']:+.4g})"
        lines.append(f"  {m['metric']}: {_fmt(m['a'])} -> {_fmt(m['b'])}{delta}")
    if result.get("gates"):
        lines.append("gates (a -> b):")
        lines += [f"  {g['gate']}: {g['a'] or '-'} -> {g['b'] or '-'}" for g in result["gates"]]
    if result.get("suites"):
        lines.append("suites x models (a -> b):")
        for row in result["suites"]:
            cells = ", ".join(f"{role} {_fmt(row[role][0])} -> {_fmt(row[role][1])}" for role in ROLES)
            lines.append(f"  {row['suite']}: {cells}")
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    return f"{v:.4g}" if isinstance(v, float) else str(v)
