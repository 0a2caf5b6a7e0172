"""The GPU check, in one shot: MFU of the Qwen2.5-1.5B shape over a small sweep, the job's own step, a DCP
round trip and the Hugging Face export, with peak memory for each. Writes gpu_check.json and gpu_check.log.

    python3 bench/gpu_check.py                     # on a GPU machine with torch + transformers (README, "The GPU check")
    .venv/bin/python bench/gpu_check.py --dry-run  # CPU, about a minute: every phase at a tiny shape

It runs on the machine a session may be lent (one H100 or H200; Python 3.12 with torch, transformers and fsspec, no
Ray, no Prefect, no pydantic, nothing downloadable) as that machine is: the sweep and the step import only
torch, transformers and training.{step,fsdp,flops,schedule}; the checkpoint and export phases use the
job's own training.checkpointing, which needs pydantic, carried as the four wheels of CARRIED_WHEELS.
tests/test_gpu_check.py runs --dry-run with Ray, Prefect and whatever that machine lacks made unimportable.

Results go to $OUT (the device tool's folder; else bench/out/gpu_check/): the JSON is rewritten after every
phase, so a run cut short keeps what it measured. Every phase and sweep variant is a row: an out-of-memory
or any other failure is recorded with its one-line cause, and a variant the time budget cannot fit is
recorded as skipped. The model is built locally with random weights (nothing is downloaded); one process,
FSDP2 over a one-GPU process group, bf16 compute with fp32 master weights, as the fine-tune runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import statistics
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training import step as job_step  # noqa: E402
from training.flops import ModelShape, mfu, peak_bf16_flops, train_flops_per_token  # noqa: E402
from training.fsdp import shard_model  # noqa: E402
from tuneproof.core.hashing import IGNORE_INDEX  # noqa: E402

if TYPE_CHECKING:
    from tuneproof.core.config import TrainConfig

QWEN25_1_5B = dict(
    vocab_size=151936,
    hidden_size=1536,
    intermediate_size=8960,
    num_hidden_layers=28,
    num_attention_heads=12,
    num_key_value_heads=2,
    max_position_embeddings=131072,
    rope_theta=1e6,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    tie_word_embeddings=True,
    use_sliding_window=False,
    max_window_layers=28,
    use_cache=False,  # training: no KV cache
)
"""Qwen/Qwen2.5-1.5B's config.json less its token ids (random tokens need none); 1.54B parameters."""
QWEN25_1_5B_PARAMS = 1_543_714_304
"""numel of the model above: embedding 233,373,696 (tied lm_head) + 28 layers x 46,797,824 + final norm 1,536."""
DRY_SHAPE = dict(
    QWEN25_1_5B, vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
)
"""The dry run's model: the real architecture at a size two CPU cores step in milliseconds."""

CARRIED_WHEELS = ("pydantic==2.14.4", "pydantic_core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5")
"""What the checkpoint and export phases need that the lent machine lacks (constraints.txt's versions; 2.4 MB
of cp312 manylinux wheels together): README, "The GPU check", gives the download and the install."""


@dataclass(frozen=True)
class Variant:
    """One configuration of the sweep."""

    name: str
    micro_batch: int
    loss: str = "chunked"
    """chunked: training.step.token_loss_sum. full: the full fp32 logits (the loss before it)."""
    fused_adamw: bool = True
    compile: bool = False
    checkpointing: str = "off"
    """Activation checkpointing: off, selective (every second layer) or full."""


SWEEP = (
    Variant("before: eager, full logits, foreach AdamW", 2, loss="full", fused_adamw=False),
    Variant("chunked loss", 2, fused_adamw=False),
    Variant("chunked loss + fused AdamW", 2),
    Variant("+ selective checkpointing", 2, checkpointing="selective"),
    Variant("+ full checkpointing", 2, checkpointing="full"),
    Variant("micro-batch 8", 8),
    Variant("micro-batch 8, full checkpointing", 8, checkpointing="full"),
    Variant("compiled", 2, compile=True),
    Variant("compiled, micro-batch 8", 8, compile=True),
    Variant("compiled, micro-batch 8, selective", 8, compile=True, checkpointing="selective"),
    Variant("compiled, micro-batch 16, selective", 16, compile=True, checkpointing="selective"),
    Variant("compiled, micro-batch 16, full checkpointing", 16, compile=True, checkpointing="full"),
)
"""Eager first (each under a minute), compiled last: a compile costs about a minute, and whatever the time
budget cannot fit becomes a skipped row rather than a run past the device call's limit."""


@dataclass
class Plan:
    """How big and how long: the real run, or the dry run's small version of every number."""

    shape: dict[str, Any]
    seq_len: int
    warmup: int
    timed: int
    job_steps: int
    budget_s: float
    compile_backend: str
    device: torch.device
    dry_run: bool
    out_dir: Path
    repeats: int = 1
    """Rounds of the whole sweep, one after another (every variant once a round), then each variant's median."""
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)


@dataclass
class Row:
    """What one phase or variant measured; error or skipped when it has no figures."""

    name: str
    settings: dict[str, Any] = field(default_factory=dict)
    figures: dict[str, Any] = field(default_factory=dict)
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    seconds: float | None = None
    error: str | None = None
    skipped: str | None = None


# ---------------------------------------------------------------- output


class Report:
    """gpu_check.json (rewritten after each row) and gpu_check.log (every line printed)."""

    def __init__(self, out_dir: Path, header: dict[str, Any]) -> None:
        out_dir.mkdir(parents=True, exist_ok=True)
        self.json_path, self.log_path = out_dir / "gpu_check.json", out_dir / "gpu_check.log"
        self.log_path.write_text("")
        self.header = header
        self.rows: list[Row] = []

    def say(self, line: str) -> None:
        print(line, flush=True)
        with self.log_path.open("a") as log:
            log.write(line + "\n")

    def add(self, row: Row) -> Row:
        self.rows.append(row)
        shown = row.error or row.skipped or ", ".join(f"{k} {fmt(v)}" for k, v in row.figures.items())
        memory = f"; peak {row.peak_allocated_gib:.1f} GiB allocated" if row.peak_allocated_gib is not None else ""
        self.say(f"{row.name}: {shown}{memory}")
        self.json_path.write_text(json.dumps({**self.header, "rows": [asdict(r) for r in self.rows]}, indent=1) + "\n")
        return row


def fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def out_dir() -> Path:
    """$OUT where the device tool sets it; bench/out/gpu_check otherwise."""
    if os.environ.get("OUT"):
        return Path(os.environ["OUT"])
    return Path(__file__).resolve().parent / "out" / "gpu_check"


# ---------------------------------------------------------------- pieces


def model_config(shape: dict[str, Any]):
    from transformers import Qwen2Config

    return Qwen2Config(**shape)


def build_model(plan: Plan, seed: int = 0):
    """Random fp32 weights made on the device (no host copy); fp32 master weights, as the fine-tune keeps."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    with plan.device:
        return AutoModelForCausalLM.from_config(model_config(plan.shape), dtype=torch.float32)


def prepared(plan: Plan, variant: Variant, seed: int = 0):
    """The sharded model and its optimizer for a variant: checkpointing and compile before FSDP2, as
    training.finetune_worker.setup does."""
    model = build_model(plan, seed)
    job_step.set_activation_checkpointing(model, variant.checkpointing)
    if variant.compile:
        job_step.compile_layers(model, plan.compile_backend)
    shard_model(model, plan.device, activation_checkpointing=False).train()
    optimizer = job_step.build_optimizer(model.parameters(), 1e-4, 0.0, plan.device, fused=variant.fused_adamw)
    return model, optimizer


def random_batch(plan: Plan, micro_batch: int, seed: int, prompt_fraction: float = 0.0) -> dict[str, torch.Tensor]:
    """Random tokens, every position labelled except a masked prompt (the first prompt_fraction of each)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, plan.shape["vocab_size"], (micro_batch, plan.seq_len), generator=g)
    labels = ids.clone()
    labels[:, : int(plan.seq_len * prompt_fraction)] = IGNORE_INDEX
    batch = {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}
    return {k: v.to(plan.device) for k, v in batch.items()}


def synchronize(plan: Plan) -> None:
    if plan.device.type == "cuda":
        torch.cuda.synchronize(plan.device)


def reset_memory(plan: Plan) -> None:
    gc.collect()
    if plan.device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(plan.device)


def record_memory(plan: Plan, row: Row) -> None:
    if plan.device.type == "cuda":
        row.peak_allocated_gib = round(torch.cuda.max_memory_allocated(plan.device) / 2**30, 3)
        row.peak_reserved_gib = round(torch.cuda.max_memory_reserved(plan.device) / 2**30, 3)


def guarded(report: Report, plan: Plan, name: str, settings: dict, needs_s: float, body: Callable[[Row], None]) -> Row:
    """Run one phase or variant as a row: out of memory or any failure becomes its error, too little time
    left its skip. Frees the device after it either way."""
    row = Row(name, settings)
    if plan.left() < needs_s:
        row.skipped = f"time budget: {plan.left():.0f} s left, this needs about {needs_s:.0f} s"
        return report.add(row)
    reset_memory(plan)
    began = time.monotonic()
    try:
        body(row)
    except torch.OutOfMemoryError as e:
        row.error = f"out of memory: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - every failure is a row; the traceback goes to the log
        row.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        report.say(traceback.format_exc())
    finally:
        record_memory(plan, row)
        row.seconds = round(time.monotonic() - began, 2)
        reset_memory(plan)
    return report.add(row)


# ---------------------------------------------------------------- phases


def sweep_variant(plan: Plan, variant: Variant, peak: float | None) -> Callable[[Row], None]:
    """Warm up, then time plan.timed optimizer steps of training.step.optimizer_step on one batch."""

    def body(row: Row) -> None:
        model, optimizer = prepared(plan, variant)
        batch = random_batch(plan, variant.micro_batch, seed=1)
        loss_fn = job_step.token_loss_sum if variant.loss == "chunked" else job_step.full_logits_loss_sum
        targets = variant.micro_batch * (plan.seq_len - 1)
        for _ in range(plan.warmup):
            job_step.optimizer_step(model, optimizer, [batch], targets, 1.0, loss_fn)
        synchronize(plan)
        if plan.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(plan.device)  # the steady state, compile's workspace aside
        began = time.perf_counter()
        for _ in range(plan.timed):
            loss, _ = job_step.optimizer_step(model, optimizer, [batch], targets, 1.0, loss_fn)
        synchronize(plan)
        seconds = (time.perf_counter() - began) / plan.timed
        tokens_per_s = variant.micro_batch * plan.seq_len / seconds
        row.figures = {"step_s": seconds, "tokens_per_s": tokens_per_s, "loss": loss}
        if peak:
            flops = train_flops_per_token(ModelShape.from_hf(model_config(plan.shape)), plan.seq_len)
            row.figures["mfu"] = mfu(flops, tokens_per_s, peak)
        if variant.checkpointing != "selective":  # the estimate knows checkpointing on or off
            row.figures["estimate_gib"] = estimated_gib(plan, variant)

    return body


def estimated_gib(plan: Plan, variant: Variant) -> float:
    """What the fine-tune's fit estimate (training.memory) says this variant needs, to judge it by the
    measured peak. Imported here: it needs pydantic (a carried wheel on the lent machine)."""
    from training.memory import fit_estimate

    # The fields fit_estimate reads of a full fine-tune's TrainConfig: the real model would import
    # tuneproof.core.config, which needs yaml, not on the lent machine.
    train = argparse.Namespace(
        method="full",
        micro_batch_size=variant.micro_batch,
        activation_checkpointing=variant.checkpointing == "full",
        sharding="full",
        shard_group_size=None,
    )
    fit = fit_estimate(
        model_config(plan.shape), cast("TrainConfig", train), plan.seq_len, 1, plan.device.type == "cuda", None
    )
    return round(fit.total_bytes / 2**30, 3)


def job_phase(plan: Plan, state: dict[str, Any]) -> Callable[[Row], None]:
    """The fine-tune's own step (global_counts + optimizer_step, the schedule, grad accumulation over two
    micro-batches with a masked prompt) for plan.job_steps steps on a fixed set of batches: the loss must
    stay finite and fall. Keeps the trained model and optimizer in `state` for the checkpoint phases."""
    from training.schedule import WarmupCosine

    def body(row: Row) -> None:
        model, optimizer = prepared(plan, Variant("job", micro_batch=2))
        schedule = WarmupCosine(3e-4, 2, plan.job_steps, 0.1)
        micro = [random_batch(plan, 2, seed=s, prompt_fraction=0.25) for s in (1, 2)]
        losses, seconds = [], []
        for step in range(1, plan.job_steps + 1):
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = schedule.lr_at(step)
            targets, _ = job_step.global_counts(micro, plan.device)
            loss, grad_norm = job_step.optimizer_step(model, optimizer, micro, targets, 1.0)
            losses.append(loss)
            seconds.append(time.perf_counter() - began)
        if not all(math.isfinite(x) for x in losses) or losses[-1] >= losses[0]:
            raise AssertionError(f"the loss did not fall finitely over {plan.job_steps} steps: {losses}")
        row.figures = {
            "first_loss": losses[0],
            "last_loss": losses[-1],
            "median_step_s": sorted(seconds)[len(seconds) // 2],
        }
        state.update(model=model, optimizer=optimizer, step=plan.job_steps)

    return body


def checkpoint_phase(plan: Plan, state: dict[str, Any], scratch: Path) -> Callable[[Row], None]:
    """training.checkpointing's asynchronous save of the trained state, then load_shards into a model and
    optimizer built from another seed: every tensor of both state dicts must come back bitwise equal."""
    from training.checkpoint_listing import write_marker
    from training.checkpointing import (
        StagingBuffers,
        TrainingProgress,
        capture_rng,
        finish_saving_shards,
        load_shards,
        start_saving_shards,
    )
    from tuneproof.core.storage import Storage

    def body(row: Row) -> None:
        model, optimizer, step = state["model"], state["optimizer"], state["step"]
        progress = TrainingProgress(step, 0, step, 0, 0, 1, {}, capture_rng())
        began = time.perf_counter()
        saving = start_saving_shards(
            model,
            optimizer,
            progress,
            Storage(str(scratch)),
            ("checkpoint",),
            dist.new_group(backend="gloo"),
            buffers=StagingBuffers(),
        )
        files = finish_saving_shards(saving)
        write_marker(Storage(str(scratch)), step, files, "checkpoint")
        saved_s = time.perf_counter() - began
        fresh, fresh_optimizer = prepared(plan, Variant("reload", micro_batch=2), seed=7)
        began = time.perf_counter()
        load_shards(fresh, fresh_optimizer, Storage(str(scratch / "checkpoint")), rank=0)
        loaded_s = time.perf_counter() - began
        different = unequal_tensors(state_tensors(model, optimizer), state_tensors(fresh, fresh_optimizer))
        if different:
            raise AssertionError(f"{len(different)} tensors differ after the reload, e.g. {different[:3]}")
        row.figures = {
            "save_s": saved_s,
            "load_s": loaded_s,
            "gib": sum(f.size for f in files.values()) / 2**30,
            "tensors_equal": len(state_tensors(model, optimizer)),
        }
        del fresh, fresh_optimizer

    return body


def state_tensors(model, optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model's and optimizer's state dicts, whole (DTensors gathered), by flat key."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    flat: dict[str, torch.Tensor] = {}

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                walk(f"{prefix}.{key}", inner)
        elif isinstance(value, list):
            for i, inner in enumerate(value):
                walk(f"{prefix}.{i}", inner)
        elif isinstance(value, torch.Tensor):
            flat[prefix] = value.full_tensor() if hasattr(value, "full_tensor") else value

    walk("", dict(zip(("model", "optim"), get_state_dict(model, optimizer), strict=True)))
    return flat


def unequal_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[str]:
    if a.keys() != b.keys():
        return sorted(a.keys() ^ b.keys())
    return [k for k in a if a[k].dtype != b[k].dtype or not torch.equal(a[k], b[k])]


def export_phase(plan: Plan, state: dict[str, Any], scratch: Path) -> Callable[[Row], None]:
    """training.hf_export.write_hf_export of the trained weights (bf16, as the base config says), then
    transformers reads the export back: every weight must equal the trained one cast to bf16."""
    from transformers import AutoModelForCausalLM

    from training.fsdp import full_state_dict
    from training.hf_export import write_hf_export
    from tuneproof.core.storage import Storage

    def body(row: Row) -> None:
        base = scratch / "base"
        config = model_config(plan.shape)
        config.dtype = "bfloat16"
        config.save_pretrained(base)
        began = time.perf_counter()
        weights = full_state_dict(state["model"])
        source = argparse.Namespace(source=str(base), revision=None)
        made_by = {"run_id": "gpu-check", "invocation": None, "run_name": "gpu-check"}
        manifest = write_hf_export(weights, state["step"], source, None, Storage(str(scratch)), "export", made_by)
        exported_s = time.perf_counter() - began
        back = AutoModelForCausalLM.from_pretrained(scratch / "export", dtype=torch.bfloat16).state_dict()
        expected = {k: v.to(torch.bfloat16) for k, v in weights.items()}
        different = unequal_tensors(expected, {k: v for k, v in back.items() if k in expected})
        if different:
            raise AssertionError(
                f"{len(different)} exported weights differ from the trained ones, e.g. {different[:3]}"
            )
        row.figures = {"export_s": exported_s, "files": len(manifest.files), "weights_equal": len(expected)}

    return body


# ---------------------------------------------------------------- the run


def run(plan: Plan) -> Report:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # bars make an unreadable log
    peak = peak_bf16_flops(torch.cuda.get_device_name(plan.device)) if plan.device.type == "cuda" else None
    report = Report(plan.out_dir, header(plan, peak))
    report.say(json.dumps(report.header))
    if plan.dry_run:
        report.add(Row("real shapes", figures=check_real_shapes(2048)))
    # Every row collects garbage before and after it (reset_memory): with torch and transformers imported
    # that is a walk of some 375,000 objects, 0.16 s a collection, a third of the dry run's 14 s.
    # Frozen here, before any phase has made a tensor, they are left out of the walks; nothing of a row's
    # own (its model, its CUDA memory) can be among them.
    gc.freeze()
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        scratch = Path(tmp)
        guarded(report, plan, "job step", {"steps": plan.job_steps}, 30, job_phase(plan, state))
        if "model" in state:
            guarded(report, plan, "DCP round trip", {}, 60, checkpoint_phase(plan, state, scratch))
            guarded(report, plan, "Hugging Face export", {}, 45, export_phase(plan, state, scratch))
        state.clear()
    measured: dict[str, list[Row]] = {}
    for repeat in range(1, plan.repeats + 1):
        for variant in SWEEP:
            needs = (90 if variant.compile else 25) if not plan.dry_run else 0
            settings = {**asdict(variant), "repeat": repeat}
            row = guarded(report, plan, variant.name, settings, needs, sweep_variant(plan, variant, peak))
            if row.figures:
                measured.setdefault(variant.name, []).append(row)
    if plan.repeats > 1:
        for name, rows in measured.items():
            report.add(spread(name, rows))
    report.say(f"done in {time.monotonic() - plan.started:.0f} s: {report.json_path}")
    return report


def spread(name: str, rows: list[Row]) -> Row:
    """A variant's median over its repeats, with their lowest and highest."""
    figures: dict[str, Any] = {"repeats": len(rows)}
    for key in ("tokens_per_s", "mfu"):
        values = sorted(r.figures[key] for r in rows if key in r.figures)
        if values:
            figures.update({key: statistics.median(values), f"{key}_min": values[0], f"{key}_max": values[-1]})
    peaks = [r.peak_allocated_gib for r in rows if r.peak_allocated_gib is not None]
    return Row(f"{name}: median of {len(rows)}", figures=figures, peak_allocated_gib=max(peaks) if peaks else None)


def header(plan: Plan, peak: float | None) -> dict[str, Any]:
    import transformers

    return {
        "dry_run": plan.dry_run,
        "device": torch.cuda.get_device_name(plan.device) if plan.device.type == "cuda" else "cpu",
        "peak_bf16_dense_flops": peak,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": sys.version.split()[0],
        "seq_len": plan.seq_len,
        "steps": {"warmup": plan.warmup, "timed": plan.timed},
        "repeats": plan.repeats,
        "train_flops_per_token": train_flops_per_token(ModelShape.from_hf(model_config(plan.shape)), plan.seq_len),
        "model": "Qwen2.5-1.5B architecture, random init" if plan.shape == QWEN25_1_5B else plan.shape,
        "precision": "bf16 compute, fp32 master weights and gradient reduction"
        if plan.device.type == "cuda"
        else "fp32",
    }


def check_real_shapes(seq_len: int) -> dict[str, Any]:
    """The full model on the meta device (no memory, no FLOPs): its parameter count and the tied lm_head."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config(QWEN25_1_5B))
    params = sum(p.numel() for p in model.parameters())
    if params != QWEN25_1_5B_PARAMS or model.lm_head.weight is not model.model.embed_tokens.weight:
        raise SystemExit(f"Qwen2.5-1.5B: {params:,} parameters (expected {QWEN25_1_5B_PARAMS:,}), or lm_head untied")
    flops = train_flops_per_token(ModelShape.from_hf(model.config), seq_len)
    return {"params": params, "seq_len": seq_len, "train_flops_per_token": flops}


@dataclass
class ProcessGroup:
    """A one-rank process group for FSDP2: nccl on the GPU, gloo on CPU."""

    device: torch.device

    def __enter__(self) -> ProcessGroup:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        options: dict[str, Any] = {"init_method": f"tcp://127.0.0.1:{port}", "rank": 0, "world_size": 1}
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            dist.init_process_group("nccl", device_id=self.device, **options)
        else:
            dist.init_process_group("gloo", **options)
        return self

    def __exit__(self, *exc: object) -> None:
        dist.destroy_process_group()


def plan_from(args: argparse.Namespace) -> Plan:
    if args.dry_run:
        cpu = torch.device("cpu")
        return Plan(DRY_SHAPE, 64, 1, 2, 4, float("inf"), "eager", cpu, True, args.out or out_dir(), args.repeats)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: bench/gpu_check.py measures a GPU (--dry-run runs it on CPU)")
    return Plan(
        QWEN25_1_5B,
        2048,
        3,
        10,
        30,
        args.budget_s,
        "inductor",
        torch.device("cuda", 0),
        False,
        args.out or out_dir(),
        args.repeats,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, every phase at a tiny shape")
    parser.add_argument("--budget-s", type=float, default=420.0, help="no phase starts that would end past this")
    parser.add_argument("--repeats", type=int, default=1, help="rounds of the sweep; >1 adds each variant's median")
    parser.add_argument("--out", type=Path, help="results directory (default: $OUT, else bench/out/gpu_check)")
    args = parser.parse_args(argv)
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1 (got {args.repeats}): 0 rounds would measure no variant")
    plan = plan_from(args)
    with ProcessGroup(plan.device):
        report = run(plan)
    failed = [r.name for r in report.rows if r.error]
    return 1 if failed and plan.dry_run else 0


if __name__ == "__main__":
    sys.exit(main())
