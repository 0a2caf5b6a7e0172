"""The lease fences the run record: a writer presumed dead whose run was taken over writes nothing more.

    .venv/bin/python -m pytest -q tests/test_lease_fencing.py   # seconds

The flow's side (a flow that loses its lease mid-stage stops and leaves its successor's record) is in
tests/test_continue.py, through the real flow.
"""

from __future__ import annotations

import time

import pytest

from tests.reading import present
from tuneproof.control import lease as leases
from tuneproof.control import record as records
from tuneproof.control.lease import Lease, LeaseInfo, LeaseLost
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass, now_iso
from tuneproof.core.storage import Storage

RUN = "fenced"


def a_record(storage: Storage) -> records.RunRecord:
    rec = records.new_record(RUN, PipelineConfig(), records.CodeIdentity(git_sha="abc", dirty=False), None)
    records.save(storage, rec)
    return rec


def taken_over(storage: Storage) -> None:
    """Another flow took the run over (this holder was presumed dead) and wrote its own verdict."""
    now = now_iso()
    successor = LeaseInfo(
        run_id=RUN, holder="elsewhere", pid=1, flow_run_id="flow-successor", command="successor", started=now,
        renewed=now,
    )  # fmt: skip
    storage.write_bytes(successor.model_dump_json().encode(), "runs", RUN, leases.LEASE)
    rec = records.load(storage, RUN)
    rec.end("failed", FailureClass.infrastructure, "verify: the successor's own verdict")
    records.save(storage, rec)


def test_a_holder_whose_run_was_taken_over_writes_nothing_and_says_who_holds_it(tmp_path):
    exercise_fence(Storage(str(tmp_path)))


@pytest.mark.integration
def test_the_fence_on_s3(s3_endpoint):
    import uuid

    from .conftest import TEST_BUCKET

    exercise_fence(Storage(f"s3://{TEST_BUCKET}/fence-{uuid.uuid4().hex[:8]}", s3_endpoint))


def exercise_fence(storage: Storage) -> None:
    """The fence's contract, the same on every store."""
    mine = a_record(storage)
    lease = Lease(storage, RUN, "flow-presumed-dead", "first")
    lease.acquire()
    records.save(storage, mine, lease)  # held: written
    taken_over(storage)

    mine.end("succeeded")
    with pytest.raises(LeaseLost, match="held by 'successor' \\(flow run flow-successor") as lost:
        records.save(storage, mine, lease)
    assert f"lost the lease on run {RUN}" in str(lost.value) and lease.lost == str(lost.value)
    after = records.load(storage, RUN)
    assert (after.status, after.cause) == ("failed", "verify: the successor's own verdict")
    assert records.read_row(storage, RUN) == records.row_of(after)

    lease.release()  # leaves the successor's lease where it is
    assert present(leases.read(storage, RUN)).flow_run_id == "flow-successor"


def test_once_lost_a_lease_stays_lost_without_asking_the_store(tmp_path):
    storage = Storage(str(tmp_path))
    mine = a_record(storage)
    lease = Lease(storage, RUN, "flow-presumed-dead", "first")
    lease.acquire()
    taken_over(storage)
    with pytest.raises(LeaseLost):
        lease.fence()
    storage.remove("runs", RUN, leases.LEASE)  # the successor released it: the run is still not ours to write
    with pytest.raises(LeaseLost):
        records.save(storage, mine, lease)
    assert records.load(storage, RUN).cause == "verify: the successor's own verdict"


def test_the_heartbeat_marks_a_held_lease_lost(tmp_path):
    storage = Storage(str(tmp_path))
    a_record(storage)
    problems: list[str] = []
    with Lease(storage, RUN, "flow-presumed-dead", "first", ttl_s=0.2).held(on_problem=problems.append) as lease:
        taken_over(storage)
        deadline = time.monotonic() + 5
        while lease.lost is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert lease.lost is not None and "flow-successor" in lease.lost
        assert any("no longer this holder's to write" in problem for problem in problems)


def test_the_fence_renews_so_no_successor_takes_over_during_the_write(tmp_path):
    # A read of the lease would pass one about to go stale; the fence renews it, so a successor waits a whole ttl.
    storage = Storage(str(tmp_path))
    lease = Lease(storage, RUN, "flow", "first")
    lease.acquire()
    before = present(leases.read(storage, RUN)).renewed
    time.sleep(0.01)
    lease.fence()
    assert present(leases.read(storage, RUN)).renewed > before
    lease.release()
