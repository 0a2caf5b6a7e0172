"""Rollback: move a model's production pointer back to an earlier version, and the hold that keeps one
flow at a time on a model's pointer.

    models/<name>/.hold.json   who is moving the pointer (a promotion while it copies, checks and swaps;
                               a rollback), created exclusively through tuneproof.core.cas

A rollback checks its target like a promotion checks its copy (the files against the version's
manifest, the manifest against the card's content hash), then swaps the pointer by compare-and-swap
against the pointer it read, and appends the move to the history (tuneproof.control.history). The
caller passes the pointer it decided on: one that moved meanwhile is refused, never rolled back in its
place. By default it goes back to the version production replaced. Every refusal happens before the
pointer is touched.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from tuneproof.control import history, registry
from tuneproof.control.history import Move, MoveIntent
from tuneproof.control.lease import LeaseInfo, pid_alive, stale_reason
from tuneproof.control.registry import CARD_JSON, MODELS
from tuneproof.core import cas, markers
from tuneproof.core.results import now_iso, one_line
from tuneproof.core.storage import Storage

_log = logging.getLogger("tuneproof.rollback")

HOLD = ".hold.json"
HOLD_TTL_S = 1800.0
"""A hold not released after this long is a dead holder's (a promotion's copy check fits well inside it)."""


class PointerHeld(RuntimeError):
    """Another flow is moving the model's pointer (copying, checking or swapping); nothing was changed."""


class RollbackRefused(ValueError):
    """The rollback was refused before the pointer moved: the reason names the version and what is wrong."""


@contextlib.contextmanager
def hold(storage: Storage, name: str, run_id: str, command: str, wait_s: float = 0.0) -> Iterator[None]:
    """Hold models/<name>/.hold.json for the block, so one flow at a time moves a model's pointer.

    Created exclusively (cas, like the pointer); a hold whose holder is gone (its pid on this host, or
    HOLD_TTL_S old) is removed and taken. A live one makes this wait up to wait_s, then PointerHeld."""
    body = LeaseInfo.this_process(run_id, command, HOLD_TTL_S).model_dump_json().encode()
    deadline = time.monotonic() + wait_s
    while not cas.write_if(storage, body, None, MODELS, name, HOLD):
        holder = _live_holder(storage, name)
        if holder is not None and time.monotonic() >= deadline:
            raise PointerHeld(
                f"{storage.uri(MODELS, name, HOLD)}: the pointer of {name} is held by {holder.describe()}"
            )
        time.sleep(0.2 if holder is not None else 0)
    try:
        yield
    finally:
        data, token = cas.read_versioned(storage, MODELS, name, HOLD)
        if data == body and token is not None:
            cas.delete_if(storage, token, MODELS, name, HOLD)


def _live_holder(storage: Storage, name: str) -> LeaseInfo | None:
    """The live holder of the model's hold; a dead holder's hold (or an unreadable one) is removed."""
    data, token = cas.read_versioned(storage, MODELS, name, HOLD)
    if data is None or token is None:
        return None
    try:
        info: LeaseInfo | None = LeaseInfo.model_validate_json(data)
    except ValueError:
        info = None
    if info is not None and stale_reason(info, datetime.now(UTC), socket.gethostname(), pid_alive) is None:
        return info
    cas.delete_if(storage, token, MODELS, name, HOLD)
    return None


def rollback(
    storage: Storage,
    name: str,
    reason: str,
    by: str,
    to_version: str | None = None,
    from_version: str | None = None,
    expected_token: str | None = None,
    on_problem: Callable[[str], None] = _log.warning,
) -> registry.ProductionPointer:
    """Move the pointer back to `to_version` (default: the version production replaced, `default_target`),
    by compare-and-swap, under the model's hold; record the move in the history. Returns the new pointer.

    from_version and expected_token are the pointer the caller read and decided on (read_pointer's version
    and token): when given, a pointer that is not that one under the hold is PromotionConflict, so a
    promotion that landed meanwhile is never the one rolled back. RollbackRefused when there is no
    production model, the production history cannot be read, the target is not an earlier complete version that
    production served, its card is another model's or version's, or its files do not match its manifest (and its
    card's content hash); PointerHeld when another flow holds the
    pointer. The pointer stays on refusal. Once it has moved, a history entry that cannot be appended goes
    to on_problem: the move is in the pointer, and readers and the next mover take it from there
    (history.backfill)."""
    if registry.read_pointer(storage, name)[0] is None:  # before the hold: refusing leaves nothing behind
        raise RollbackRefused(f"{storage.uri(MODELS, name)}: no production model to roll back")
    with hold(storage, name, "(rollback)", f"rollback {name} by {by}"):
        pointer, token = registry.read_pointer(storage, name)
        if pointer is None:
            raise RollbackRefused(f"{storage.uri(MODELS, name)}: no production model to roll back")
        seen = pointer.version == from_version and expected_token in (None, token)
        if from_version is not None and not seen:
            raise registry.PromotionConflict(name, expected_token, token, pointer.version)
        names = registry.versions(storage, name)
        versions = [v for v in names if storage.exists(MODELS, name, v, CARD_JSON)]
        try:
            moves = history.read(storage, name, pointer.move)
        except history.HistoryUnreadable as e:  # which versions served is unknown: no target can be trusted
            raise RollbackRefused(f"{name}: the production history cannot be read: {e}") from None
        served = history.served(moves, names, registry.unrecorded_version(pointer))
        target, card = _rollback_target(
            storage, name, versions, served, pointer, to_version or default_target(pointer, versions)
        )
        history.backfill(storage, name, pointer.move)
        intent = MoveIntent(kind="rollback", by=by, reason=reason)
        move = history.next_move(pointer.move, pointer.version, intent, target, card.run_id, now_iso())
        new_pointer = registry.pointer_doc(name, target, card.run_id, card.content_sha256, move)
        registry.swap_pointer(storage, name, new_pointer, token, 30.0, 60.0)
        try:
            history.append(storage, name, move)
        except (history.HistoryUnreadable, OSError) as e:
            on_problem(f"{name}: rollback #{move.seq} is in the pointer but not yet in its history: {e}")
        return new_pointer


def default_target(pointer: registry.ProductionPointer, versions: list[str]) -> str | None:
    """The version production replaced: the from-version of the move that put it there (not the version
    numbered before it, which may be a copy that never served or one rolled back as bad). None when it
    replaced none, or when that move was a rollback (its from-version is the one rolled back from). A
    pointer written before moves were recorded has only its previous_version, if that: else the latest of
    `versions` (complete, in promotion order) before it, as rollbacks then chose. Pure."""
    if pointer.move is not None:
        return None if pointer.move.kind == "rollback" else pointer.move.from_version
    if pointer.previous_version is not None:
        return pointer.previous_version
    earlier = versions[: versions.index(pointer.version)] if pointer.version in versions else []
    return earlier[-1] if earlier else None


def repeats(move: Move | None, reason: str, by: str, to_version: str | None) -> bool:
    """The move that put the pointer where it is is this very rollback: by the same person, for the same
    reason, to the version asked for (if one was). A retry of a rollback whose first attempt moved the pointer
    (and then failed, or died) finds it so, and moves nothing again. Pure."""
    if move is None or move.kind != "rollback":
        return False
    return (move.by, move.reason) == (by, reason) and to_version in (None, move.to_version)


def _rollback_target(
    storage: Storage,
    name: str,
    versions: list[str],
    served: set[str],
    pointer: registry.ProductionPointer,
    target: str | None,
) -> tuple[str, registry.ModelCard]:
    """(target, its card), once the target is an earlier complete version that production served (history.served:
    a complete copy whose promotion died before the swap has a card, but never served), whose card names this
    model and version, and whose files match its manifest."""
    current = pointer.version
    if target is None:
        move = pointer.move
        how = f"was restored by rollback #{move.seq}" if move and move.kind == "rollback" else "replaced none"
        raise RollbackRefused(
            f"{name}: production {current} {how}, so there is no earlier version to go back to by default; "
            "name one (--to)"
        )
    if target not in versions:
        raise RollbackRefused(f"{name}: no complete version {target!r} (complete: {', '.join(versions) or 'none'})")
    if target == current:
        raise RollbackRefused(f"{name}: {target} is already production")
    if target not in served:
        raise RollbackRefused(
            f"{name}: {target} was never production (no move in {storage.uri(MODELS, name, history.HISTORY)}/ puts it "
            "there; its promotion stopped before the pointer's swap): nothing was rolled back"
        )
    if current in versions and versions.index(target) > versions.index(current):
        raise RollbackRefused(f"{name}: {target} is not earlier than production {current}: a rollback goes back")
    try:
        card = registry.read_card(storage, name, target)
    except (ValueError, OSError, RecursionError) as e:
        where = storage.uri(MODELS, name, target, CARD_JSON)
        raise RollbackRefused(f"{name} {target}: {where} cannot be read: {one_line(str(e), 200)}") from None
    if (card.name, card.version) != (name, target):
        # A folder copied from another model (or version): the pointer would name this one and serve that one.
        where = storage.uri(MODELS, name, target, CARD_JSON)
        raise RollbackRefused(
            f"{name} {target}: {where} is the card of {card.name} {card.version}, expected {name} {target}: "
            "nothing was rolled back"
        )
    try:
        content = markers.verify_export(storage, MODELS, name, target).content_sha256
    except markers.ExportUnverified as e:
        raise RollbackRefused(f"{name} {target}: its files do not match its manifest: {e}") from None
    if card.content_sha256 not in (None, content):
        raise RollbackRefused(
            f"{name} {target}: manifest content {content[:12]}, its card says {card.content_sha256[:12]}"
        )
    return target, card
