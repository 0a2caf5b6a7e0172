"""Which checkpoints count: the completion marker, listing a run's checkpoints, and Ray Train's snapshot kept in step.

A checkpoint counts only when its marker (tuneproof_complete.json, written last) exists and every file
it lists is there with its size and sha256 (`check_complete`). Used by the fine-tune's driver
(training/finetune.py: `find_checkpoints`, `skip_unusable`, `set_aside_unusable_ray_snapshot`,
`remove_unmarked` before and after the Ray Train run), by its workers (`write_marker`,
`latest_complete_checkpoint`) and by the resume and evaluate jobs, on local disk or S3 alike. What is
in a checkpoint and how it is saved and loaded is training/checkpointing.py.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from training.checkpointing import MARKER, checkpoint_dir_name, step_of
from tuneproof.core import markers
from tuneproof.core.markers import Digests
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef
from tuneproof.core.summaries_training import SkippedCheckpoint


def missing_files(expected: dict[str, int], present: dict[str, int]) -> list[str]:
    """Each listed file that is absent or has another size, as 'name (why)'. Pure."""
    problems = []
    for name, size in sorted(expected.items()):
        if name not in present:
            problems.append(f"{name} (missing, expected {size} bytes)")
        elif present[name] != size:
            problems.append(f"{name} (size {present[name]} bytes, expected {size})")
    return problems


def stored_files(storage: Storage, *parts: str) -> dict[str, int]:
    """Every file under a storage location with its size, by path relative to it."""
    base = storage.path(*parts).rstrip("/")
    try:
        found = storage.fs.find(base, detail=True)
    except FileNotFoundError:
        return {}
    return {
        path[len(base) :].lstrip("/"): int(info["size"])
        for path, info in found.items()
        if info.get("type") != "directory" and path.startswith(base + "/")
    }


def check_complete(storage: Storage, *parts: str, contents: bool = True) -> str | None:
    """None when the checkpoint at parts is complete and unchanged; otherwise one line naming what is wrong.

    Sizes are checked first (cheap); then, with `contents`, every listed file is read and hashed against the
    marker's sha256. A worker checks sizes only: it hashes each file it loads while loading it
    (checkpointing.load_shards), so no rank reads a file twice or reads the files only other ranks need.
    """
    where = storage.uri(*parts)
    present = stored_files(storage, *parts)
    if MARKER not in present:
        return f"{where}: no completion marker {MARKER} (the save never finished)"
    try:
        marker = json.loads(storage.read_bytes(*parts, MARKER))
        expected = {str(k): int(v) for k, v in marker["files"].items()}
        int(marker["step"])
        digests = markers.parse_digests(marker) if "sha256" in marker else None
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        return f"{where}: completion marker unreadable ({type(e).__name__}: {e})"
    problems = missing_files(expected, present)
    if not problems and digests is None:
        problems = [f"{MARKER} lists no sha256 per file (written by an earlier release): content unverifiable"]
    if not problems and digests is not None and contents:
        problems = markers.digest_problems(digests, markers.stored_digests(storage, *parts, names=digests))
    return f"{where}: {'; '.join(problems)}" if problems else None


def read_step(storage: Storage, *parts: str) -> int:
    return int(storage.read_json(*parts, MARKER)["step"])


def write_marker(storage: Storage, step: int, files: Digests, *parts: str) -> None:
    """Write the completion marker LAST, after checking the listed files really are in storage.

    The sha256 per file comes from the writer's local copy; a reader hashes what is stored against it
    (check_complete), so an upload that changed a file, or a later edit, makes the checkpoint unusable.
    """
    problems = missing_files({n: d.size for n, d in files.items()}, stored_files(storage, *parts))
    if problems:
        raise FileNotFoundError(f"{storage.uri(*parts)}: not marking complete, {'; '.join(problems)}")
    storage.write_json({"step": step, **markers.marker_fields(files), "written_at": now_iso()}, *parts, MARKER)


def list_checkpoints(storage: Storage, *run_parts: str) -> list[tuple[int, str]]:
    """(step, dir name) of every checkpoint_* directory of a run, newest first, complete or not."""
    named = [(step_of(name), name) for name in storage.listdir(*run_parts)]
    return sorted(((s, n) for s, n in named if s is not None), reverse=True)


def complete_checkpoints(storage: Storage, *run_parts: str) -> Iterator[CheckpointRef]:
    """Every complete checkpoint of a run, newest first (lazily: each is validated when reached)."""
    for _, name in list_checkpoints(storage, *run_parts):
        if check_complete(storage, *run_parts, name) is None:
            yield CheckpointRef(read_step(storage, *run_parts, name), storage.uri(*run_parts, name))


def remove_unmarked(storage: Storage, *run_parts: str) -> list[str]:
    """Delete a stopped run's checkpoint directories that have no completion marker; returns their names.

    They are never resumed from, and after a save cut short by a full disk they hold the space the run
    record and the job's result still need. Call only once no worker can be writing (the trainer ended).
    A checkpoint whose marker is there but whose files do not match it is kept: that is evidence."""
    unmarked = [
        name for _, name in list_checkpoints(storage, *run_parts) if not storage.exists(*run_parts, name, MARKER)
    ]
    for name in unmarked:
        storage.remove(*run_parts, name, recursive=True)
    return unmarked


RAY_SNAPSHOT = "checkpoint_manager_snapshot.json"
"""Ray Train V2's list of the checkpoints a run reported, in the run's storage directory. Ray rewrites it
in place at every report, not through a temporary file, and reads it whole when a run of that name starts."""


def unusable_ray_snapshot(storage: Storage, *run_parts: str) -> str | None:
    """Why Ray Train would refuse to start from this run's snapshot; None when it is absent or usable.

    A disk that filled up (or a controller killed) during Ray's rewrite leaves it torn, and Ray's controller
    then dies at start on its JSON. A checkpoint it lists may also be gone: remove_unmarked deletes those a
    failed save left without a marker, and Ray refuses a snapshot naming a missing checkpoint."""
    if not storage.exists(*run_parts, RAY_SNAPSHOT):
        return None
    try:
        state = json.loads(storage.read_bytes(*run_parts, RAY_SNAPSHOT))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError both are
        return f"not valid JSON: {e}"
    missing = sorted({name for name in snapshot_checkpoints(state) if not storage.exists(*run_parts, name)})
    if missing:
        return f"it lists {', '.join(missing)}, not in storage"
    return None


def snapshot_checkpoints(state: Any) -> set[str]:
    """Every checkpoint directory a Ray Train snapshot names, wherever it sits in the document. Pure.

    Read by key, not by Ray's schema (private, and not the same in every release)."""
    if isinstance(state, dict):
        named = {state["checkpoint_dir_name"]} if isinstance(state.get("checkpoint_dir_name"), str) else set()
        return named.union(*(snapshot_checkpoints(v) for v in state.values()))
    if isinstance(state, list):
        return set().union(*(snapshot_checkpoints(v) for v in state))
    return set()


def set_aside_unusable_ray_snapshot(storage: Storage, *run_parts: str) -> str | None:
    """Move an unusable Ray Train snapshot out of Ray's way, keeping it beside as evidence; returns what
    was done, or None when there was nothing to do. Without it, the run starts with no Ray-side history and
    resumes from its latest complete checkpoint by completion marker (resolve_start), as always."""
    problem = unusable_ray_snapshot(storage, *run_parts)
    return None if problem is None else set_aside_ray_snapshot(storage, problem, *run_parts)


def set_aside_ray_snapshot(storage: Storage, problem: str, *run_parts: str) -> str:
    aside = f"{RAY_SNAPSHOT}.unusable-{time.strftime('%Y%m%dT%H%M%S')}"
    storage.write_bytes(storage.read_bytes(*run_parts, RAY_SNAPSHOT), *run_parts, aside)
    storage.remove(*run_parts, RAY_SNAPSHOT)
    return f"Ray Train's {RAY_SNAPSHOT} of this run is unusable ({problem}); set aside as {aside}"


@dataclass(frozen=True)
class CheckpointsFound:
    """A run's checkpoints as a new job finds them: where it resumes, and what newer failed its check."""

    latest: CheckpointRef | None
    """The newest complete checkpoint (None: there is none)."""
    unusable: list[tuple[str, int, str]]
    """(dir name, step, problem) of every checkpoint newer than `latest` that failed check_complete, newest first."""


def find_checkpoints(storage: Storage, *run_parts: str, contents: bool = True) -> CheckpointsFound:
    """Check the run's checkpoints newest first until one is complete (older ones are not read); `contents`
    as in check_complete."""
    unusable: list[tuple[str, int, str]] = []
    for step, name in list_checkpoints(storage, *run_parts):
        problem = check_complete(storage, *run_parts, name, contents=contents)
        if problem is None:
            return CheckpointsFound(
                CheckpointRef(read_step(storage, *run_parts, name), storage.uri(*run_parts, name)), unusable
            )
        unusable.append((name, step, problem))
    return CheckpointsFound(None, unusable)


def skip_unusable(storage: Storage, found: CheckpointsFound, *run_parts: str) -> list[SkippedCheckpoint]:
    """Leave every checkpoint newer than the newest complete one out of Ray Train's bookkeeping and out of
    the way of the steps that will be saved again; returns what was done to each. Call before the trainer
    starts (its controller reads the snapshot once, at start).

    Ray's snapshot is rewritten first, without them: its checkpoint manager would otherwise hand the restart
    one of them, and later prune it by path, failing the run on a path that is gone or deleting the
    checkpoint saved again under the same name. Then a checkpoint whose marker is there but whose files do
    not match it is moved aside (checkpoint_<step>.unusable-<time>, a name no listing takes for a checkpoint),
    kept as evidence; one without a marker (a save cut short) stays, to be saved over. With no complete
    checkpoint at all nothing is done: the restart then fails naming the problem, or starts fresh when Ray
    knew of no checkpoint."""
    if found.latest is None or not found.unusable:
        return []
    names = {name for name, _, _ in found.unusable}
    dropped = drop_from_ray_snapshot(storage, names, *run_parts)
    skipped = []
    stamp = time.strftime("%Y%m%dT%H%M%S")
    for name, step, problem in found.unusable:
        aside = None
        if storage.exists(*run_parts, name, MARKER):
            aside = f"{name}.unusable-{stamp}"
            storage.fs.mv(storage.path(*run_parts, name), storage.path(*run_parts, aside), recursive=True)
        skipped.append(
            SkippedCheckpoint(
                name=name, step=step, reason=problem, set_aside_as=aside, dropped_from_ray=name in dropped
            )
        )
    return skipped


def set_aside_latest(storage: Storage, reason: str, *run_parts: str) -> SkippedCheckpoint | None:
    """Take the run's newest complete checkpoint out of use, kept beside as evidence: out of Ray Train's snapshot,
    then moved to checkpoint_<step>.unusable-<time>, so a continuation resumes from the complete one before it,
    or fresh. Returns what was done; None when the run has no complete checkpoint. Call once no worker runs."""
    latest = find_checkpoints(storage, *run_parts, contents=False).latest
    if latest is None:
        return None
    name = checkpoint_dir_name(latest.step)
    dropped = drop_from_ray_snapshot(storage, {name}, *run_parts)
    aside = f"{name}.unusable-{time.strftime('%Y%m%dT%H%M%S')}"
    storage.fs.mv(storage.path(*run_parts, name), storage.path(*run_parts, aside), recursive=True)
    return SkippedCheckpoint(
        name=name, step=latest.step, reason=reason, set_aside_as=aside, dropped_from_ray=name in dropped
    )


def drop_from_ray_snapshot(storage: Storage, names: set[str], *run_parts: str) -> set[str]:
    """Rewrite Ray Train's snapshot without the named checkpoints; returns those it listed. A snapshot in a
    shape this does not know is set aside whole (Ray then starts with no history: resolve_start still
    resumes from the newest complete checkpoint, by its marker)."""
    if not storage.exists(*run_parts, RAY_SNAPSHOT):
        return set()
    state = json.loads(storage.read_bytes(*run_parts, RAY_SNAPSHOT))
    listed = names & snapshot_checkpoints(state)
    if not listed:
        return set()
    try:
        kept = snapshot_without(state, listed)
    except ValueError as e:
        set_aside_ray_snapshot(storage, f"cannot take {', '.join(sorted(listed))} out of it: {e}", *run_parts)
        return listed
    storage.write_bytes(json.dumps(kept).encode(), *run_parts, RAY_SNAPSHOT)
    return listed


def snapshot_without(state: Any, names: set[str]) -> dict[str, Any]:
    """Ray Train V2's checkpoint-manager snapshot without the named checkpoints; its latest checkpoint becomes
    the newest one kept. Pure. Read by key (Ray's schema is private): raises ValueError when a key it needs
    is missing or its paired lists differ in length."""

    def name(result: Any) -> str:
        if not isinstance(result, dict) or not isinstance(result.get("checkpoint_dir_name"), str):
            raise ValueError(f"a checkpoint result without a checkpoint_dir_name: {str(result)[:80]}")
        return result["checkpoint_dir_name"]

    if not isinstance(state, dict) or "checkpoint_results" not in state or "latest_checkpoint_result" not in state:
        raise ValueError("no checkpoint_results or latest_checkpoint_result")
    out = dict(state)
    pairs = {"checkpoint_results": "checkpoint_report_indices", "pending_training_results": "pending_validation_specs"}
    for results, partner in pairs.items():
        listed, other = state.get(results, []), state.get(partner, [])
        if len(listed) != len(other):
            raise ValueError(f"{results} has {len(listed)} entries, {partner} {len(other)}")
        kept = [(r, o) for r, o in zip(listed, other) if name(r) not in names]
        if results in state:
            out[results], out[partner] = [r for r, _ in kept], [o for _, o in kept]
    for key, value in state.items():
        if key.endswith("_checkpoint_dir_names") and isinstance(value, list):
            out[key] = [n for n in value if n not in names]
    latest = state["latest_checkpoint_result"]
    if latest is not None and name(latest) in names:
        by_index = sorted(zip(out["checkpoint_report_indices"], range(len(out["checkpoint_results"]))))
        out["latest_checkpoint_result"] = out["checkpoint_results"][by_index[-1][1]] if by_index else None
    return out


def latest_complete_checkpoint(storage: Storage, *run_parts: str, contents: bool = True) -> CheckpointRef | None:
    """The newest checkpoint of a run whose marker and files check out; None when there is none."""
    return find_checkpoints(storage, *run_parts, contents=contents).latest
