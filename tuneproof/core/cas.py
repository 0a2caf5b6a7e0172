"""Compare-and-swap on one small object, on a local (or FSx/NFS) root and on S3 alike.

    data, token = read_versioned(storage, "models", name, "production.json")
    ok = write_if(storage, new_bytes, token, "models", name, "production.json")   # False: it changed

The token is opaque: a content hash on local disk, the ETag on S3; None means "no object". Locally
the compare and the write happen under an O_EXCL lock file beside the object (atomic on local disks,
NFSv3+ and Lustre, unlike flock on some mounts); on S3 they are one conditional request (If-Match:
<ETag>, or If-None-Match: * to create), which S3 and compliant stores reject with 412 when the
object moved. A store that ignores the condition makes every CAS a blind write: training.verify
probes for that (`honours_conditional_writes`) and names such a store as a finding.

A caller that loses (False) re-reads: when the object already says what it meant to write (its own
earlier attempt, whose response was lost), that is success, not a conflict.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path
from typing import TYPE_CHECKING

from tuneproof.core.files import read_regular, read_s3_body
from tuneproof.core.results import now_iso
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
    """Write `data` only if the object's token is still `expected` (None: only if it does not exist)."""
    if storage.is_s3:
        condition = {"IfNoneMatch": "*"} if expected is None else {"IfMatch": expected}
        return _s3_conditional(storage, parts, "put_object", Body=data, **condition)
    with file_lock(_lock_path(storage, parts), lock_timeout_s, stale_lock_s):
        if read_versioned(storage, *parts)[1] != expected:
            return False
        storage.write_bytes(data, *parts)  # temp file + os.replace: readers see old or new
        return True


def delete_if(
    storage: Storage, expected: str, *parts: str, lock_timeout_s: float = 30.0, stale_lock_s: float = 60.0
) -> bool:
    """Delete the object only if its token is still `expected`."""
    if storage.is_s3:
        return _s3_conditional(storage, parts, "delete_object", IfMatch=expected)
    with file_lock(_lock_path(storage, parts), lock_timeout_s, stale_lock_s):
        if read_versioned(storage, *parts)[1] != expected:
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


def _lock_path(storage: Storage, parts: tuple[str, ...]) -> Path:
    target = Path(storage.path(*parts))
    return target.with_name(f".{target.name}.lock")


@contextmanager
def file_lock(path: Path, timeout_s: float, stale_s: float) -> Iterator[None]:
    """Hold `path` (created with O_EXCL) for the block; a lock older than stale_s is a crashed holder's.

    The block must be short (milliseconds): breaking a lock is only safe because no live holder
    keeps one for anywhere near stale_s.
    """
    nonce = uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    path.parent.mkdir(parents=True, exist_ok=True)
    while not _try_create(path, nonce):
        _break_if_stale(path, stale_s)
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"lock {path} still held after {timeout_s}s by {_holder(path)}; "
                f"it is broken automatically once {stale_s}s old"
            )
        time.sleep(0.02)
    try:
        yield
    finally:
        if _holder(path).get("nonce") == nonce:
            path.unlink(missing_ok=True)


def _try_create(path: Path, nonce: str) -> bool:
    try:
        fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "w") as f:
        json.dump({"nonce": nonce, "pid": os.getpid(), "host": socket.gethostname(), "at": now_iso()}, f)
    return True


def _break_if_stale(path: Path, stale_s: float) -> None:
    try:
        seen = path.stat()
    except FileNotFoundError:
        return
    if time.time() - seen.st_mtime < stale_s:
        return
    grave = path.with_name(f"{path.name}.stale-{uuid.uuid4().hex}")
    try:
        os.rename(path, grave)  # atomic: of several processes breaking the same lock, one moves it
    except FileNotFoundError:
        return
    if grave.stat().st_ino != seen.st_ino:
        # Between our stat and rename another process broke the stale lock and a new holder took a
        # fresh one, which we just moved: give it back (link fails only if yet another holder exists).
        with suppress(FileExistsError):
            os.link(grave, path)
    grave.unlink(missing_ok=True)


def _holder(path: Path) -> dict:
    try:
        return json.loads(path.read_text() or "{}")
    except (FileNotFoundError, json.JSONDecodeError):
        return {}


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
