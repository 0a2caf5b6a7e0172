"""The fine-tune stage and the training side of the resume test.

Unit tests cover the parameters, data order and loss bookkeeping. The integration tests run real
2-worker FSDP2 training through Ray Train on CPU (gloo) with a tiny tied-embedding Qwen2 on a
synthetic digit-reversal task: a straight run, a replay from its step-4 checkpoint that must
reproduce its losses exactly, a stop-and-restart under the same run name, a NaN that must end as a
modeling failure, and the same fine-tune against an S3-compatible server. The resume test's job (every rank
killed after a checkpoint, restarted as a new run) is asserted on the session's demo run
(tests/test_full_pipeline.py), which runs it.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import TEST_BUCKET, ray_driver
from tests.datasets import write_prepared
from tests.test_checkpointing import RUN, fake_checkpoint
from training import jobkit
from training.checkpoint_listing import check_complete, latest_complete_checkpoint
from training.checkpointing import MARKER
from training.data_files import Example
from training.finetune import finetune, train_failure_cause
from training.finetune_state import TrainParams, Worker
from training.finetune_worker import divergence, resolve_start
from training.jobkit import JobContext
from training.restarts import restarts
from training.train_data import BatchLayout, StepBatches, load_examples, rank_slices
from tuneproof.control.resume_evidence import compare_losses
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.envelope import ENV_VAR, PROGRESS_PREFIX
from tuneproof.core.results import FailureClass, StageFailure, error_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import CheckpointRef
from tuneproof.core.summaries_training import FinetuneSummary, Restart, loss_curve

DATASET = "datasets/reverse/abc123"
DIGIT0, SEP, EOS = 3, 13, 14  # token ids of the synthetic task (digits are 3..12)


# ---------------------------------------------------------------- builders


def reverse_task(n: int, seed: int) -> list[dict]:
    """Rows of 'reverse these digits': prompt ids masked with -100 in labels, no padding."""
    rng = np.random.default_rng(seed)
    rows = []
    for _ in range(n):
        digits = rng.integers(0, 10, size=int(rng.integers(3, 7))).tolist()
        prompt = [DIGIT0 + d for d in digits] + [SEP]
        answer = [DIGIT0 + d for d in reversed(digits)] + [EOS]
        rows.append(
            {
                "input_ids": prompt + answer,
                "labels": [-100] * len(prompt) + answer,
                "prompt": "".join(map(str, digits)),
                "reference": "".join(map(str, reversed(digits))),
            }
        )
    return rows


def write_dataset(storage: Storage, path: str = DATASET, n_train: int = 256, n_eval: int = 32) -> str:
    """A prepared dataset as the data stage writes it: parquet shards per split, manifest.json last."""
    splits = {"train": reverse_task(n_train, 0), "eval": reverse_task(n_eval, 1)}
    write_prepared(
        storage, path, "reverse", {k: [Example(**row) for row in rows] for k, rows in splits.items()}, shard_rows=100
    )
    return path


def write_tiny_model(out_dir: Path) -> Path:
    """A 2-layer, hidden-32 Qwen2 with tied embeddings and a real (byte-level) tokenizer."""
    from tuneproof.app.tiny_model import build_tiny_model

    return build_tiny_model(out_dir, ["0123456789 reverse"] * 20, hidden=32, layers=2, seed=0, vocab_size=270)


def make_config(root: str, model_dir: Path, endpoint_url: str | None = None, **train) -> PipelineConfig:
    train = {
        "num_workers": 2,
        "max_steps": 12,
        "micro_batch_size": 8,
        "lr": 3e-3,
        "warmup_steps": 2,
        "checkpoint_every": 4,
        "num_to_keep": 5,
        "log_every": 4,
        **train,
    }
    return PipelineConfig.model_validate(
        {
            "storage": {"root": root, "endpoint_url": endpoint_url},
            "model": {"source": str(model_dir)},
            "train": train,
            "resume": {"extra_steps": 1, "replay_steps": 1},
        }
    )


def context(config: PipelineConfig, run_id: str, job: str = "finetune", **params) -> JobContext:
    return JobContext(run_id, job, config, {"dataset": DATASET, **params})


def train(ctx: JobContext) -> dict:
    """The fine-tune stage's summary as the run record holds it (JSON)."""
    return finetune(ctx).to_json()


def losses(summary: dict) -> dict[int, float]:
    return {step: loss for step, loss in summary["loss_curve"]}


# ---------------------------------------------------------------- unit tests


def test_params_default_to_the_config_and_reject_unknown_keys(tmp_path):
    config = make_config(str(tmp_path), tmp_path)
    params = TrainParams.resolve(context(config, "r1"))
    assert (params.run_name, params.max_steps, params.checkpoint_every, params.export) == ("r1", 12, 4, True)
    assert params.export_dir("r1") == "model"
    assert TrainParams.resolve(context(config, "r1", run_name="r1-resume")).export_dir("r1") == "model-r1-resume"
    with pytest.raises(ValueError, match="hold_after"):
        TrainParams.resolve(context(config, "r1", hold_after=3))
    with pytest.raises(ValueError, match="must be a checkpoint step .* got 6"):
        TrainParams.resolve(context(config, "r1", hold_after_checkpoint_step=6))


def test_divergence_names_the_loss_or_gradient_norm_and_step():
    assert divergence(2.5, 1.0, 7, 50.0) is None
    assert divergence(float("nan"), 1.0, 37, 50.0) == "loss is nan at step 37"
    assert divergence(float("inf"), 1.0, 3, 50.0) == "loss is inf at step 3"
    assert divergence(80.0, 1.0, 9, 50.0) == "loss is 80 at step 9, above train.divergence_loss 50.0"
    assert divergence(2.5, float("inf"), 4, 50.0) == (
        "gradient norm is inf at step 4 (loss 2.5): its update was not applied"
    )


def test_a_full_disk_is_named_with_what_to_do_and_other_failures_pass_through():
    cause = train_failure_cause("TrainingFailedError: ... OSError: [Errno 28] No space left on device", "/mnt/s/runs")
    assert cause.startswith("storage full: no space left on device (ENOSPC) writing under /mnt/s/runs;")
    assert "train.continue_previous=true" in cause and "[Errno 28]" in cause
    assert train_failure_cause("worker died", "/s") == "Ray Train run failed: worker died"


def test_restarts_pair_each_new_attempt_with_the_step_and_failure_before_it():
    attempts: list[dict[str, Any]] = [
        {"attempt": 0, "restored_step": 0, "restored_from": None, "started_at": 100.0},
        {"attempt": 1, "restored_step": 20, "restored_from": "/s/checkpoint_000020", "started_at": 200.0},
    ]
    rows = [{"step": s, "time": 100.0 + s, "attempt": 0} for s in range(1, 24)]
    rows += [{"step": 9, "time": 50.0, "attempt": 0}]  # an earlier job's row: not this attempt's
    rows += [{"step": s, "time": 200.0 + s, "attempt": 1} for s in range(21, 41)]
    failures = [{"time": 150.0, "cause": "rank 1: ActorDiedError"}, {"time": 90.0, "cause": "earlier"}]
    assert restarts(attempts, failures, rows) == [
        Restart(
            attempt=1,
            at_step=23,
            restored_step=20,
            restored_from="/s/checkpoint_000020",
            cause=failures[0]["cause"],
            lost_steps=3,
        )
    ]
    assert restarts(attempts[:1], failures, rows) == []


def test_loss_curve_keeps_the_last_row_written_for_a_replayed_step():
    rows = [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.0}, {"step": 3, "loss": 1.9}, {"step": 3, "loss": 1.8}]
    assert loss_curve(rows) == [(1, 3.0), (2, 2.0), (3, 1.8)]


def test_batches_depend_only_on_seed_step_and_layout(tmp_path):
    storage = Storage(str(tmp_path))
    examples = load_examples(storage, write_dataset(storage), "train")
    layout = BatchLayout(micro_batch_size=4, grad_accum_steps=2, world_size=2)
    ranks = [StepBatches(examples, layout, seed=5, rank=r, pad_id=0) for r in range(2)]
    again = StepBatches(examples, layout, seed=5, rank=0, pad_id=0)
    assert ranks[0].per_epoch == 256 // 16
    for step in (1, 2, 17):  # 17 is the first step of epoch 1
        first, replay = ranks[0].micro_batches(step), again.micro_batches(step)
        assert len(first) == 2 and all(b["input_ids"].shape[0] == 4 for b in first)
        assert all((a["input_ids"] == b["input_ids"]).all() for a, b in zip(first, replay))
    order = np.arange(32)
    assert [s.tolist() for s in rank_slices(order, 1, layout, 1)] == [[24, 25, 26, 27], [28, 29, 30, 31]]


def test_collated_batch_masks_padding(tmp_path):
    storage = Storage(str(tmp_path))
    examples = load_examples(storage, write_dataset(storage), "train")
    batch = StepBatches(examples, BatchLayout(8, 1, 1), seed=0, rank=0, pad_id=0).micro_batches(1)[0]
    lengths = batch["attention_mask"].sum(dim=1)
    assert int(lengths.max()) == batch["input_ids"].shape[1]
    for row, n in enumerate(lengths.tolist()):
        assert (batch["labels"][row, n:] == -100).all() and (batch["input_ids"][row, n:] == 0).all()


def test_a_dataset_without_its_manifest_is_refused(tmp_path):
    storage = Storage(str(tmp_path))
    write_dataset(storage)
    storage.remove(DATASET, "manifest.json")
    with pytest.raises(StageFailure, match="no manifest.json") as info:
        load_examples(storage, DATASET)
    assert info.value.failure_class is FailureClass.infrastructure


def worker_for(config: PipelineConfig, **params) -> Worker:
    """A Worker with only what choosing the start point reads (storage, run name, init_from)."""
    ctx = context(config, "r1", **params)
    unread: dict[str, Any] = dict(device=None, model=None, optimizer=None, batches=None, schedule=None)
    return Worker(
        ctx,
        TrainParams.resolve(ctx),
        rank=0,
        world_size=2,
        **unread,  # what resolve_start never reads: no device, model or optimizer to build
        flops_per_token=0.0,
        peak_flops=None,
    )


def test_a_reported_checkpoint_that_fails_its_check_mid_run_stops_the_run_instead_of_resaving_its_step(
    tmp_path, monkeypatch
):
    """Within one Ray Train run, Ray's checkpoint manager holds the bad checkpoint: resuming from an older one
    would save that step again under the name Ray prunes later. The next job's driver skips it properly."""
    import ray.train

    config = make_config(str(tmp_path), tmp_path)
    storage = Storage(str(tmp_path))
    fake_checkpoint(storage, 4)
    cut_short = fake_checkpoint(storage, 8)
    storage.remove(*cut_short, "__0_0.distcp")
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: ray.train.Checkpoint(storage.path(*cut_short)))
    with pytest.raises(
        StageFailure,
        match=r"failed its check during run r1; continue the run .*checkpoint_000004\): .*__0_0\.distcp \(missing",
    ):
        resolve_start(worker_for(config))
    storage.remove(*RUN, "checkpoint_000004", recursive=True)
    with pytest.raises(StageFailure, match=r"no complete checkpoint to resume from: .*__0_0\.distcp \(missing") as info:
        resolve_start(worker_for(config))
    assert info.value.failure_class is FailureClass.infrastructure


def test_start_is_init_from_only_when_the_run_has_no_checkpoint(tmp_path, monkeypatch):
    import ray.train

    config = make_config(str(tmp_path), tmp_path)
    storage = Storage(str(tmp_path))
    main_run = Storage(str(tmp_path / "main"))
    init_from = main_run.uri(*fake_checkpoint(main_run, 8))
    monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)
    assert resolve_start(worker_for(config)) is None
    assert resolve_start(worker_for(config, init_from=init_from)) == CheckpointRef(8, init_from)
    fake_checkpoint(storage, 4)  # once the run has its own checkpoint, it resumes from that
    start = resolve_start(worker_for(config, init_from=init_from))
    assert start is not None and start.step == 4


# ---------------------------------------------------------------- integration: Ray Train on CPU


@pytest.fixture(scope="module")
def ray_cluster(ray_head, s3_endpoint):
    """This process as a driver of the session Ray head; its workers import the project and get S3 creds."""
    # Ray Train's print patch would echo every worker line twice (its logger plus the original stream).
    env_vars = {
        "PYTHONPATH": str(PROJECT_ROOT),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    }
    env_vars.update({k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")})
    with ray_driver(ray_head, runtime_env={"env_vars": env_vars}):
        yield ray_head


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("base") / "tiny-qwen2")


@pytest.fixture(scope="module")
def local_run(ray_cluster, base_model, tmp_path_factory):
    """The straight 12-step run (checkpoints at 4, 8, 12) that other tests compare against."""
    root = tmp_path_factory.mktemp("storage")
    config = make_config(str(root), base_model)
    write_dataset(Storage(str(root)))
    summary = train(context(config, "run-a"))
    return config, summary


@pytest.mark.integration
def test_straight_run_trains_checkpoints_and_exports(local_run):
    config, summary = local_run
    storage = Storage(config.storage.root)
    assert summary["start_step"] == 0 and summary["restored_from"] is None and summary["steps"] == 12
    assert [c["step"] for c in summary["checkpoints"]] == [4, 8, 12]
    assert summary["latest_checkpoint"]["step"] == 12
    assert [s for s, _ in summary["loss_curve"]] == list(range(1, 13))
    assert summary["final_loss"] < summary["first_loss"]
    assert summary["tokens_per_s"] > 0
    print("peak memory per rank:", summary["memory"], "fit estimate:", summary["fit_estimate"])
    assert [m["rank"] for m in summary["memory"]] == list(range(config.train.num_workers))
    assert all(m["device"] == "cpu" and m["peak_rss_bytes"] > 100 * 2**20 for m in summary["memory"])
    assert summary["fit_estimate"] is None  # estimated for GPU runs, against the GPUs verify reported
    assert summary["export_path"] == "runs/run-a/model"
    export = Path(summary["export_uri"])
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= {p.name for p in export.iterdir()}
    assert check_complete(storage, "runs/run-a/model") is None
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(export)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()


@pytest.mark.integration
def test_replay_from_a_checkpoint_reproduces_the_logged_losses(local_run):
    config, main = local_run
    step4 = next(c["uri"] for c in main["checkpoints"] if c["step"] == 4)
    replay = train(
        context(
            config,
            "run-a",
            job="resume",
            run_name="run-a-resume",
            init_from=step4,
            max_steps=12,
            export=False,
            first_step_marker=True,
        )
    )
    assert replay["start_step"] == 4 and replay["restored_step"] == 4 and replay["restored_from"] == step4
    assert replay["first_step_completed_at"] > 0 and replay["export_path"] is None
    assert [s for s, _ in replay["loss_curve"]] == list(range(5, 13))
    verdict = compare_losses(losses(main), losses(replay), rtol=0.0)
    assert verdict["ok"] and verdict["steps_compared"] == 8 and verdict["max_abs_diff"] == 0.0, verdict


@pytest.mark.integration
def test_init_from_an_incomplete_checkpoint_is_an_infrastructure_failure(local_run, tmp_path):
    config, main = local_run
    import shutil

    broken = tmp_path / "checkpoint_000008"
    shutil.copytree(next(c["uri"] for c in main["checkpoints"] if c["step"] == 8), broken)
    (broken / "__1_0.distcp").unlink()
    with pytest.raises(StageFailure, match=r"__1_0\.distcp \(missing") as info:
        train(context(config, "run-a", job="resume", run_name="run-a-broken", init_from=str(broken)))
    assert info.value.failure_class is FailureClass.infrastructure


@pytest.mark.integration
def test_a_stopped_run_resumes_under_its_name_at_the_saved_step(local_run, ray_cluster):
    """Hold after the step-8 checkpoint, kill the driver, restart: steps 9..12 equal the straight run."""
    config, main = local_run
    job = jobkit.encode_job(
        "run-a",
        "held",
        config,
        {"dataset": DATASET, "run_name": "run-a-held", "hold_after_checkpoint_step": 8, "export": False},
    )
    env = {**os.environ, ENV_VAR: job, "RAY_ADDRESS": ray_cluster.gcs_address, "PYTHONPATH": str(PROJECT_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "training.finetune"],
        cwd=PROJECT_ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        seen = wait_for_line(proc, "HOLDING after checkpoint step 8", timeout=240)
    finally:
        os.killpg(proc.pid, 9)
        proc.wait(30)
    assert any(PROGRESS_PREFIX in line and '"holding": true' in line for line in seen)
    resumed = train(context(config, "run-a", job="held", run_name="run-a-held", export=False, first_step_marker=True))
    assert resumed["restored_step"] == 8 and resumed["start_step"] == 8
    curve = losses(resumed)
    assert sorted(curve) == list(range(1, 13))  # steps 1..8 from the stopped attempt, 9..12 after restart
    assert compare_losses(losses(main), curve, rtol=0.0)["ok"]


@pytest.mark.integration
def test_a_run_whose_ray_snapshot_was_torn_by_a_full_disk_continues_from_its_latest_complete_checkpoint(local_run):
    """Ray rewrites checkpoint_manager_snapshot.json in place; a disk that fills up mid-write leaves it torn
    and Ray's controller dies on it at the next start. The continuation sets it aside and resumes by marker."""
    import shutil

    from training.checkpoint_listing import RAY_SNAPSHOT

    config, main = local_run
    storage = Storage(config.storage.root)
    source, copy = Path(storage.path("runs", "run-a", "train", "run-a")), ("runs", "run-a", "train", "run-a-torn")
    shutil.copytree(source, storage.path(*copy), ignore=shutil.ignore_patterns("checkpoint_000012"))
    snapshot = Path(storage.path(*copy, RAY_SNAPSHOT))
    snapshot.write_bytes(snapshot.read_bytes()[:40])  # lists 4, 8 and 12; cut where the disk filled up
    resumed = train(context(config, "run-a", job="torn", run_name="run-a-torn", export=False, first_step_marker=True))
    assert resumed["restored_step"] == 8 and [s for s, _ in resumed["loss_curve"]] == [9, 10, 11, 12]
    assert compare_losses(losses(main), losses(resumed), rtol=0.0)["ok"]
    assert any(name.startswith(f"{RAY_SNAPSHOT}.unusable-") for name in storage.listdir(*copy))


def wait_for_line(proc: subprocess.Popen, needle: str, timeout: float) -> list[str]:
    deadline, lines = time.monotonic() + timeout, []
    assert proc.stdout is not None, "started without stdout=PIPE"
    os.set_blocking(proc.stdout.fileno(), False)
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line:
            lines.append(line)
            if needle in line:
                return lines
        elif proc.poll() is not None:
            break
        else:
            time.sleep(0.2)
    raise AssertionError(f"{needle!r} not seen within {timeout}s; output tail:\n{''.join(lines[-40:])}")


@pytest.mark.integration
def test_a_nan_loss_stops_training_as_a_modeling_failure(local_run):
    config, _ = local_run
    with pytest.raises(StageFailure) as info:
        train(context(config, "run-nan", inject_nan_at_step=3, max_steps=6))
    failure = info.value
    assert isinstance(failure.summary, FinetuneSummary)
    assert failure.failure_class is FailureClass.modeling and failure.cause == "loss is nan at step 3"
    assert failure.summary.steps == 3 and failure.summary.loss_curve[-1] == (3, None)
    assert failure.summary.checkpoints == []  # stopped before the first checkpoint, none saved after


@pytest.mark.integration
def test_data_prep_and_fine_tune_on_s3_read_back_from_the_bucket(ray_cluster, tmp_path, s3_endpoint):
    """The data stage and the fine-tune with storage on the S3-compatible server: the dataset, a
    checkpoint and the export are then read back from the bucket."""
    import boto3

    from training.data_files import read_split
    from training.data_prep import prepare_data
    from tuneproof.app.tiny_model import DEFAULT_DATA, ensure_tiny_model

    model = tmp_path / "tiny-qwen2"
    ensure_tiny_model(model, DEFAULT_DATA)
    root = f"s3://{TEST_BUCKET}/ft-{int(time.time())}"
    storage = Storage(root, s3_endpoint)
    storage.write_bytes(b"\n".join(DEFAULT_DATA.read_bytes().splitlines()[:300]) + b"\n", "sources", "dates.jsonl")
    config = PipelineConfig.model_validate(
        {
            **make_config(root, model, s3_endpoint, max_steps=4, checkpoint_every=2).model_dump(),
            "data": {"source": f"{root}/sources/dates.jsonl"},
        }
    )
    data = prepare_data(JobContext("run-s3", "data", config)).to_json()
    summary = train(JobContext("run-s3", "finetune", config, {"dataset": data["dataset_path"]}))

    assert data["dataset_uri"].startswith(f"{root}/datasets/dates/")
    assert (
        read_split(storage, data["dataset_path"], "train").num_rows
        == data["manifest"]["splits"]["train"]["rows"]
        == 270
    )
    assert [c["step"] for c in summary["checkpoints"]] == [2, 4]
    assert summary["export_uri"].startswith(f"s3://{TEST_BUCKET}/")
    s3 = boto3.client("s3", endpoint_url=s3_endpoint)
    prefix = root.removeprefix(f"s3://{TEST_BUCKET}/")
    marker = json.loads(
        s3.get_object(Bucket=TEST_BUCKET, Key=f"{prefix}/runs/run-s3/train/run-s3/checkpoint_000004/{MARKER}")[
            "Body"
        ].read()
    )
    assert marker["step"] == 4 and ".metadata" in marker["files"]
    exported = json.loads(
        s3.get_object(Bucket=TEST_BUCKET, Key=f"{prefix}/runs/run-s3/model/config.json")["Body"].read()
    )
    assert exported["tie_word_embeddings"] is True
    latest = latest_complete_checkpoint(storage, "runs", "run-s3", "train", "run-s3")
    assert latest is not None and latest.step == 4
    assert all(math.isfinite(loss) for _, loss in summary["loss_curve"])


def test_every_ranks_sample_ids_together_cover_one_global_batch_in_the_planned_order(tmp_path):
    storage = Storage(str(tmp_path))
    examples = load_examples(storage, write_dataset(storage), "train")
    layout = BatchLayout(micro_batch_size=4, grad_accum_steps=2, world_size=2)
    ranks = [StepBatches(examples, layout, seed=5, rank=r, pad_id=0) for r in range(2)]
    epoch_one = ranks[0].order(1)
    for step in (17, 18):  # epoch 1's first two steps: one global batch of 16 each, no sample twice
        ids = ranks[0].sample_ids(step) + ranks[1].sample_ids(step)
        start = (step - 17) * layout.global_batch
        assert ids == epoch_one[start : start + layout.global_batch].tolist()
        trained = ranks[0].micro_batches(step)[0]["input_ids"][0]
        first = examples[ids[0]].input_ids
        assert trained[: len(first)].tolist() == first.tolist()


def test_the_ledger_folds_each_steps_ids_and_stays_unknown_after_an_unknown_start():
    from training.train_data import fold_ledger, samples_digest

    one = fold_ledger("", 1, [3, 1, 2])
    assert one is not None and one == fold_ledger("", 1, [3, 1, 2]) and len(one) == 64
    assert fold_ledger(one, 2, [0, 4]) != fold_ledger(one, 2, [4, 0])  # the order within a step counts
    assert fold_ledger(one, 2, [0, 4]) != fold_ledger(fold_ledger("", 1, [3, 2, 1]), 2, [0, 4])  # and every step before
    assert fold_ledger(None, 2, [0, 4]) is None
    assert samples_digest([3, 1, 2]) != samples_digest([3, 12]) and len(samples_digest([1])) == 16


def test_the_planted_sampler_bug_changes_what_a_restored_worker_trains_on(tmp_path, monkeypatch):
    """TUNEPROOF_FAULT_AT=sampler:<step>: a worker restored at that step loses its epoch seed (the fault the
    data-order ledger must catch); restored at any other step it is inert."""
    from training import fault_hooks

    storage = Storage(str(tmp_path))
    examples = load_examples(storage, write_dataset(storage), "train")
    layout = BatchLayout(micro_batch_size=4, grad_accum_steps=2, world_size=2)
    planned, restored = (StepBatches(examples, layout, seed=5, rank=0, pad_id=0) for _ in range(2))
    monkeypatch.setenv(fault_hooks.FAULT_AT, "sampler:8")
    fault_hooks.after_restore(restored, 4)
    assert restored.sample_ids(9) == planned.sample_ids(9)
    fault_hooks.after_restore(restored, 8)
    assert restored.sample_ids(9) != planned.sample_ids(9)
    assert sorted(restored.order(0).tolist()) == list(range(len(examples)))  # still a permutation, just unseeded


def test_a_worker_groups_error_is_named_by_the_workers_own_exception_not_rays_header():
    # Ray Train's error opens with a header and ends each rank's traceback with the worker's exception; the
    # connectivity stage showed only the header ("Training failed due to worker errors:") for a bad model.source.
    from ray.train.v2.api.exceptions import WorkerGroupError

    snippet = (
        "[Rank 0,1 Error Snippet]:\nTraceback (most recent call last):\n"
        + '  File "training/connectivity.py", line 130, in rank_story\n' * 40
        + "training.modeling.ModelUnreadable: model directory /etc has no config.json\n"
    )
    error = WorkerGroupError(snippet, {0: OSError("x"), 1: OSError("x")})
    line = error_line(error)
    assert line.startswith("WorkerGroupError: Training failed due to worker errors: ... ")
    assert line.endswith("training.modeling.ModelUnreadable: model directory /etc has no config.json")
    assert error_line(ValueError("one line")) == "ValueError: one line"
    # The fine-tune's cause: the same line, the full text still searched for a full disk.
    assert train_failure_cause(str(error), "/s", line) == f"Ray Train run failed: {line}"
    full = WorkerGroupError(snippet.replace("ModelUnreadable", "OSError: [Errno 28] No space left on device\nX"), {})
    assert train_failure_cause(str(full), "/s", error_line(full)).startswith("storage full")
