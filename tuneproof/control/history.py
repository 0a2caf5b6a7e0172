"""Production history: an append-only log of every move of a model's production pointer.

    models/<name>/history/<seq>.json   one Move per pointer move (seq 000001, 000002, ...), each created
                                       once (exclusive create: O_EXCL lock + existence check locally,
                                       If-None-Match: * on S3) and never rewritten

The sequence number comes from the pointer: a mover reads the pointer (whose `move` names the move
that put it there, seq N), and moves it by compare-and-swap to a pointer whose `move` is seq N+1, so
only the winner of that swap ever writes entry N+1. The entry is appended after the swap; a mover
that dies between the two leaves its move in the pointer, and `read` (and the next mover, through
`backfill`) take it from there, so a move is never lost from the history.

`production_at` answers "what was production at time T" from the log alone, and `served` which versions
production ever served (both pure): a rollback goes only to one of those.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Literal

from pydantic import ValidationError

from tuneproof.core import cas
from tuneproof.core.results import Model
from tuneproof.core.storage import Storage

MODELS = "models"
"""The registry's root in storage (models/<name>/...); defined here, below the registry, which imports this module."""
HISTORY = "history"

MoveKind = Literal["promote", "forced-promote", "rollback"]


class Move(Model):
    """One move of the production pointer: from which version to which, who, when and why."""

    seq: int
    """1 for the model's first recorded move, one more for each later move."""
    kind: MoveKind
    from_version: str | None
    """Production before the move (None: there was none)."""
    to_version: str
    run_id: str
    """The run that produced `to_version`."""
    by: str
    at: str
    """UTC ISO 8601 time the pointer moved."""
    reason: str
    """Why: the gates passed, the override's reason, or the rollback's reason."""
    evidence_sha256: str | None = None
    """A promotion's evidence (the judged summaries) by content; None for a rollback."""

    def line(self) -> str:
        evidence = f" evidence {self.evidence_sha256[:12]}" if self.evidence_sha256 else ""
        return (
            f"#{self.seq} {self.at} {self.kind} {self.from_version or '(none)'} -> {self.to_version} "
            f"by {self.by}: {self.reason}{evidence}"
        )


class MoveIntent(Model):
    """What a mover says about its move before it knows its sequence number."""

    kind: MoveKind
    by: str
    reason: str
    evidence_sha256: str | None = None


class HistoryUnreadable(ValueError):
    """A history entry that exists but is not a Move (truncated, hand-edited)."""


def next_move(
    last: Move | None, from_version: str | None, intent: MoveIntent, to_version: str, run_id: str, at: str
) -> Move:
    """The move that follows `last`, the one the current pointer records (pure): seq one above it, from the
    pointer's version."""
    return Move(
        seq=(last.seq if last else 0) + 1,
        from_version=from_version,
        to_version=to_version,
        run_id=run_id,
        at=at,
        **intent.model_dump(),
    )


def entry_parts(name: str, seq: int) -> tuple[str, str, str, str]:
    return (MODELS, name, HISTORY, f"{seq:06d}.json")


def append(storage: Storage, name: str, move: Move) -> None:
    """Create the move's entry once; an entry already there must be this same move (a retry's)."""
    data = move.model_dump_json(indent=2).encode()
    if cas.write_if(storage, data, None, *entry_parts(name, move.seq)):
        return
    existing = read_entry(storage, name, move.seq)
    if existing != move:
        raise HistoryUnreadable(
            f"{storage.uri(*entry_parts(name, move.seq))} records {existing.line()!r}, expected {move.line()!r}: "
            "two movers claimed one sequence number, which the pointer's compare-and-swap should prevent"
        )


def backfill(storage: Storage, name: str, current: Move | None) -> None:
    """Append `current`, the move the pointer records, if its mover died before appending it."""
    if current is not None and not storage.exists(*entry_parts(name, current.seq)):
        append(storage, name, current)


def read(storage: Storage, name: str, current: Move | None) -> list[Move]:
    """Every move of the model's pointer, oldest first, including `current` (the move the pointer records)
    when its entry was never appended."""
    moves = {}
    for file in storage.listdir(MODELS, name, HISTORY):
        if file.endswith(".json") and file[:-5].isdigit():
            seq = int(file[:-5])
            moves[seq] = read_entry(storage, name, seq)
    if current is not None:
        if problem := _time_problem(current):
            raise HistoryUnreadable(
                f"{storage.uri(MODELS, name, 'production.json')}: its move #{current.seq} {problem}"
            )
        moves.setdefault(current.seq, current)
    return [moves[s] for s in sorted(moves)]


def read_entry(storage: Storage, name: str, seq: int) -> Move:
    """Entry `seq`, read only as a regular file (object) of at most cas.MAX_OBJECT_BYTES: a FIFO or a device
    in its place (a hostile or broken store) is refused by name instead of blocking or reading forever.
    HistoryUnreadable when it cannot be read as a Move."""
    where = storage.uri(*entry_parts(name, seq))
    try:
        data, _ = cas.read_versioned(storage, *entry_parts(name, seq))
    except OSError as e:
        raise HistoryUnreadable(f"{where}: cannot be read as a production-history entry: {e.strerror or e}") from None
    if data is None:
        raise HistoryUnreadable(f"{where}: listed, then gone: an entry is never removed")
    try:
        move = Move.model_validate(json.loads(data))
    except (ValueError, ValidationError, RecursionError) as e:
        raise HistoryUnreadable(f"{where}: not a production-history entry ({str(e)[:200]})") from None
    # A hand edit can make a valid Move that is not this entry: listed as it was, `--at` then crashed on its time,
    # and a seq other than the file's would order the log by a number no mover wrote.
    if move.seq != seq:
        raise HistoryUnreadable(f"{where}: not a production-history entry (seq is {move.seq}, expected {seq})")
    if problem := _time_problem(move):
        raise HistoryUnreadable(f"{where}: not a production-history entry ({problem})")
    return move


def _time_problem(move: Move) -> str | None:
    """Why a move's `at` is not the ISO 8601 time production_at compares, or None."""
    try:
        parse_time(move.at)
    except ValueError as e:
        return f"at: {e}"
    return None


def parse_time(value: str) -> datetime:
    """An ISO 8601 time; one without a zone is UTC. ValueError names the value and the expected form."""
    try:
        t = datetime.fromisoformat(value)
    except ValueError:
        raise ValueError(f"time {value!r} is not ISO 8601 (expected e.g. 2026-12-03T14:00:00Z)") from None
    return t if t.tzinfo else t.replace(tzinfo=UTC)


def production_at(moves: list[Move], t: datetime) -> Move | None:
    """The move that made the version production at time `t` (its to_version), or None when nothing
    was production yet (or the log starts later). Pure."""
    before = [m for m in moves if parse_time(m.at) <= t]
    return max(before, key=lambda m: m.seq) if before else None


def served(moves: list[Move], names: list[str], unrecorded: str | None) -> set[str]:
    """The versions production ever served, as far as the record tells (pure; `names`: the model's versions in
    promotion order). Every move's to-version and from-version (the pointer named it when the move was made);
    and, from before moves were recorded, every version up to the one production then had (the first move's
    from-version, or `unrecorded`: the version of a pointer that records no move). Nothing tells a version that
    served then from a copy that never did, so those all count, as rollbacks then took them.

    A complete version outside this set is a copy whose promotion stopped before the pointer's swap: its card
    claims a move that never happened."""
    found = {v for m in moves for v in (m.from_version, m.to_version) if v is not None}
    before = [moves[0].from_version if moves else None, unrecorded]
    marks = [names.index(v) for v in before if v in names]
    return found | set(names[: max(marks) + 1]) if marks else found


def render(moves: list[Move]) -> list[str]:
    """A markdown table of the moves, newest first (the model card and the flow's artifact)."""
    rows = ["| # | when | move | from | to | by | why |", "|---|---|---|---|---|---|---|"]
    for m in reversed(moves):
        why = m.reason + (f" (evidence `{m.evidence_sha256[:12]}`)" if m.evidence_sha256 else "")
        rows.append(
            f"| {m.seq} | {m.at} | {m.kind} | {m.from_version or '–'} | {m.to_version} | {m.by} | {why.replace('|', '/')} |"
        )
    return rows if moves else ["No earlier moves of the production pointer."]
