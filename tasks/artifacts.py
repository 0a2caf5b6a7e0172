"""Prefect artifacts: the evidence, where people deciding on a model look (the flow run page).

Called by the flow after each stage, and by the stage tasks for live progress. Keys are
per run (`<kind>-<run>` in lowercase with dashes, as Prefect requires) so a run's artifacts
version together. A table cell that begins with '>=' renders as a quote in the UI, so gate
thresholds are written 'at least 0.8' instead.
"""

from __future__ import annotations

import base64
import io
import re
from typing import Any

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tuneproof.core.config import STAGES
from tuneproof.core.storage import Storage


def key(kind: str, run_id: str) -> str:
    return re.sub(r"[^a-z0-9-]", "-", f"{kind}-{run_id}".lower())


def safe_cell(value: Any) -> Any:
    """Numbers stay numbers; strings that the UI would render as a quote are reworded."""
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, str) and value.lstrip().startswith((">", ">=")):
        return value.replace(">=", "at least ", 1).replace(">", "above ", 1)
    return value


def table(kind: str, run_id: str, rows: list[dict[str, Any]], description: str) -> None:
    if rows:
        create_table_artifact([{k: safe_cell(v) for k, v in r.items()} for r in rows],
                              key=key(kind, run_id), description=description)


def stage_table(record: dict) -> None:
    rows = [{"stage": s, "status": e["status"], "failure class": e.get("failure_class") or "",
             "seconds": duration(e), "cause": e.get("cause") or ""}
            for s, e in sorted(record["stages"].items(), key=lambda item: STAGES.index(item[0]))]
    table("stages", record["run_id"], rows, f"Stages of run {record['run_id']}")


def duration(entry: dict) -> float | None:
    from datetime import datetime

    try:
        return round((datetime.fromisoformat(entry["ended_at"]) - datetime.fromisoformat(entry["started_at"])).total_seconds(), 1)
    except (KeyError, TypeError, ValueError):
        return None


def for_stage(record: dict, stage: str, storage: Storage) -> None:
    """The artifact(s) a finished stage contributes."""
    entry = record["stages"][stage]
    summary, run_id = entry.get("summary") or {}, record["run_id"]
    if stage == "verify":
        verify_findings(run_id, entry)
    elif stage == "connectivity" and summary.get("allreduce"):
        transport = (summary.get("transport") or {}).get("kind")
        rows = [{**r, "transport": transport} for r in summary["allreduce"]]
        table("connectivity", run_id, rows, f"All-reduce over {summary.get('world_size')} ranks ({summary.get('backend')}); transport {transport}")
    elif stage == "data" and summary.get("manifest"):
        dataset_summary(run_id, summary)
    elif stage == "finetune" and summary.get("loss_curve"):
        loss_image(run_id, summary["loss_curve"], storage)
    elif stage == "evaluate" and summary.get("models"):
        evaluation_table(run_id, summary)


def verify_findings(run_id: str, entry: dict) -> None:
    summary = entry.get("summary") or {}
    lines = [f"# Verify: {entry['status']}", ""]
    findings = summary.get("findings") or []
    lines += [f"- **{f.get('severity', 'error')}** {f['subject']}: `{f['field']}` is `{f['seen']}`, expected `{f['expected']}` {f.get('message') or ''}"
              for f in findings] or ["No findings: every node matches what the config expects."]
    lines += ["", "| node | head | ray | torch | python | cuda | nccl | GPUs (visible/Ray) | env digest |", "|---|---|---|---|---|---|---|---|---|"]
    for n in summary.get("nodes") or []:
        lines.append(f"| {n.get('node_ip')} | {n.get('is_head')} | {n.get('ray_version')} | {n.get('torch_version')} | "
                     f"{n.get('python_version')} | {n.get('cuda_version')} | {n.get('nccl_version')} | "
                     f"{n.get('gpus_visible')}/{n.get('gpus_advertised')} | {str(n.get('environment_digest'))[:12]} |")
    create_markdown_artifact("\n".join(lines), key=key("verify", run_id), description="Cluster verification")


def dataset_summary(run_id: str, summary: dict) -> None:
    m = summary["manifest"]
    splits = m.get("splits") or {}
    lines = [f"# Dataset `{m.get('name')}` {summary.get('content_hash', '')[:16]}" + (" (cache hit)" if summary.get("cache_hit") else ""),
             "", f"Source: `{(m.get('source') or {}).get('uri')}`; {m.get('total_rows')} rows; dropped {m.get('dropped_fraction', 0):.2%}", "",
             "| split | rows | tokens | shards |", "|---|---|---|---|"]
    lines += [f"| {name} | {s.get('rows')} | {s.get('tokens')} | {len(s.get('shards') or [])} |" for name, s in splits.items()]
    dropped = m.get("dropped") or {}
    if dropped:
        lines += ["", "| dropped because | rows |", "|---|---|"] + [f"| {r} | {d.get('count')} |" for r, d in dropped.items()]
    create_markdown_artifact("\n".join(lines), key=key("dataset", run_id), description="Prepared dataset")


def loss_png(loss_curve: list[list[float]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps, losses = zip(*loss_curve)
    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    ax.plot(steps, losses, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    plt.close(fig)
    return buf.getvalue()


def loss_image(run_id: str, loss_curve: list[list[float]], storage: Storage) -> None:
    """The PNG goes to run storage; the UI gets it inline (a local path is not a URL a browser can load)."""
    png = loss_png(loss_curve)
    storage.write_bytes(png, "runs", run_id, "stages", "finetune", "loss.png")
    create_image_artifact("data:image/png;base64," + base64.b64encode(png).decode(), key=key("loss-curve", run_id),
                          description=f"Training loss ({storage.uri('runs', run_id, 'stages', 'finetune', 'loss.png')})")


def evaluation_table(run_id: str, summary: dict) -> None:
    """One row per metric: candidate, base, incumbent, and that metric's gate verdicts."""
    models = summary["models"]
    gates = summary.get("gates") or {}
    names = sorted({n for m in models.values() if m for n in (m.get("metrics") or {})})
    rows = []
    for name in names:
        verdicts = [v for v in gates.get("verdicts", []) if v["metric"] == name]
        rows.append({
            "metric": name,
            **{role: metric_cell(models.get(role), name) for role in ("candidate", "base", "incumbent")},
            "gates": ", ".join(f"{v['gate']}: {verdict_word(v)}" for v in verdicts) or "not gated",
        })
    verdict = "passed" if gates.get("passed") else "failed"
    table("evaluation", run_id, rows, f"Candidate vs base vs incumbent ({summary.get('incumbent_version') or 'no incumbent'}); "
                                      f"gates {verdict}:\n\n" + "\n".join(f"* {line}" for line in gates.get("lines", [])))


def verdict_word(v: dict) -> str:
    if not v["passed"]:
        return "FAIL"
    return "pass" if v["value"] is not None else "n/a (no incumbent)"


def metric_cell(model: dict | None, name: str) -> Any:
    """A value, or words: a lone '-' renders as a list bullet in the UI."""
    if not model:
        return "no model"
    value = (model.get("metrics") or {}).get(name)
    return "n/a" if value is None else value


def run_report(record: dict) -> None:
    code, cluster, data = record.get("code") or {}, record.get("cluster") or {}, record.get("data") or {}
    promotion = record.get("promotion") or {}
    lines = [
        f"# Run {record['run_id']}: {record['status']}" + (f" ({record['failure_class']}: {record['cause']})" if record.get("failure_class") else ""),
        "", "| identity | value |", "|---|---|",
        f"| image digest | {cluster.get('image_digest') or 'n/a (local profile)'} |",
        f"| cluster | Ray {cluster.get('ray_version')} on {len(cluster.get('nodes') or [])} node(s), environment {str(cluster.get('environment_digest'))[:16]} |",
        f"| code | {code.get('git_sha')} (dirty: {code.get('dirty')}) |",
        f"| working_dir hash | {code.get('working_dir_hash')} |",
        f"| config hash | {record.get('config_hash')} |",
        f"| runtime_env additions | {record.get('runtime_env_additions')} |",
        f"| dataset hash | {data.get('content_hash')} |",
        "", f"Promotion: {'promoted ' + str(promotion.get('version')) if promotion.get('promoted') else 'refused: ' + '; '.join(promotion.get('reasons') or ['not reached'])}",
    ]
    create_markdown_artifact("\n".join(lines), key=key("run-report", record["run_id"]), description="Run report")


class Progress:
    """A progress artifact that follows a stage's step progress (created on the first event)."""

    def __init__(self, run_id: str, stage: str):
        self.key = key(f"{stage}-progress", run_id)
        self.stage = stage
        self.artifact_id = None
        self.last = -1.0

    def update(self, done: int, total: int) -> None:
        pct = round(100.0 * done / max(total, 1), 1)
        if pct - self.last < 2.0 and pct < 100.0:
            return  # every event would be an API call; two-percent steps are plenty for a bar
        self.last = pct
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(pct, key=self.key, description=f"{self.stage}: {done}/{total}")
        else:
            update_progress_artifact(self.artifact_id, pct, description=f"{self.stage}: {done}/{total}")
