"""What a fine-tune may resume from and what counts as training: the stage's own driver (`finetune`) and worker
(`train_loop`) in this process, on one gloo rank, with Ray Train's calls stubbed (tests/test_finetune.py runs
real Ray Train runs in the integration tier).

- a checkpoint resumes only under the settings it was written with (max_steps may grow); one written before
  those were recorded restores unchecked, and the log says so;
- a run whose loss does not fall fails as modeling; a short run or a continuation is not judged;
- after a divergence the latest checkpoint is set aside, so no continuation resumes into it;
- a non-finite gradient norm writes nothing into the weights.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.test_checkpointing import ray_snapshot, single_rank_group, tiny_sharded_model
from tests.test_finetune import context, make_config, write_dataset, write_tiny_model
from training import jobkit
from training.checkpoint_listing import RAY_SNAPSHOT, latest_complete_checkpoint, list_checkpoints, write_marker
from training.checkpointing import MARKER, checkpoint_dir_name
from training.finetune import finetune
from training.finetune_state import METRICS, OUTCOME, TrainParams
from training.finetune_summary import loss_trend
from tuneproof.core import markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.rowlog import append_rows
from tuneproof.core.storage import Storage

__all__ = ["single_rank_group"]  # a fixture: imported for pytest to find by name

RUN = ("runs", "r1", "train", "r1")


@pytest.fixture(scope="module")
def base_model(tmp_path_factory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("base") / "tiny-qwen2")


def in_process(monkeypatch, ray_knows_checkpoints: bool = False) -> None:
    """finetune's Ray Train run replaced by train_loop on this process's one rank, Ray Train's calls stubbed.
    ray_knows_checkpoints: afterwards, write Ray's snapshot listing every checkpoint, as Ray's controller would."""
    import ray.train

    from training import finetune as stage

    def run_trainer(ctx: jobkit.JobContext, params: TrainParams) -> Exception | None:
        where = ctx.storage.path(*ctx.run_parts("train", params.run_name))
        storage = SimpleNamespace(experiment_fs_path=where, storage_filesystem=None)
        monkeypatch.setattr(ray.train, "get_context", lambda: SimpleNamespace(get_storage=lambda: storage))
        monkeypatch.setattr(ray.train, "get_checkpoint", lambda: None)  # resolve_start resumes by marker
        monkeypatch.setattr(ray.train, "report", lambda *args, **kwargs: None)
        job = jobkit.encode_job(ctx.run_id, ctx.job, ctx.config, params.model_dump())
        try:
            stage.train_loop({"job": job})
        except RuntimeError as e:  # a classified failure, already in outcome.json: Ray sees only that it stopped
            return e
        finally:
            if ray_knows_checkpoints:
                names = [name for _, name in reversed(list_checkpoints(ctx.storage, *RUN))]
                ctx.storage.write_bytes(ray_snapshot(*names), *RUN, RAY_SNAPSHOT)
        return None

    monkeypatch.setattr(stage, "run_trainer", run_trainer)


def one_worker(root: Path, base_model: Path, **train) -> PipelineConfig:
    """tests/test_finetune.py's config on one worker, without the resume test (whose steps short runs lack)."""
    defaults = make_config(str(root), base_model).train.model_dump(mode="json")
    return PipelineConfig.model_validate(
        {
            "storage": {"root": str(root)},
            "model": {"source": str(base_model)},
            "train": {**defaults, "num_workers": 1, **train},
            "resume": {"enabled": False},
        }
    )


def without_identity(storage: Storage, step: int) -> None:
    """Make a checkpoint look written before identities were recorded: none in its progress, marker rewritten."""
    parts = (*RUN, checkpoint_dir_name(step))
    progress = storage.read_json(*parts, "progress-rank0.json")
    del progress["identity"]
    storage.write_bytes(json.dumps(progress).encode(), *parts, "progress-rank0.json")
    files = markers.local_digests(storage.path(*parts))
    write_marker(storage, step, {n: d for n, d in files.items() if n != MARKER}, *parts)


# ---- resume only under the same settings ---------------------------------------------------------------


def test_a_checkpoint_resumes_only_under_the_settings_it_was_written_with(
    single_rank_group, base_model, tmp_path, monkeypatch
):
    in_process(monkeypatch)
    storage = Storage(str(tmp_path))
    write_dataset(storage)
    first = finetune(context(one_worker(tmp_path, base_model, max_steps=20, checkpoint_every=10), "r1", export=False))
    assert first.loss_falling is True and first.steps == 20  # a healthy run passes the loss rule

    other_data = write_dataset(storage, "datasets/other/def456", n_train=200)
    changed = one_worker(tmp_path, base_model, max_steps=22, checkpoint_every=2, lr=1e-3, seed=5, micro_batch_size=4)
    with pytest.raises(StageFailure) as refused:
        finetune(context(changed, "r1", job="finetune-r2", dataset=other_data, export=False))
    assert refused.value.failure_class is FailureClass.infrastructure
    assert refused.value.cause.startswith("checkpoint checkpoint_000020 was written under other settings")
    for differs in (
        "dataset (checkpoint 'datasets/reverse/abc123', this run 'datasets/other/def456')",
        "train.seed (checkpoint 0, this run 5)",
        "train.lr (checkpoint 0.003, this run 0.001)",
        "train.micro_batch_size x train.grad_accum_steps x workers (checkpoint 8, this run 4)",
    ):
        assert differs in refused.value.cause
    assert "warmup" not in refused.value.cause  # only what differs is named

    longer = one_worker(tmp_path, base_model, max_steps=22, checkpoint_every=2)  # max_steps alone may grow
    continued = finetune(context(longer, "r1", job="finetune-r3", export=False))
    assert (continued.start_step, continued.steps) == (20, 22)
    assert (
        continued.loss_falling is None and continued.loss_trend == "not judged: this job continued the run from step 20"
    )


def test_a_checkpoint_written_before_identities_restores_unchecked_and_says_so(
    single_rank_group, base_model, tmp_path, monkeypatch, capsys
):
    in_process(monkeypatch)
    storage = Storage(str(tmp_path))
    write_dataset(storage)
    finetune(context(one_worker(tmp_path, base_model, max_steps=4, checkpoint_every=4), "r1", export=False))
    without_identity(storage, 4)
    other_lr = one_worker(tmp_path, base_model, max_steps=6, checkpoint_every=2, lr=1e-3)
    resumed = finetune(context(other_lr, "r1", job="finetune-r2", export=False))
    assert resumed.start_step == 4
    assert "records no run identity (written before it was recorded)" in capsys.readouterr().out


# ---- loss finite and falling ---------------------------------------------------------------------------


def test_the_loss_rule_compares_the_mean_of_the_first_and_last_tenth_of_a_run_trained_from_step_1():
    falling = [(s, 5.0 - 0.1 * s) for s in range(1, 41)]
    assert loss_trend(falling) == (True, "mean loss 1.15 over steps 37-40, 4.75 over steps 1-4")
    noisy = [(s, 5.0 - 0.1 * s + (1.0 if s == 40 else 0.0)) for s in range(1, 41)]  # one bad step: means decide
    assert loss_trend(noisy)[0] is True
    rising = [(s, 5.6 + 0.4 * s) for s in range(1, 21)]
    assert loss_trend(rising) == (False, "mean loss 13.4 over steps 19-20, 6.2 over steps 1-2")
    assert loss_trend([(1, 5.0)]) == (None, "not judged: too few steps to judge (1, fewer than 20)")
    assert loss_trend([(s, 1.0 + s) for s in range(31, 61)])[0] is None  # a continuation: the run's middle
    assert loss_trend([(1, 5.0), (2, None)]) == (False, "the loss is not finite at step 2")


def test_a_run_whose_loss_rose_fails_as_modeling(tmp_path, monkeypatch):
    """What the workers leave for a run at lr 1.0: every step completed, the loss from 5.6 up to 14."""
    from training import finetune as stage

    def run_trainer(ctx: jobkit.JobContext, params: TrainParams) -> None:
        rows = [{"step": s, "loss": 5.6 + 0.45 * s, "tokens_per_s": 1.0} for s in range(1, 21)]
        append_rows(ctx.storage, rows, *ctx.stage_parts(METRICS))
        outcome = {"status": "completed", "cause": None, "start_step": 0, "steps": 20, "restored_from": None}
        outcome |= {"first_step_completed_at": None, "export_path": None, "trainable_params": 1, "total_params": 1}
        ctx.storage.write_json(outcome, *ctx.stage_parts(OUTCOME))

    monkeypatch.setattr(stage, "run_trainer", run_trainer)
    with pytest.raises(StageFailure) as failed:
        finetune(context(one_worker(tmp_path, tmp_path, max_steps=20), "r1", export=False))
    assert failed.value.failure_class is FailureClass.modeling
    assert failed.value.cause == "the loss did not fall: mean loss 14.38 over steps 19-20, 6.275 over steps 1-2"


# ---- divergence ----------------------------------------------------------------------------------------


def test_a_divergence_sets_the_latest_checkpoint_aside_so_no_continuation_resumes_into_it(
    single_rank_group, base_model, tmp_path, monkeypatch
):
    """At lr 1.5 the loss passes train.divergence_loss at step 5: the step-4 checkpoint holds the very weights
    whose loss diverged. Ray Train had registered it: its snapshot must no longer name it either."""
    in_process(monkeypatch, ray_knows_checkpoints=True)
    storage = Storage(str(tmp_path))
    write_dataset(storage)
    config = one_worker(tmp_path, base_model, max_steps=8, checkpoint_every=4, lr=1.5)
    with pytest.raises(StageFailure) as diverged:
        finetune(context(config, "r1", export=False))
    assert diverged.value.failure_class is FailureClass.modeling
    assert (
        diverged.value.cause.startswith("loss is ") and "at step 5, above train.divergence_loss" in diverged.value.cause
    )
    assert latest_complete_checkpoint(storage, *RUN) is None
    [aside] = diverged.value.summary.skipped_checkpoints  # type: ignore[union-attr]
    assert (aside.name, aside.step, aside.dropped_from_ray) == ("checkpoint_000004", 4, True)
    assert aside.reason.startswith("the loss diverged after it: loss is ")
    assert storage.exists(*RUN, aside.set_aside_as or "", MARKER)  # kept as evidence, under a name no listing takes
    assert "checkpoint_000004" not in storage.read_bytes(*RUN, RAY_SNAPSHOT).decode()


def test_a_non_finite_gradient_norm_leaves_the_weights_as_they_were(single_rank_group, monkeypatch):
    import training.fsdp
    from training.step import optimizer_step

    model, optimizer = tiny_sharded_model(seed=0)
    before = [p.full_tensor().clone() for p in model.parameters()]
    monkeypatch.setattr(training.fsdp, "clip_gradients", lambda model, max_norm: math.inf)
    ids = torch.randint(0, 64, (2, 8))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    loss, norm = optimizer_step(model, optimizer, [batch], targets=14, max_grad_norm=1.0)
    assert math.isfinite(loss) and norm == math.inf
    assert all(torch.equal(a, p.full_tensor()) for a, p in zip(before, model.parameters()))
