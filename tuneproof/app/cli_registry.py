"""`tuneproof models ...` and `tuneproof images ...`: the model registry and the images registry, read back.

    tuneproof models list | show NAME | history NAME [--at TIME] [--json]
    tuneproof images list [--json] | show DECISION [--json]

Command groups of the CLI (tuneproof/app/cli.py adds `models_app` and `images_app`); they read storage
only and never import Prefect. Promotion, rollback and the canary, which change the registries, are
top-level commands in cli.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import typer

from tuneproof.app.cli_common import ConfigOpt, SetOpt, console, err, group, prefect_env_or_exit, slug_arg, storage_for
from tuneproof.app.terminal import say

models_app = group("Read the model registry.")


images_app = group("Read the images registry: canary decisions and the adopted image.")


@models_app.command("list")
def models_list(
    as_json: bool = typer.Option(False, "--json"), config: Path | None = ConfigOpt, sets: list[str] = SetOpt
) -> None:
    """Registered models and their production versions."""
    from tuneproof.control.registry import list_models

    storage = storage_for(config, sets)
    models = list_models(storage)
    for m in models:
        pointed = (m.get("production") or {}).get("version")
        if pointed is not None and pointed not in m.get("versions", []):
            # A pointer whose version is gone (deleted, or a copy that never finished) serves nothing.
            m["problem"] = (
                f"{storage.uri('models', m['name'], 'production.json')} is broken: it names version {pointed!r}, "
                f"which is not under {storage.uri('models', m['name'])}"
            )
    if as_json:
        print(json.dumps(models, indent=2))
        return
    if not models:  # an empty table would not say where it looked
        say(err, f"no models under {storage.uri('models')}: a run that passes its gates promotes the first")
        return
    from tuneproof.app.terminal import whole_table

    # A version is named v<NNNN>-<run id>: the run that produced it needs no column of its own.
    cells = [
        [
            m["name"],
            production_cell(m),
            str(len(m.get("versions", []))),
        ]
        for m in models
    ]
    console.print(whole_table(["model", "production version", "versions"], cells, keep=("model", "production version")))
    for m in models:
        if m.get("problem"):
            say(err, m["problem"])


def production_cell(model: dict) -> str:
    """The production version, `-` without one, or why the pointer serves nothing (unreadable, broken)."""
    pointed = (model.get("production") or {}).get("version")
    if model.get("problem"):
        return f"broken ({pointed})" if pointed is not None else "unreadable"
    return pointed or "-"


@models_app.command("show")
def models_show(
    name: str = typer.Argument(..., callback=slug_arg("model name")),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """One model: the production pointer, every version with its card, the production history, and what
    each promoted version cost (its card's cost: its run and the model's other runs since the previous
    promotion, as they stood when its copy check had run)."""
    from tuneproof.control.history import HistoryUnreadable
    from tuneproof.control.registry import RegistryUnreadable, show_model, version_costs

    storage = storage_for(config, sets)
    try:
        shown = show_model(storage, name)
    except (FileNotFoundError, RegistryUnreadable, HistoryUnreadable) as e:
        say(err, e)
        raise typer.Exit(1) from None
    shown["cost"] = version_costs(shown["versions"])
    print(json.dumps(shown, indent=2))


@models_app.command("history")
def models_history(
    name: str = typer.Argument(..., callback=slug_arg("model name")),
    at: str | None = typer.Option(
        None, "--at", help="Only the move that made production what it was at this ISO time."
    ),
    as_json: bool = typer.Option(False, "--json"),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """Every move of the production pointer (from, to, who, when, why), oldest first; or, with --at, what
    was production at that time."""
    from tuneproof.control import history
    from tuneproof.control.registry import RegistryUnreadable, read_history

    storage = storage_for(config, sets)
    try:
        moves = read_history(storage, name)
        when = history.parse_time(at) if at is not None else None
    except (RegistryUnreadable, history.HistoryUnreadable) as e:
        say(err, e)
        raise typer.Exit(1) from None
    except ValueError as e:
        say(err, f"--at: {e}")
        raise typer.Exit(2) from None
    if not moves:  # a name never promoted (or mistyped): say so, rather than exit 1 with nothing printed
        known = ", ".join(storage.listdir(history.MODELS)) or "none"
        say(err, f"{name}: no production moves under {storage.uri(history.MODELS, name)} (models: {known})")
    elif when is not None:
        found = history.production_at(moves, when)
        moves = [found] if found else []
        if not found:
            say(err, f"{name}: no recorded production model at {when.isoformat()}")
    if as_json:
        print(json.dumps([m.model_dump() for m in moves], indent=2))
    else:
        for m in moves:
            say(console, m.line())  # who and why come from shared storage: escaped, never obeyed
    raise typer.Exit(0 if moves else 1)


@images_app.command("list")
def images_list(
    as_json: bool = typer.Option(False, "--json"), config: Path | None = ConfigOpt, sets: list[str] = SetOpt
) -> None:
    """Canary decisions, newest first: digest, tag, versions verify saw, baseline, decision (* = current)."""
    from tuneproof.app.images_cli import list_command

    raise typer.Exit(list_command(storage_for(config, sets), as_json, console, err))


@images_app.command("show")
def images_show(
    decision_id: str = typer.Argument(..., callback=slug_arg("decision id")),
    as_json: bool = typer.Option(False, "--json"),
    config: Path | None = ConfigOpt,
    sets: list[str] = SetOpt,
) -> None:
    """One decision: the candidate, what verify saw, the baseline, the comparison and the reasons."""
    if not as_json:
        prefect_env_or_exit()  # the decision's rendering is the Prefect artifact's
    from tuneproof.app.images_cli import show_command

    raise typer.Exit(show_command(storage_for(config, sets), decision_id, as_json, console, err))
