"""What every `tuneproof` command shares: the consoles, the --config/--set options, config and storage loading.

Imported by tuneproof/app/cli.py (the command line's entry, `tuneproof = tuneproof.app.cli:main`) and its
command groups (cli_runs.py, cli_registry.py). A bad config prints every problem and exits 3 before
anything runs (`config_or_exit`); a bad id is click's usage error, exit 2 (`slug_arg`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import typer
from rich.console import Console

from tuneproof.app.preflight import environment_problems
from tuneproof.app.terminal import Screen, say
from tuneproof.core.config import ConfigError, PipelineConfig, load_config
from tuneproof.core.names import slug_problem
from tuneproof.core.results import EXIT_BY_CLASS, EXIT_INVALID_CONFIG, FailureClass


def group(help: str) -> typer.Typer:
    return typer.Typer(no_args_is_help=True, rich_markup_mode=None, help=help)


# Flows and Prefect are imported by the commands that run them, not here: `transport`, `lint`, `runs list` and
# `models` never need Prefect, so its settings (a mistyped PREFECT_API_URL) cannot stop them.
console: Console = Screen()


err: Console = Screen(stderr=True)


STAGES_HELP = "names from the stage table (tuneproof/control/stages.py); an unknown one is refused with the list"


ConfigOpt = typer.Option(None, "--config", "-c", help="YAML profile (default configs/local.yaml).")


SetOpt = typer.Option([], "--set", "-s", help="Override a field: dotted.key=value (repeatable).")


EXIT_UNEXPECTED = 4


def slug_arg(kind: str):
    """A typer callback refusing an id that is not a slug (exit 2, click's convention for a bad argument)."""

    def check(value: str | None) -> str | None:
        if value is not None and (problem := slug_problem(value)):
            raise typer.BadParameter(f"{kind} {value!r} {problem}")
        return value

    return check


def config_or_exit(config: Path | None, sets: list[str]) -> PipelineConfig:
    """Load and validate the config; on any problem print them all and exit 3 before anything runs."""
    try:
        cfg = load_config(config, sets)
        problems = preflight(cfg)
    except ConfigError as e:
        problems = e.problems
    if problems:
        say(err, "invalid config — nothing was submitted:", "bold red")
        for p in problems:
            say(err, f"  {p}")
        raise typer.Exit(EXIT_INVALID_CONFIG)
    return cfg


def prefect_env_or_exit() -> None:
    """Before a command imports Prefect: each environment problem on its line, exit 3, nothing ran."""
    problems = environment_problems(os.environ)
    for problem in problems:
        say(err, f"environment: {problem}")
    if problems:
        raise typer.Exit(EXIT_INVALID_CONFIG)


def preflight(cfg: PipelineConfig) -> list[str]:
    """Checks that need more than the schema: metric names resolve to a shipped or loadable module."""
    from tuneproof.core.metric_names import check_eval_config

    return check_eval_config(cfg.eval)


def storage_for(config: Path | None, sets: list[str]):
    from tuneproof.core.storage import Storage

    storage = Storage.from_config(config_or_exit(config, sets).storage)
    if not storage.is_s3 and Path(storage.root).exists() and not Path(storage.root).is_dir():
        say(err, f"storage root {storage.root} is not a directory: check storage.root")
        raise typer.Exit(EXIT_BY_CLASS[FailureClass.infrastructure])
    return storage


def summary_unreadable(run: str, e: Any) -> int:
    """A record that parsed but holds a stage summary, or a recorded config the cost reads, that its model refuses
    (hand-edited, another release's)."""
    first = e.errors()[0]
    where = ".".join(str(p) for p in first["loc"])
    part = "its recorded config" if e.title == "config" else "a stage summary"
    say(err, f"run {run}: {part} in record.json is not readable: {e.title}.{where}: {first['msg']}")
    return 1
