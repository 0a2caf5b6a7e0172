"""`tuneproof runs list | show RUN | diff A B`: the run records, read back.

    tuneproof runs list [--json] | show RUN [--json] | diff A B [--json]

A command group of the CLI (tuneproof/app/cli.py adds `runs_app`); reads records from storage with
tuneproof/control/record.py and never imports Prefect. An absent or unreadable record is exit 1.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from tuneproof.app.cli_common import (
    ConfigOpt,
    SetOpt,
    config_or_exit,
    console,
    err,
    group,
    slug_arg,
    storage_for,
    summary_unreadable,
)
from tuneproof.app.terminal import say

if TYPE_CHECKING:
    from tuneproof.control.record import RunRecord
    from tuneproof.core.storage import Storage

runs_app = group("Read run records.")


@runs_app.command("list")
def runs_list(
    as_json: bool = typer.Option(False, "--json"), config: Path | None = ConfigOpt, sets: list[str] = SetOpt
) -> None:
    """Runs, newest first."""
    from tuneproof.control import record

    storage = storage_for(config, sets)
    rows = record.list_rows(storage)
    for row in rows:
        if row.status == "running":
            row.status, row.cause = shown_status(storage, row.run_id, row.status, row.cause)
    if as_json:
        print(json.dumps([r.model_dump() for r in rows], indent=2))
        return
    if not rows:  # an empty table would not say where it looked (a mistyped storage.root looks like no runs)
        say(err, f"no runs under {storage.uri('runs')}: `tuneproof run` starts the first")
        return
    from tuneproof.app.terminal import whole_table

    cells = [
        [r.run_id, (r.created_at or "")[:16].replace("T", " "), r.status, r.failure_class or "", r.cause or ""]
        for r in rows
    ]
    console.print(whole_table(["run", "created", "status", "failure", "cause"], cells, keep=("run",)))


def shown_status(storage: Any, run_id: str, status: str, cause: str | None) -> tuple[str, str | None]:
    """A record left "running" by a writer that died (kill -9, a lost machine) has no live lease: show it
    crashed. Readers never rewrite the record; the next flow on the run takes the stale lease over."""
    from tuneproof.control import lease

    if status != "running":
        return status, cause
    try:
        _, why = lease.stale(storage, run_id)
    except OSError as e:  # this run's lease cannot be read: say so on its row, and list the others
        return status, f"{cause or ''} (its lease cannot be read: {e.strerror or e})".strip()
    if why is None:
        return status, cause
    return "crashed", f"its writer is gone ({why}); the record was left running"


@runs_app.command("show")
def runs_show(
    run_id: str = typer.Argument(..., callback=slug_arg("run id")),
    as_json: bool = typer.Option(False, "--json"),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """One run's record."""

    storage = storage_for(config, sets)
    rec = record_or_exit(storage, run_id)
    rec.status, rec.cause = shown_status(storage, run_id, rec.status, rec.cause)  # type: ignore[assignment]
    if as_json:
        print(json.dumps(rec.to_json(), indent=2))
        return
    from pydantic import ValidationError

    from tuneproof.app.terminal import print_record

    try:
        print_record(rec, console)
        prices, source = shown_prices(rec, sets, config_or_exit(config, sets).cost.prices)
        print_cost(rec, prices, source)  # the cost reads the fine-tune's summaries too
    except ValidationError as e:
        raise typer.Exit(summary_unreadable(run_id, e)) from None


def shown_prices(rec: RunRecord, sets: list[str], configured: dict[str, float]) -> tuple[dict[str, float], str]:
    """(the price table `runs show` prices the run with, where it came from): the run's own recorded
    cost.prices, as `runs diff` and the model card use, so one run has one cost whoever reads it; an explicit
    `--set cost.prices...` prices it with another table (`configured`, the reader's config with it applied)."""
    from tuneproof.control.cost import record_prices
    from tuneproof.core.config import parse_override

    if any(parse_override(item)[0][:2] == ["cost", "prices"] for item in sets):
        return configured, "--set cost.prices"
    own = record_prices(rec)
    if own:
        return own, "the run's own cost.prices"
    return {}, "the run's config has no cost.prices (`--set cost.prices=...` prices it)"


def print_cost(rec: Any, prices: dict[str, float], source: str) -> None:
    """What the run cost, stage by stage (superseded attempts included): resource-seconds and money, the
    resources the table does not price named, and which table it was."""
    from tuneproof.app.terminal import whole_table
    from tuneproof.control.cost import attach_note, run_cost, seconds_line, unpriced

    run = run_cost(rec, prices)
    cells = [
        [
            s.stage + (" (superseded)" if s.superseded else ""),
            f"{s.seconds:.1f}",
            seconds_line(s.resource_seconds, s.money, unpriced(s.resource_seconds, prices)),
        ]
        for s in run.stages
    ]
    console.print(whole_table(["stage", "wall s", "resource-seconds"], cells, keep=("stage",)))
    table = ", ".join(f"{r} {p:g}" for r, p in sorted(prices.items()))
    console.print(f"prices per resource-hour: {table + ' (' + source + ')' if table else source}")
    line = seconds_line(run.resource_seconds, run.money, run.unpriced)
    console.print(f"cost: {line}; fine-tune steps paid for: {run.steps}")
    if note := attach_note(run.timed_from_attach):
        console.print(note)


def record_or_exit(storage: Storage, run_id: str) -> RunRecord:
    """The run's record, or exit 1 with one line naming why it cannot be read."""
    from tuneproof.control import record

    try:
        return record.load(storage, run_id)
    except (FileNotFoundError, record.RecordUnreadable) as e:
        say(err, e)
        raise typer.Exit(1) from None


@runs_app.command("diff")
def runs_diff(
    run_a: str = typer.Argument(..., callback=slug_arg("run id")),
    run_b: str = typer.Argument(..., callback=slug_arg("run id")),
    as_json: bool = typer.Option(False, "--json"),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """What changed between two runs: identity, config fields, and metric deltas."""
    from tuneproof.app.rundiff import diff_records, render_diff
    from tuneproof.control.cost import recorded_cost, unpriced_note

    storage = storage_for(config, sets)
    a, b = record_or_exit(storage, run_a), record_or_exit(storage, run_b)
    from pydantic import ValidationError

    try:
        result = diff_records(a, b)
        unpriced = {"a": recorded_cost(a).unpriced, "b": recorded_cost(b).unpriced}
    except ValidationError as e:
        raise typer.Exit(summary_unreadable(f"{run_a} or {run_b}", e)) from None
    if as_json:
        print(json.dumps({**result, "cost_unpriced": unpriced}, indent=2))
        return
    note = unpriced_note(unpriced["a"], unpriced["b"])
    for line in render_diff(result).splitlines():
        say(console, line)
        if note and line.startswith("  cost.money:"):  # beside the figure it qualifies, as `runs show` puts it
            say(console, f"    {note}")
