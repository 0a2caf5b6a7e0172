"""In-process pipeline events for a terminal display (the CLI subscribes; workers have no subscribers).

Events are plain dicts: {"kind": "stage", "stage", "status"}, {"kind": "job", "stage", "submission_id",
"status"}, {"kind": "progress", "stage", "event": ProgressEvent}.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_subscribers: list[Callable[[dict[str, Any]], None]] = []


def subscribe(fn: Callable[[dict[str, Any]], None]) -> Callable[[], None]:
    _subscribers.append(fn)
    return lambda: _subscribers.remove(fn)


def publish(kind: str, **fields: Any) -> None:
    event = {"kind": kind, **fields}
    for fn in list(_subscribers):
        try:
            fn(event)
        except Exception:  # noqa: BLE001 - a display problem must never fail a stage
            pass
