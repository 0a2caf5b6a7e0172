"""`tuneproof runs diff A B`: which choices changed between two runs, and how the results moved.

Pure over two run records. Choices: image digest, per-node Ray/torch/CUDA/NCCL/Python versions,
environment digest, cluster configuration, code SHA + dirty flag, working_dir hash, every config
field (dotted names), runtime_env additions, dataset hash. Results: throughput, final loss, eval
metrics, bus bandwidth — so a team can tell which change explains a different result.
"""

from __future__ import annotations

import math
from typing import Any

NODE_FIELDS = ("ray_version", "torch_version", "cuda_version", "nccl_version", "python_version",
               "transformers_version", "environment_digest", "gpus_advertised")


def flatten(obj: Any, prefix: str = "") -> dict[str, Any]:
    """{'train': {'lr': 1}} -> {'train.lr': 1}; lists stay whole values."""
    if isinstance(obj, dict):
        out: dict[str, Any] = {}
        for key, value in obj.items():
            out.update(flatten(value, f"{prefix}.{key}" if prefix else str(key)))
        return out if out or not prefix else {prefix: {}}
    return {prefix: obj}


def identity(record: dict) -> dict[str, Any]:
    """The choices behind a run, flattened to dotted names."""
    cluster = record.get("cluster") or {}
    facts: dict[str, Any] = {
        "image_digest": cluster.get("image_digest"),
        "environment_digest": cluster.get("environment_digest"),
        "code.git_sha": (record.get("code") or {}).get("git_sha"),
        "code.dirty": (record.get("code") or {}).get("dirty"),
        "code.working_dir_hash": (record.get("code") or {}).get("working_dir_hash"),
        "data.content_hash": (record.get("data") or {}).get("content_hash"),
    }
    for role, node in nodes_by_role(cluster.get("nodes") or []).items():
        for field in NODE_FIELDS:
            facts[f"nodes.{role}.{field}"] = node.get(field)
    facts.update(flatten(record.get("runtime_env_additions") or {}, "runtime_env"))
    facts.update(flatten(record.get("config") or {}, "config"))
    return facts


def nodes_by_role(nodes: list[dict]) -> dict[str, dict]:
    """Name nodes by role and order (head, worker-0, ...) so runs on different IPs compare."""
    head = [n for n in nodes if n.get("is_head")]
    workers = sorted((n for n in nodes if not n.get("is_head")), key=lambda n: str(n.get("node_ip")))
    named = {"head": head[0]} if head else {}
    named.update({f"worker-{i}": n for i, n in enumerate(workers)})
    return named


def metrics(record: dict) -> dict[str, float | None]:
    stages = record.get("stages") or {}
    finetune = (stages.get("finetune") or {}).get("summary") or {}
    conn = (stages.get("connectivity") or {}).get("summary") or {}
    evaluation = (stages.get("evaluate") or {}).get("summary") or {}
    resume = (stages.get("resume") or {}).get("summary") or {}
    out: dict[str, float | None] = {
        "finetune.tokens_per_s": finetune.get("tokens_per_s"),
        "finetune.final_loss": finetune.get("final_loss"),
        "finetune.seconds": finetune.get("seconds"),
        "resume.max_loss_diff": resume.get("max_loss_diff"),
    }
    rows = conn.get("allreduce") or []
    if rows:
        largest = max(rows, key=lambda r: r["size_bytes"])
        out[f"connectivity.busbw_GBps@{largest['size_bytes']}B"] = largest.get("busbw_GBps")
    for role in ("candidate", "base", "incumbent"):
        for name, value in (((evaluation.get("models") or {}).get(role) or {}).get("metrics") or {}).items():
            out[f"eval.{role}.{name}"] = value
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def diff_records(a: dict, b: dict) -> dict[str, Any]:
    ida, idb = identity(a), identity(b)
    changes = [{"field": k, "a": ida.get(k), "b": idb.get(k)}
               for k in sorted(set(ida) | set(idb)) if not _same(ida.get(k), idb.get(k))]
    ma, mb = metrics(a), metrics(b)
    deltas = []
    for name in sorted(set(ma) | set(mb)):
        va, vb = ma.get(name), mb.get(name)
        numeric = isinstance(va, (int, float)) and isinstance(vb, (int, float))
        deltas.append({"metric": name, "a": va, "b": vb, "delta": (vb - va) if numeric else None})
    return {"a": a["run_id"], "b": b["run_id"], "changed": bool(changes), "changes": changes, "metrics": deltas}


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
    return "\n".join(lines)


def _fmt(v: Any) -> str:
    return f"{v:.4g}" if isinstance(v, float) else str(v)
