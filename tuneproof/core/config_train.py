"""The `train`, `connectivity` and `resume` sections of the config, and LoRA's settings and packaging facts.

TrainConfig (with LoraSettings) is read by the fine-tune job (training/finetune.py) and the resume
test; ConnectivityConfig by the connectivity job; ResumeConfig by the resume stage. PEFT_REQUIREMENT,
LORA_JOB_MODULES and LORA_ADAPTER_DIR say what a LoRA run's jobs add and where its export keeps the
adapter. Runs on both sides (Prefect and inside Ray jobs): it imports only pydantic and the core, which the published
Ray image has.
"""

from __future__ import annotations

import re
import reprlib
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tuneproof.core.config_base import (
    MAX_BATCH,
    MAX_ITERS,
    MAX_LORA_ALPHA,
    MAX_LORA_RANK,
    MAX_MODULE_NAMES,
    MAX_SEED,
    MAX_STEPS,
    MAX_WORKERS,
    Strict,
)

PEFT_REQUIREMENT = "peft==0.21.2"
"""What a LoRA run's jobs add to their runtime_env: peft is not in the published Ray image (exact pin,
so every node resolves the same version and the record names it)."""


LORA_JOB_MODULES = ("training.finetune", "training.resume")
"""Jobs that build the LoRA model: the fine-tune and the resume test's fine-tune jobs. The others get no
peft (a pip runtime_env costs each job a virtualenv set-up; evaluation loads the merged export)."""


LORA_ADAPTER_DIR = "adapter"
"""Where a LoRA export keeps its peft adapter: a folder inside the merged model's (runs/<run>/model/adapter,
models/<name>/<version>/adapter)."""


QWEN2_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSettings(Strict):
    """Low-rank adapters (peft LoRA) on the base model's linear layers; read when train.method is lora."""

    rank: int = Field(8, ge=1, le=MAX_LORA_RANK)
    """r: the rank of each adapter's A (r x in) and B (out x r) matrices, 1..4096."""
    alpha: int = Field(16, ge=1, le=MAX_LORA_ALPHA)
    """lora_alpha: the adapter's output is scaled by alpha / rank, 1..65,536."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """lora_dropout on the adapter's input, finite, [0, 1) (its RNG state is checkpointed, so a resume
    replays it exactly)."""
    target_modules: list[str] = QWEN2_LINEAR
    """Names (last path component) of the linear layers that get adapters: every projection of a Qwen2
    block by default; attention only is q_proj, k_proj, v_proj, o_proj."""
    modules_to_save: list[str] = []
    """Modules trained in full beside the adapters (peft modules_to_save; a name matches every module path
    ending in it, so "norm" is every RMSNorm). A pretrained base needs none. A randomly initialised base
    (the tiny local model) needs ["embed_tokens"]: its frozen tied head (embeddings of norm ~0.16 after an
    RMSNorm) caps every logit near +-1.3, so the loss stalls near 5 whatever the adapters learn. With a tied
    head, naming embed_tokens (or lm_head) trains the one shared weight as both."""

    @field_validator("target_modules")
    @classmethod
    def _named(cls, v: list[str]) -> list[str]:
        if not v or any(not name.strip() for name in v) or len(set(v)) != len(v):
            raise ValueError(f"target_modules must be a non-empty list of distinct module names, got {v!r}")
        return _module_names(v)

    @field_validator("modules_to_save")
    @classmethod
    def _saved_named(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("must list distinct module names")
        return _module_names(v)


MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")


def _module_names(v: list[str]) -> list[str]:
    """At most MAX_MODULE_NAMES names, each a module path component (letters, digits, _ and .)."""
    if len(v) > MAX_MODULE_NAMES:
        raise ValueError(f"{len(v)} module names; at most {MAX_MODULE_NAMES}")
    bad = [name for name in v if not MODULE_NAME.match(name)]
    if bad:
        raise ValueError(
            f"{reprlib.repr(bad)} are not module names (a letter or _, then letters, digits, _ or ., "
            "at most 128 characters)"
        )
    return v


class TrainConfig(Strict):
    method: Literal["full", "lora"] = "full"
    """full: every weight trains. lora: the base is frozen and only low-rank adapters (train.lora) train;
    checkpoints hold the adapters and their optimizer state, the export the adapter and a merged model."""
    lora: LoraSettings = LoraSettings()
    num_workers: int = Field(2, ge=1, le=MAX_WORKERS)
    """Ray Train workers, 1..4096."""
    use_gpu: bool = False
    max_steps: int = Field(400, ge=1, le=MAX_STEPS)
    """Optimizer steps, 1..10,000,000."""
    micro_batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    """Sequences per worker per micro-step, 1..65,536."""
    grad_accum_steps: int = Field(1, ge=1, le=MAX_BATCH)
    lr: float = Field(2e-3, gt=0.0, le=10.0)
    """Peak learning rate, finite, in (0, 10]."""
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS)
    """Steps of linear warmup to lr, 0..max_steps - 1; the cosine decay to min_lr_ratio spans the steps after."""
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    activation_checkpointing: bool = False
    compile: bool = False
    """torch.compile each decoder layer (training.step.compile_layers). Off by default: on CPU compiling
    costs more than it saves at these sizes; on GPU bench/gpu_check.py measures what it gains."""
    sharding: Literal["full", "hybrid", "ddp"] = "full"
    """How parameters, gradients and optimizer state spread over the workers. full: sharded over all
    of them (FSDP2, least memory). hybrid: sharded within a group of shard_group_size workers and
    replicated across groups (HSDP: all-gathers stay on a node's NVLink, only the gradient
    all-reduce crosses nodes). ddp: replicated on every worker, gradients all-reduced (most memory,
    fewest collectives). A checkpoint saved under one resumes under any other (DCP reshards)."""
    shard_group_size: int | None = Field(None, ge=1)
    """Workers per shard group under hybrid sharding; ignored otherwise. None: the workers on one
    node (Ray Train's local world size), which is the GPUs per node with one GPU per worker; on a
    single CPU machine that makes hybrid the same as full, so give it (e.g. 2 of 4 workers) there."""
    checkpoint_every: int = Field(100, ge=1, le=MAX_STEPS)
    num_to_keep: int = Field(3, ge=1, le=1000)
    max_failures: int = Field(0, ge=0, le=100)
    checkpoint_on_preemption: bool = False
    """On Ray's preemption notice (a node of the worker group drained with a deadline, as a spot reclaim
    is), save a checkpoint at once instead of losing the steps since the last one (training.preemption).
    The step loop asks Ray every 5th step (a barrier across the workers). Off locally: one machine is not
    preempted; on in the EKS profile, whose nodes may be spot."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    log_every: int = Field(10, ge=1, le=MAX_STEPS)
    divergence_loss: float = Field(50.0, gt=0.0)
    """A loss above this (or NaN/inf) stops training as a modeling failure."""
    continue_previous: bool = False
    """A fine-tune rerun (`--only finetune` on an existing run) trains a fresh Ray Train run named
    <run>-r<invocation> from the base model. true: continue the latest fine-tune's Ray Train run instead
    (resume its last checkpoint and train on to max_steps); refused when it is already at max_steps."""

    @model_validator(mode="after")
    def _warmup_ends_before_the_last_step(self) -> TrainConfig:
        # At warmup_steps >= max_steps the rate climbs to the end and never decays: min_lr_ratio is never
        # reached and the schedule the record names is not the one that ran. Named in full (train.x): the
        # error reader prints a message that names its section's fields as it is.
        if self.warmup_steps >= self.max_steps:
            raise ValueError(
                f"train.warmup_steps {self.warmup_steps} must be below train.max_steps {self.max_steps}: "
                "warmup would take every step and leave none for the decay; lower train.warmup_steps "
                "or raise train.max_steps"
            )
        return self

    @model_validator(mode="after")
    def _shard_groups_tile_the_workers(self) -> TrainConfig:
        group, workers = self.shard_group_size, self.num_workers
        if self.sharding == "hybrid" and group is not None and workers % group:
            raise ValueError(
                f"hybrid sharding needs shard_group_size to divide num_workers, "
                f"got shard_group_size={group} and num_workers={workers}"
            )
        return self


class ConnectivityConfig(Strict):
    sizes_bytes: list[int] = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22]
    """All-reduce message sizes, each 4 bytes..16 GiB and a multiple of 4: the all-reduce is of float32 elements."""
    iters: int = Field(5, ge=1, le=MAX_ITERS)
    warmup_iters: int = Field(2, ge=0, le=MAX_ITERS)
    fsdp_steps: int = Field(3, ge=1, le=MAX_ITERS)
    expect_transport: Literal["any", "gloo", "efa"] = "any"
    """'efa' fails the stage on socket fallback or inconclusive NCCL logs."""

    @field_validator("sizes_bytes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(s < 4 or s > 1 << 34 for s in v):
            raise ValueError(f"sizes_bytes must be non-empty, each 4 bytes..16 GiB (17179869184), got {v!r}")
        if odd := [s for s in v if s % 4]:
            # size // 4 float32 elements are reduced: 6 would reduce 4 bytes and report bandwidth for 6.
            raise ValueError(f"sizes_bytes must be multiples of 4 bytes (float32 elements), got {odd!r} in {v!r}")
        return sorted(v)


class ResumeConfig(Strict):
    enabled: bool = True
    extra_steps: int = Field(4, ge=1, le=MAX_ITERS)
    """How far past the final checkpoint the interrupted continuation runs before it is stopped."""
    replay_steps: int = Field(5, ge=1, le=MAX_ITERS)
    loss_rtol: float = Field(0.0, ge=0.0, le=1.0)
    """Allowed relative loss difference on replay, finite, 0..1: 0 on CPU fp32; e.g. 0.02 on GPU bf16."""
