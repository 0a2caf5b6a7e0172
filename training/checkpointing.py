"""Training checkpoints (DCP shards, per-rank progress, completion marker) and the final HF export.

One checkpoint directory (runs/<run>/train/<run_name>/checkpoint_<step:06d>/) holds:

    .metadata, __<rank>_<i>.distcp torch.distributed.checkpoint (DCP) shards; every rank writes its own
                                   (WRITER_THREADS files, written and hashed at once)
    progress-rank<r>.json          TrainingProgress of rank r: step, data position, seed, RNG, schedule
    tuneproof_complete.json        the completion marker, written LAST: every file above with its size and sha256

Every rank writes its own files straight into the checkpoint's storage directory: on local or shared
POSIX storage (a laptop, FSx) DCP writes there itself; on S3 it writes a local staging copy that the
same background thread uploads, WRITER_THREADS files at once. On local storage each file is fsynced
(beside its hashing) before the marker can be written, so a marker never vouches for bytes that a host
failure could still take back. Ray Train is then told about the directory without copying
it (CheckpointUploadMode.NO_UPLOAD), and rank 0 writes the marker only after every rank's files are stored.
A checkpoint counts only when the marker exists and every file it lists is there with its size and
sha256, so a checkpoint cut short by an interruption, or a shard changed since, is never resumed from. Used inside Ray Train workers
(save/load) and by the stage driver (listing, validation), on local disk or S3 alike.

The export is the consolidated model as a Hugging Face directory (safetensors, config, the base's
tokenizer and generation config), with its manifest (tuneproof-export.json: every file's sha256, one
content hash over them, the run, invocation and Ray Train run that produced it) and the same kind
of marker written last.
"""

from __future__ import annotations

import base64
import contextlib
import errno
import json
import os
import random
import re
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from tuneproof.core import markers
from tuneproof.core.markers import Digests, ExportManifest
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef
from tuneproof.core.summaries_training import SkippedCheckpoint

__all__ = ["CheckpointRef"]  # re-exported: workers and tests name checkpoints through this module

MARKER = markers.COMPLETION_MARKER
METADATA = ".metadata"  # DCP's index of every rank's shards, written by the coordinator (rank 0) last
WRITER_THREADS = 2
"""Files each rank writes and hashes at once (DCP's thread_count): its background save on two cores."""
_DIR_PATTERN = re.compile(r"^checkpoint_(\d+)$")
# Files of a base model directory that the export carries over unchanged (all but weights and config).
_BASE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|chat_template\.(jinja|json)|.*\.model|.*\.tiktoken|generation_config\.json)$"
)


def checkpoint_dir_name(step: int) -> str:
    return f"checkpoint_{step:06d}"


def step_of(dir_name: str) -> int | None:
    """The step a checkpoint directory name encodes; None for anything else."""
    match = _DIR_PATTERN.match(dir_name)
    return int(match.group(1)) if match else None


@dataclass
class TrainingProgress:
    """Where training stood when a checkpoint was taken, for one rank."""

    step: int
    """Optimizer steps completed; training resumes at step + 1."""
    epoch: int
    """Epoch of the next batch."""
    batch_in_epoch: int
    """Index of the next batch within that epoch's seeded permutation."""
    seed: int
    rank: int
    world_size: int
    schedule: dict[str, Any]
    """Parameters of the LR schedule (it is a pure function of the step, so that is its whole state)."""
    rng: dict[str, Any]
    """RNG states of torch (CPU and CUDA), python and numpy on this rank."""
    ledger: str | None = None
    """The data-order ledger after `step` (training.train_data.fold_ledger): a running sha256 of every step's
    sample ids. The same on every rank; None in checkpoints written before the ledger existed."""

    def file_name(self) -> str:
        return progress_file(self.rank)


def progress_file(rank: int) -> str:
    return f"progress-rank{rank}.json"


# ---- RNG state (JSON-able, so progress files stay readable) ----


def capture_rng() -> dict[str, Any]:
    import numpy as np
    import torch

    state: dict[str, Any] = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": _jsonable(random.getstate()),
        "numpy": _jsonable(np.random.get_state()),
    }
    if torch.cuda.is_available():
        state["cuda"] = base64.b64encode(torch.cuda.get_rng_state().numpy().tobytes()).decode()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    import numpy as np
    import torch

    torch.set_rng_state(_byte_tensor(state["torch"]))
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    kind, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(_byte_tensor(state["cuda"]))


def seed_everything(seed: int) -> None:
    """Seed torch, python and numpy for a fresh start (a resumed run restores their states instead)."""
    import numpy as np
    import torch

    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def _byte_tensor(encoded: str):
    import torch

    return torch.frombuffer(bytearray(base64.b64decode(encoded)), dtype=torch.uint8)


def _jsonable(value: Any) -> Any:
    if isinstance(value, (tuple, list)):
        return [_jsonable(v) for v in value]
    if hasattr(value, "tolist"):
        return value.tolist()
    return value


# ---- save / load (collective: every rank calls these) ----


class StagingBuffers:
    """The CPU memory an asynchronous save copies the state into, kept from one save to the next.

    Allocating it afresh for every save costs page faults on every byte (about 60 % of the copy on the
    2-core machine), and the copy runs in the training thread. One per model and optimizer; only one
    save may use it at a time (the fine-tune completes each save before it starts the next)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def copy_of(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """state_dict's tensors copied into the kept buffers (new ones when its layout changed); the other
        values (learning rates, steps as numbers) are taken as they are now."""
        import torch
        from torch.distributed._state_dict_utils import CompanionMismatch, _copy_state_dict, _create_cpu_state_dict

        if self.state is not None:
            try:
                return _copy_state_dict(state_dict, self.state)
            except CompanionMismatch:
                self.state = None  # another layout (a changed optimizer state): allocate again below
        self.state = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
        return _copy_state_dict(state_dict, self.state)


def shard_writer(local_dir: str | Path, buffers: StagingBuffers | None = None):
    """DCP's FileSystemWriter for one rank's shards, the files it wrote named (`.written`: this rank's shard
    files, and .metadata on the coordinator), so a rank writing into a directory the other ranks share
    hashes only its own.

    DCP's own fsync (sync_files) is off: the caller makes the files durable with digest_files, which
    fsyncs each one while it hashes it rather than after.
    """
    from torch.distributed.checkpoint import FileSystemWriter

    class ShardWriter(FileSystemWriter):
        def __init__(self) -> None:
            super().__init__(str(local_dir), sync_files=False, thread_count=WRITER_THREADS)
            self.written: list[str] = []

        def stage(self, state_dict):
            return super().stage(state_dict) if buffers is None else buffers.copy_of(state_dict)

        def write_data(self, plan, planner):
            future = super().write_data(plan, planner)  # FileSystemWriter has written when it returns
            self.written += sorted({r.storage_data.relative_path for r in future.value()})
            return future

        def finish(self, metadata, results) -> None:
            super().finish(metadata, results)
            self.written.append(METADATA)

    return ShardWriter()


@dataclass
class ShardsInFlight:
    """A DCP save that `start_saving_shards` began: its files count only after `finish_saving_shards`."""

    progress: TrainingProgress
    """Taken when the save began; written beside the shards once they are."""
    uri: str
    """The checkpoint directory in storage."""
    digests: Future[Digests]
    """This rank's files with size and sha256, once the background thread has stored and hashed them."""

    @property
    def step(self) -> int:
        return self.progress.step


def start_saving_shards(
    model,
    optimizer,
    progress: TrainingProgress,
    storage: Storage,
    parts: Sequence[str],
    process_group,
    trainable_only: bool = False,
    buffers: StagingBuffers | None = None,
) -> ShardsInFlight:
    """Begin an asynchronous DCP save of this rank's shards into the storage directory at `parts`: the
    state is copied to CPU memory now (training may change the weights as soon as this returns); a
    background thread writes it (straight into the directory on local storage; on S3 into a staging
    directory, then uploaded), adds the progress file and hashes this rank's files, so the training loop
    waits for none of it. Collective.

    A marker already in the directory (a step saved before and being saved again) is removed first, by
    rank 0 before it joins DCP's planning collective, so no rank writes a file while an old marker still
    vouches for the directory. process_group must be a gloo group of its own: the background thread's
    collectives would otherwise interleave with the training loop's on the default group. Nothing here is
    complete until finish_saving_shards has waited. buffers: the CPU memory to copy into, kept from the
    previous save (None: allocated for this save).
    """
    import torch.distributed.checkpoint as dcp

    if progress.rank == 0:
        storage.remove(*parts, MARKER)
    write_dir = Path(tempfile.mkdtemp(prefix="tuneproof-save-")) if storage.is_s3 else Path(storage.path(*parts))
    write_dir.mkdir(parents=True, exist_ok=True)
    writer = shard_writer(write_dir, buffers)
    state = _checkpoint_state(model, optimizer, trainable_only)
    # The copy to CPU memory happens here, in the caller; the write runs in DCP's thread.
    response = dcp.async_save(state, storage_writer=writer, process_group=process_group)
    # The default stager copies synchronously and returns the write's Future; a staging stager returns both.
    written = response if isinstance(response, Future) else response.upload_completion
    digests: Future[Digests] = Future()

    def store_when_written(done: Future) -> None:
        """Runs in DCP's writer thread once the write ends (or failed): progress file, every file's sha256,
        then (S3) the upload of each file."""
        try:
            done.result()
            Path(write_dir, progress.file_name()).write_text(json.dumps(asdict(progress), indent=1))
            # sha256 of every file and, where the directory is the storage, the fsync beside it
            files = digest_files(write_dir, [*writer.written, progress.file_name()], durable=not storage.is_s3)
            if storage.is_s3:
                with ThreadPoolExecutor(WRITER_THREADS) as uploads:
                    list(uploads.map(lambda name: storage.put_file(write_dir / name, *parts, name), files))
        except BaseException as e:  # handed to finish_saving_shards, which re-raises it in the training loop
            failed: BaseException | None = e
        else:
            failed = None
        if storage.is_s3:  # before the result is handed over: a finished save leaves no staging copy
            shutil.rmtree(write_dir, ignore_errors=True)
        if failed is None:
            digests.set_result(files)
        else:
            digests.set_exception(failed)

    written.add_done_callback(store_when_written)
    return ShardsInFlight(progress, storage.uri(*parts), digests)


def digest_files(directory: Path | str, names: Sequence[str], durable: bool) -> Digests:
    """Size and sha256 of the named files, WRITER_THREADS at a time; durable: each also fsynced (and the
    directory, for their entries), so the completion marker written after this never vouches for bytes
    still only in the page cache, and a host that dies just after a checkpoint keeps it.

    The fsyncs run beside the hashing, not after it: the disk writes what the page cache holds while
    the CPUs hash the same pages, so the two cost about the longer of them. Off for a staging directory
    (the S3 path), whose durable copy is the upload. A torn file still fails the marker's size and
    sha256 check and is never resumed from.
    """
    directory = Path(directory)
    if not durable:
        return markers.local_digests(directory, names, threads=WRITER_THREADS)
    with ThreadPoolExecutor(max(1, len(names))) as syncs:
        synced = [syncs.submit(fsync_path, directory / name) for name in names]
        files = markers.local_digests(directory, names, threads=WRITER_THREADS)
        for done in synced:
            done.result()
    fsync_path(directory)
    return files


def fsync_path(path: Path) -> None:
    """fsync one file or directory (its data and metadata reach the disk before this returns).

    A directory on a file system that cannot fsync one (some FUSE and network mounts answer EINVAL) is
    left as it is: its files' own fsyncs, which must succeed, are what the marker relies on."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError as e:
        if not (path.is_dir() and e.errno in (errno.EINVAL, errno.ENOTSUP)):
            raise
    finally:
        os.close(fd)


def finish_saving_shards(saving: ShardsInFlight) -> Digests:
    """Wait for the background write and hashes (re-raising their error); returns this rank's files
    with size and sha256."""
    return saving.digests.result()


def _checkpoint_state(model, optimizer, trainable_only: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(trainable_only))
    if trainable_only:
        model_sd = without_frozen(model, model_sd)
    return {"model": model_sd, "optim": optim_sd}


def load_shards(model, optimizer, local_dir: str | Path, rank: int, trainable_only: bool = False) -> TrainingProgress:
    """DCP-load model + optimizer (resharding if the world size changed) and this rank's progress.

    A rank the checkpoint did not have (a larger world size) takes rank 0's progress; its RNG
    state then comes from rank 0, which the caller logs. With trainable_only the frozen parameters
    keep the values they were loaded with; dcp.load still fails on any trained one the checkpoint lacks.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_state_dict

    state = _checkpoint_state(model, optimizer, trainable_only)
    dcp.load(state, checkpoint_id=str(local_dir))  # fills both dicts in place
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_options(trainable_only),
    )
    own = Path(local_dir, progress_file(rank))
    source = own if own.exists() else Path(local_dir, progress_file(0))
    return TrainingProgress(**json.loads(source.read_text()))


def _state_options(trainable_only: bool):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False only so the frozen keys may be absent from what is set back.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def without_frozen(model, state: dict) -> dict:
    """`state` without any frozen parameter. StateDictOptions(ignore_frozen_params) misses the second name
    of a tied weight (lm_head.weight, tied to the frozen embedding), which would save the whole embedding."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen}


def local_files(local_dir: str | Path) -> dict[str, int]:
    root = Path(local_dir)
    return {p.relative_to(root).as_posix(): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


# ---- completeness (the marker) ----


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


def check_complete(storage: Storage, *parts: str) -> str | None:
    """None when the checkpoint at parts is complete and unchanged; otherwise one line naming what is wrong.

    Sizes are checked first (cheap); then every listed file is read and hashed against the marker's sha256.
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
    if not problems and digests is not None:
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


def find_checkpoints(storage: Storage, *run_parts: str) -> CheckpointsFound:
    """Check the run's checkpoints newest first until one is complete (older ones are not read)."""
    unusable: list[tuple[str, int, str]] = []
    for step, name in list_checkpoints(storage, *run_parts):
        problem = check_complete(storage, *run_parts, name)
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


def latest_complete_checkpoint(storage: Storage, *run_parts: str) -> CheckpointRef | None:
    """The newest checkpoint of a run whose marker and files check out; None when there is none."""
    return find_checkpoints(storage, *run_parts).latest


@contextlib.contextmanager
def local_copy(uri: str, endpoint_url: str | None) -> Iterator[Path]:
    """A local directory with the checkpoint's files: the directory itself on disk, a download from S3."""
    storage = Storage(uri, endpoint_url)
    if not storage.is_s3:
        yield Path(storage.root)
        return
    with tempfile.TemporaryDirectory(prefix="tuneproof-ckpt-") as tmp:
        yield storage.download_dir(os.path.join(tmp, "checkpoint"))


# ---- the Hugging Face export ----


def write_hf_export(
    state: dict,
    step: int,
    model_cfg,
    endpoint_url: str | None,
    storage: Storage,
    path: str,
    made_by: dict[str, Any],
    also: Callable[[Path], None] | None = None,
) -> ExportManifest:
    """Write the full state dict as a Hugging Face model at storage `path`: files, manifest, marker last.

    made_by names the producer for the manifest: run_id, invocation and run_name (the Ray Train run).

    The weights take the base config's dtype (fp32 when it names none); tokenizer and generation
    config come from the base model, so the export loads and generates like the base does.
    `also` writes further files into the export directory (the LoRA adapter) before it is hashed and
    uploaded: the manifest's content hash and the marker cover them.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from training.modeling import load_config, materialize

    config = load_config(model_cfg.source, model_cfg.revision, endpoint_url)
    with torch.device("meta"):  # no random init: every tensor comes from `state`
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    with tempfile.TemporaryDirectory(prefix="tuneproof-export-") as tmp:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        copy_base_files(materialize(model_cfg.source, endpoint_url), model_cfg, endpoint_url, Path(tmp))
        if also is not None:
            also(Path(tmp))
        return publish_export(storage, tmp, path, step, made_by)


def publish_export(
    storage: Storage, local_dir: str | Path, path: str, step: int, made_by: dict[str, Any]
) -> ExportManifest:
    """Upload a finished local export to storage `path`: files, then its manifest, then the marker last."""
    storage.remove(path, MARKER)  # an earlier, superseded export stops counting before any file changes
    storage.remove(path, markers.EXPORT_MANIFEST)
    storage.upload_dir(local_dir, path)
    files = markers.local_digests(local_dir)
    manifest = ExportManifest(
        content_sha256=markers.content_sha256(files),
        files=markers.content_files(files),
        step=step,
        written_at=now_iso(),
        **made_by,
    )
    storage.write_bytes(manifest.model_dump_json(indent=1).encode(), path, markers.EXPORT_MANIFEST)
    listed = {**files, **markers.stored_digests(storage, path, names=[markers.EXPORT_MANIFEST])}
    write_marker(storage, step, listed, path)
    return manifest


def copy_base_files(source_ref: str, model_cfg, endpoint_url: str | None, out_dir: Path) -> None:
    """Tokenizer and generation config of the base: copied from a local directory, re-saved from a hub id."""
    if os.path.isdir(source_ref):
        for file in sorted(Path(source_ref).iterdir()):
            if file.is_file() and _BASE_FILES.match(file.name):
                shutil.copy2(file, out_dir / file.name)
        return
    from training.modeling import load_tokenizer

    load_tokenizer(model_cfg.source, model_cfg.revision, endpoint_url).save_pretrained(out_dir)
