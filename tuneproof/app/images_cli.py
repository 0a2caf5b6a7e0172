"""`tuneproof images list|show` and `tuneproof canary`: plain functions the CLI calls, returning exit codes.

    tuneproof images list [--json]            decisions newest first: digest, tag, versions, baseline, decision
    tuneproof images show DECISION [--json]   one decision.json, with whether it is current
    tuneproof canary [--candidate-image repo@sha256:...] [--config F] [--set k=v]... [--json]

Exit codes (the README's table): 0 done (an adopted candidate), 1 the decision asked for is absent or
unreadable, or the candidate was rejected, 3 a refused request (nothing ran: a bad image reference, a
decision id in use), 4 storage that cannot be read.
"""

from __future__ import annotations

import json
from typing import Any

from rich.console import Console

from tuneproof.app.terminal import say
from tuneproof.control import images
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import EXIT_BY_CLASS, EXIT_INVALID_CONFIG, EXIT_OK, FailureClass
from tuneproof.core.storage import Storage

EXIT_ABSENT_OR_REJECTED = 1


def list_command(storage: Storage, as_json: bool, console: Console, err: Console) -> int:
    try:
        current, _ = images.read_current(storage)
    except images.ImagesUnreadable as e:
        say(err, e)
        current = None
    decisions, problems = images.history(storage)
    rows = [images.row(d, current) for d in decisions]
    if as_json:
        print(json.dumps(rows, indent=2))
    elif not rows and not problems:  # decisions refused below are decisions: "run the canary first" misleads
        say(err, f"no image decisions under {storage.uri(images.IMAGES)}: run `tuneproof canary` to record the first")
    else:
        from tuneproof.app.terminal import whole_table

        console.print(whole_table(LIST_COLUMNS, [list_cells(r) for r in rows], keep=("decision id", "decision")))
    for problem in problems:
        say(err, problem)
    return EXIT_OK


LIST_COLUMNS = ["decision id", "decision", "current", "image", "versions", "baseline", "metrics (median)"]


def list_cells(row: dict[str, Any]) -> list[str]:
    """One table row (pure): the digest shortened to 12 hex, the tag, versions and a few headline metrics."""
    versions = row["versions"]
    shown = " ".join(f"{k} {versions[k]}" for k in ("ray", "torch", "nccl", "efa") if versions.get(k))
    tag = f" ({row['release_tag']})" if row["release_tag"] else ""
    return [
        row["decision_id"],
        row["decision"],
        "*" if row["current"] else "",
        f"{row['digest'][:19]}{tag}",
        shown or "-",
        row["baseline_decision"] or "(first)",
        headline(row["candidate_metrics"]),
    ]


def headline(metrics: dict[str, float]) -> str:
    keys = ("finetune.tokens_per_s", "finetune.final_loss", "eval.candidate.exact_match")
    return ", ".join(f"{k.split('.')[-1]} {metrics[k]:.4g}" for k in keys if k in metrics) or "-"


def show_command(storage: Storage, decision_id: str, as_json: bool, console: Console, err: Console) -> int:
    try:
        decision = images.load_decision(storage, decision_id)
        current, _ = images.read_current(storage)
    except (FileNotFoundError, images.ImagesUnreadable) as e:
        say(err, e)
        return EXIT_ABSENT_OR_REJECTED
    doc = {**decision.to_json(), "current": current is not None and current.decision_id == decision_id}
    if as_json:
        print(json.dumps(doc, indent=2))
        return EXIT_OK
    from tasks.image_artifacts import render

    for line in render(decision).splitlines():
        say(console, line)
    say(console, f"current: {'yes' if doc['current'] else 'no'}")
    return EXIT_OK


def canary_command(
    cfg: PipelineConfig,
    candidate: str | None,
    max_steps: int,
    repeats: int,
    threshold: float,
    decision_id: str | None,
    as_json: bool,
    console: Console,
) -> int:
    """Run the image-canary flow in-process (as the deployment does), a line per finished stage; the decision."""
    from flows.canary import image_canary
    from tuneproof.app.terminal import NotRun, run_here, stage_lines
    from tuneproof.control import record as records

    decision_id = decision_id or records.make_run_id()
    state = run_here(
        console,
        f"image canary {decision_id}: {candidate or 'this environment'}",
        stage_lines(console),
        image_canary,
        candidate_image=candidate,
        config=cfg,
        max_steps=max_steps,
        repeats=repeats,
        threshold=threshold,
        decision_id=decision_id,
    )
    if isinstance(state, NotRun):
        return EXIT_BY_CLASS[FailureClass.infrastructure] if state.failure_class else EXIT_INVALID_CONFIG
    storage = Storage.from_config(cfg.resolved().storage)
    try:
        decision = images.load_decision(storage, decision_id)
    except (FileNotFoundError, images.ImagesUnreadable):
        say(console, state.message or "the canary ended without a decision", "bold red")
        return EXIT_BY_CLASS[FailureClass.infrastructure]
    for reason in decision.reasons:
        say(console, f"  {decision.decision}: {reason}")
    style = "bold green" if state.is_completed() else "bold red"
    say(console, state.message or decision.decision, style)
    if as_json:  # the caller sent everything else to stderr: stdout is this document alone
        print(json.dumps(decision.to_json(), indent=2))
    return EXIT_OK if state.is_completed() else EXIT_ABSENT_OR_REJECTED
