"""Training checkpoints: DCP shards, per-rank progress and RNG state, saved and loaded (collective).

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
(save/load), on local disk or S3 alike.

The marker and which checkpoints count (listing, validation, Ray Train's snapshot, used by the stage
driver too) are training/checkpoint_listing.py; the final Hugging Face export, with its manifest and the
same kind of marker written last, is training/hf_export.py.
"""

from __future__ import annotations

import base64
import dataclasses
import errno
import hashlib
import json
import os
import pickle
import random
import re
import shutil
import tempfile
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneproof.core import markers
from tuneproof.core.markers import Digests
from tuneproof.core.storage import Storage

if TYPE_CHECKING:  # torch loads inside workers only
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions

MARKER = markers.COMPLETION_MARKER
METADATA = ".metadata"  # DCP's index of every rank's shards, written by the coordinator (rank 0) last
WRITER_THREADS = 2
"""Files each rank writes and hashes at once (DCP's thread_count): its background save on two cores."""
_DIR_PATTERN = re.compile(r"^checkpoint_(\d+)$")


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
    identity: dict[str, Any] | None = None
    """The settings a run resuming from it must share (training.finetune_state.run_identity); None in
    checkpoints written before it was recorded."""

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


def _byte_tensor(encoded: str) -> torch.Tensor:
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


def shard_writer(local_dir: str | Path, buffers: StagingBuffers | None = None) -> Any:
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

        def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
            return super().stage(state_dict) if buffers is None else buffers.copy_of(state_dict)

        def write_data(self, plan: Any, planner: Any) -> Any:
            future = super().write_data(plan, planner)  # FileSystemWriter has written when it returns
            self.written += sorted({r.storage_data.relative_path for r in future.value()})
            return future

        def finish(self, metadata: Any, results: Any) -> None:
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
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    progress: TrainingProgress,
    storage: Storage,
    parts: Sequence[str],
    process_group: Any,
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


def written_on_every_rank(saving: ShardsInFlight, device: torch.device | str = "cpu") -> bool:
    """Whether every rank's background write, hashes (and upload) of this save are done, without waiting
    for any: one number all-reduced (MIN) on the default group, so every rank gets the same answer and
    completes the save at the same step. Collective: every rank calls it while the save is in flight."""
    import torch
    import torch.distributed as dist

    done = torch.tensor([int(saving.digests.done())], device=device)
    dist.all_reduce(done, op=dist.ReduceOp.MIN)
    return bool(done.item())


def finish_saving_shards(saving: ShardsInFlight) -> Digests:
    """Wait for the background write and hashes (re-raising their error); returns this rank's files
    with size and sha256."""
    return saving.digests.result()


def _checkpoint_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, trainable_only: bool) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer, options=_state_options(trainable_only))
    if trainable_only:
        model_sd = without_frozen(model, model_sd)
    return {"model": model_sd, "optim": optim_sd}


class ChangedCheckpoint(RuntimeError):
    """A checkpoint file read while loading differs from what its completion marker lists."""


@dataclass(frozen=True)
class Loaded:
    """What load_shards restored, and every file this rank read for it (name -> bytes read, each once)."""

    progress: TrainingProgress
    read: dict[str, int]


def load_shards(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    checkpoint: Storage,
    rank: int,
    trainable_only: bool = False,
) -> Loaded:
    """DCP-load model + optimizer (resharding if the world size changed) and this rank's progress, straight
    from the checkpoint's storage (local or S3), every byte it uses checked against the completion marker
    (verifying_reader); ChangedCheckpoint names a file that differs, on every rank.

    A rank the checkpoint did not have (a larger world size) takes rank 0's progress; its RNG
    state then comes from rank 0, which the caller logs. With trainable_only the frozen parameters
    keep the values they were loaded with; dcp.load still fails on any trained one the checkpoint lacks.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    reader = verifying_reader(checkpoint, markers.parse_digests(checkpoint.read_json(MARKER)))
    state = _checkpoint_state(model, optimizer, trainable_only)
    try:
        dcp.load(state, storage_reader=reader)  # fills both dicts in place
    except CheckpointException as e:
        changed = [str(exc) for exc, _ in e.failures.values() if isinstance(exc, ChangedCheckpoint)]
        if changed:  # raised on the rank that verified the file; every rank fails with its words
            raise ChangedCheckpoint(changed[0]) from None
        raise
    set_state_dict(
        model,
        optimizer,
        model_state_dict=state["model"],
        optim_state_dict=state["optim"],
        options=_state_options(trainable_only),
    )
    own = progress_file(rank) if progress_file(rank) in reader.digests else progress_file(0)
    progress = TrainingProgress(**json.loads(reader.verified_bytes(own)))
    return Loaded(progress, dict(reader.read))


class _HashedRead:
    """One file read once from its start to its end, every byte hashed, whatever parts of it are used.

    The hash of each piece runs on a thread while the caller deserializes it (hashlib lets go of the GIL),
    one piece at a time, so hashing adds little to the load's time on a second core and holds no more
    than one piece beyond the caller's."""

    def __init__(self, f: Any) -> None:
        self.f, self.position, self.digest = f, 0, hashlib.sha256()
        self.hasher = ThreadPoolExecutor(1, thread_name_prefix="tuneproof-hash")
        self.pending: Future[None] | None = None

    def read(self, n: int) -> bytes:
        data = self.f.read(n)
        if self.pending is not None:
            self.pending.result()
        self.pending = self.hasher.submit(self.digest.update, data)
        self.position += len(data)
        return data

    def skip_to(self, offset: int) -> None:
        while self.position < offset and self.read(min(offset - self.position, markers.READ_CHUNK)):
            pass

    def finish(self) -> markers.FileDigest:
        while self.read(markers.READ_CHUNK):
            pass
        self.hasher.shutdown(wait=True)
        return markers.FileDigest(size=self.position, sha256=self.digest.hexdigest())


def verifying_reader(checkpoint: Storage, digests: Digests) -> Any:
    """DCP's FileSystemReader over a Storage, checking every byte a load uses against the marker's sha256
    with each file read once (the class is made on first use: torch loads inside workers only).

    A file's hash covers the whole file, so one rank verifies each file: the one that needs most of its
    bytes, chosen by the coordinator over every rank's load plan. That rank reads the file once, start to
    end, hashing as it goes and serving its ranges on the way (stock FileSystemReader seeks to each range,
    so it could not check a hash); a mismatch raises ChangedCheckpoint inside DCP's read, which fails the
    load on every rank. The other ranks read only the ranges they need from it (the small replicated
    values, like each optimizer step count, that DCP spreads over every rank's files). With an unchanged
    world size each rank thus verifies exactly its own files; .metadata and its progress file every rank
    reads and verifies itself."""
    import io

    import torch
    from torch.distributed._shard._utils import narrow_tensor_by_index
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import LoadItemType

    class Reader(FileSystemReader):
        def __init__(self) -> None:
            super().__init__(checkpoint.root)
            self.digests = digests
            self.read: dict[str, int] = {}

        def verified_bytes(self, name: str) -> bytes:
            data = checkpoint.read_bytes(name)
            self.check(name, markers.FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest()))
            return data

        def check(self, name: str, seen: markers.FileDigest) -> None:
            self.read[name] = self.read.get(name, 0) + seen.size
            want = self.digests.get(name)
            if want is None:
                problems = [f"{name} (not listed in {MARKER})"]
            else:
                problems = markers.digest_problems({name: want}, {name: seen})
            if problems:
                raise ChangedCheckpoint(f"{checkpoint.uri()}: {'; '.join(problems)}, per its {MARKER}")

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = pickle.loads(self.verified_bytes(METADATA))
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

        def prepare_global_plan(self, plans: list[Any]) -> list[Any]:
            """Each file is verified by the rank whose plan needs most of its bytes (ties: the lowest rank)."""
            needs: dict[str, dict[int, int]] = {}
            for i, plan in enumerate(plans):
                for name, ranges in self.ranges_by_file(plan.items).items():
                    needs.setdefault(name, {})[i] = sum(length for _, length in ranges)
            verifier = {name: max(sorted(by_rank), key=lambda i: by_rank[i]) for name, by_rank in needs.items()}
            return [
                dataclasses.replace(plan, storage_data=sorted(n for n, r in verifier.items() if r == i))
                for i, plan in enumerate(plans)
            ]

        def ranges_by_file(self, items: list[Any]) -> dict[str, dict[tuple[int, int], list[Any]]]:
            """file -> (offset, length) -> the read items served from that range (several when resharding)."""
            out: dict[str, dict[tuple[int, int], list[Any]]] = {}
            for item in items:
                info = self.storage_data[item.storage_index]
                out.setdefault(info.relative_path, {}).setdefault((info.offset, info.length), []).append(item)
            return out

        def read_data(self, plan: Any, planner: Any) -> Any:
            # WRITER_THREADS files at a time, as they were written: hashing is the load's largest CPU cost
            with ThreadPoolExecutor(WRITER_THREADS, thread_name_prefix="tuneproof-load") as files:
                reads = [
                    files.submit(self.read_file, name, ranges, name in plan.storage_data, planner)
                    for name, ranges in sorted(self.ranges_by_file(plan.items).items())
                ]
                for read in reads:
                    read.result()  # re-raises a file's failure, ChangedCheckpoint included
            done: torch.futures.Future[None] = torch.futures.Future()
            done.set_result(None)
            return done

        def read_file(self, name: str, ranges: dict[tuple[int, int], list[Any]], verify: bool, planner: Any) -> None:
            """The ranges of one file: the whole file read once and hashed when this rank verifies it, else
            only those ranges."""
            path = checkpoint.path(name)
            if not verify:
                for (offset, length), sharing in sorted(ranges.items()):
                    self.load(checkpoint.fs.cat_file(path, start=offset, end=offset + length), sharing, planner)
                    self.read[name] = self.read.get(name, 0) + length
                return
            with checkpoint.fs.open(path, "rb") as f:
                stream = _HashedRead(f)
                try:
                    for (offset, length), sharing in sorted(ranges.items()):
                        stream.skip_to(offset)
                        self.load(stream.read(length), sharing, planner)
                except Exception:
                    self.check(name, stream.finish())  # a torn range fails before the hash is done
                    raise
                self.check(name, stream.finish())

        def load(self, data: bytes, items: list[Any], planner: Any) -> None:
            for item in items:
                if item.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(item, io.BytesIO(data))
                    continue
                tensor = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
                tensor = narrow_tensor_by_index(tensor, item.storage_offsets, item.lengths)
                target = planner.resolve_tensor(item).detach()
                if target.size() != tensor.size():
                    raise ValueError(f"{item.storage_index}: stored size {tensor.size()}, expected {target.size()}")
                target.copy_(tensor)
                planner.commit_tensor(item, target)

    return Reader()


def _state_options(trainable_only: bool) -> StateDictOptions:
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    # strict=False only so the frozen keys may be absent from what is set back.
    return StateDictOptions(ignore_frozen_params=trainable_only, strict=not trainable_only)


def without_frozen(model: torch.nn.Module, state: dict) -> dict:
    """`state` without any frozen parameter. StateDictOptions(ignore_frozen_params) misses the second name
    of a tied weight (lm_head.weight, tied to the frozen embedding), which would save the whole embedding."""
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    return {key: value for key, value in state.items() if key not in frozen}
