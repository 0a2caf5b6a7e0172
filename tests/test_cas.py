"""cas's local lock file: who may break it, and a writer that lost it writes nothing.

    .venv/bin/python -m pytest -q -p no:cacheprovider tests/test_cas.py

The lock's holder is a real child process (a sleeping one, or one killed with -9 inside the lock), so its
pid is checked the way a real writer's is; times are shrunk through write_if's parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tuneproof.core import cas
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.procs import pid_alive, stat_state
from tuneproof.core.storage import Storage

PARTS = ("models", "m", "production.json")

HOLD = """
import sys, time
from pathlib import Path
from tuneproof.core import cas
with cas.file_lock(Path(sys.argv[1]), 5, 60):
    print("locked", flush=True)
    time.sleep(600)
"""


@pytest.fixture
def storage(tmp_path: Path) -> Storage:
    storage = Storage(str(tmp_path))
    assert cas.write_if(storage, b"v1", None, *PARTS)
    return storage


@pytest.fixture
def holder(storage: Storage) -> Iterator[subprocess.Popen[str]]:
    """A child process of this host holding the object's lock, sleeping inside it."""
    lock = cas._lock_path(storage, PARTS)
    child = subprocess.Popen(
        [sys.executable, "-c", HOLD, str(lock)], cwd=PROJECT_ROOT, stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "locked\n"
    yield child
    child.kill()
    child.wait()


def token(storage: Storage) -> str | None:
    return cas.read_versioned(storage, *PARTS)[1]


def test_a_lock_left_by_a_killed_writer_of_this_host_is_broken_at_once(storage, holder):
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    started = time.monotonic()
    assert cas.write_if(storage, b"v2", token(storage), *PARTS, lock_timeout_s=3)
    assert time.monotonic() - started < 1
    assert cas.read_versioned(storage, *PARTS)[0] == b"v2"


def test_a_lock_whose_holder_still_runs_is_not_broken_however_old(storage, holder):
    before = token(storage)
    time.sleep(0.3)
    with pytest.raises(TimeoutError, match=rf"pid {holder.pid} still runs"):
        cas.write_if(storage, b"v2", before, *PARTS, lock_timeout_s=0.5, stale_lock_s=0.1)
    assert token(storage) == before
    assert json.loads(cas._lock_path(storage, PARTS).read_text())["pid"] == holder.pid


def test_a_lock_from_another_host_is_broken_by_age(storage):
    lock = cas._lock_path(storage, PARTS)
    lock.write_text(json.dumps({"nonce": "x", "pid": 1, "host": "elsewhere", "pid_space": "elsewhere//", "at": "-"}))
    with pytest.raises(TimeoutError, match="not a process this machine can check"):
        cas.write_if(storage, b"v2", token(storage), *PARTS, lock_timeout_s=0.2)
    old = time.time() - 120
    os.utime(lock, (old, old))
    assert cas.write_if(storage, b"v2", token(storage), *PARTS, lock_timeout_s=1)


@pytest.mark.parametrize("operation", ["write", "delete"])
def test_a_writer_whose_lock_was_broken_and_retaken_changes_nothing(storage, monkeypatch, operation):
    """The writer stalled past stale_lock_s, another host broke its lock and holds it now: the write it
    was about to make would undo whatever that holder writes."""
    lock = cas._lock_path(storage, PARTS)
    real_read = cas.read_versioned

    def read_then_lose_the_lock(*args):
        seen = real_read(*args)
        lock.unlink()
        lock.write_text(json.dumps({"nonce": "theirs", "pid": 1, "host": "elsewhere", "at": "-"}))
        return seen

    before = token(storage)
    assert before is not None
    monkeypatch.setattr(cas, "read_versioned", read_then_lose_the_lock)
    if operation == "write":
        assert cas.write_if(storage, b"v2", before, *PARTS) is False
    else:
        assert cas.delete_if(storage, before, *PARTS) is False
    monkeypatch.undo()
    assert cas.read_versioned(storage, *PARTS) == (b"v1", before)
    assert json.loads(lock.read_text())["nonce"] == "theirs"  # their lock is left to them
    assert not [p.name for p in lock.parent.iterdir() if p.name.startswith(".tmp-")]


def test_a_zombie_counts_as_gone():
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{child.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert not pid_alive(child.pid)
    child.wait()


def test_the_process_state_is_read_after_the_last_parenthesis():
    assert stat_state("4242 (a) Z (b) S 1 4242 4242 0 -1") == "S"
    assert stat_state("4242 (python3) Z 1 4242") == "Z"
