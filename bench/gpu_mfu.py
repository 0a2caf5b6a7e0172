"""Qwen2.5-1.5B (architecture, random weights) through the fine-tune's FSDP2 step: tokens/s/GPU, MFU, memory.

    torchrun --standalone --nproc-per-node=gpu bench/gpu_mfu.py   # one rank per local GPU
    .venv/bin/python bench/gpu_mfu.py                              # the same without torchrun (spawns one rank per GPU)
    .venv/bin/python bench/gpu_mfu.py --dry-run                    # CPU, ~1 min: shapes, a step at 2 layers, FLOPs

Nothing is downloaded: the model is built from QWEN25_1_5B below (Qwen/Qwen2.5-1.5B's config.json)
with random weights. Each configuration (activation checkpointing off, then on) runs the pieces
the fine-tune's train_step runs: training.fsdp.shard_model (FSDP2, a group per decoder layer,
bf16 parameters with fp32 gradient reduction), fp32 master weights under AdamW,
training.finetune.token_loss_sum, clip_gradients. Each rank trains on --batch sequences of
--seq-len random tokens per step; after --warmup steps, --steps are timed.

MFU = training.flops.train_flops_per_token (weights 6N plus causal attention) x tokens/s per GPU
/ the detected GPU's dense bf16 peak (training.flops.PEAK_BF16_DENSE). Rank 0 prints a table and
writes bench/out/gpu_mfu.json. Target: MFU >= 45 % on H100/H200.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import socket
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from training.finetune import token_loss_sum  # noqa: E402
from training.flops import ModelShape, matmul_weights, mfu, peak_bf16_flops, train_flops_per_token  # noqa: E402
from training.fsdp import clip_gradients, shard_model  # noqa: E402

OUT = Path(__file__).resolve().parent / "out" / "gpu_mfu.json"
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
"""Qwen/Qwen2.5-1.5B's config.json less its token ids (random tokens need none). Its model card:
1.54B parameters (1.31B non-embedding), 28 layers, 12 query and 2 KV heads. The base model sets
max_position_embeddings 131072 (the Instruct model 32768); positions are RoPE, so neither value
changes a parameter or a FLOP at 2048."""
QWEN25_1_5B_PARAMS = 1_543_714_304
"""numel of the model above: embedding 233,373,696 (tied lm_head) + 28 layers x 46,797,824 + final norm 1,536."""


@dataclass
class Measurement:
    activation_checkpointing: bool
    tokens_per_s_per_gpu: float | None = None
    mfu: float | None = None
    peak_memory_gib: float | None = None
    step_seconds: float | None = None
    loss: float | None = None
    error: str | None = None
    """Why no figures, e.g. out of memory at this batch size."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU: check shapes and the code path, print FLOPs/token")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=4, help="sequences per GPU per step")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--out", type=Path, default=OUT)
    return parser.parse_args()


def model_config(**smaller):
    """The Qwen2.5-1.5B config; `smaller` overrides fields for the dry run (e.g. num_hidden_layers=2)."""
    from transformers import Qwen2Config

    return Qwen2Config(**{**QWEN25_1_5B, **smaller})


def build_model(config, device: torch.device):
    """Random fp32 weights, the same on every rank (seeded), created on the device (fast, no host copy)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    with device:
        return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def random_batch(config, batch: int, seq_len: int, device: torch.device, rank: int) -> dict:
    """A fully labelled batch without padding, as token_loss_sum takes it."""
    ids = torch.randint(0, config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(rank))
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def train_step(model, optimizer, batch: dict) -> float:
    """training.finetune.train_step's work for one micro-batch: mean token loss, backward, clip, AdamW."""
    targets = int((batch["labels"][:, 1:] != -100).sum())
    loss = token_loss_sum(model, batch) / targets
    loss.backward()
    clip_gradients(model, max_norm=1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def measure(config, device: torch.device, checkpointing: bool, args, rank: int, peak: float | None) -> Measurement:
    """Build, shard, warm up, then time args.steps steps of one configuration."""
    result = Measurement(activation_checkpointing=checkpointing)
    try:
        model = shard_model(build_model(config, device), device, checkpointing).train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        batch = random_batch(config, args.batch, args.seq_len, device, rank)
        for _ in range(args.warmup):
            train_step(model, optimizer, batch)
        synchronize(device)
        reset_peak_memory(device)
        began = time.perf_counter()
        for _ in range(args.steps):
            result.loss = train_step(model, optimizer, batch)
        synchronize(device)
        result.step_seconds = (time.perf_counter() - began) / args.steps
        result.peak_memory_gib = peak_memory_gib(device)
    except torch.OutOfMemoryError as e:  # every rank runs the same shapes, so every rank sees it
        result.error = f"out of memory at batch {args.batch} x {args.seq_len}: {str(e).splitlines()[0]}"
        return result
    finally:
        del model, optimizer, batch  # free the GPU before the next configuration
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    result.tokens_per_s_per_gpu = args.batch * args.seq_len / result.step_seconds
    if peak:
        flops_per_token = train_flops_per_token(ModelShape.from_hf(config), args.seq_len)
        result.mfu = mfu(flops_per_token, result.tokens_per_s_per_gpu, peak)
    return result


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gib(device: torch.device) -> float | None:
    """Most memory tensors held at once during the timed steps (the model state included)."""
    return torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None


# ---------------------------------------------------------------- report


def print0(*values) -> None:
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*values, flush=True)


def flops_summary(seq_len: int) -> dict:
    shape = ModelShape.from_hf(model_config())
    return {
        "seq_len": seq_len,
        "matmul_weights": matmul_weights(shape),
        "train_flops_per_token": train_flops_per_token(shape, seq_len),
    }


def table(results: list[Measurement]) -> str:
    def cell(value, width: int, fmt: str) -> str:
        return (format(value, fmt) if value is not None else "-").rjust(width)

    lines = [f"{'activation ckpt':<16} {'tokens/s/GPU':>13} {'MFU':>7} {'peak mem GiB':>13} {'s/step':>8} {'loss':>7}"]
    for r in results:
        lines.append(
            f"{'on' if r.activation_checkpointing else 'off':<16} {cell(r.tokens_per_s_per_gpu, 13, ',.0f')} "
            f"{cell(r.mfu, 7, '.1%')} {cell(r.peak_memory_gib, 13, '.1f')} {cell(r.step_seconds, 8, '.3f')} "
            f"{cell(r.loss, 7, '.3f')}" + (f"  {r.error}" if r.error else "")
        )
    return "\n".join(lines)


def report(results: list[Measurement], args, device_name: str, peak: float | None, world: int) -> None:
    summary = {
        "model": "Qwen2.5-1.5B architecture, random init",
        "gpu": device_name,
        "gpus": world,
        "peak_bf16_dense_flops": peak,
        "batch_per_gpu": args.batch,
        "steps_timed": args.steps,
        "flops": flops_summary(args.seq_len),
        "torch": torch.__version__,
        "sharding": "full",
        "precision": "bf16 params, fp32 reduce, fp32 master weights (AdamW)",
        "results": [asdict(r) for r in results],
    }
    print0(
        f"{device_name} x {world}, batch {args.batch} x {args.seq_len} tokens per GPU, "
        f"{summary['flops']['train_flops_per_token'] / 1e9:.3f} GFLOP/token, "
        f"peak {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s bf16 dense"
    )
    print0(table(results))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    print0(f"wrote {args.out}")


# ---------------------------------------------------------------- GPU ranks


def gpu_rank(local_rank: int, args) -> None:
    """One rank per GPU: both configurations, then rank 0 reports."""
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    try:
        name = torch.cuda.get_device_name(device)
        peak = peak_bf16_flops(name)
        config = model_config()
        results = [
            measure(config, device, checkpointing, args, dist.get_rank(), peak) for checkpointing in (False, True)
        ]
        if dist.get_rank() == 0:
            report(results, args, name, peak, dist.get_world_size())
    finally:
        dist.destroy_process_group()


def spawned_rank(local_rank: int, world: int, port: int, args) -> None:
    """A rank started by this script itself: the environment torchrun would have set."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(local_rank),
        LOCAL_RANK=str(local_rank),
        WORLD_SIZE=str(world),
        LOCAL_WORLD_SIZE=str(world),
    )
    gpu_rank(local_rank, args)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_on_gpus(args) -> None:
    if "LOCAL_RANK" in os.environ:  # under torchrun
        return gpu_rank(int(os.environ["LOCAL_RANK"]), args)
    world = torch.cuda.device_count()
    if world == 0:
        sys.exit("no CUDA device: bench/gpu_mfu.py measures GPUs (use --dry-run on CPU)")
    if world == 1:
        return spawned_rank(0, 1, free_port(), args)
    import torch.multiprocessing as mp

    mp.spawn(spawned_rank, args=(world, free_port(), args), nprocs=world, join=True)


# ---------------------------------------------------------------- CPU dry run

DRY_RUN_SIZE = {"num_hidden_layers": 2, "vocab_size": 8192}
"""Real widths (hidden, heads, KV heads, SwiGLU), fewer layers and a smaller vocabulary: one fp32
step of the full 151936-token lm_head and its AdamW state takes ~25 s on 2 CPU cores."""
DRY_BATCH, DRY_SEQ = 1, 32


def dry_run(args) -> None:
    """The real model's shapes on the meta device and its FLOPs; then the measured code path at
    DRY_RUN_SIZE on a 1-rank gloo group, activation checkpointing off and on."""
    started = time.perf_counter()
    check_real_shapes(args.seq_len)
    summary = flops_summary(args.seq_len)
    print(
        f"Qwen2.5-1.5B at seq_len {args.seq_len}: {summary['train_flops_per_token'] / 1e9:.3f} GFLOP/token "
        f"(6N = {6 * summary['matmul_weights'] / 1e9:.3f}, N = {summary['matmul_weights']:,} matmul weights)"
    )
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        config = model_config(**DRY_RUN_SIZE)
        small = argparse.Namespace(batch=DRY_BATCH, seq_len=DRY_SEQ, warmup=0, steps=1)
        results = [
            measure(config, torch.device("cpu"), checkpointing, small, 0, None) for checkpointing in (False, True)
        ]
    finally:
        dist.destroy_process_group()
    print(table(results))
    expected = math.log(config.vocab_size)  # a random init predicts about uniformly
    for r in results:
        if r.error or r.loss is None or not math.isfinite(r.loss) or abs(r.loss - expected) > 1.0:
            sys.exit(f"dry run failed: {r} (expected a finite loss near ln(vocab) = {expected:.2f})")
    print(f"dry run ok in {time.perf_counter() - started:.0f} s")


def check_real_shapes(seq_len: int) -> None:
    """The full 28-layer model on the meta device (no memory, no FLOPs): parameter count, matmul
    weights as training.flops counts them, the tied lm_head, and the logits of one sequence."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        # Eager attention and an explicit mask: otherwise recent transformers (5.2x) check, from the data, for
        # packed sequences and whether SDPA may skip the mask (.item() calls no meta tensor can answer).
        # The shapes are the same under any attention implementation.
        model = AutoModelForCausalLM.from_config(model_config(), attn_implementation="eager")
        ids = torch.zeros((1, seq_len), dtype=torch.long)
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
    params = sum(p.numel() for p in model.parameters())
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    counted = matmul_weights(ModelShape.from_hf(model.config))
    expected_logits = (1, seq_len, QWEN25_1_5B["vocab_size"])
    problems = []
    if params != QWEN25_1_5B_PARAMS:
        problems.append(f"{params:,} parameters, expected {QWEN25_1_5B_PARAMS:,}")
    if linear != counted:
        problems.append(f"{linear:,} linear weights, flops.matmul_weights counts {counted:,}")
    if model.lm_head.weight is not model.model.embed_tokens.weight:
        problems.append("lm_head is not tied to embed_tokens")
    if tuple(logits.shape) != expected_logits:
        problems.append(f"logits {tuple(logits.shape)}, expected {expected_logits}")
    if problems:
        sys.exit("Qwen2.5-1.5B shapes: " + "; ".join(problems))
    print(
        f"Qwen2.5-1.5B: {params:,} parameters, {linear:,} matmul weights (lm_head tied), "
        f"logits {tuple(logits.shape)}: shapes ok"
    )


def main() -> None:
    args = parse_args()
    if args.dry_run:
        dry_run(args)
    else:
        run_on_gpus(args)


if __name__ == "__main__":
    main()
