"""Checkpoint completeness (marker + listed files), RNG state, and a DCP save/load round trip."""

from __future__ import annotations

import hashlib
import json
import random
import re
import tempfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import TEST_BUCKET
from tests.reading import present
from tests.tiny import save_checkpoint
from training.checkpoint_listing import (
    RAY_SNAPSHOT,
    check_complete,
    complete_checkpoints,
    find_checkpoints,
    latest_complete_checkpoint,
    missing_files,
    remove_unmarked,
    set_aside_unusable_ray_snapshot,
    skip_unusable,
    snapshot_checkpoints,
    snapshot_without,
    unusable_ray_snapshot,
    write_marker,
)
from training.checkpointing import (
    MARKER,
    StagingBuffers,
    TrainingProgress,
    capture_rng,
    checkpoint_dir_name,
    finish_saving_shards,
    load_shards,
    restore_rng,
    start_saving_shards,
    step_of,
    written_on_every_rank,
)
from tuneproof.core.markers import FileDigest
from tuneproof.core.storage import Storage

RUN = ("runs", "r1", "train", "r1")


def fake_checkpoint(storage: Storage, step: int, marked: bool = True) -> tuple[str, ...]:
    """A checkpoint directory with DCP-like files from two ranks, marked complete unless told not to."""
    parts = (*RUN, checkpoint_dir_name(step))
    files = {
        ".metadata": b"m" * 10,
        "__0_0.distcp": b"a" * 100,
        "__1_0.distcp": b"b" * 100,
        "progress-rank0.json": b"{}",
        "progress-rank1.json": b"{}",
    }
    for name, data in files.items():
        storage.write_bytes(data, *parts, name)
    if marked:
        write_marker(storage, step, digests(files), *parts)
    return parts


def digests(files: dict[str, bytes]) -> dict[str, FileDigest]:
    return {name: FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest()) for name, data in files.items()}


def test_dir_names_carry_the_step():
    assert checkpoint_dir_name(12) == "checkpoint_000012"
    assert step_of("checkpoint_000012") == 12
    assert step_of("checkpoint_manager_snapshot.json") is None and step_of(".tmp-checkpoint_1") is None


def test_missing_files_names_each_absent_or_short_file():
    expected = {"a": 10, "b": 20, "c": 5}
    assert missing_files(expected, {"a": 10, "b": 19, "extra": 1}) == [
        "b (size 19 bytes, expected 20)",
        "c (missing, expected 5 bytes)",
    ]
    assert missing_files(expected, {**expected, "extra": 3}) == []


def test_a_checkpoint_with_a_deleted_shard_is_never_the_latest(tmp_path):
    storage = Storage(str(tmp_path))
    for step in (4, 8, 12):
        fake_checkpoint(storage, step)
    storage.remove(*RUN, checkpoint_dir_name(12), "__1_0.distcp")
    assert check_complete(storage, *RUN, "checkpoint_000012") == (
        f"{storage.uri(*RUN, 'checkpoint_000012')}: __1_0.distcp (missing, expected 100 bytes)"
    )
    latest = latest_complete_checkpoint(storage, *RUN)
    assert latest is not None
    assert (latest.step, latest.uri) == (8, storage.uri(*RUN, "checkpoint_000008"))
    assert [c.step for c in complete_checkpoints(storage, *RUN)] == [8, 4]


def test_unmarked_truncated_or_garbled_checkpoints_do_not_count(tmp_path):
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    fake_checkpoint(storage, 8, marked=False)  # interrupted before the marker
    truncated = fake_checkpoint(storage, 12)
    storage.write_bytes(b"a" * 60, *truncated, "__0_0.distcp")
    garbled = fake_checkpoint(storage, 16)
    storage.write_bytes(b"{not json", *garbled, MARKER)
    assert "no completion marker" in (check_complete(storage, *RUN, "checkpoint_000008") or "")
    assert "__0_0.distcp (size 60 bytes, expected 100)" in (check_complete(storage, *RUN, "checkpoint_000012") or "")
    assert "completion marker unreadable" in (check_complete(storage, *RUN, "checkpoint_000016") or "")
    assert present(latest_complete_checkpoint(storage, *RUN)).step == 4


def test_a_failed_run_drops_only_its_unmarked_checkpoints(tmp_path):
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    fake_checkpoint(storage, 8, marked=False)  # a save cut short (a full disk, a killed rank)
    tampered = fake_checkpoint(storage, 12)
    storage.write_bytes(b"a" * 60, *tampered, "__0_0.distcp")  # marked but changed since: evidence, kept
    storage.write_bytes(b"{}", *RUN, "checkpoint_manager_snapshot.json")
    assert remove_unmarked(storage, *RUN) == ["checkpoint_000008"]
    assert storage.listdir(*RUN) == ["checkpoint_000004", "checkpoint_000012", "checkpoint_manager_snapshot.json"]
    assert present(latest_complete_checkpoint(storage, *RUN)).step == 4
    assert remove_unmarked(storage, *RUN) == []


def ray_snapshot(*names: str) -> bytes:
    """Ray Train 2.60's snapshot of a run that reported these checkpoints (its shape, trimmed)."""
    results = [{"version": 0, "checkpoint_dir_name": name, "metrics": {"step": step_of(name)}} for name in names]
    state = {
        "ray_version": "2.60.0",
        "checkpoint_results": results,
        "checkpoint_report_indices": list(range(len(results))),
        "latest_checkpoint_result": results[-1],
    }
    return json.dumps(state).encode()


def test_a_ray_snapshot_naming_present_checkpoints_is_left_alone(tmp_path):
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    fake_checkpoint(storage, 8)
    storage.write_bytes(ray_snapshot("checkpoint_000004", "checkpoint_000008"), *RUN, RAY_SNAPSHOT)
    assert unusable_ray_snapshot(storage, *RUN) is None and set_aside_unusable_ray_snapshot(storage, *RUN) is None
    assert storage.exists(*RUN, RAY_SNAPSHOT)
    assert unusable_ray_snapshot(storage, "runs", "r1", "train", "never-ran") is None  # no snapshot: nothing to do


def test_a_torn_ray_snapshot_or_one_naming_a_removed_checkpoint_is_set_aside_and_kept(tmp_path):
    """A full disk during Ray's in-place rewrite leaves the snapshot torn; remove_unmarked deletes a
    checkpoint it may list. Either way Ray's controller would refuse to start the run."""
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    torn = ray_snapshot("checkpoint_000004", "checkpoint_000008")[:70]
    storage.write_bytes(torn, *RUN, RAY_SNAPSHOT)
    assert present(unusable_ray_snapshot(storage, *RUN)).startswith("not valid JSON: ")
    note = set_aside_unusable_ray_snapshot(storage, *RUN)
    assert note is not None
    assert note.startswith(f"Ray Train's {RAY_SNAPSHOT} of this run is unusable (not valid JSON: ")
    aside = [name for name in storage.listdir(*RUN) if name.startswith(f"{RAY_SNAPSHOT}.unusable-")]
    assert not storage.exists(*RUN, RAY_SNAPSHOT) and len(aside) == 1 and aside[0] in (note or "")
    assert storage.read_bytes(*RUN, aside[0]) == torn  # kept as it was: evidence of what Ray left

    storage.write_bytes(ray_snapshot("checkpoint_000004", "checkpoint_000008"), *RUN, RAY_SNAPSHOT)
    assert unusable_ray_snapshot(storage, *RUN) == "it lists checkpoint_000008, not in storage"
    assert present(latest_complete_checkpoint(storage, *RUN)).step == 4  # what the run resumes from without it


def test_the_checkpoints_a_snapshot_names_are_found_wherever_they_sit():
    state = {"a": [{"checkpoint_dir_name": "checkpoint_000001"}, {"x": {"checkpoint_dir_name": "checkpoint_000002"}}]}
    assert snapshot_checkpoints(state) == {"checkpoint_000001", "checkpoint_000002"}
    assert snapshot_checkpoints({"checkpoint_dir_name": None, "n": 3}) == set() and snapshot_checkpoints([]) == set()


def flip_a_byte(storage: Storage, parts: tuple[str, ...], name: str = "__1_0.distcp") -> None:
    data = bytearray(storage.read_bytes(*parts, name))
    data[len(data) // 2] ^= 0xFF  # same size: only the sha256 can tell
    storage.write_bytes(bytes(data), *parts, name)


def test_a_corrupted_newest_checkpoint_is_skipped_set_aside_and_dropped_from_rays_snapshot(tmp_path):
    storage = Storage(str(tmp_path))
    for step in (4, 8, 12):
        fake_checkpoint(storage, step)
    fake_checkpoint(storage, 16, marked=False)  # a save cut short after 12
    flip_a_byte(storage, (*RUN, "checkpoint_000012"))
    storage.write_bytes(ray_snapshot("checkpoint_000004", "checkpoint_000008", "checkpoint_000012"), *RUN, RAY_SNAPSHOT)
    found = find_checkpoints(storage, *RUN)
    assert found.latest is not None
    assert found.latest.step == 8 and [(n, s) for n, s, _ in found.unusable] == [
        ("checkpoint_000016", 16),
        ("checkpoint_000012", 12),
    ]
    skipped = skip_unusable(storage, found, *RUN)
    unmarked, flipped = skipped
    assert (unmarked.name, unmarked.set_aside_as, unmarked.dropped_from_ray) == ("checkpoint_000016", None, False)
    assert "no completion marker" in unmarked.reason
    assert flipped.name == "checkpoint_000012" and flipped.dropped_from_ray and "__1_0.distcp" in flipped.reason
    assert "sha256" in flipped.reason
    assert flipped.set_aside_as is not None
    assert flipped.set_aside_as.startswith("checkpoint_000012.unusable-") and storage.exists(*RUN, flipped.set_aside_as)
    assert not storage.exists(*RUN, "checkpoint_000012")  # the step is saved again into a clean directory
    state = json.loads(storage.read_bytes(*RUN, RAY_SNAPSHOT))
    assert snapshot_checkpoints(state) == {"checkpoint_000004", "checkpoint_000008"}
    assert state["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_000008"
    assert present(latest_complete_checkpoint(storage, *RUN)).step == 8
    assert skip_unusable(storage, find_checkpoints(storage, *RUN), *RUN) == [
        skipped[0]
    ]  # once done, only the unmarked save (left in place) is found again


def test_with_no_complete_checkpoint_nothing_is_skipped_and_the_restart_decides(tmp_path):
    storage = Storage(str(tmp_path))
    flip_a_byte(storage, fake_checkpoint(storage, 4))
    storage.write_bytes(ray_snapshot("checkpoint_000004"), *RUN, RAY_SNAPSHOT)
    found = find_checkpoints(storage, *RUN)
    assert found.latest is None and skip_unusable(storage, found, *RUN) == []
    assert storage.exists(*RUN, "checkpoint_000004") and storage.exists(*RUN, RAY_SNAPSHOT)


def test_a_snapshot_without_checkpoints_keeps_its_pairs_aligned_and_moves_latest_back():
    state = json.loads(ray_snapshot("checkpoint_000004", "checkpoint_000008", "checkpoint_000012"))
    state |= {
        "checkpoint_report_indices": [0, 1, 2],
        "pending_training_results": [state["checkpoint_results"][2]],
        "pending_validation_specs": [True],
        "validated_checkpoint_dir_names": ["checkpoint_000004", "checkpoint_000012"],
        "current_report_index": 3,
    }
    out = snapshot_without(state, {"checkpoint_000012"})
    assert [r["checkpoint_dir_name"] for r in out["checkpoint_results"]] == ["checkpoint_000004", "checkpoint_000008"]
    assert out["checkpoint_report_indices"] == [0, 1] and out["current_report_index"] == 3
    assert out["pending_training_results"] == [] and out["pending_validation_specs"] == []
    assert out["validated_checkpoint_dir_names"] == ["checkpoint_000004"]
    assert out["latest_checkpoint_result"]["checkpoint_dir_name"] == "checkpoint_000008"
    assert (
        snapshot_without(state, {"checkpoint_000004", "checkpoint_000008", "checkpoint_000012"})[
            "latest_checkpoint_result"
        ]
        is None
    )
    with pytest.raises(ValueError, match="checkpoint_results has 3 entries, checkpoint_report_indices 1"):
        snapshot_without(state | {"checkpoint_report_indices": [0]}, {"checkpoint_000012"})
    with pytest.raises(ValueError, match="no checkpoint_results"):
        snapshot_without({"ray_version": "2.58.0"}, {"checkpoint_000012"})


def test_a_snapshot_in_an_unknown_shape_is_set_aside_whole(tmp_path):
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    flip_a_byte(storage, fake_checkpoint(storage, 8))
    storage.write_bytes(
        json.dumps({"results": [{"checkpoint_dir_name": "checkpoint_000008"}]}).encode(), *RUN, RAY_SNAPSHOT
    )
    (skipped,) = skip_unusable(storage, find_checkpoints(storage, *RUN), *RUN)
    assert skipped.dropped_from_ray and not storage.exists(*RUN, RAY_SNAPSHOT)
    assert any(n.startswith(f"{RAY_SNAPSHOT}.unusable-") for n in storage.listdir(*RUN))


def test_rays_own_checkpoint_manager_loads_the_rewritten_snapshot_and_prunes_without_a_missing_path(tmp_path):
    """The held-out failure, replayed on Ray Train's own CheckpointManager (no cluster): checkpoint 20 of a
    run is corrupted; the continuation resumes from 10 and saves 20, 30, 40 again with num_to_keep 2. Left in
    Ray's snapshot, the old 20 and the new one are two entries for one directory: pruning the first deletes
    the second, pruning the second fails on "Path not found". Skipped, Ray hands out 10 and prunes cleanly."""
    import asyncio

    import pyarrow.fs
    from ray.train import CheckpointConfig
    from ray.train._checkpoint import Checkpoint
    from ray.train.v2._internal.execution.checkpoint.checkpoint_manager import CheckpointManager
    from ray.train.v2._internal.execution.context import StorageContext
    from ray.train.v2._internal.execution.training_report import _TrainingReport

    storage = Storage(str(tmp_path))
    fs = pyarrow.fs.LocalFileSystem()

    def manager() -> CheckpointManager:
        context = StorageContext(
            storage_path=storage.path(*RUN[:-1]), experiment_dir_name=RUN[-1], storage_filesystem=fs
        )
        return CheckpointManager(CheckpointConfig(num_to_keep=2), context)

    def report(cm: CheckpointManager, step: int) -> None:
        parts = fake_checkpoint(storage, step)
        checkpoint = Checkpoint(path=storage.path(*parts), filesystem=fs)
        cm.register_checkpoint(_TrainingReport(checkpoint=checkpoint, metrics={"step": step}, validation=False))

    async def first_run() -> None:
        cm = manager()
        for step in (10, 20):
            report(cm, step)

    async def continuation() -> int | None:
        cm = manager()
        restored = cm.latest_checkpoint_result
        for step in (20, 30, 40):
            report(cm, step)
        return step_of(restored.checkpoint.path.rsplit("/", 1)[-1]) if restored and restored.checkpoint else None

    asyncio.run(first_run())
    flip_a_byte(storage, (*RUN, "checkpoint_000020"))
    (skipped,) = skip_unusable(storage, find_checkpoints(storage, *RUN), *RUN)
    assert skipped.name == "checkpoint_000020" and skipped.dropped_from_ray
    assert asyncio.run(continuation()) == 10
    kept = sorted(n for n in storage.listdir(*RUN) if step_of(n) is not None)
    assert kept == ["checkpoint_000030", "checkpoint_000040"]
    assert [c.step for c in complete_checkpoints(storage, *RUN)] == [40, 30]


def test_no_checkpoints_at_all_is_none(tmp_path):
    assert latest_complete_checkpoint(Storage(str(tmp_path)), *RUN) is None


def test_the_marker_is_refused_while_a_listed_file_is_absent(tmp_path):
    storage = Storage(str(tmp_path))
    parts = fake_checkpoint(storage, 4, marked=False)
    with pytest.raises(FileNotFoundError, match=r"not marking complete, __2_0\.distcp \(missing"):
        write_marker(storage, 4, digests({"__0_0.distcp": b"a" * 100, "__2_0.distcp": b"c" * 100}), *parts)
    assert not storage.exists(*parts, MARKER)


@pytest.mark.integration
def test_completeness_is_checked_the_same_on_s3(s3_endpoint):
    storage = Storage(f"s3://{TEST_BUCKET}/ckpt-unit", s3_endpoint)
    fake_checkpoint(storage, 4)
    fake_checkpoint(storage, 8)
    storage.remove(*RUN, checkpoint_dir_name(8), ".metadata")
    assert ".metadata (missing, expected 10 bytes)" in (check_complete(storage, *RUN, "checkpoint_000008") or "")
    latest = latest_complete_checkpoint(storage, *RUN)
    assert latest is not None
    assert latest.uri == f"s3://{TEST_BUCKET}/ckpt-unit/runs/r1/train/r1/checkpoint_000004"


def test_rng_states_round_trip_through_json():
    torch.manual_seed(1), random.seed(1), np.random.seed(1)
    saved = json.loads(json.dumps(capture_rng()))
    expected = (torch.rand(3), random.random(), np.random.rand())
    torch.manual_seed(2), random.seed(2), np.random.seed(2)
    restore_rng(saved)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


@pytest.fixture
def single_rank_group(tmp_path):
    """A one-rank gloo process group, enough for fully_shard and DCP in-process."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def tiny_sharded_model(seed: int):
    from tests.tiny import tiny_qwen2
    from training.fsdp import shard_model

    model = shard_model(tiny_qwen2(64, seed), torch.device("cpu"), activation_checkpointing=False)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def test_dcp_round_trip_restores_weights_optimizer_and_progress(single_rank_group, tmp_path):
    model, optimizer = tiny_sharded_model(seed=0)
    batch = torch.randint(0, 64, (2, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    progress = TrainingProgress(
        step=1, epoch=0, batch_in_epoch=1, seed=0, rank=0, world_size=1, schedule={"peak_lr": 1e-2}, rng=capture_rng()
    )
    files = save_checkpoint(model, optimizer, progress, tmp_path / "ckpt")
    assert {".metadata", "progress-rank0.json"} <= set(files) and any(f.endswith(".distcp") for f in files)

    other, other_optimizer = tiny_sharded_model(seed=1)
    restored = load_shards(other, other_optimizer, Storage(str(tmp_path / "ckpt")), rank=0).progress
    assert restored == progress
    for (name, a), (_, b) in zip(model.named_parameters(), other.named_parameters()):
        assert torch.equal(a.full_tensor(), b.full_tensor()), name
    assert other.lm_head.weight is other.model.embed_tokens.weight
    state, other_state = optimizer.state_dict()["state"], other_optimizer.state_dict()["state"]
    assert all(torch.equal(state[k]["exp_avg"].full_tensor(), other_state[k]["exp_avg"].full_tensor()) for k in state)


def trained_one_step(model, optimizer) -> None:
    batch = torch.randint(0, 64, (2, 8))
    model(input_ids=batch, labels=batch).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def progress_at_step(step: int) -> TrainingProgress:
    return TrainingProgress(
        step=step, epoch=0, batch_in_epoch=step, seed=0, rank=0, world_size=1, schedule={}, rng=capture_rng()
    )


def test_an_async_save_holds_the_weights_of_its_step_while_training_goes_on(single_rank_group, tmp_path):
    import torch.distributed as dist

    model, optimizer = tiny_sharded_model(seed=0)
    trained_one_step(model, optimizer)
    at_save = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
    saving = start_saving_shards(
        model, optimizer, progress_at_step(1), Storage(str(tmp_path)), ("ckpt",), dist.new_group(backend="gloo")
    )
    trained_one_step(model, optimizer)  # the next step changes every weight while the write may still run
    files = finish_saving_shards(saving)
    assert {".metadata", "progress-rank0.json"} <= set(files) and any(f.endswith(".distcp") for f in files)
    write_marker(Storage(str(tmp_path)), 1, files, "ckpt")

    other, other_optimizer = tiny_sharded_model(seed=1)
    assert load_shards(other, other_optimizer, Storage(str(tmp_path / "ckpt")), rank=0).progress.step == 1
    for name, p in other.named_parameters():
        assert torch.equal(p.full_tensor(), at_save[name]), name
    assert not torch.equal(model.model.norm.weight.full_tensor(), at_save["model.norm.weight"])


def test_saves_that_reuse_staging_buffers_each_hold_their_own_step(single_rank_group, tmp_path):
    """The kept CPU buffers are overwritten by the next save: each checkpoint must still hold the weights,
    optimizer moments and learning rate of the step it was taken at."""
    import torch.distributed as dist

    model, optimizer = tiny_sharded_model(seed=0)
    group, buffers = dist.new_group(backend="gloo"), StagingBuffers()
    expected = {}
    for step in (1, 2):
        trained_one_step(model, optimizer)
        optimizer.param_groups[0]["lr"] = 0.01 * step
        expected[step] = {name: p.full_tensor().clone() for name, p in model.named_parameters()}
        saving = start_saving_shards(
            model, optimizer, progress_at_step(step), Storage(str(tmp_path)), (f"s{step}",), group, buffers=buffers
        )
        files = finish_saving_shards(saving)
        assert any(f.endswith(".distcp") for f in files)
        write_marker(Storage(str(tmp_path)), step, files, f"s{step}")
    first = buffers.state
    assert first is not None

    for step in (1, 2):
        other, other_optimizer = tiny_sharded_model(seed=1)
        assert load_shards(other, other_optimizer, Storage(str(tmp_path / f"s{step}")), rank=0).progress.step == step
        for name, p in other.named_parameters():
            assert torch.equal(p.full_tensor(), expected[step][name]), (step, name)
        assert other_optimizer.param_groups[0]["lr"] == pytest.approx(0.01 * step)
    assert buffers.state is first  # the second save copied into the first one's memory


def test_a_save_counts_as_written_only_once_its_background_write_and_hashes_are_done(
    single_rank_group, tmp_path, monkeypatch
):
    """The loop asks after each step and trains on while the write runs: asking never waits for it."""
    import threading

    import torch.distributed as dist

    from training import checkpointing

    release = threading.Event()
    hashed = checkpointing.digest_files

    def slow_disk(*args, **kwargs):
        assert release.wait(30), "the test never released the write"
        return hashed(*args, **kwargs)

    monkeypatch.setattr(checkpointing, "digest_files", slow_disk)
    model, optimizer = tiny_sharded_model(seed=0)
    storage = Storage(str(tmp_path))
    saving = start_saving_shards(
        model, optimizer, progress_at_step(1), storage, ("ckpt",), dist.new_group(backend="gloo")
    )
    assert [written_on_every_rank(saving) for _ in range(3)] == [False, False, False]
    trained_one_step(model, optimizer)  # training goes on meanwhile
    release.set()
    files = finish_saving_shards(saving)
    assert written_on_every_rank(saving) and "progress-rank0.json" in files


def test_a_background_write_that_fails_raises_and_leaves_no_marker(single_rank_group, tmp_path, monkeypatch):
    """A crash during the async write must leave the checkpoint unmarked: nothing may resume from it."""
    import torch.distributed as dist
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.api import CheckpointException

    from training import finetune_saving

    def disk_full(self, plan, planner):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(FileSystemWriter, "write_data", disk_full)
    model, optimizer = tiny_sharded_model(seed=0)
    storage = Storage(str(tmp_path / "store"))
    group = dist.new_group(backend="gloo")
    parts = (*RUN, checkpoint_dir_name(100))
    worker = SimpleNamespace(
        rank=0,
        world_size=1,
        storage=storage,
        run_parts=RUN,
        saving=start_saving_shards(model, optimizer, progress_at_step(100), storage, parts, group),
    )
    with pytest.raises(CheckpointException, match="No space left"):
        finetune_saving.complete_checkpoint(worker)  # type: ignore[arg-type]
    assert not storage.exists(*RUN, checkpoint_dir_name(100), MARKER)
    assert latest_complete_checkpoint(storage, *RUN) is None
    assert worker.saving is None  # never waited on twice


def test_an_async_save_writes_into_the_storage_directory_and_hashes_only_its_own_files(single_rank_group, tmp_path):
    """Every rank writes into the one checkpoint directory: a rank lists (and hashes) the files it wrote,
    never another rank's, and a marker left from an earlier save of the step stops counting before any
    file changes."""
    import torch.distributed as dist

    model, optimizer = tiny_sharded_model(seed=0)
    trained_one_step(model, optimizer)
    storage = Storage(str(tmp_path / "store"))
    parts = (*RUN, checkpoint_dir_name(7))
    storage.write_bytes(b"another rank's shard", *parts, "__1_0.distcp")
    storage.write_json({"step": 7, "files": {}}, *parts, MARKER)

    saving = start_saving_shards(model, optimizer, progress_at_step(7), storage, parts, dist.new_group(backend="gloo"))
    files = finish_saving_shards(saving)

    assert sorted(files) == [".metadata", "__0_0.distcp", "__0_1.distcp", "progress-rank0.json"]  # WRITER_THREADS files
    assert saving.uri == storage.uri(*parts)
    assert not storage.exists(*parts, MARKER)  # the old marker went before the shards were rewritten
    assert storage.read_bytes(*parts, "__1_0.distcp") == b"another rank's shard"
    write_marker(storage, 7, files, *parts)
    assert check_complete(storage, *parts) is None
    other, other_optimizer = tiny_sharded_model(seed=1)
    assert load_shards(other, other_optimizer, Storage(storage.path(*parts)), rank=0).progress.step == 7
    assert torch.equal(other.model.norm.weight.full_tensor(), model.model.norm.weight.full_tensor())


def test_a_changed_byte_in_a_file_the_load_reads_fails_it_naming_the_file(single_rank_group, tmp_path):
    """The load hashes each file as it reads it: a flipped byte the marker's sizes cannot see still stops it."""
    from training.checkpointing import ChangedCheckpoint

    model, optimizer = tiny_sharded_model(seed=0)
    trained_one_step(model, optimizer)
    save_checkpoint(model, optimizer, progress_at_step(2), tmp_path / "ckpt")
    for name in ("__0_1.distcp", "progress-rank0.json"):
        data = bytearray((tmp_path / "ckpt" / name).read_bytes())
        data[len(data) // 2] ^= 1
        (tmp_path / "ckpt" / name).write_bytes(bytes(data))
        assert check_complete(Storage(str(tmp_path)), "ckpt", contents=False) is None  # the sizes all match
        other, other_optimizer = tiny_sharded_model(seed=1)
        with pytest.raises(ChangedCheckpoint, match=rf"{re.escape(name)} \(sha256 \w+, expected \w+\)"):
            load_shards(other, other_optimizer, Storage(str(tmp_path / "ckpt")), rank=0)
        data[len(data) // 2] ^= 1
        (tmp_path / "ckpt" / name).write_bytes(bytes(data))


@pytest.mark.integration
def test_an_async_save_to_s3_uploads_each_file_and_leaves_no_staging_copy(single_rank_group, s3_endpoint, tmp_path):
    """On S3 the background thread stages, hashes and uploads; the stored files match the hashes, the
    checkpoint loads back straight from the bucket, and the staging directory is gone."""
    import torch.distributed as dist

    model, optimizer = tiny_sharded_model(seed=0)
    trained_one_step(model, optimizer)
    storage = Storage(f"s3://{TEST_BUCKET}/ckpt-direct", s3_endpoint)
    parts = (*RUN, checkpoint_dir_name(3))
    staged_before = set(Path(tempfile.gettempdir()).glob("tuneproof-save-*"))

    saving = start_saving_shards(model, optimizer, progress_at_step(3), storage, parts, dist.new_group(backend="gloo"))
    files = finish_saving_shards(saving)

    assert sorted(files) == [".metadata", "__0_0.distcp", "__0_1.distcp", "progress-rank0.json"]
    assert set(files) <= set(storage.listdir(*parts))  # uploaded by the background thread
    assert set(Path(tempfile.gettempdir()).glob("tuneproof-save-*")) == staged_before
    write_marker(storage, 3, files, *parts)
    assert check_complete(storage, *parts) is None
    other, other_optimizer = tiny_sharded_model(seed=1)
    loaded = load_shards(other, other_optimizer, Storage(storage.uri(*parts), s3_endpoint), rank=0)
    assert loaded.progress.step == 3 and loaded.read == {name: d.size for name, d in files.items()}  # each file once
    assert torch.equal(other.model.norm.weight.full_tensor(), model.model.norm.weight.full_tensor())


@pytest.mark.integration
def test_put_file_streams_one_file_into_a_nested_location_on_disk_and_on_s3(tmp_path, s3_endpoint, monkeypatch):
    """One PUT for a small file; a file of several parts goes up as a multipart upload (parts shrunk to S3's
    5 MiB minimum here) and reads back whole."""
    from tuneproof.core import storage as storage_module

    monkeypatch.setattr(storage_module, "PUT_PART_BYTES", 5 * 2**20)
    small, large = tmp_path / "small.bin", tmp_path / "large.bin"
    small.write_bytes(b"x" * 70_000 + b"end")
    large.write_bytes(bytes(range(256)) * (11 * 2**20 // 256) + b"tail")
    for storage in (Storage(str(tmp_path / "store")), Storage(f"s3://{TEST_BUCKET}/put-file", s3_endpoint)):
        for source in (small, large):
            storage.put_file(source, "a", "b", source.name)
            assert storage.read_bytes("a", "b", source.name) == source.read_bytes()


def test_a_durable_digest_hashes_every_file_and_fsyncs_it_and_the_directory(tmp_path, monkeypatch):
    import training.checkpointing as checkpointing
    from tuneproof.core import markers

    contents = {f"__0_{i}.distcp": bytes([i]) * (3 * 2**20 + i) for i in range(3)} | {"progress-rank0.json": b"{}"}
    for name, data in contents.items():
        (tmp_path / name).write_bytes(data)
    synced: list[Path] = []
    real_fsync = checkpointing.fsync_path

    def fsync_path(path: Path) -> None:
        synced.append(Path(path))
        real_fsync(path)

    monkeypatch.setattr(checkpointing, "fsync_path", fsync_path)

    files = checkpointing.digest_files(tmp_path, sorted(contents), durable=True)

    assert files == {
        name: FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest()) for name, data in contents.items()
    }
    assert sorted(synced) == sorted([tmp_path / name for name in contents] + [tmp_path])
    # the same digests from one thread, and nothing synced for a staging directory
    assert markers.local_digests(tmp_path, sorted(contents), threads=1) == files
    synced.clear()
    assert checkpointing.digest_files(tmp_path, sorted(contents), durable=False) == files
    assert synced == []


def test_a_directory_that_cannot_be_fsynced_is_left_but_a_file_that_cannot_fails_the_save(tmp_path, monkeypatch):
    import errno
    import os
    import stat

    import training.checkpointing as checkpointing

    (tmp_path / "__0_0.distcp").write_bytes(b"a" * 100)
    real_fsync = os.fsync
    refuse = {"dir"}

    def fsync(fd: int) -> None:
        kind = "dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file"
        if kind in refuse:
            raise OSError(errno.EINVAL, "Invalid argument")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    assert set(checkpointing.digest_files(tmp_path, ["__0_0.distcp"], durable=True)) == {"__0_0.distcp"}
    refuse = {"file"}
    with pytest.raises(OSError, match="Invalid argument"):
        checkpointing.digest_files(tmp_path, ["__0_0.distcp"], durable=True)
