"""The append-only row log (tuneproof/core/rowlog.py): appends never rewrite, a torn write is no row,
and a resumed job's replayed steps are later rows the reader keeps (training/finetune.py latest_rows)."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from tests.reading import present
from training.restarts import restarts
from tuneproof.core.rowlog import append_rows, read_rows, remove_log
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import latest_rows, loss_curve

from .conftest import TEST_BUCKET

LOG = ("runs", "r1", "stages", "finetune", "metrics.jsonl")


def rows(steps: range, attempt: int, loss: float, t0: float) -> list[dict]:
    return [{"step": s, "loss": loss + s, "attempt": attempt, "time": t0 + s} for s in steps]


def interrupted_then_resumed(storage: Storage) -> None:
    """Attempt 0 flushes steps 1-20 and is killed; attempt 1 restores step 10's checkpoint and trains to 30."""
    append_rows(storage, rows(range(1, 11), 0, 0.0, 100.0), *LOG)
    append_rows(storage, rows(range(11, 21), 0, 0.0, 100.0), *LOG)
    append_rows(storage, rows(range(11, 31), 1, 0.5, 200.0), *LOG)


def check_resumed(storage: Storage) -> None:
    everything = read_rows(storage, *LOG)
    assert [r["step"] for r in everything] == [*range(1, 21), *range(11, 31)]  # in the order written
    curve = loss_curve(everything)
    assert [s for s, _ in curve] == list(range(1, 31))  # one point per step, none lost, none twice
    assert curve[9] == (10, 10.0) and curve[10] == (11, 11.5)  # past the restored step: the replay's row
    attempts: list[dict[str, Any]] = [
        {"attempt": 0, "started_at": 100.0, "restored_step": 0, "restored_from": None},
        {"attempt": 1, "started_at": 150.0, "restored_step": 10, "restored_from": "ckpt-10"},
    ]
    assert restarts(attempts, [], everything)[0].at_step == 20


def test_local_appends_keep_every_row_and_the_reader_keeps_the_last_per_step(tmp_path):
    storage = Storage(str(tmp_path))
    interrupted_then_resumed(storage)
    check_resumed(storage)


def test_an_append_never_rewrites_what_was_written(tmp_path):
    storage = Storage(str(tmp_path))
    append_rows(storage, rows(range(1, 3), 0, 0.0, 0.0), *LOG)
    path = tmp_path.joinpath(*LOG)
    before, inode = path.read_bytes(), path.stat().st_ino
    append_rows(storage, rows(range(3, 4), 0, 0.0, 0.0), *LOG)
    assert path.read_bytes().startswith(before) and path.stat().st_ino == inode  # same file, grown


def test_a_write_killed_halfway_is_no_row_and_the_next_append_starts_clean(tmp_path):
    storage = Storage(str(tmp_path))
    append_rows(storage, rows(range(1, 3), 0, 0.0, 0.0), *LOG)
    with open(tmp_path.joinpath(*LOG), "a") as f:
        f.write('{"step": 3, "lo')  # SIGKILL mid-write
    assert [r["step"] for r in read_rows(storage, *LOG)] == [1, 2]
    append_rows(storage, rows(range(3, 5), 1, 0.0, 0.0), *LOG)
    assert [r["step"] for r in read_rows(storage, *LOG)] == [1, 2, 3, 4]


def test_latest_rows_prefers_the_replay(tmp_path):
    storage = Storage(str(tmp_path))
    interrupted_then_resumed(storage)
    assert {r["attempt"] for r in latest_rows(read_rows(storage, *LOG)) if r["step"] > 10} == {1}


def test_a_missing_log_has_no_rows_and_removing_it_twice_is_fine(tmp_path):
    storage = Storage(str(tmp_path))
    assert read_rows(storage, *LOG) == []
    append_rows(storage, [{"step": 1}], *LOG)
    remove_log(storage, *LOG)
    remove_log(storage, *LOG)
    assert read_rows(storage, *LOG) == []


@pytest.mark.integration
def test_on_s3_each_flush_is_a_numbered_chunk_read_back_in_order(s3_endpoint):
    storage = Storage(f"s3://{TEST_BUCKET}/rowlog-{uuid.uuid4().hex[:8]}", s3_endpoint)
    interrupted_then_resumed(storage)
    assert storage.listdir(*LOG[:-1], "metrics.jsonl.d") == [f"{n:012d}.jsonl" for n in (1, 2, 3)]
    check_resumed(storage)
    remove_log(storage, *LOG)
    assert read_rows(storage, *LOG) == []


@pytest.mark.integration
def test_an_s3_writer_that_keeps_its_chunk_number_lists_once(s3_endpoint, monkeypatch):
    storage = Storage(f"s3://{TEST_BUCKET}/rowlog-{uuid.uuid4().hex[:8]}", s3_endpoint)
    chunk = present(append_rows(storage, [{"step": 1}], *LOG))  # on S3: the chunk number written
    listings: list[tuple[str, ...]] = []

    def listdir(*parts: str) -> list[str]:
        listings.append(parts)
        return []

    monkeypatch.setattr(storage, "listdir", listdir)
    for step in (2, 3):
        chunk = present(append_rows(storage, [{"step": step}], *LOG, chunk=chunk + 1))
    assert chunk == 3 and listings == []
    monkeypatch.undo()
    assert [r["step"] for r in read_rows(storage, *LOG)] == [1, 2, 3]
