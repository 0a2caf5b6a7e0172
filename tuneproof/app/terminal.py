"""What `tuneproof run` shows: the current stage, the Ray job state, step progress, and a summary.

The flow runs in this process; stage/job/progress events arrive through tasks.events. Prefect's
own console log lines are kept to warnings unless --verbose (TUNEPROOF_VERBOSE=1), since the full
job logs are in the Prefect UI and in each job's Ray logs.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tuneproof.core.config import STAGES, PipelineConfig

STATUS_STYLE = {"succeeded": "green", "failed": "bold red", "running": "yellow", "skipped": "dim", "pending": "dim"}


class Display:
    """Live state of one run, rebuilt into a small table on every event."""

    def __init__(self, run_id: str, stages: list[str]):
        self.run_id = run_id
        self.stages = {s: "pending" for s in stages}
        self.job = ""
        self.progress: dict[str, Any] = {}

    def on_event(self, event: dict[str, Any]) -> None:
        if event["kind"] == "stage":
            self.stages[event["stage"]] = event["status"]
        elif event["kind"] == "job":
            self.job = f"{event['submission_id']}: {event['status']}"
        elif event["kind"] == "progress":
            self.progress = event

    def render(self) -> Group:
        table = Table(show_header=False, box=None, padding=(0, 1))
        for stage, status in self.stages.items():
            table.add_row(stage, Text(status, style=STATUS_STYLE.get(status, "")))
        lines = [Text(f"run {self.run_id}", style="bold"), table]
        if self.job:
            lines.append(Text(f"Ray job {self.job}", style="cyan"))
        if self.progress:
            lines.append(Text(progress_line(self.progress)))
        return Group(*lines)


def progress_line(event: dict[str, Any]) -> str:
    done, total = event.get("done", 0), event.get("total") or 1
    width = 30
    filled = int(width * min(done / total, 1.0))
    extras = "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                       for k, v in event.items() if k not in {"kind", "stage", "done", "total"})
    return f"{event.get('stage', '')}: [{'#' * filled}{'.' * (width - filled)}] {done}/{total}  {extras}"


def quiet_prefect_console(verbose: bool) -> None:
    if verbose:
        return
    # Ray's SDK announces every working_dir upload; the record holds the package hash instead.
    for name in ("ray.dashboard.modules.dashboard_sdk", "ray._private.runtime_env.packaging"):
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.setLevel(logging.WARNING)


def run_with_display(cfg: PipelineConfig, run_id: str | None, only: list[str] | None, console: Console) -> dict:
    """Run the flow in-process with a live display; returns the run record (or, when the flow
    ended before writing one, a minimal failure record)."""
    from flows.pipeline import pipeline
    from tasks import events
    from tuneproof.control import record as records
    from tuneproof.core.storage import Storage

    problem = prefect_api_problem()
    if problem:
        console.print(f"[bold red]cannot run[/]: {problem}")
        return {"run_id": None, "status": "failed", "failure_class": "infrastructure", "cause": problem}
    run_id = run_id or records.make_run_id()
    console.print(f"run id: [bold]{run_id}[/]")
    display = Display(run_id, [s for s in STAGES if not only or s in only])
    quiet_prefect_console(os.environ.get("TUNEPROOF_VERBOSE") == "1")
    with Live(display.render(), console=console, refresh_per_second=4, transient=False) as live:
        unsubscribe = events.subscribe(lambda e: (display.on_event(e), live.update(display.render())))
        try:
            state = pipeline(config=cfg, run_id=run_id, only=only, return_state=True)
        finally:
            unsubscribe()
    storage = Storage.from_config(cfg.resolved().storage)
    try:
        rec = records.load(storage, run_id)
    except FileNotFoundError:
        console.print(f"[bold red]the flow ended before writing a record[/]: {state.message}")
        return {"run_id": run_id, "failure_class": "infrastructure", "cause": state.message}
    print_summary(rec, console)
    return rec


def prefect_api_problem() -> str | None:
    """Why the configured Prefect API cannot take a flow run, or None (unset means a temporary local server)."""
    import urllib.request

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5):
            return None
    except OSError as e:
        return (f"the Prefect API at {url} does not answer ({getattr(e, 'reason', e)}); start the local one with "
                "`tuneproof local up`, or point PREFECT_API_URL at yours")


def print_summary(rec: dict, console: Console) -> None:
    table = Table("stage", "status", "failure", "cause / evidence", title=f"run {rec['run_id']}")
    for stage, entry in ordered_stages(rec):
        table.add_row(stage, Text(entry["status"], style=STATUS_STYLE.get(entry["status"], "")),
                      entry.get("failure_class") or "", short_evidence(stage, entry))
    console.print(table)
    gates = ((rec["stages"].get("evaluate") or {}).get("summary") or {}).get("gates") or {}
    for line in gates.get("lines", []):
        console.print(f"  gate: {line}")
    promotion = rec.get("promotion") or {}
    if promotion:
        verdict = "promoted " + str(promotion.get("version")) if promotion.get("promoted") else "refused: " + "; ".join(promotion.get("reasons", []))
        console.print(f"  promotion: {verdict}")
    style = "green" if rec["status"] == "succeeded" else "bold red"
    tail = f" ({rec['failure_class']}: {rec['cause']})" if rec.get("failure_class") else ""
    console.print(f"[{style}]run {rec['run_id']} {rec['status']}{tail}[/]")


def ordered_stages(rec: dict) -> list[tuple[str, dict]]:
    """Stages in pipeline order (the stored record's keys are sorted alphabetically)."""
    return [(s, rec["stages"][s]) for s in STAGES if s in rec["stages"]]


def short_evidence(stage: str, entry: dict) -> str:
    s = entry.get("summary") or {}
    if entry["status"] == "failed":
        return entry.get("cause") or ""
    if stage == "verify":
        return f"{len(s.get('nodes', []))} node(s), env {str((s.get('cluster') or {}).get('environment_digest', ''))[:12]}"
    if stage == "connectivity":
        return f"{s.get('world_size')} ranks, transport {(s.get('transport') or {}).get('kind')}"
    if stage == "data":
        return f"{str(s.get('content_hash', ''))[:12]} {'(cache hit)' if s.get('cache_hit') else ''}"
    if stage == "finetune":
        return f"loss {s.get('first_loss', float('nan')):.3f} -> {s.get('final_loss', float('nan')):.3f} in {s.get('steps')} steps"
    if stage == "resume":
        return f"restored step {s.get('restored_step')}, max loss diff {s.get('max_loss_diff')}"
    if stage == "evaluate":
        return evaluation_line(s.get("models") or {})
    if stage == "promote":
        return f"{s.get('version')} (previous: {s.get('previous_version') or 'none'})"
    return entry.get("cause") or ""


def evaluation_line(models: dict) -> str:
    """'exact_match: candidate 1.000, base 0.000, incumbent -' for each gated-style metric."""
    names = [n for n in ((models.get("candidate") or {}).get("metrics") or {}) if n not in ("eval_loss", "perplexity")]
    parts = []
    for name in names:
        values = [f"{role} {value_of(models, role, name)}" for role in ("candidate", "base", "incumbent")]
        parts.append(f"{name}: " + ", ".join(values))
    return "; ".join(parts)


def value_of(models: dict, role: str, name: str) -> str:
    value = ((models.get(role) or {}).get("metrics") or {}).get(name)
    return f"{value:.3f}" if isinstance(value, (int, float)) else "-"


def print_record(rec: dict, console: Console) -> None:
    console.print(f"[bold]run {rec['run_id']}[/] created {rec['created_at']} status {rec['status']}")
    code = rec.get("code") or {}
    console.print(f"  code {code.get('git_sha')} dirty={code.get('dirty')} working_dir {str(code.get('working_dir_hash'))[:16]}")
    console.print(f"  config {rec['config_hash'][:16]}  data {(rec.get('data') or {}).get('content_hash', '-')}")
    cluster = rec.get("cluster") or {}
    console.print(f"  cluster ray {cluster.get('ray_version', '-')} nodes {len(cluster.get('nodes', []) or [])} "
                  f"image {cluster.get('image_digest', '-')} env {str(cluster.get('environment_digest', '-'))[:16]}")
    print_summary(rec, console)
