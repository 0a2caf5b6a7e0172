"""Prefect artifacts: the evidence, where people deciding on a model look (the flow run page).

The flow publishes each finished stage's artifact (flows/stage_tasks.py names which function
below is a stage's), then the stage table and the run report when the run ends; the job
tasks keep a progress artifact per stage. Keys are per run (`<kind>-<run>` in lowercase with dashes,
as Prefect requires) so a run's artifacts version together. A table cell that begins with '>=' renders
as a quote in the UI, so gate thresholds are written 'at least 0.8' instead.
"""

from __future__ import annotations

import base64
import io
import re
import threading
from datetime import datetime
from typing import Any

from prefect.artifacts import (
    create_image_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)

from tuneproof.control.record import RunRecord, StageEntry
from tuneproof.core.envelope import ProgressEvent
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ConnectivitySummary, VerifySummary
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import EvaluateSummary, ModelScore
from tuneproof.core.summaries_training import FinetuneSummary, LossPoint


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
        create_table_artifact(
            [{k: safe_cell(v) for k, v in r.items()} for r in rows], key=key(kind, run_id), description=description
        )


def stage_table(record: RunRecord, order: list[str]) -> None:
    """Every stage of the run in pipeline order: status, failure class, seconds, cause."""
    rows = [
        {
            "stage": name,
            "status": entry.status,
            "failure class": entry.failure_class.value if entry.failure_class else "",
            "seconds": duration(entry),
            "cause": entry.cause or "",
        }
        for name, entry in sorted(record.stages.items(), key=lambda item: _position(order, item[0]))
    ]
    table("stages", record.run_id, rows, f"Stages of run {record.run_id}")


def _position(order: list[str], name: str) -> int:
    return order.index(name) if name in order else len(order)


def duration(entry: StageEntry) -> float | None:
    try:
        return round(
            (datetime.fromisoformat(entry.ended_at) - datetime.fromisoformat(entry.started_at)).total_seconds(), 1
        )
    except ValueError:
        return None


# ---- one per stage (the stage table names them) ------------------------------------------------


def verify_findings(record: RunRecord, entry: StageEntry, storage: Storage) -> None:
    summary = entry.summary_as(VerifySummary)
    lines = [f"# Verify: {entry.status}", ""]
    if summary is None:
        lines.append(f"No findings were collected: {entry.cause}")
    else:
        lines += [
            f"- **{f.severity}** {f.subject}: `{f.field}` is `{f.seen}`, expected `{f.expected}` {f.message}"
            for f in summary.findings
        ] or ["No findings: every node matches what the config expects."]
        lines += [
            "",
            "| node | head | ray | torch | python | cuda | nccl | GPUs (visible/Ray) | env digest |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for n in summary.nodes:
            lines.append(
                f"| {n.node_ip} | {n.is_head} | {n.ray_version} | {n.torch_version} | {n.python_version} | "
                f"{n.cuda_version} | {n.nccl_version} | {n.gpus_visible}/{n.gpus_advertised} | "
                f"{str(n.environment_digest)[:12]} |"
            )
    create_markdown_artifact("\n".join(lines), key=key("verify", record.run_id), description="Cluster verification")


def connectivity_table(record: RunRecord, entry: StageEntry, storage: Storage) -> None:
    summary = entry.summary_as(ConnectivitySummary)
    if summary is None or not summary.allreduce:
        return
    kind = summary.transport.kind
    rows = [{**row.to_json(), "transport": kind} for row in summary.allreduce]
    table(
        "connectivity",
        record.run_id,
        rows,
        f"All-reduce over {summary.world_size} ranks ({summary.backend}); transport {kind}",
    )


def dataset_summary(record: RunRecord, entry: StageEntry, storage: Storage) -> None:
    summary = entry.summary_as(DataSummary)
    if summary is None or summary.manifest is None:
        return
    m = summary.manifest
    lines = [
        f"# Dataset `{m.name}` {m.content_hash[:16]}" + (" (cache hit)" if summary.cache_hit else ""),
        "",
        f"Source: `{m.source.uri}`; {m.total_rows} rows; dropped {m.dropped_fraction:.2%}",
        "",
        *(
            [
                f"Replayed into the training split: `{m.replay.uri}` ({m.settings['replay']['share']:.0%} of its rows)",
                "",
            ]
            if m.replay
            else []
        ),
        "| split | rows | tokens | shards |",
        "|---|---|---|---|",
    ]
    lines += [f"| {name} | {s.rows} | {s.tokens} | {len(s.shards)} |" for name, s in m.splits.items()]
    if m.dropped:
        lines += ["", "| dropped because | rows |", "|---|---|"] + [
            f"| {r} | {d.count} |" for r, d in m.dropped.items()
        ]
    create_markdown_artifact("\n".join(lines), key=key("dataset", record.run_id), description="Prepared dataset")


def loss_png(loss_curve: list[LossPoint]) -> bytes:
    # A Figure of its own, not pyplot: the same PNG without pyplot's import (seconds here) or its global state.
    from matplotlib.figure import Figure

    finite = [(step, loss) for step, loss in loss_curve if loss is not None]
    steps, losses = zip(*finite) if finite else ((), ())
    fig = Figure(figsize=(6, 3.2), dpi=100)
    ax = fig.subplots()
    ax.plot(steps, losses, linewidth=1.2)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_yscale("log")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    return buf.getvalue()


def import_plotting_in_background() -> None:
    """Import matplotlib on a daemon thread now. The loss plot is drawn between the fine-tune and the next stage,
    where its import (seconds on a small machine) would add to the run; while a stage runs the flow only waits."""
    threading.Thread(target=_import_plotting, daemon=True, name="import-matplotlib").start()


def _import_plotting() -> None:
    try:
        import matplotlib.backends.backend_agg  # noqa: F401 - what Figure.savefig draws a PNG with
        import matplotlib.figure  # noqa: F401
    except ImportError:
        pass  # loss_png imports it again and the artifact's publisher reports the error


def loss_image(record: RunRecord, entry: StageEntry, storage: Storage) -> None:
    """The PNG goes to run storage; the UI gets it inline (a local path is not a URL a browser can load)."""
    summary = entry.summary_as(FinetuneSummary)
    if summary is None or not summary.loss_curve:
        return
    png = loss_png(summary.loss_curve)
    parts = ("runs", record.run_id, "stages", "finetune", "loss.png")
    storage.write_bytes(png, *parts)
    create_image_artifact(
        "data:image/png;base64," + base64.b64encode(png).decode(),
        key=key("loss-curve", record.run_id),
        description=f"Training loss ({storage.uri(*parts)})",
    )


def evaluation_table(record: RunRecord, entry: StageEntry, storage: Storage) -> None:
    """One row per metric: candidate, base, incumbent, and that metric's gate verdicts."""
    summary = entry.summary_as(EvaluateSummary)
    if summary is None:
        return
    names = sorted({n for m in summary.models.values() if m for n in m.metrics})
    rows = []
    for name in names:
        verdicts = [v for v in summary.gates.verdicts if v.metric == name]
        rows.append(
            {
                "metric": name,
                **{role: metric_cell(summary.models.get(role), name) for role in ("candidate", "base", "incumbent")},
                "gates": ", ".join(f"{v.gate}: {v.brief()}" for v in verdicts) or "not gated",
            }
        )
    rows += generation_rows(summary)
    verdict = "passed" if summary.gates.passed else "failed"
    table(
        "evaluation",
        record.run_id,
        rows,
        f"Candidate vs base vs incumbent ({summary.incumbent_version or 'no incumbent'}); gates {verdict}:\n\n"
        + "\n".join(f"* {line}" for line in summary.gates.lines),
    )
    if summary.suites:
        passed = "passed" if all(s.gates.passed for s in summary.suites) else "failed"
        table(
            "suites",
            record.run_id,
            [row.to_json() for row in summary.suite_rows()],
            f"Regression suites x models ({summary.incumbent_version or 'no incumbent'}); suite gates {passed}:\n\n"
            + "\n".join(f"* {line}" for s in summary.suites for line in s.gates.lines),
        )


def generation_rows(summary: EvaluateSummary) -> list[dict[str, Any]]:
    """A row per split (the task's first, then each suite): each model's cut-off and empty answers (pure)."""
    models = {role: summary.models.get(role) for role in ("candidate", "base", "incumbent")}
    splits = list(dict.fromkeys(split for m in models.values() if m for split in m.generations))
    return [
        {
            "metric": f"answers cut off / empty ({split})",
            **{role: _generations_cell(model, split) for role, model in models.items()},
            "gates": "self-test: empty at most eval.max_truncated_fraction; cut off too, unless another model stopped"
            + (" (the base is not held to it on the task)" if split == "task" else ""),
        }
        for split in splits
    ]


def _generations_cell(model: ModelScore | None, split: str) -> str:
    seen = model.generations.get(split) if model else None
    return f"{seen.cut_off} / {seen.empty} of {seen.answers}" if seen else "no model"


def metric_cell(model: ModelScore | None, name: str) -> Any:
    """A value, or words: a lone '-' renders as a list bullet in the UI."""
    if model is None:
        return "no model"
    value = model.metrics.get(name)
    return "n/a" if value is None else value


# ---- when the run ends ------------------------------------------------------------------------


def run_report(record: RunRecord) -> None:
    code, cluster, data, promotion = record.code, record.cluster, record.data, record.promotion
    failure = f" ({record.failure_class.value}: {record.cause})" if record.failure_class else ""
    if promotion is None:
        verdict = "not reached"
    elif promotion.promoted:
        verdict = f"promoted {promotion.version}"
    else:
        verdict = "refused: " + "; ".join(promotion.reasons)
    lines = [
        f"# Run {record.run_id}: {record.status}{failure}",
        "",
        "| identity | value |",
        "|---|---|",
        f"| image digest | {(cluster.image_digest if cluster else None) or 'n/a (local profile)'} |",
        f"| cluster | Ray {cluster.ray_version if cluster else None} on {len(cluster.nodes) if cluster else 0} node(s), "
        f"environment {str(cluster.environment_digest if cluster else None)[:16]} |",
        f"| code | {code.git_sha} (dirty: {code.dirty}) |",
        f"| working_dir hash | {code.working_dir_hash} |",
        f"| config hash | {record.config_hash} |",
        f"| runtime_env additions | {record.runtime_env_additions.model_dump()} |",
        f"| dataset hash | {data.content_hash if data else None} |",
        "",
        f"Promotion: {verdict}",
    ]
    create_markdown_artifact("\n".join(lines), key=key("run-report", record.run_id), description="Run report")


class Progress:
    """A progress artifact that follows a stage's step progress (created on the first event)."""

    def __init__(self, run_id: str, stage: str):
        self.key = key(f"{stage}-progress", run_id)
        self.stage = stage
        self.artifact_id: Any = None
        self.last = -1.0

    def update(self, event: ProgressEvent) -> None:
        pct = round(100.0 * event.fraction, 1)
        if pct - self.last < 2.0 and pct < 100.0:
            return  # every event would be an API call; two-percent steps are plenty for a bar
        self.last = pct
        description = f"{self.stage}: {event.done}/{event.total}"
        if self.artifact_id is None:
            self.artifact_id = create_progress_artifact(pct, key=self.key, description=description)
        else:
            update_progress_artifact(self.artifact_id, pct, description=description)
