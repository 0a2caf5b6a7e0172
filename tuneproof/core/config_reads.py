"""Which settings a stage actually read: observed while it runs, never declared beside it.

    with recording(cfg) as reads:     # cfg: a PipelineConfig
        body(cfg)                     # every cfg.train.lr, cfg.eval.gates, cfg.data.model_dump() ... noted
    reads                             # {"train.lr", "eval.gates", "data"}

A stage's result depends on the settings it read, so those are what a continued run compares: a hand
list beside the stage drifts (connectivity's once left out the train.* settings its job reads, so a
continuation with another world size kept a verdict measured on the old one). Config sections
(tuneproof.core.config_base.Strict) report each attribute read to the active recorder, named by its dotted
path from the root: a leaf (`train.lr`), a dict or list as a whole (`eval.gates`), a section that is
dumped whole (`data.fields`). Reading a section alone (`cfg.train`) reads nothing yet.

One recorder per process at a time: a Ray job's driver, one Ray Train worker (whose reads are saved next
to the job's result, see training/jobkit.py), or the flow while a stage runs. Pure apart from that slot.
"""

from __future__ import annotations

import typing
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tuneproof.core.hashing import sha256_json

NOT_INPUTS = ("timeouts",)
"""Sections that bound a stage without changing its result: a read of them is not an input."""


class Recorder:
    """The dotted paths read so far, and where each kind of config section sits in the config.

    Sections are known by their class, not by object: a copy of the config (Prefect copies a task's
    parameters) reports its reads under the same paths. A section kept in a dict or list (a gate) stands
    for that whole container: a read of any gate is a read of `eval.gates`.
    """

    def __init__(self, root: type) -> None:
        self.reads: set[str] = set()
        self.paths: dict[type, tuple[str, bool]] = {}
        """section class -> (its path, whether a read inside it is a read of that whole path)"""
        self._walk(root, "", whole=False)

    def _walk(self, section: type, path: str, whole: bool) -> None:
        self.paths.setdefault(section, (path, whole))
        for name, field in section.__pydantic_fields__.items():  # type: ignore[attr-defined]
            dotted = path if whole else (f"{path}.{name}" if path else name)
            for kind, contained in _sections_in(field.annotation):
                self._walk(kind, dotted, whole or contained)

    def note(self, section: Any, name: str, value: Any) -> None:
        known = self.paths.get(type(section))
        # Not a config section, not a field, or a section read on the way to its own settings (noted as
        # they are read): nothing to note.
        if known is None or name not in type(section).__pydantic_fields__ or type(value) in self.paths:
            return
        path, whole = known
        self._add(path if whole else (f"{path}.{name}" if path else name))

    def note_whole(self, section: Any) -> None:
        known = self.paths.get(type(section))
        if known is not None:
            self._add(known[0])

    def _add(self, dotted: str) -> None:
        # The whole config dumped is how it travels (a job's envelope, a parameter's cache hash), not a read.
        if dotted and dotted.split(".", 1)[0] not in NOT_INPUTS:
            self.reads.add(dotted)


def _sections_in(annotation: Any, contained: bool = False) -> list[tuple[type, bool]]:
    """The config section classes an annotation holds, each with whether it sits in a dict or list."""
    if isinstance(annotation, type) and hasattr(annotation, "__pydantic_fields__"):
        return [(annotation, contained)]
    origin = typing.get_origin(annotation)
    inner = contained or origin in (dict, list, tuple, set, frozenset)
    return [found for arg in typing.get_args(annotation) for found in _sections_in(arg, inner)]


class _Slot:
    recorder: Recorder | None = None


ACTIVE = _Slot()
"""The process's recorder while one is active (read on every config attribute access: kept cheap)."""


@contextmanager
def recording(config: Any) -> Iterator[set[str]]:
    """Note every setting of `config` read inside the block (this process, any thread); yields the set."""
    previous = ACTIVE.recorder
    ACTIVE.recorder = Recorder(type(config))
    try:
        yield ACTIVE.recorder.reads
    finally:
        ACTIVE.recorder = previous


def value_at(config: dict[str, Any], path: str) -> Any:
    """The value at a dotted path of a config as JSON ('' is the whole config); a missing one is None."""
    value: Any = config
    for part in path.split(".") if path else []:
        value = value.get(part) if isinstance(value, dict) else None
    return value


def reads_hashes(config: dict[str, Any], paths: set[str] | list[str]) -> dict[str, str]:
    """{path: sha256 of its value}, for the paths a stage read: what its inputs key is made of."""
    return {path: sha256_json(value_at(config, path)) for path in sorted(outermost(paths))}


def outermost(paths: set[str] | list[str]) -> set[str]:
    """The paths without those inside another one: 'data' read whole covers 'data.source'."""
    found = set(paths)
    return {p for p in found if not any(p != q and (q == "" or p.startswith(q + ".")) for q in found)}


def unread_settings(config: dict[str, Any], defaults: dict[str, Any], reads: set[str] | list[str]) -> list[str]:
    """Settings given a value other than the default that no stage read, in sections that some stage did read:
    set, reaching the jobs, and ignored (a knob a job forgot, or one that means nothing with the others, such
    as a shard group size without hybrid sharding). Sections nothing read (a stage left out by --only) say
    nothing. Pure."""
    covered = outermost(reads)
    sections = {path.split(".", 1)[0] for path in covered}
    return [
        path
        for path, value in leaves(config, "")
        if path.split(".", 1)[0] in sections
        and path.split(".", 1)[0] not in NOT_INPUTS
        and value != value_at(defaults, path)
        and not is_read(path, covered)
    ]


def is_read(path: str, reads: set[str] | list[str]) -> bool:
    """Whether reading `reads` read the setting at `path` (itself, or a section or container holding it)."""
    return any(path == read or path.startswith(read + ".") for read in reads)


def leaves(value: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    """(dotted path, value) for every setting of a config as JSON."""
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from leaves(inner, f"{path}.{key}" if path else str(key))
    elif path:
        yield path, value
