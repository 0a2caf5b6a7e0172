"""One writer per run: a lease on the run id, held by the flow for its whole run.

`runs/<run-id>/lease.json` is created exclusively (local disk: link(2) of a complete file, which fails
like O_CREAT|O_EXCL when the lease exists; S3: a put with
`If-None-Match: *`, which AWS S3 and moto's server both honour), so of two flows that start on the
same run id exactly one gets it; the other (and `tuneproof promote RUN --force`) is refused naming
the holder. A heartbeat thread renews it; renewals, takeovers and the release are conditional too
(S3: `If-Match` on the ETag the holder last wrote; local disk: under an flock on a sidecar file), so
a holder that lost its lease never overwrites its successor's.

The lease fences the record too: its holder calls `fence()` before each write of the run's record
(record.save does). A holder presumed dead (its renewals failed for longer than the ttl) whose run was
taken over gets LeaseLost there, and writes nothing over its successor's record.

A lease is stale when it was not renewed for `ttl_s`, or when its holder ran on this host and its pid
is gone (kill -9, a crash of the machine's session): then the next flow takes it over and says so.

    with Lease(storage, run_id, flow_run_id, command).held(on_takeover=log):
        ...  # the run
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, TypedDict, Unpack

from pydantic import Field, ValidationError, field_validator

from tuneproof.core.files import FileRefused, read_regular, read_s3_body
from tuneproof.core.procs import pid_alive
from tuneproof.core.results import Model, now_iso
from tuneproof.core.storage import Storage, boto_config, split_s3

LEASE = "lease.json"
MAX_LEASE_BYTES = 64 << 10
MAX_PID = 2**22
"""Linux's largest pid_max: a pid beyond it (or below 1, which os.kill reads as a process group) is not one."""
MAX_TTL_S = 7 * 86400.0
DEFAULT_TTL_S = 120.0
"""A holder that has not renewed for this long is presumed dead (the heartbeat renews every ttl/4)."""


class LeaseInfo(Model):
    """Who holds a run: enough to find the process, and to tell a live holder from a dead one."""

    run_id: str
    holder: str
    """The holder's host name."""
    pid: int = Field(ge=1, le=MAX_PID)
    flow_run_id: str | None = None
    command: str
    started: str
    renewed: str
    ttl_s: float = Field(DEFAULT_TTL_S, gt=0, le=MAX_TTL_S, allow_inf_nan=False)
    """A NaN or infinite ttl would never go stale: its run would show `running` forever."""

    @classmethod
    def this_process(cls, run_id: str, command: str, ttl_s: float, flow_run_id: str | None = None) -> LeaseInfo:
        """Held by this host and pid, started and renewed now."""
        now = now_iso()
        return cls(
            run_id=run_id,
            holder=socket.gethostname(),
            pid=os.getpid(),
            flow_run_id=flow_run_id,
            command=command,
            started=now,
            renewed=now,
            ttl_s=ttl_s,
        )

    @field_validator("started", "renewed")
    @classmethod
    def _aware(cls, v: str) -> str:
        """An ISO time with its offset: a naive one cannot be compared with now (UTC)."""
        if datetime.fromisoformat(v).tzinfo is None:
            raise ValueError(f"time {v!r} has no UTC offset")
        return v

    def describe(self) -> str:
        flow = f"flow run {self.flow_run_id}, " if self.flow_run_id else ""
        return f"{self.command!r} ({flow}pid {self.pid} on {self.holder}, since {self.started}, renewed {self.renewed})"


class LeaseHeld(Exception):
    """The run is held by a live writer; nothing was done."""

    def __init__(self, run_id: str, info: LeaseInfo):
        self.info = info
        super().__init__(
            f"run {run_id} is held by {info.describe()}: wait for it to end, or pick another --run-id "
            f"(a dead holder's lease is taken over once it is stale: pid gone on this host, or {info.ttl_s:.0f}s "
            "without renewal)"
        )


class LeaseLost(Exception):
    """Our lease was taken over (we were presumed dead) or deleted under us: the run is no longer ours to write."""


def stale_reason(info: LeaseInfo, now: datetime, host: str, pid_alive: Callable[[int], bool]) -> str | None:
    """Why a lease no longer protects its holder, or None while it does. Pure over its arguments."""
    renewed = datetime.fromisoformat(info.renewed)
    age = (now - renewed).total_seconds()
    if age > info.ttl_s:
        return f"not renewed for {age:.0f}s (ttl {info.ttl_s:.0f}s)"
    if info.holder == host and not pid_alive(info.pid):
        return f"its pid {info.pid} on {host} is gone"
    return None


def read(storage: Storage, run_id: str) -> LeaseInfo | None:
    """The run's lease, or None when there is none (or it is not a lease: then nobody can claim to hold it)."""
    return read_info(_store(storage, run_id))


def stale(storage: Storage, run_id: str) -> tuple[LeaseInfo | None, str | None]:
    """(the lease or None, why it no longer protects its holder or None). No lease counts as 'absent'."""
    store = _store(storage, run_id)
    raw = store.read()
    if raw is None:
        return None, "no lease"
    info = _parse(raw[0])
    if info is None:
        return None, f"{store.where} is not a readable lease"
    return info, stale_reason(info, datetime.now(UTC), socket.gethostname(), pid_alive)


class Lease:
    """The lease of one holder (this process) on one run."""

    def __init__(
        self,
        storage: Storage,
        run_id: str,
        flow_run_id: str | None,
        command: str,
        ttl_s: float = DEFAULT_TTL_S,
    ):
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.store = _store(storage, run_id)
        self.info = LeaseInfo.this_process(run_id, command, ttl_s, flow_run_id)
        self.taken_over: str | None = None
        """When acquiring replaced a stale lease: whose, and why it was stale."""
        self.lost: str | None = None
        """Set (to what happened, and who holds the run now) once a renewal finds the lease no longer ours:
        from then on every renewal and fence raises LeaseLost without asking the store again."""
        self._token: Any = None
        # The heartbeat thread and the flow's fence both renew: one at a time, so neither sends a token the
        # other has just replaced (which would read as a takeover).
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Create the lease, or take over a stale one; LeaseHeld when a live writer holds it."""
        self._token = self.store.create(_body(self.info))
        if self._token is not None:
            return
        raw = self.store.read()
        if raw is None:  # released between our create and our read: try once more
            self._token = self.store.create(_body(self.info))
            if self._token is not None:
                return
            raw = self.store.read()
            if raw is None:
                raise OSError(f"cannot create or read {self.store.where}")
        held, token = raw
        info = _parse(held)
        why = "it is not a readable lease" if info is None else stale_reason(info, _now(), self.info.holder, pid_alive)
        if why is None and info is not None:
            raise LeaseHeld(self.run_id, info)
        self._token = self.store.replace(_body(self.info), token)
        if self._token is None:  # another flow took it over first
            current = read_info(self.store)
            if current is None:
                raise OSError(f"lost a race for {self.store.where} and cannot read the winner's lease")
            raise LeaseHeld(self.run_id, current)
        self.taken_over = f"took over the lease of {info.describe() if info else 'an unreadable lease'}: {why}"

    def renew(self) -> None:
        """Extend the lease by a ttl from now; LeaseLost (and `lost` set) when it is no longer this holder's."""
        with self._renewing:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            renewed = self.info.model_copy(update={"renewed": now_iso()})
            token = self.store.replace(_body(renewed), self._token)
            if token is None:
                self.lost = self._loss()
                raise LeaseLost(self.lost)
            self.info, self._token = renewed, token

    def fence(self) -> None:
        """Before each write of the run's record: LeaseLost, and nothing to write, unless this holder still holds
        the run. The check is a renewal (a conditional write of the lease): it fails when another writer took the
        lease over, and when it succeeds no successor can take over for a whole ttl, so the write that follows
        lands while the lease is ours. A plain read would pass a lease about to go stale."""
        self.renew()

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        if self._token is not None:
            self.store.delete(self._token)
            self._token = None

    @contextlib.contextmanager
    def held(self, on_problem: Callable[[str], None] = print) -> Iterator[Lease]:
        """Acquire, renew on a heartbeat thread, and release whatever happens inside."""
        self.acquire()
        self._thread = threading.Thread(target=self._heartbeat, args=(on_problem,), daemon=True, name="lease")
        self._thread.start()
        try:
            yield self
        finally:
            try:
                self.release()
            except Exception as e:  # noqa: BLE001 - the run's own outcome matters more; a stale lease expires
                on_problem(f"could not release the lease {self.store.where}: {type(e).__name__}: {e}")

    def _heartbeat(self, on_problem: Callable[[str], None]) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost as e:  # `lost` is set: the holder's next fence stops it before it writes
                on_problem(f"{e}; the run's record is no longer this holder's to write")
                return
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried; the ttl leaves room for several
                on_problem(f"could not renew the lease {self.store.where}: {type(e).__name__}: {e}")

    def _loss(self) -> str:
        """What happened to the lease, and who holds the run now, for the LeaseLost a renewal raises."""
        try:
            current = read_info(self.store)
        except OSError as e:
            now = f"who holds it now cannot be read ({type(e).__name__}: {e})"
        else:
            now = f"it is now held by {current.describe()}" if current else "nobody holds it now (released or removed)"
        return (
            f"lost the lease on run {self.run_id} ({self.store.where}): it was taken over or removed after this "
            f"holder's last renewal at {self.info.renewed} (a holder is presumed dead {self.ttl_s:.0f}s after "
            f"its last renewal); {now}"
        )


def _body(info: LeaseInfo) -> bytes:
    return info.model_dump_json(indent=2).encode()


def _now() -> datetime:
    return datetime.now(UTC)


def _parse(raw: bytes) -> LeaseInfo | None:
    try:
        return LeaseInfo.model_validate_json(raw)
    except (ValidationError, ValueError):
        return None


def read_info(store: _LocalStore | _S3Store) -> LeaseInfo | None:
    """The lease a store holds, or None when it holds none or not a readable one."""
    raw = store.read()
    return _parse(raw[0]) if raw else None


def _store(storage: Storage, run_id: str) -> _LocalStore | _S3Store:
    if storage.is_s3:
        return _S3Store(storage, run_id)
    return _LocalStore(Path(storage.path("runs", run_id, LEASE)))


class _LocalStore:
    """Exclusive create with link(2) (EEXIST like O_EXCL, and never a half-written lease); every change
    of an existing lease under an flock on a sidecar file, after checking the lease still holds what its
    writer last saw (its token: the bytes)."""

    def __init__(self, path: Path):
        self.path = path
        self.where = str(path)

    def create(self, body: bytes) -> bytes | None:
        # Written whole under a private name, then linked into place: link(2) fails if the lease exists
        # (exclusive like O_EXCL) and a reader never sees a lease half-written (which it would take for junk).
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{LEASE}.{os.getpid()}.{threading.get_ident()}")
        fd = os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(body)
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return None
        finally:
            tmp.unlink()
        return body

    def read(self) -> tuple[bytes, bytes] | None:
        try:
            body = read_regular(self.path, MAX_LEASE_BYTES)
        except FileNotFoundError:
            return None
        except (IsADirectoryError, FileRefused):  # not a lease (a folder, a FIFO): unreadable bytes, held by nobody
            body = b""
        return body, body

    def replace(self, body: bytes, token: Any) -> bytes | None:
        with self._locked():
            current = self.read()
            if current is None or current[1] != token:
                return None
            tmp = self.path.with_name(f".{LEASE}.{os.getpid()}.{threading.get_ident()}")
            tmp.write_bytes(body)
            os.replace(tmp, self.path)
            return body

    def delete(self, token: Any) -> None:
        with self._locked():
            current = self.read()
            if current is not None and current[1] == token:
                self.path.unlink()

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        lock = self.path.with_name(f".{LEASE}.lock")
        fd = os.open(lock, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)


class _PutCondition(TypedDict, total=False):
    """The one precondition a lease write carries (boto3-stubs types each put_object keyword)."""

    IfNoneMatch: str
    IfMatch: str


class _S3Store:
    """Conditional writes: create with If-None-Match '*', replace and delete with If-Match on the ETag."""

    def __init__(self, storage: Storage, run_id: str):
        import boto3

        self.bucket, self.key = split_s3(storage.uri("runs", run_id, LEASE))
        self.where = storage.uri("runs", run_id, LEASE)
        self.client = boto3.client("s3", endpoint_url=storage.endpoint_url, config=boto_config())

    def create(self, body: bytes) -> str | None:
        return self._put(body, IfNoneMatch="*")

    def read(self) -> tuple[bytes, str] | None:
        try:
            obj = self.client.get_object(Bucket=self.bucket, Key=self.key)
        except self.client.exceptions.NoSuchKey:
            return None
        try:
            return read_s3_body(obj, MAX_LEASE_BYTES, self.where), obj["ETag"]
        except FileRefused:  # not a lease (megabytes of something): unreadable bytes, held by nobody
            return b"", obj["ETag"]

    def replace(self, body: bytes, token: Any) -> str | None:
        return self._put(body, IfMatch=token)

    def delete(self, token: Any) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self.key, IfMatch=token)
        except self.client.exceptions.ClientError as e:
            if _code(e) not in ("PreconditionFailed", "NoSuchKey", "404"):
                raise

    def _put(self, body: bytes, **condition: Unpack[_PutCondition]) -> str | None:
        try:
            return self.client.put_object(Bucket=self.bucket, Key=self.key, Body=body, **condition)["ETag"]
        except self.client.exceptions.ClientError as e:
            # 412: the condition failed; 409: a concurrent conditional write to the same key is in flight.
            if _code(e) in ("PreconditionFailed", "ConditionalRequestConflict", "412", "409", "NoSuchKey"):
                return None
            raise


def _code(e: Exception) -> str:
    return str(getattr(e, "response", {}).get("Error", {}).get("Code", ""))
