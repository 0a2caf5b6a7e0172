"""The flow rows' and the load test's own checks, without a cluster (the rows themselves run in
tests/test_faults.py and `make faults`).

    pytest -m faults tests/test_faults_flow.py
"""

from __future__ import annotations

import time

import pytest

from faults.f_flow import check_resumed, logged_step
from faults.f_load import PointerWatch, run_of
from tuneproof.control import record as records
from tuneproof.control.record import CodeIdentity, Invocation, StageEntry
from tuneproof.core.config import PipelineConfig
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

pytestmark = pytest.mark.faults


def test_the_pointer_watch_counts_whole_pointers_and_catches_a_torn_one(tmp_path):
    storage = Storage(str(tmp_path))
    parts = ("models", "m", "production.json")
    with PointerWatch(storage, "m") as watch:
        time.sleep(0.1)  # no pointer yet: nothing read, nothing torn
        pointer = {"name": "m", "version": "v0001-a", "path": "models/m/v0001-a", "run_id": "a", "promoted_at": "t"}
        storage.write_json({**pointer, "content_sha256": "h"}, *parts)
        time.sleep(0.2)
        storage.write_bytes(b'{"version": "v0002-b", "pa', *parts)  # a half-written pointer
        time.sleep(0.2)
    assert watch.reads >= 1 and watch.versions == ["v0001-a"]
    assert watch.torn and "not a JSON production pointer" in watch.torn[0]


def test_registry_versions_name_their_run():
    assert run_of("v0003-load-b") == "load-b"


def test_the_logged_step_is_the_last_metrics_row(tmp_path):
    storage = Storage(str(tmp_path))
    assert logged_step(storage, "r") == 0
    storage.write_bytes(b'{"step": 1}\n{"step": 2}\n', "runs", "r", "stages", "finetune", "metrics.jsonl")
    assert logged_step(storage, "r") == 2


def continued(start_step: int, restored: bool) -> records.RunRecord:
    rec = records.new_record("r", PipelineConfig(), CodeIdentity(), None)
    tuned = FinetuneSummary(
        run_name="r", train_storage_uri="/t", checkpoints=[], start_step=start_step, steps=40, seconds=1.0,
        restored_from="/t/checkpoint_000020" if restored else None,
    )  # fmt: skip
    rec.stages["finetune"] = StageEntry.succeeded("finetune", tuned, "t0")
    rec.invocations = [Invocation(at="t0", config_hash="c", kept=["verify", "connectivity", "data"])]
    return rec


def test_a_continuation_must_restore_a_checkpoint_and_keep_the_earlier_stages():
    problems: list[str] = []
    check_resumed(continued(20, restored=True), problems, 20)
    assert problems == []
    check_resumed(continued(0, restored=False), problems, 20)
    assert problems == ["the continued fine-tune started at step 0, not from a checkpoint >= 20"]
    rec = continued(20, restored=True)
    rec.invocations[-1].kept = ["verify"]
    problems = []
    check_resumed(rec, problems, 20)
    assert [p.split(" was")[0] for p in problems] == ["connectivity", "data"]
