"""One writer per run: a lease on the run id, held by the flow for its whole run.

`runs/<run-id>/lease.json` is created exclusively through tuneproof.core.cas (compare-and-swap, as for
the registry's pointer), so of two flows that start on the same run id exactly one gets it; the other
(and `tuneproof promote RUN --force`) is refused naming the holder. A heartbeat thread renews it;
renewals, takeovers and the release are conditional on the token the holder last wrote, so a holder
that lost its lease never overwrites its successor's.

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
import os
import socket
import threading
from collections.abc import Callable, Iterator
from datetime import UTC, datetime

from pydantic import Field, ValidationError, field_validator

from tuneproof.core import cas
from tuneproof.core.files import FileRefused
from tuneproof.core.results import Model, now_iso
from tuneproof.core.storage import Storage

LEASE = "lease.json"
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


def pid_alive(pid: int) -> bool:
    """Whether `pid` still runs here: another user's process does; a zombie (exited, not yet reaped) does not."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:  # no /proc (macOS), or the process went meanwhile: os.kill saw it
        return True


def read(storage: Storage, run_id: str) -> LeaseInfo | None:
    """The run's lease, or None when there is none (or it is not a lease: then nobody can claim to hold it)."""
    data = _read(storage, run_id)
    return None if data is None else _parse(data)


def stale(storage: Storage, run_id: str) -> tuple[LeaseInfo | None, str | None]:
    """(the lease or None, why it no longer protects its holder or None). No lease counts as 'absent'."""
    data = _read(storage, run_id)
    if data is None:
        return None, "no lease"
    info = _parse(data)
    if info is None:
        return None, f"{storage.uri(*_parts(run_id))} is not a readable lease"
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
        self.storage = storage
        self.run_id = run_id
        self.ttl_s = ttl_s
        self.parts = _parts(run_id)
        self.where = storage.uri(*self.parts)
        self.info = LeaseInfo.this_process(run_id, command, ttl_s, flow_run_id)
        self.taken_over: str | None = None
        """When acquiring replaced a stale lease: whose, and why it was stale."""
        self.lost: str | None = None
        """Set (to what happened, and who holds the run now) once a renewal finds the lease no longer ours:
        from then on every renewal and fence raises LeaseLost without asking the store again."""
        self._token: str | None = None
        # The heartbeat thread and the flow's fence both renew: one at a time, so neither sends a token the
        # other has just replaced (which would read as a takeover).
        self._renewing = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def acquire(self) -> None:
        """Create the lease, or take over a stale one; LeaseHeld when a live writer holds it. FileRefused (or
        IsADirectoryError) when something that is not a lease file sits in its place: no token can replace it."""
        self._token = cas.write_if(self.storage, _body(self.info), None, *self.parts)
        if self._token is not None:
            return
        held, token = cas.read_versioned(self.storage, *self.parts)
        if held is None:  # released between our create and our read: try once more
            self._token = cas.write_if(self.storage, _body(self.info), None, *self.parts)
            if self._token is not None:
                return
            held, token = cas.read_versioned(self.storage, *self.parts)
            if held is None:
                raise OSError(f"cannot create or read {self.where}")
        info = _parse(held)
        why = "it is not a readable lease" if info is None else stale_reason(info, _now(), self.info.holder, pid_alive)
        if why is None and info is not None:
            raise LeaseHeld(self.run_id, info)
        self._token = cas.write_if(self.storage, _body(self.info), token, *self.parts)
        if self._token is None:  # another flow took it over first
            current = read(self.storage, self.run_id)
            if current is None:
                raise OSError(f"lost a race for {self.where} and cannot read the winner's lease")
            raise LeaseHeld(self.run_id, current)
        self.taken_over = f"took over the lease of {info.describe() if info else 'an unreadable lease'}: {why}"

    def renew(self) -> None:
        """Extend the lease by a ttl from now; LeaseLost (and `lost` set) when it is no longer this holder's."""
        with self._renewing:
            if self.lost is not None:
                raise LeaseLost(self.lost)
            renewed = self.info.model_copy(update={"renewed": now_iso()})
            token = cas.write_if(self.storage, _body(renewed), self._token, *self.parts)
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
            cas.delete_if(self.storage, self._token, *self.parts)
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
                on_problem(f"could not release the lease {self.where}: {type(e).__name__}: {e}")

    def _heartbeat(self, on_problem: Callable[[str], None]) -> None:
        while not self._stop.wait(self.ttl_s / 4):
            try:
                self.renew()
            except LeaseLost as e:  # `lost` is set: the holder's next fence stops it before it writes
                on_problem(f"{e}; the run's record is no longer this holder's to write")
                return
            except Exception as e:  # noqa: BLE001 - a failed renewal is retried; the ttl leaves room for several
                on_problem(f"could not renew the lease {self.where}: {type(e).__name__}: {e}")

    def _loss(self) -> str:
        """What happened to the lease, and who holds the run now, for the LeaseLost a renewal raises."""
        try:
            current = read(self.storage, self.run_id)
        except OSError as e:
            now = f"who holds it now cannot be read ({type(e).__name__}: {e})"
        else:
            now = f"it is now held by {current.describe()}" if current else "nobody holds it now (released or removed)"
        return (
            f"lost the lease on run {self.run_id} ({self.where}): it was taken over or removed after this "
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


def _parts(run_id: str) -> tuple[str, str, str]:
    return ("runs", run_id, LEASE)


def _read(storage: Storage, run_id: str) -> bytes | None:
    """The lease's bytes, None when there is none; b"" when something that is not a lease file sits in its place
    (a directory, a FIFO, an object over cas.MAX_OBJECT_BYTES): unreadable, so held by nobody."""
    try:
        return cas.read_versioned(storage, *_parts(run_id))[0]
    except (IsADirectoryError, FileRefused):
        return b""
