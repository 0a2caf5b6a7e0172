"""What `tuneproof run` shows: the current stage, the Ray job state, step progress, and a summary.

The flow runs in this process; stage/job/progress events arrive through tasks.events. Prefect's
own console log lines are kept to warnings unless --verbose (TUNEPROOF_VERBOSE=1), since the full
job logs are in the Prefect UI and in each job's Ray logs. Every stage's evidence line comes from
the stage table (tuneproof/control/stages.py). Tables fold long cells instead of cutting them: run ids, versions
and digests are always shown whole, whatever the terminal's width.

Every command prints through this module's consoles and helpers:
- `Screen`: a console that, off a terminal (a pipe, a file, CI), is as wide as its widest line, so a
  table is never cut to 80 columns; on a terminal a COLUMNS that is not a positive number is ignored.
- `say()`: one message on one line, never wrapped by rich (the terminal may fold it; a copied path stays whole).
- `printable()`: what storage, a log or a saved file holds is text to show, never control characters
  to obey: every control character, escape sequence and bidi/zero-width format character is escaped.
Importing this module does not import Prefect (commands such as `transport` never need it).
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from rich import box
from rich.console import Console, ConsoleDimensions, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from tuneproof.control.record import Invocation, RunRecord
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ProgressEvent, format_metrics
from tuneproof.core.summaries_eval import EvaluateSummary, PromoteSummary

if TYPE_CHECKING:
    from prefect.states import State

STATUS_STYLE = {
    "succeeded": "green",
    "failed": "bold red",
    "running": "yellow",
    "skipped": "dim",
    "kept": "green",
    "pending": "dim",
    "crashed": "bold red",
    "cancelled": "bold red",
    "unreadable": "bold red",
}


OFF_TERMINAL_WIDTH = 100_000
"""Off a terminal nothing wraps or cuts: a table is as wide as it needs (rich never pads it to this width)."""
UNSAFE = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2060-\u2069\ufeff]")
"""C0 and C1 controls (ESC starts every terminal escape sequence; CSI is U+009B), and the format characters
that reorder or hide text (bidi overrides and isolates, zero-width spaces and joiners, the BOM)."""


def printable(text: object) -> str:
    """`text` with every control or invisible format character written as an escape (\\x1b, \\u202e):
    a record, log or file on shared storage can never move the cursor, recolour, hide or reorder what an
    operator reads. Newlines are escaped too: a stored one-line field stays one line."""
    return UNSAFE.sub(lambda m: _escape(m.group()), str(text))


def _escape(ch: str) -> str:
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


class Screen(Console):
    """rich's Console, sized for output that is read whole: see the module docstring."""

    def __init__(self, stderr: bool = False):
        # COLUMNS is read here, at print time: rich's own reading takes COLUMNS=0 as a width of 0 (no output).
        super().__init__(stderr=stderr, _environ={k: v for k, v in os.environ.items() if k != "COLUMNS"})

    @property
    def size(self) -> ConsoleDimensions:
        if self._width is not None:  # set by a caller
            return super().size
        if not self.is_terminal:
            return ConsoleDimensions(OFF_TERMINAL_WIDTH, self._height or 25)
        columns = os.environ.get("COLUMNS", "")
        dimensions = super().size
        if columns.isdigit() and int(columns) > 0:
            return ConsoleDimensions(int(columns), dimensions.height)
        return dimensions

    @size.setter
    def size(self, new_size: tuple[int, int]) -> None:
        self._width, self._height = new_size


def say(console: Console, message: object, style: str = "") -> None:
    """One message as one line: escaped (printable), never markup, never wrapped by rich."""
    console.print(Text(printable(message), style=style), soft_wrap=True)


def whole_table(columns: list[str], rows: list[list[str]], keep: tuple[str, ...] = (), **kwargs: Any) -> Table:
    """A table that never cuts a cell: the `keep` columns (ids, versions) stay whole on one line, the
    others fold onto more lines when the terminal is narrow, instead of ending in '…'."""
    t = Table(box=box.SIMPLE_HEAD, padding=(0, 1), **kwargs)
    for column in columns:
        if column in keep:
            width = max([len(column), *(len(row[columns.index(column)]) for row in rows)])
            t.add_column(column, no_wrap=True, min_width=width)
        else:
            t.add_column(column, overflow="fold")
    for row in rows:
        t.add_row(*(Text(printable(cell)) for cell in row))  # cells are data (a cause, a file name), never markup
    return t


def print_line(console: Console, *parts: str | tuple[str, str]) -> None:
    """One line that the terminal, not rich, wraps: a long digest is never broken by inserted newlines.
    Every part is shown escaped (printable): parts are data from a record."""
    console.print(
        Text.assemble(*(printable(p) if isinstance(p, str) else (printable(p[0]), p[1]) for p in parts)),
        soft_wrap=True,
    )


class Display:
    """Live state of one run, rebuilt into a small table on every event."""

    def __init__(self, run_id: str, stages: list[str]):
        self.run_id = run_id
        self.stages = {s: "pending" for s in stages}
        self.job = ""
        self.progress: ProgressEvent | None = None

    def on_event(self, event: dict[str, Any]) -> None:
        if event["kind"] == "stage":
            self.stages[event["stage"]] = event["status"]
        elif event["kind"] == "job":
            self.job = f"{event['submission_id']}: {event['status']}"
        elif event["kind"] == "progress":
            self.progress = event["event"]

    def render(self) -> Group:
        rows = Table(show_header=False, box=None, padding=(0, 1))
        for stage, status in self.stages.items():
            rows.add_row(stage, Text(status, style=STATUS_STYLE.get(status, "")))
        lines: list[Any] = [Text(f"run {self.run_id}", style="bold"), rows]
        if self.job:
            lines.append(Text(f"Ray job {self.job}", style="cyan"))
        if self.progress:
            lines.append(Text(progress_line(self.progress)))
        return Group(*lines)


def progress_line(event: ProgressEvent, width: int = 30) -> str:
    filled = int(width * event.fraction)
    bar = "#" * filled + "." * (width - filled)
    return f"{event.stage}: [{bar}] {event.done}/{event.total}  {format_metrics(event.metrics)}".rstrip()


def quiet_prefect_console(verbose: bool) -> None:
    if verbose:
        return
    # Ray's SDK announces every working_dir upload and every closed log stream; the record holds what matters.
    for name in (
        "ray.dashboard.modules.dashboard_sdk",
        "ray._private.runtime_env.packaging",
        "ray.dashboard.modules.job.sdk",
    ):
        logging.getLogger(name).setLevel(logging.WARNING)
    for handler in logging.getLogger().handlers:
        if type(handler).__name__ == "PrefectConsoleHandler":
            handler.setLevel(logging.WARNING)


def run_with_display(
    cfg: PipelineConfig, run_id: str | None, only: list[str] | None, console: Console, until: str | None = None
) -> RunRecord | dict[str, Any]:
    """Run the flow in-process with a live display; returns the run record (or, when the flow
    ended before writing one, a minimal failure document)."""
    from flows.pipeline import pipeline
    from tuneproof.control import record as records
    from tuneproof.control import stages as table
    from tuneproof.core.storage import Storage

    run_id = run_id or records.make_run_id()
    display = Display(run_id, table.names(table.plan(only, until)))
    state = run_here(
        console,
        f"run id: {run_id}",
        live_display(console, display),
        pipeline,
        config=cfg,
        run_id=run_id,
        only=only,
        until=until,
    )
    if isinstance(state, NotRun):
        # Refused before any stage ran (another flow holds the run, a missing forwarded variable, ...), or the
        # Prefect API cannot take the run.
        return {"run_id": None if state.failure_class else run_id, "status": "failed", **state.fields()}
    storage = Storage.from_config(cfg.resolved().storage)
    try:
        rec = records.load(storage, run_id)
    except FileNotFoundError:
        say(console, f"the flow ended before writing a record: {state.message}", "bold red")
        return {"run_id": run_id, "status": "crashed", "failure_class": None, "cause": state.message}
    except (OSError, records.RecordUnreadable) as e:
        say(console, f"the run's record cannot be read back ({e}): {state.message}", "bold red")
        return {"run_id": run_id, "status": "crashed", "failure_class": None, "cause": state.message}
    if rec.status == "running" or not (state.is_completed() or written_by(rec, state)):
        # The flow raised and could not even mark its record (the storage that failed refused that too): the record
        # on disk is still running, or still an earlier invocation's, whose summary is not this invocation's end.
        say(console, f"run {run_id} crashed and its record could not be updated: {state.message}", "bold red")
        return {"run_id": run_id, "status": "crashed", "failure_class": None, "cause": state.message}
    print_summary(rec, console)
    return rec


def written_by(rec: RunRecord, state: State) -> bool:
    """The record's last invocation is the flow run that ended in `state` (it opened the record and saved it)."""
    last = rec.invocations[-1] if rec.invocations else None
    return last is not None and last.flow_run_id == str(state.state_details.flow_run_id)


def prefect_api_problem(console: Console) -> str | None:
    """Why the configured Prefect API cannot take a flow run, said on `console` as the reason nothing runs;
    None when it can (unset means a temporary local server). Every in-process flow asks this first."""
    import urllib.request

    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return None
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=5):
            return None
    except OSError as e:
        problem = (
            f"the Prefect API at {url} does not answer ({getattr(e, 'reason', e)}); start the local one with "
            "`tuneproof local up`, or point PREFECT_API_URL at yours"
        )
    say(console, f"cannot run: {problem}", "bold red")
    return problem


def print_summary(rec: RunRecord, console: Console) -> None:
    """One line per stage (status, then its evidence, or its cause when it failed), the gates, the verdict."""
    from tuneproof.control import stages as table

    names = [*table.names(), *sorted(set(rec.stages) - set(table.names()))]
    entries = [(name, rec.stages[name]) for name in names if name in rec.stages]
    statuses = [e.status + (f" ({e.failure_class.value})" if e.failure_class else "") for _, e in entries]
    name_width, status_width = max(map(len, names)) + 2, max(map(len, statuses), default=0) + 2
    for (name, entry), status in zip(entries, statuses):
        print_line(
            console,
            f"  {name:<{name_width}}",
            (f"{status:<{status_width}}", STATUS_STYLE.get(entry.status, "")),
            table.evidence_line(entry),
        )
    # Evidence a rerun made stale is shown as such, never as passed: its model or data is not the current one.
    stale = {e.stage: e for e in rec.superseded if e.stage not in rec.stages}
    for name in [n for n in names if n in stale]:
        print_line(
            console,
            f"  {name:<{name_width}}",
            (f"{'superseded':<{status_width}}", "yellow"),
            f"its {stale[name].status} result of invocation {stale[name].invocation} is stale: a stage it "
            "depends on was rerun",
        )
    evaluation = rec.summary("evaluate", EvaluateSummary)
    suites = [suite.gates for suite in evaluation.suites] if evaluation else []  # "suite add: ..." lines
    for line in [line for gates in ([evaluation.gates] if evaluation else []) + suites for line in gates.lines]:
        print_line(console, f"  gate: {line}")
    if rec.unread_settings:
        print_line(console, ("  ignored: ", "yellow"), f"set, but no stage read: {', '.join(rec.unread_settings)}")
    if rec.promotion is not None:
        print_line(console, f"  promotion: {promotion_verdict(rec, rec.promotion)}")
    style = "green" if rec.status == "succeeded" else "bold red"
    tail = f" ({rec.failure_class.value}: {rec.cause})" if rec.failure_class else ""
    last = rec.invocations[-1] if rec.invocations else None
    if last is not None and last.until and rec.status == "succeeded":
        tail = f" through {last.until} (--until): `tuneproof run --run-id {rec.run_id}` runs the rest"
    print_line(console, (f"run {rec.run_id} {rec.status}{tail}", style))


def promotion_verdict(rec: RunRecord, promotion: PromoteSummary) -> str:
    """The record's promotion in words (pure): refused and why; promoted, and since rolled back when a rollback
    moved production away from that version (the record names it); or promoted on superseded evidence, which
    production kept serving. The record never denies what production serves, nor claims it serves a version a
    rollback took out; what it says of production is as of the run's last end (a later run may have replaced it),
    and a promotion skipped because production already serves the candidate's bytes is not a refusal."""
    if not promotion.promoted:
        entry = rec.stages.get("promote")
        said = "not needed: " if entry is not None and entry.status == "skipped" else "refused: "
        return said + "; ".join(promotion.reasons)
    verdict = f"promoted {promotion.version}"
    if promotion.approval is not None:  # who decided it, as the card and the history move say
        verdict += f", approved by {promotion.approval.by}" + (
            f" ({promotion.approval.comment})" if promotion.approval.comment else ""
        )
    away = [r for r in rec.rollbacks if r.from_version == promotion.version and promotion.name in (None, r.model)]
    if away:
        back = away[-1]
        return f"{verdict}, since rolled back to {back.to_version} (history #{back.seq})"
    if not rec.passed("promote"):
        verdict += (
            " earlier in this run and in production when the run last ended, though the evidence it was promoted on is "
            "superseded "
            f"(`tuneproof rollback {promotion.name or 'MODEL'} --reason ...` takes it out)"
        )
    return verdict


def print_record(rec: RunRecord, console: Console) -> None:
    """The run's identity, one fact a line, then its stages."""
    code, cluster, data = rec.code, rec.cluster, rec.data
    facts = [
        ("run", f"{rec.run_id}, created {rec.created_at}, {rec.status}"),
        ("code", f"{code.git_sha} (dirty: {code.dirty})"),
        ("working_dir", str(code.working_dir_hash)),
        ("config", rec.config_hash),
        ("data", str(data.content_hash if data else "-")),
    ]
    if cluster:
        facts += [
            ("cluster", f"Ray {cluster.ray_version}, {len(cluster.nodes)} node(s)"),
            ("image", str(cluster.image_digest or "-")),
            ("environment", str(cluster.environment_digest)),
        ]
    for label, value in facts:
        print_line(console, (f"{label:<13}", "bold"), value)
    for invocation in rec.invocations:
        print_line(console, (f"{'invocation':<13}", "bold"), invocation_line(invocation))
    print_summary(rec, console)
    for back in rec.rollbacks:  # production moved away from this run's model: when, by whom and why
        print_line(
            console,
            ("  rolled back: ", "yellow"),
            f"{back.model} {back.from_version} -> {back.to_version} at {back.at} by {back.by} "
            f"(history #{back.seq}): {back.reason}",
        )


def invocation_line(invocation: Invocation) -> str:
    """'2 at <time>, crashed (its writer died ...); kept verify, data; reran finetune (failed ...)'."""
    only = f" --only {','.join(invocation.only)}" if invocation.only else ""
    only += f" --until {invocation.until}" if invocation.until else ""
    parts = [f"{invocation.number} at {invocation.at}{only}, {invocation.status or 'running'}"]
    if invocation.cause and invocation.status not in ("succeeded", None):
        parts[0] += f" ({invocation.cause})"
    if invocation.lease_takeover:
        parts.append(invocation.lease_takeover)
    if invocation.kept:
        parts.append(f"kept {', '.join(invocation.kept)}")
    if invocation.reran:
        parts.append("reran " + ", ".join(f"{name} ({why})" for name, why in invocation.reran.items()))
    return "; ".join(parts)


def run_comparison(
    cfg_a: PipelineConfig,
    cfg_b: PipelineConfig,
    stages: list[str],
    repeats: int,
    threshold: float,
    sets_a: list[str],
    sets_b: list[str],
    comparison_id: str | None,
    console: Console,
) -> dict[str, Any]:
    """Run the comparison flow in-process, a line per finished stage of each run, then the metric table.
    Returns comparison.json's content, with `failure_class` set when a run failed or nothing ran."""
    from flows.compare import compare
    from tuneproof.control import comparison as cmp
    from tuneproof.control import record as records
    from tuneproof.core.storage import Storage

    comparison_id = comparison_id or records.make_run_id()
    title = f"comparison id: {comparison_id} ({', '.join(stages)}; {repeats} repeats, A B A B ...)"
    state = run_here(
        console,
        title,
        stage_lines(console),
        compare,
        config_a=cfg_a,
        config_b=cfg_b,
        stages=stages,
        repeats=repeats,
        threshold=threshold,
        sets_a=sets_a,
        sets_b=sets_b,
        comparison_id=comparison_id,
    )
    if isinstance(state, NotRun):
        # Refused before its first run (e.g. an id already taken): whatever is stored under the id is not this.
        return {"status": "failed", **state.fields()}
    try:
        result = cmp.load(Storage.from_config(cfg_a.resolved().storage), comparison_id)
    except FileNotFoundError:
        say(console, state.message, "bold red")
        return {"status": "failed", "cause": state.message}
    rows = cmp.summary_rows(result)
    cells = [[fmt_cell(v) for v in row.values()] for row in rows]
    console.print(whole_table(list(rows[0]) if rows else ["metric"], cells, keep=("metric",)))
    uri = Storage.from_config(cfg_a.resolved().storage).uri("comparisons", comparison_id, cmp.COMPARISON)
    say(console, f"comparison {comparison_id} {result.status}: {uri}")
    out = result.to_json()
    failed = next((o for o in result.order if o.status != "succeeded"), None)
    if failed is not None:
        say(console, f"{failed.run_id} {failed.status}: {failed.cause}", "bold red")
        out["failure_class"] = failed.failure_class or "infrastructure"
    return out


@dataclass(frozen=True)
class NotRun:
    """Why a flow run in this process ran nothing: the Prefect API cannot take it (infrastructure) or the flow
    refused the request (failure_class None: a usage error, exit 3)."""

    cause: str
    failure_class: str | None = None

    def fields(self) -> dict[str, Any]:
        return {"failure_class": self.failure_class, "cause": self.cause}


def run_here(
    console: Console, title: str, watching: AbstractContextManager[Any], flow: Any, **parameters: Any
) -> State | NotRun:
    """The one way the CLI runs a flow in this process (a run, a comparison, a canary): the Prefect API checked
    first, `title` said, the flow run while `watching` shows its progress; its final state, or NotRun (said on
    `console`) where nothing ran."""
    from flows.pipeline import refusal

    if problem := prefect_api_problem(console):
        return NotRun(problem, "infrastructure")
    say(console, title)
    with watching:
        state = flow(**parameters, return_state=True)
    if refused := refusal(state):
        say(console, refused, "bold red")
        return NotRun(refused)
    return state


@contextmanager
def live_display(console: Console, display: Display) -> Iterator[None]:
    """The run's stages as a live table, redrawn on every event of the flow running in this process."""
    from tasks import events

    quiet_prefect_console(os.environ.get("TUNEPROOF_VERBOSE") == "1")
    with Live(display.render(), console=console, refresh_per_second=4, transient=False) as live:

        def show(event: dict[str, Any]) -> None:
            display.on_event(event)
            live.update(display.render())

        unsubscribe = events.subscribe(show)
        try:
            yield
        finally:
            unsubscribe()
    console.print()  # the live display's last line is not terminated


@contextmanager
def stage_lines(console: Console) -> Iterator[None]:
    """A line per finished stage while a flow of several runs (a comparison, a canary) runs in this process."""
    from tasks import events

    quiet_prefect_console(os.environ.get("TUNEPROOF_VERBOSE") == "1")

    def show(event: dict[str, Any]) -> None:
        if event["kind"] == "stage":
            failure = f" ({event['failure_class']})" if event.get("failure_class") else ""
            say(console, f"  {event['stage']:<13} {event['status']}{failure}")

    unsubscribe = events.subscribe(show)
    try:
        yield
    finally:
        unsubscribe()


def fmt_cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)
