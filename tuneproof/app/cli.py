"""`tuneproof`: the command line.

    tuneproof local up|down|status
    tuneproof run [--config F] [--set k.v=x]... [--only STAGE,... | --until STAGE] [--run-id RUN]
    tuneproof runs list [--json] | show RUN [--json] | diff A B [--json]
    tuneproof compare --stages S,... --a k=v... --b k=v... [--repeats N] [--json]
    tuneproof verify [--config F] [--from-files DIR]
    tuneproof lint [PATH...]
    tuneproof transport LOG... [--expect efa]
    tuneproof models list | show NAME | history NAME [--at TIME] [--json]
    tuneproof promote RUN --force --reason TEXT
    tuneproof rollback NAME [--to VERSION] --reason TEXT
    tuneproof canary [--candidate-image REPO@sha256:...] [--json]
    tuneproof images list [--json] | show DECISION [--json]

Exit codes of `run`: 0 ok, 3 invalid config or refused request (nothing ran), 4 infrastructure failure or a
crashed flow, 5 data, 6 modeling failure, 130 cancelled (Ctrl-C or SIGTERM). `run --run-id RUN` without --only
continues a run: stages that succeeded with unchanged inputs are kept, the rest run (an interrupted fine-tune
resumes from its checkpoint).
Every command: 1 findings that are errors (or the run/model asked for is absent or unreadable), 2 a
malformed argument (click's usage convention), 3 an invalid config or refused request, 4 storage or
another resource that cannot be read; an unexpected exception is one `error: ...` line, exit 4.

The `runs`, `models` and `images` groups live in cli_runs.py and cli_registry.py, what every command
shares in cli_common.py; this file builds the app, runs the pipeline and holds the other commands.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Any

import typer

from tuneproof.app.cli_common import (
    EXIT_UNEXPECTED,
    STAGES_HELP,
    ConfigOpt,
    SetOpt,
    config_or_exit,
    console,
    err,
    group,
    prefect_env_or_exit,
    preflight,
    slug_arg,
)
from tuneproof.app.cli_registry import images_app, models_app
from tuneproof.app.cli_runs import runs_app
from tuneproof.app.preflight import unknown_stage_lines, unread_difference
from tuneproof.app.terminal import say
from tuneproof.core.config import PROJECT_ROOT, ConfigError, PipelineConfig, load_config
from tuneproof.core.results import EXIT_BY_CLASS, EXIT_INVALID_CONFIG, FailureClass, exit_code_for

EXIT_CANCELLED = 130
"""128 + SIGINT, as a shell reports a command stopped by Ctrl-C."""

# Click's plain rendering, not Rich's (rich_markup_mode=None): Rich boxes a usage error at 80 columns off a terminal
# (an id broken mid-string) and prints nothing at all with COLUMNS=0; click's is one `Error: ...` line at any width.
app = typer.Typer(
    add_completion=False,
    rich_markup_mode=None,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    help="Fine-tune Qwen on Ray; promote only on evidence.",
)


local_app = group("The embedded local cluster (Ray head, Prefect server + worker).")
app.add_typer(local_app, name="local")
app.add_typer(runs_app, name="runs")
app.add_typer(models_app, name="models")
app.add_typer(images_app, name="images")


def main() -> None:
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    sys.exit(guarded(app))


def guarded(command: Any) -> int:
    """Run the CLI; the last resort for an exception no reader anticipated: one line, exit 4, never a traceback.

    Every input the bad-input suite (tests/test_bad_input.py) feeds in gets its own message before this."""
    try:
        command()
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except OSError as e:  # storage or a file vanished, refused or broke mid-read: an infrastructure problem
        say(err, f"error: cannot read {e.filename or 'storage'}: {e.strerror or e}")
        return EXIT_UNEXPECTED
    except Exception as e:  # noqa: BLE001 - the point of the guard
        say(err, f"error: {type(e).__name__}: {e} (please report)")
        return EXIT_UNEXPECTED
    return 0


# ---------------------------------------------------------------- run


@app.command()
def run(
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
    only: str | None = typer.Option(None, help=f"Comma-separated subset of the stages: {STAGES_HELP}."),
    until: str | None = typer.Option(
        None,
        help="Run the stages up to and including this one, then stop; `--run-id RUN` later continues the run.",
    ),
    run_id: str | None = typer.Option(
        None,
        "--run-id",
        callback=slug_arg("run id"),
        help="Continue this run (keeps stages whose inputs are unchanged), or with --only rerun stages against it.",
    ),
) -> None:
    """Run the pipeline; prints the run id; exit code by failure class."""
    cfg = config_or_exit(config, sets)
    prefect_env_or_exit()
    from tuneproof.control import stages as table

    stages = parse_only(only)
    check_until(stages, until)
    if stages and not run_id and table.needs_an_earlier_run(table.plan(stages)):
        run_id = latest_run_id(cfg)
        say(
            console, f"--only {','.join(stages)} reruns against the latest run, {run_id} (use --run-id to pick another)"
        )
    from tuneproof.app.terminal import run_with_display

    # SIGTERM (`kill`, a supervisor stopping the process) ends the run the way Ctrl-C does, instead of
    # killing it where it stands and leaving its record `running` until the lease goes stale.
    # The handler is put back on the way out: a caller in the same process (a test, a notebook) keeps
    # its own, and processes it forks later do not inherit one that raises.
    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        record = run_with_display(cfg, run_id, stages, console, until)
    except KeyboardInterrupt as e:
        # The flow has marked its record cancelled, stopped its Ray job and released the run's lease.
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        say(err, f"cancelled ({how}): the record says `cancelled`; continue it with --run-id", "bold red")
        raise typer.Exit(EXIT_CANCELLED) from None
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
    raise typer.Exit(run_exit_code(record))


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the flow stands: the same path as Ctrl-C (job stopped, record cancelled)."""


def terminated(signum: int, frame: Any) -> None:
    raise Terminated(f"signal {signal.Signals(signum).name}")


def run_exit_code(record: Any) -> int:
    """By failure class; a crashed flow is an infrastructure failure (4), a cancelled one 130; a failed
    run without a class was a request that could not run (e.g. --only without an earlier stage's output,
    or another flow holding the run), which is a usage error like an invalid config."""
    doc = record.to_json() if hasattr(record, "to_json") else record
    if doc.get("failure_class"):
        return exit_code_for(doc["failure_class"])
    status = doc.get("status")
    if status == "crashed":
        return EXIT_BY_CLASS[FailureClass.infrastructure]
    if status == "cancelled":
        return EXIT_CANCELLED
    return EXIT_INVALID_CONFIG if status == "failed" else 0


def parse_only(only: str | None, option: str = "--only") -> list[str] | None:
    from tuneproof.control import stages as table

    if only is None:
        return None
    stages = [s.strip() for s in only.split(",") if s.strip()]
    if not stages:
        # Not "all stages": `--only "$STAGES"` with the variable unset would otherwise run, and promote, everything.
        say(err, f"{option}: names no stage (got {only!r}); expected some of {', '.join(table.names())}")
        raise typer.Exit(EXIT_INVALID_CONFIG)
    refuse_unknown_stages(option, stages)
    try:
        table.plan(stages)
    except table.UnknownStages as e:
        say(err, f"{option}: {e}")
        raise typer.Exit(EXIT_INVALID_CONFIG) from None
    return stages


def check_until(only: list[str] | None, until: str | None) -> None:
    """--until names one stage of the table and does not combine with --only; exit 3 naming the bad value."""
    from tuneproof.control import stages as table

    if until is None:
        return
    refuse_unknown_stages("--until", [until])
    try:
        table.plan(only, until)
    except table.UnknownStages as e:
        say(err, f"--until: {e}")
        raise typer.Exit(EXIT_INVALID_CONFIG) from None


def refuse_unknown_stages(option: str, given: list[str]) -> None:
    """Exit 3 naming each name that is not a stage (escaped, with the stage it looks like)."""
    from tuneproof.control import stages as table

    lines = unknown_stage_lines(option, given, table.names())
    for line in lines:
        say(err, line)
    if lines:
        raise typer.Exit(EXIT_INVALID_CONFIG)


def latest_run_id(cfg: PipelineConfig) -> str:
    """The newest run of this model whose record says it finished (succeeded or failed): what `--only` without
    --run-id reruns against. Exit 3 when there is none."""
    from tuneproof.control import record
    from tuneproof.core.config_reads import value_at
    from tuneproof.core.storage import Storage

    storage = Storage.from_config(cfg.storage)

    def a_base(run_id: str) -> bool:
        # The record decides, never its listing row alone: a row can be a save behind (a flow killed between the
        # two writes). A run still running (or whose writer died), crashed or cancelled is no base to rerun
        # against, nor is another model's run: its evidence is about another model, which a promote would then
        # serve as this one.
        found = record.load_or_row(storage, run_id)
        return (
            isinstance(found, record.RunRecord)
            and found.status in ("succeeded", "failed")
            and value_at(found.config, "model.name") == cfg.model.name
        )

    latest = next((row.run_id for row in record.list_rows(storage) if a_base(row.run_id)), None)
    if latest is None:
        say(
            err,
            f"--only without --run-id needs an earlier finished run of {cfg.model.name} to rerun against; none found",
        )
        raise typer.Exit(EXIT_INVALID_CONFIG)
    return latest


@app.command()
def compare(
    stages: str = typer.Option(..., "--stages", help=f"Comma-separated stages each repeat runs: {STAGES_HELP}."),
    a: list[str] = typer.Option([], "--a", help="An override for arm A only: dotted.key=value (repeatable)."),
    b: list[str] = typer.Option([], "--b", help="An override for arm B only: dotted.key=value (repeatable)."),
    repeats: int = typer.Option(3, "--repeats", help="Runs per arm, interleaved A B A B ... (2 to 20)."),
    threshold: float = typer.Option(
        0.05, "--threshold", help="Smallest relative change a verdict may call a difference."
    ),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
    comparison_id: str | None = typer.Option(
        None, "--id", callback=slug_arg("comparison id"), help="Comparison id (default: a new one)."
    ),
    as_json: bool = typer.Option(
        False, "--json", help="Print comparison.json on stdout (the table and progress go to stderr)."
    ),
) -> None:
    """The same stages under settings A and B, interleaved; medians, spread, a 95% interval of B/A, a verdict."""
    problems = []
    cfgs = {}
    for arm, extra in (("A", a), ("B", b)):
        try:
            cfgs[arm] = load_config(config, [*sets, *extra])
            problems += [f"arm {arm}: {p}" for p in preflight(cfgs[arm])]
        except ConfigError as e:
            problems += [f"arm {arm}: {p}" for p in e.problems]
    if not 0 < threshold < 1:
        problems.append(f"--threshold must be between 0 and 1 (got {threshold})")
    prefect_env_or_exit()
    if len(cfgs) == 2:  # judged beside the problems above: `--repeats 0 --threshold -1` named the threshold alone
        from flows.compare import ComparisonRefused, check_request

        chosen = parse_only(stages, "--stages") or []
        try:
            check_request(cfgs["A"], cfgs["B"], chosen, repeats)
        except ComparisonRefused as e:
            problems.append(str(e))
    if not problems:
        from tuneproof.control import record
        from tuneproof.control import stages as table
        from tuneproof.core.storage import Storage

        runs, _ = record.list_records(Storage.from_config(cfgs["A"].storage))
        read = table.reads_when_last_run(table.names(table.plan(chosen or None)), runs)
        problems += unread_difference(cfgs["A"], cfgs["B"], chosen, read)
    if problems:
        say(err, "invalid comparison — nothing was submitted:", "bold red")
        for p in problems:
            say(err, f"  {p}")
        raise typer.Exit(EXIT_INVALID_CONFIG)
    from tuneproof.app.terminal import run_comparison

    # With --json, stdout carries the one JSON document (for jq and scripts); progress and the table go to stderr.
    out = err if as_json else console
    result = run_comparison(
        cfgs["A"], cfgs["B"], parse_only(stages, "--stages") or [], repeats, threshold, a, b, comparison_id, out
    )
    if as_json:
        print(json.dumps(result, indent=2))
    if result.get("failure_class"):
        raise typer.Exit(exit_code_for(result["failure_class"]))
    raise typer.Exit(0 if result.get("status") == "succeeded" else EXIT_INVALID_CONFIG)


# ---------------------------------------------------------------- checks


@app.command()
def verify(
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
    from_files: Path | None = typer.Option(None, "--from-files", help="Saved kubectl/ray JSON."),
    as_json: bool = typer.Option(False, "--json"),
) -> None:
    """Verify the cluster live (the verify stage), or over saved `kubectl get -o json` / `ray list nodes` output."""
    if from_files is not None:
        from tuneproof.app.cli_eks import verify_from_files_command

        raise typer.Exit(verify_from_files_command(str(from_files), str(config) if config else None, sets, as_json))
    cfg = config_or_exit(config, sets)
    prefect_env_or_exit()
    from tuneproof.app.terminal import run_with_display

    rec = run_with_display(cfg, None, ["verify"], console)
    raise typer.Exit(run_exit_code(rec))


@app.command()
def lint(
    paths: list[str] = typer.Argument(None, help="Manifests or folders (default deployments/)."),
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Profile whose expectations apply (default configs/eks.yaml)."
    ),
    sets: list[str] = SetOpt,
    read_pointer: bool = typer.Option(
        False, "--read-pointer", help="Also read images/current.json from an S3 storage root (a local root always is)."
    ),
) -> None:
    """Static checks of deployments/ manifests against schemas and the pipeline's expectations."""
    from tuneproof.app.cli_eks import lint_command

    manifests = paths or [str(PROJECT_ROOT / "deployments")]
    raise typer.Exit(lint_command(manifests, str(config) if config else None, sets, read_pointer))


class TransportExpect(str, Enum):
    any = "any"
    efa = "efa"
    gloo = "gloo"


@app.command()
def transport(
    logs: list[Path] = typer.Argument(..., help="NCCL log files."),
    expect: TransportExpect = typer.Option(TransportExpect.any, help="What the logs must show."),
) -> None:
    """Classify NCCL logs: efa | socket-fallback | inconclusive | gloo. Non-zero exit when --expect is not met."""
    from tuneproof.core.files import read_regular
    from tuneproof.core.transport import MAX_LOG_BYTES, decode_log, verdict_for_files

    texts = {}
    for path in logs:
        try:
            texts[str(path)] = decode_log(read_regular(path, MAX_LOG_BYTES))
        except (OSError, ValueError) as e:
            say(err, f"cannot read {path}: {getattr(e, 'strerror', None) or e}")
            raise typer.Exit(2) from None
    verdict = verdict_for_files(texts, expect.value)
    print(json.dumps(verdict, indent=2))
    raise typer.Exit(0 if verdict["ok"] else 1)


# ---------------------------------------------------------------- registry


@app.command()
def rollback(
    name: str = typer.Argument(..., callback=slug_arg("model name")),
    to: str | None = typer.Option(
        None, "--to", callback=slug_arg("version"), help="Default: the version production replaced."
    ),
    reason: str = typer.Option("", "--reason", help="Why production goes back (recorded in the history)."),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """Move a model's production pointer back to an earlier version (checked against its manifest)."""
    if not reason.strip():
        err.print("rollback needs a non-empty --reason (it is recorded in the production history)")
        raise typer.Exit(2)
    cfg = config_or_exit(config, sets)
    from tasks.promote import roll_back
    from tuneproof.control.registry import current_user

    result = roll_back(cfg, name, reason, current_user(), to)
    print(json.dumps(result.model_dump(), indent=2))
    if not result.rolled_back:
        say(err, "rollback refused, the pointer did not move: " + "; ".join(result.reasons))
    raise typer.Exit(0 if result.rolled_back else EXIT_INVALID_CONFIG)


@app.command()
def promote(
    run_id: str = typer.Argument(..., callback=slug_arg("run id")),
    force: bool = typer.Option(False, "--force", help="Required: this bypasses the gates."),
    reason: str = typer.Option("", "--reason", help="Why the gates are overridden (recorded)."),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """The logged override: promote a run's exported model regardless of its gates."""
    if not force or not reason.strip():
        say(err, "promote is an override of the gates: it needs --force and a non-empty --reason")
        raise typer.Exit(2)
    cfg = config_or_exit(config, sets)
    prefect_env_or_exit()
    from tasks.promote import forced_promotion, unreadable_summary
    from tuneproof.control import record
    from tuneproof.control.lease import Lease, LeaseHeld, LeaseLost
    from tuneproof.core.storage import Storage

    storage = Storage.from_config(cfg.resolved().storage)
    # The override writes the run's record: not while a flow is writing it, and not at all when the record is
    # missing or not this run's (a copied directory): checked before the lease, so a refusal leaves nothing.
    lease = Lease(storage, run_id, None, f"tuneproof promote {run_id} --force")
    try:
        if problem := unreadable_summary(record.load(storage, run_id)):
            raise record.RecordUnreadable(problem)
        with lease.held(on_problem=lambda problem: say(err, problem)):
            result = forced_promotion(cfg, run_id, reason, os.environ.get("USER", "unknown"), lease)
    except (FileNotFoundError, record.RecordUnreadable) as e:  # nothing to promote: a refused request
        say(err, f"promote refused: {e}")
        raise typer.Exit(EXIT_INVALID_CONFIG) from None
    except LeaseHeld as e:
        say(err, f"promote refused, nothing was changed: {e}")
        raise typer.Exit(EXIT_INVALID_CONFIG) from None
    except LeaseLost as e:  # presumed dead mid-override and taken over: the run is another writer's now
        say(err, f"promote stopped, its record not written: {e}")
        raise typer.Exit(EXIT_BY_CLASS[FailureClass.infrastructure]) from None
    print(json.dumps(result.to_json(), indent=2))
    raise typer.Exit(0 if result.promoted else 1)


# ---------------------------------------------------------------- images


@app.command()
def canary(
    candidate_image: str | None = typer.Option(
        None,
        "--candidate-image",
        help="The image to try, repo@sha256:<64 hex> (eks: required; locally: this environment by default).",
    ),
    max_steps: int = typer.Option(60, "--max-steps", help="Fine-tune steps of each canary run (a short run)."),
    repeats: int = typer.Option(
        3, "--repeats", help="Canary runs (2-20): each metric is compared by its t interval against the baseline's."
    ),
    threshold: float = typer.Option(0.10, "--threshold", help="Smallest relative change that counts as worse."),
    decision_id: str | None = typer.Option(
        None, "--id", callback=slug_arg("decision id"), help="Decision id (default: a new one)."
    ),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
    as_json: bool = typer.Option(False, "--json", help="Print decision.json."),
) -> None:
    """Try a candidate image on the production workload; record adopt|reject under images/; adopt moves the pointer."""
    from tuneproof.app.images_cli import canary_command
    from tuneproof.control import images

    if candidate_image is not None and (problem := images.image_problem(candidate_image)):
        say(err, f"--candidate-image {candidate_image!r} {problem}")
        raise typer.Exit(EXIT_INVALID_CONFIG)
    # Before any flow run: the flow checks them too (a deployment's parameters), but only after it has started.
    for option, problem in (
        ("--max-steps", images.max_steps_problem(max_steps)),
        ("--repeats", images.repeats_problem(repeats)),
        ("--threshold", images.threshold_problem(threshold)),
    ):
        if problem:
            say(err, f"{option}: {problem}")
            raise typer.Exit(EXIT_INVALID_CONFIG)
    cfg = config_or_exit(config, sets)
    prefect_env_or_exit()
    out = err if as_json else console  # --json: stdout is the decision alone; progress goes to stderr
    raise typer.Exit(canary_command(cfg, candidate_image, max_steps, repeats, threshold, decision_id, as_json, out))


# ---------------------------------------------------------------- local


@local_app.command("up")
def local_up() -> None:
    """Start the Ray head (at cluster.address), prepare storage and the tiny base model; Prefect server + worker."""
    prefect_env_or_exit()
    from tuneproof.app import localctl

    raise typer.Exit(localctl.up(console))


@local_app.command("down")
def local_down() -> None:
    """Stop what `local up` started."""
    prefect_env_or_exit()
    from tuneproof.app import localctl

    raise typer.Exit(localctl.down(console))


@local_app.command("status")
def local_status() -> None:
    """What is running."""
    prefect_env_or_exit()
    from tuneproof.app import localctl

    raise typer.Exit(localctl.status(console))


if __name__ == "__main__":
    main()
