"""Compare-and-swap on one small object, on a local (or FSx/NFS) root and on S3 alike.

    data, token = read_versioned(storage, "models", name, "production.json")
    ok = write_if(storage, new_bytes, token, "models", name, "production.json")   # False: it changed

The token is opaque: a content hash on local disk, the ETag on S3; None means "no object". Locally
the compare and the write happen under an O_EXCL lock file beside the object (atomic on local disks,
NFSv3+ and Lustre, unlike flock on some mounts), which the writer checks is still its own right before
it replaces the object; on S3 they are one conditional request (If-Match: <ETag>, or If-None-Match: *
to create), which S3 and compliant stores reject with 412 when the object moved. A store that ignores the condition makes every CAS a blind write: training.verify
probes for that (`honours_conditional_writes`) and names such a store as a finding.

A caller that loses (False) re-reads: when the object already says what it meant to write (its own
earlier attempt, whose response was lost), that is success, not a conflict.
"""

from __future__ import annotations

import hashlib
import os
import socket
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from pydantic import ValidationError

from tuneproof.core.files import read_regular, read_s3_body
from tuneproof.core.procs import pid_alive, pid_space
from tuneproof.core.results import Model, now_iso
from tuneproof.core.storage import Storage, boto_config

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MAX_OBJECT_BYTES = 1 << 20
"""The largest object compare-and-swap reads: a pointer or a hold is a few hundred bytes; a bigger one (or a FIFO
in its place) is refused by name (tuneproof.core.files.FileRefused) instead of read until memory runs out."""

_CONFLICT_CODES = ("PreconditionFailed", "ConditionalRequestConflict", "NoSuchKey", "412", "409")
"""412: the condition failed; 409: a concurrent conditional write won; NoSuchKey: If-Match on a deleted key."""


def content_token(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def read_versioned(storage: Storage, *parts: str) -> tuple[bytes | None, str | None]:
    """(bytes, token) of the object, or (None, None) when there is none; FileRefused when it is not a regular file
    or holds more than MAX_OBJECT_BYTES."""
    if storage.is_s3:
        return _s3_read(storage, parts)
    try:
        data = read_regular(storage.path(*parts), MAX_OBJECT_BYTES)
    except FileNotFoundError:
        return None, None
    return data, content_token(data)


def write_if(
    storage: Storage,
    data: bytes,
    expected: str | None,
    *parts: str,
    lock_timeout_s: float = 30.0,
    stale_lock_s: float = 60.0,
) -> bool:
    """Write `data` only if the object's token is still `expected` (None: only if it does not exist).

    False when it was not, or when this writer's lock was broken under it (it stalled past stale_lock_s and
    another writer may have gone first): either way nothing was written, and the caller reads again."""
    if storage.is_s3:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        return _s3_conditional(storage, parts, "put_object", Body=data, **condition)
    target = Path(storage.path(*parts))
    with file_lock(_lock_path(storage, parts), lock_timeout_s, stale_lock_s) as lock:
        if read_versioned(storage, *parts)[1] != expected:
            return False
        staged = _stage(data, target)
        if not lock.held():
            staged.unlink()
            return False
        os.replace(staged, target)  # readers see old or new
        return True


def delete_if(
    storage: Storage, expected: str, *parts: str, lock_timeout_s: float = 30.0, stale_lock_s: float = 60.0
) -> bool:
    """Delete the object only if its token is still `expected`; False (nothing deleted) as write_if's."""
    if storage.is_s3:
        return _s3_conditional(storage, parts, "delete_object", IfMatch=expected)
    with file_lock(_lock_path(storage, parts), lock_timeout_s, stale_lock_s) as lock:
        if read_versioned(storage, *parts)[1] != expected or not lock.held():
            return False
        Path(storage.path(*parts)).unlink()
        return True


def honours_conditional_writes(storage: Storage, *parts: str) -> str | None:
    """Probe the store with a throwaway object: None when it honours conditions, else what it got wrong.

    Creates the object, then tries a write with a stale token and a second create: both must be
    refused; then a write with the current token must pass. The object is removed afterwards.
    """
    try:
        if not write_if(storage, b"probe v1", None, *parts):
            return "creating a new object with If-None-Match: * was refused"
        _, first = read_versioned(storage, *parts)
        if write_if(storage, b"probe create again", None, *parts):
            return "a second If-None-Match: * create over an existing object was accepted"
        if not write_if(storage, b"probe v2", first, *parts):
            return "a write with the current token was refused"
        if write_if(storage, b"probe stale", first, *parts):
            return "a write with a stale token (If-Match on an old ETag) was accepted"
        return None
    finally:
        storage.remove(*parts)


# ---- local: an O_EXCL lock file ---------------------------------------------------------------


class LockHolder(Model):
    """What a lock file records about the process that holds it."""

    nonce: str
    pid: int
    host: str
    pid_space: str = ""
    """tuneproof.core.procs.pid_space() of the holder: its pid can be checked only from the same space."""
    at: str


class HeldLock:
    """The lock a writer took; `held()` is asked right before the change it guards."""

    def __init__(self, path: Path, nonce: str):
        self.path = path
        self.nonce = nonce

    def held(self) -> bool:
        """False once the lock was broken under us (we were presumed dead, or the file was removed): then another
        writer may have changed the object since our compare, and writing now would undo its write."""
        lock = _read_lock(self.path)
        return lock is not None and lock.holder is not None and lock.holder.nonce == self.nonce


def _stage(data: bytes, target: Path) -> Path:
    """`data` in a temp file beside `target`, ready for os.replace. A slow write (hung NFS) happens here, before
    the lock is checked, not between the check and the replace."""
    fd, staged = tempfile.mkstemp(dir=target.parent, prefix=".tmp-")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return Path(staged)


def _lock_path(storage: Storage, parts: tuple[str, ...]) -> Path:
    target = Path(storage.path(*parts))
    return target.with_name(f".{target.name}.lock")


@contextmanager
def file_lock(path: Path, timeout_s: float, stale_s: float) -> Iterator[HeldLock]:
    """Hold `path` (created with O_EXCL) for the block; TimeoutError after timeout_s naming the holder.

    A lock left by a process of this host (same boot and pid namespace) that is gone is broken at once; one whose holder still runs is
    never broken, however old (a paused process resumes). A lock from another host is broken once stale_s
    old, as its pid cannot be checked from here: a holder that stalled that long (VM pause, hung NFS)
    finds on resuming that `held()` is False and must change nothing.
    """
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    path.parent.mkdir(parents=True, exist_ok=True)
    while not _try_create(path, nonce):
        _break_if_stale(path, stale_s)
        if time.monotonic() > deadline:
            raise TimeoutError(f"lock {path} still held after {timeout_s}s {_holding(path, stale_s)}")
        time.sleep(0.02)
    lock = HeldLock(path, nonce)
    try:
        yield lock
    finally:
        if lock.held():
            path.unlink(missing_ok=True)


def _try_create(path: Path, nonce: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    holder = LockHolder(nonce=nonce, pid=os.getpid(), host=socket.gethostname(), pid_space=pid_space(), at=now_iso())
    with os.fdopen(fd, "w") as f:
        f.write(holder.model_dump_json())
    return True


def _break_if_stale(path: Path, stale_s: float) -> None:
    lock = _read_lock(path)
    if lock is None or not _breakable(lock.holder, time.time() - lock.seen.st_mtime, stale_s):
        return
    grave = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, grave)  # atomic: of several processes breaking the same lock, one moves it
    except FileNotFoundError:
        return
    if grave.stat().st_ino != lock.seen.st_ino:
        # Between our read and rename another process broke the stale lock and a new holder took a
        # fresh one, which we just moved: give it back (link fails only if yet another holder exists,
        # and then the one we moved finds held() False and writes nothing).
        with suppress(FileExistsError):
            os.link(grave, path)
    grave.unlink(missing_ok=True)


def _breakable(holder: LockHolder | None, age_s: float, stale_s: float) -> bool:
    if holder is not None and holder.pid_space == pid_space():
        return not pid_alive(holder.pid)
    # Another host's (or an unreadable, maybe half-written) lock: age is all there is to go on.
    return age_s >= stale_s


class _LockFile(NamedTuple):
    raw: bytes
    holder: LockHolder | None
    """None when the record is unreadable (another version's, or half-written)."""
    seen: os.stat_result
    """The stat of the very file read (not of one that replaced it since)."""


def _read_lock(path: Path) -> _LockFile | None:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    with os.fdopen(fd, "rb") as f:
        seen = os.fstat(fd)
        raw = f.read(4096)
    try:
        return _LockFile(raw, LockHolder.model_validate_json(raw), seen)
    except ValidationError:
        return _LockFile(raw, None, seen)


def _holding(path: Path, stale_s: float) -> str:
    lock = _read_lock(path)
    if lock is None:
        return "(it was just released)"
    recorded = lock.raw.decode(errors="replace")
    if lock.holder is None or lock.holder.pid_space != pid_space():
        return f"by {recorded}, not a process this machine can check; it is broken once {stale_s}s old"
    return (
        f"by {recorded}: pid {lock.holder.pid} still runs (it may be paused or hung); stop it, or remove {path} "
        "if that pid is no longer a tuneproof writer"
    )


# ---- S3: conditional requests -----------------------------------------------------------------


def _s3_client(storage: Storage) -> S3Client:
    import boto3

    return boto3.client("s3", endpoint_url=storage.endpoint_url, config=boto_config())


def _s3_location(storage: Storage, parts: tuple[str, ...]) -> tuple[str, str]:
    bucket, _, key = storage.path(*parts).partition("/")
    return bucket, key


def _s3_read(storage: Storage, parts: tuple[str, ...]) -> tuple[bytes | None, str | None]:
    from botocore.exceptions import ClientError

    bucket, key = _s3_location(storage, parts)
    try:
        obj = _s3_client(storage).get_object(Bucket=bucket, Key=key)
    except ClientError as e:
        if e.response["Error"]["Code"] in ("NoSuchKey", "404"):
            return None, None
        raise
    # Body and ETag come from one response, so the token is the one of the bytes returned.
    return read_s3_body(obj, MAX_OBJECT_BYTES, storage.uri(*parts)), obj["ETag"]


def _s3_conditional(storage: Storage, parts: tuple[str, ...], operation: str, **kwargs: str | bytes) -> bool:
    from botocore.exceptions import ClientError

    bucket, key = _s3_location(storage, parts)
    try:
        getattr(_s3_client(storage), operation)(Bucket=bucket, Key=key, **kwargs)
    except ClientError as e:
        if e.response["Error"]["Code"] in _CONFLICT_CODES:
            return False
        raise
    return True
