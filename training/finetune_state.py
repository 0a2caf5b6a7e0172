"""What the fine-tune's driver and its Ray Train workers share: the job's parameters and one rank's state.

Imported by training/finetune.py (the driver validates TrainParams from the job's params; each worker
validates them again from the encoded job), training/finetune_worker.py and training/finetune_saving.py
(every rank's helpers take the Worker that `finetune_worker.setup` builds) and training/resume.py. The
file names here are where workers leave results for the driver under runs/<run>/stages/<job>/.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from training import jobkit
from training.checkpointing import ShardsInFlight, StagingBuffers
from training.jobkit import JobContext
from training.preemption import NoticeWatch
from training.schedule import WarmupCosine
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import METRICS_LOG

if TYPE_CHECKING:  # torch and the data module load inside workers only
    import torch
    from transformers import PreTrainedModel

    from training.train_data import StepBatches


OUTCOME = "outcome.json"


METRICS = METRICS_LOG


INTERRUPTED = "interrupted.json"
"""Written by rank 0 just before a planned interruption kills every rank: {step, time}."""


class TrainParams(BaseModel):
    """What the submitting task may set for one fine-tune job; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    dataset: str
    """Storage path of the prepared dataset, datasets/<name>/<hash>."""
    run_name: str
    """Ray Train run name (RunConfig.name); the same name resumes. Defaults to the run id."""
    init_from: str | None = None
    """URI of a complete checkpoint to start from when run_name has none of its own."""
    max_steps: int = Field(ge=1)
    """Step to stop after; defaults to train.max_steps. The LR schedule always spans train.max_steps,
    so a run stopped early or continued past the end replays the same rates step for step."""
    checkpoint_every: int = Field(ge=1)
    export: bool = True
    hold_after_checkpoint_step: int | None = Field(None, ge=1)
    """After this step's checkpoint is complete, every rank sleeps until the job is stopped from outside."""
    interrupt_after_checkpoint_step: int | None = Field(None, ge=1)
    """After this step's checkpoint is complete, every rank SIGKILLs itself (the resume test's interruption).
    The run's max_failures is 0 then: the kill ends the run, and the restart under test is a new one."""
    first_step_marker: bool = False
    """Record restored_step and first_step_completed_at (unix time) in the summary."""
    inject_nan_at_step: int | None = Field(None, ge=1)
    """Test hook: make the loss NaN at this step."""
    invocation: int | None = None
    """The run record's invocation this job belongs to; written into the export's manifest."""
    gpu_memory_bytes: int | None = Field(None, ge=1)
    """The smallest GPU the verify stage reported (the task reads it from the record); None: unknown."""

    @model_validator(mode="after")
    def _stop_on_a_checkpoint(self) -> TrainParams:
        stops = {"hold_after_checkpoint_step": self.hold_after_checkpoint_step}
        stops["interrupt_after_checkpoint_step"] = self.interrupt_after_checkpoint_step
        if None not in stops.values():
            raise ValueError("hold_after_checkpoint_step and interrupt_after_checkpoint_step do not combine")
        for name, step in stops.items():
            if step is not None and step % self.checkpoint_every and step != self.max_steps:
                raise ValueError(
                    f"{name} must be a checkpoint step (a multiple of checkpoint_every "
                    f"{self.checkpoint_every}, or max_steps {self.max_steps}), got {step}"
                )
        return self

    @classmethod
    def resolve(cls, ctx: JobContext) -> TrainParams:
        defaults = {
            "run_name": ctx.run_id,
            "max_steps": ctx.config.train.max_steps,
            "checkpoint_every": ctx.config.train.checkpoint_every,
        }
        return cls.model_validate({**defaults, **ctx.params})

    def export_dir(self, run_id: str) -> str:
        """runs/<run>/model for the run's own training; a differently named run exports beside it."""
        return "model" if self.run_name == run_id else f"model-{self.run_name}"


def run_identity(ctx: JobContext, params: TrainParams, world_size: int) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes from it, by the setting that decides each. Pure.

    Each decides what the steps after the checkpoint train or how: the base model, the dataset (its path
    names its content hash) and the method what is trained on what; the seed and the global batch which
    samples each step takes (training.train_data cuts step s out of a (seed, epoch) permutation by the global
    batch); the peak rate, warmup and floor the rate at each step. Not in it: train.max_steps (a continuation
    raises it to train on; the cosine then spans the new end), and the worker count alone (DCP reshards, and
    an equal global batch keeps every step's samples)."""
    cfg = ctx.config
    return {
        "model.source": cfg.model.source,
        "model.revision": cfg.model.revision,
        "dataset": params.dataset,
        "train.method": cfg.train.method,
        "train.lora": cfg.train.lora.model_dump(mode="json") if cfg.train.method == "lora" else None,
        "train.seed": cfg.train.seed,
        "train.lr": cfg.train.lr,
        "train.warmup_steps": cfg.train.warmup_steps,
        "train.min_lr_ratio": cfg.train.min_lr_ratio,
        "train.micro_batch_size x train.grad_accum_steps x workers": (
            cfg.train.micro_batch_size * cfg.train.grad_accum_steps * world_size
        ),
    }


def identity_differences(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """Each setting of `current` the checkpoint recorded with another value, as 'name (checkpoint X, this run
    Y)'. Pure. A setting the checkpoint did not record (added since it was written) is not compared."""
    return [
        f"{name} (checkpoint {saved[name]!r}, this run {value!r})"
        for name, value in current.items()
        if name in saved and saved[name] != value
    ]


@dataclass
class Worker:
    """Everything one rank trains with; built once by `setup`."""

    ctx: JobContext
    params: TrainParams
    rank: int
    world_size: int
    device: torch.device
    model: PreTrainedModel
    """The FSDP2-sharded model."""
    optimizer: torch.optim.Optimizer
    batches: StepBatches
    schedule: WarmupCosine
    flops_per_token: float
    """Model FLOPs per trained token (training.flops), for MFU."""
    peak_flops: float | None
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """Rank 0: the rows logged since the last flush, which appends them to metrics.jsonl."""
    metrics_chunk: int | None = None
    """On S3, the number of this worker's last metrics chunk (None: list the chunks once to find it)."""
    restored_from: str | None = None
    attempt: int = 0
    """Which start of the worker group this is within the job (0 first; more after Ray Train restarts)."""
    first_step_completed_at: float | None = None
    param_counts: tuple[int, int] = (0, 0)
    """(trainable, total) parameters of the model as set up (base + adapters under LoRA)."""
    mesh: list[int] = field(default_factory=list)
    """The device mesh's shape the model is sharded on (training.fsdp.mesh_shape)."""
    save_group: Any = None
    """A gloo process group of the checkpoint writer's own (the async DCP save's collectives run on it)."""
    saving: ShardsInFlight | None = None
    """The checkpoint whose shards are being written in the background; not complete, no marker yet."""
    staging: StagingBuffers = field(default_factory=StagingBuffers)
    """CPU memory each asynchronous save copies the state into, kept across saves (one save at a time)."""
    ledger: str | None = ""
    """The data-order ledger after the last step trained (training.train_data.fold_ledger); "" before step 1."""
    samples: str = ""
    """The last step's sample ids, as their digest (every rank's)."""
    notices: NoticeWatch = field(default_factory=lambda: NoticeWatch(enabled=False))
    """Ray's preemption notices (train.checkpoint_on_preemption), asked every few steps."""
    identity: dict[str, Any] = field(default_factory=dict)
    """run_identity of this run: saved in every checkpoint's progress, compared with a checkpoint's at restore."""

    def log(self, message: str) -> None:
        if self.rank == 0:
            jobkit.log(message)

    @property
    def storage(self) -> Storage:
        return self.ctx.storage

    @property
    def run_parts(self) -> tuple[str, ...]:
        return self.ctx.run_parts("train", self.params.run_name)

    @property
    def lora(self) -> bool:
        """Only the adapters train: checkpoints hold them (and their optimizer state), not the frozen base."""
        return self.ctx.config.train.method == "lora"
