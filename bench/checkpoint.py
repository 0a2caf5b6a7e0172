"""checkpoint: DCP save throughput vs a raw sequential write of the same bytes to the same storage. >= 0.5.

    python -m bench.run --only checkpoint            # ~220 MB checkpoint, local and S3 (moto), 7 rounds each at least
    python -m bench.run --only checkpoint --quick    # ~50 MB

One process, one gloo rank, a Qwen2 (random weights from a config) trained one step so AdamW has
state; a checkpoint is about 12 bytes per parameter (fp32 weights and two moments). Ours is what a
fine-tune rank does (training.finetune save_checkpoint/complete_checkpoint): the asynchronous DCP save
(training.checkpointing.start_saving_shards; its background thread writes the shards straight into the
checkpoint's storage directory on local storage, or stages, hashes and uploads them file by file on S3,
and hashes every file) waited for at once by finish_saving_shards, and the completion marker (write_marker:
checks the stored files, lists each with its sha256). Ray Train's report is not timed: it needs a Ray
Train worker, and with CheckpointUploadMode.NO_UPLOAD it only registers the directory (no bytes move).
Bare writes the same number of bytes as one object: a local file, or one S3 PUT (boto3) to moto on
127.0.0.1. Throughput = bytes / seconds; ratio = ours / bare, local and S3 each measured, the worse one
judged. One untimed save first, so neither side pays first-use costs (ours allocates its staging
buffers, StagingBuffers, once per worker).

Same durability on both sides: the local save fsyncs every file before its marker is written (DCP's
sync_files; training.checkpointing.shard_writer), and the bare file is fsynced too, so both are timed
to the disk, not to the page cache (where the bare side is a memory copy, 4.5 GB/s here, and each side
would also pay for the other's dirty pages being written back). On S3 both sides are durable when the
PUTs return.

Size: the full run's shape (hidden 768, 2 layers, vocabulary 8192, ~220 MB in ~80 tensors of ~3 MB)
is closer to a real model's tensors (Qwen2.5-0.5B: ~6 GB in ~870 tensors of ~7 MB) than the quick
one (4 layers at hidden 256, ~50 MB in ~150 tensors of ~0.3 MB), where DCP's fixed per-tensor cost
(planning, a torch.save record per tensor) is a third of ours' time and would misjudge a real save.

details: per side min/median/max bytes/s; `phases`, the median seconds and share of each part of
ours (state_dict, staging: the copy to CPU in the training thread; dcp_plan, dcp_write, dcp_metadata,
progress_file, sha256, upload (S3 only): the background thread; marker), largest first, and
`dominant`; `async_stall`: with the asynchronous save, the training steps stalled per checkpoint
(measure_stall: a loop of real training steps on the same model, local storage, a checkpoint every few
steps completed one step later as the fine-tune does), its max and ok (max <= 1).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from collections.abc import Sequence
from pathlib import Path

from bench.common import BenchResult, Spread, Target, interleave, ratio, say
from bench.harness import S3_BUCKET, moto_server

TARGET = Target(">=", 0.5)
MIN_REPEATS = 7
"""Rounds per storage at least: a save takes a third of a second locally, and one fsync to this virtual
disk can take 0.07 or 0.4 s, so a median of three is mostly the disk's mood."""


@contextlib.contextmanager
def one_rank():
    """A world of one gloo rank in this process (what DCP and fully_shard need)."""
    import torch.distributed as dist

    from tuneproof.app.local import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


SIZES = {
    "quick": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 512},
    "full": {"hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 2, "vocab_size": 8192},
}
"""Model shapes (the checkpoint is about 12 bytes per parameter: weights and AdamW's two moments, fp32)."""


def trained_model(shape: dict[str, int]):
    """A sharded Qwen2 and its AdamW after one step (so the optimizer has state to save)."""
    import torch
    from torch.distributed.fsdp import fully_shard
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=shape["vocab_size"],
        hidden_size=shape["hidden_size"],
        intermediate_size=shape["intermediate_size"],
        num_hidden_layers=shape["num_hidden_layers"],
        num_attention_heads=shape["hidden_size"] // 64,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    model = Qwen2ForCausalLM(config)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, shape["vocab_size"], (2, 16))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    return model, optimizer


def progress(step: int = 1):
    from training.checkpointing import TrainingProgress, capture_rng

    return TrainingProgress(
        step=step, epoch=0, batch_in_epoch=step, seed=0, rank=0, world_size=1, schedule={}, rng=capture_rng()
    )


def save_ours(model, optimizer, group, buffers, storage, name: str) -> tuple[int, float, dict[str, float]]:
    """(bytes, seconds, seconds per phase) of one checkpoint as a fine-tune rank makes it: the asynchronous
    save into storage waited for at once (throughput, not overlap: the stall is measured apart), the marker."""
    from training.checkpointing import finish_saving_shards, start_saving_shards, write_marker

    began = time.perf_counter()
    saving = start_saving_shards(model, optimizer, progress(), storage, ("ckpt", name), group, buffers=buffers)
    files = finish_saving_shards(saving)
    phases = {k: v for k, v in saving.phases.items() if k != "waited"}  # waited overlaps the writer's phases
    with timed(phases, "marker"):
        write_marker(storage, 1, files, "ckpt", name)
    seconds = time.perf_counter() - began
    phases["other"] = max(0.0, seconds - sum(phases.values()))  # progress capture, the marker's removal
    return sum(f.size for f in files.values()), seconds, phases


@contextlib.contextmanager
def timed(phases: dict[str, float], name: str):
    began = time.perf_counter()
    yield
    phases[name] = time.perf_counter() - began


def write_bare(storage, size: int, name: str, s3_url: str | None) -> float:
    """Seconds to write `size` bytes as one object/file at the same storage."""
    import os

    blob = os.urandom(size)
    began = time.perf_counter()
    if s3_url:
        import boto3

        key = storage.path("raw", name).split("/", 1)[1]
        boto3.client("s3", endpoint_url=s3_url).put_object(Bucket=S3_BUCKET, Key=key, Body=blob)
    else:
        target = Path(storage.path("raw", name))
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("wb") as f:
            f.write(blob)
            os.fsync(f.fileno())
    return time.perf_counter() - began


def breakdown(runs: list[dict[str, float]]) -> dict[str, dict[str, float]]:
    """Median seconds of each phase over the repeats and its share of the summed medians, largest first. Pure."""
    names = sorted({name for run in runs for name in run})
    medians = {name: statistics.median(run.get(name, 0.0) for run in runs) for name in names}
    total = sum(medians.values()) or 1.0
    ordered = sorted(medians.items(), key=lambda item: -item[1])
    return {name: {"s": round(s, 4), "share": round(s / total, 3)} for name, s in ordered}


def measure(where: str, storage, s3_url: str | None, model, optimizer, group, buffers, repeats: int) -> dict:
    sizes: list[int] = []
    phases: list[dict[str, float]] = []

    def ours(i: int) -> float:
        size, seconds, parts = save_ours(model, optimizer, group, buffers, storage, f"ours-{i}")
        sizes.append(size)
        phases.append(parts)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
        say(f"  checkpoint {where} ours #{i}: {size / 1e6:.0f} MB in {seconds:.2f} s = {size / seconds / 1e6:.0f} MB/s")
        say(f"    phases (s): {shown}")
        storage.remove("ckpt", f"ours-{i}", recursive=True)  # not timed: keeps moto's memory and the disk small
        return size / seconds

    def bare(i: int) -> float:
        size = sizes[-1]
        seconds = write_bare(storage, size, f"bare-{i}", s3_url)
        say(f"  checkpoint {where} bare #{i}: {size / 1e6:.0f} MB in {seconds:.2f} s = {size / seconds / 1e6:.0f} MB/s")
        storage.remove("raw", f"bare-{i}")
        return size / seconds

    measured = interleave({"ours": ours, "bare": bare}, repeats)
    a, b = Spread.of(measured["ours"]), Spread.of(measured["bare"])
    phase_table = breakdown(phases)
    say(f"  checkpoint {where}: ours' time by phase (median s, share): {phase_table}")
    return {
        "ratio": round(ratio(a.median, b.median), 4),
        "ours_bytes_per_s": vars(a),
        "bare_bytes_per_s": vars(b),
        "bytes": sizes[-1],
        "phases": phase_table,
        "dominant": next(iter(phase_table)),
    }


STALL = {
    "quick": {"steps": 13, "every": 4, "batch": 2, "seq": 64},
    "full": {"steps": 11, "every": 5, "batch": 2, "seq": 64},
}
"""The stall loop: training steps, a checkpoint every `every` (at least one step to complete in), batch x seq tokens a step."""


def stalled_steps(step_seconds: Sequence[float], spans: Sequence[tuple[int, int]]) -> list[float]:
    """Per checkpoint, started after step c and completed (marker written) after step d >= c (1-based): the
    extra seconds of steps c..d+1 (the save's start, every step its background write shared the CPUs
    with, the wait and the marker, and the step after) over the median of the steps no checkpoint
    touched, in units of that median step. 0 when the save hid entirely behind the steps. Pure."""
    last = len(step_seconds)
    if bad := [(c, d) for c, d in spans if not 1 <= c <= d <= last]:
        raise ValueError(f"checkpoint spans {bad} are outside the {last} steps timed")
    touched = {s for c, d in spans for s in range(c, d + 2) if s <= last}
    clean = [t for step, t in enumerate(step_seconds, 1) if step not in touched]
    if not clean:
        raise ValueError(f"no step without a checkpoint around it among {last} steps to compare with")
    base = statistics.median(clean)
    stalls = []
    for c, d in spans:
        around = [step_seconds[s - 1] for s in range(c, d + 2) if s <= last]
        stalls.append(max(0.0, sum(around) - base * len(around)) / base)
    return stalls


def measure_stall(model, optimizer, group, buffers, storage, plan: dict[str, int]) -> dict:
    """Train `steps` steps with a checkpoint every `every`, as training.finetune's loop does it: the save starts
    after its step (start_saving_shards) and is completed after the next one (finish_saving_shards, the
    marker); returns each checkpoint's stall in steps, the max and ok (max <= 1)."""
    import torch

    from training.checkpointing import finish_saving_shards, start_saving_shards, write_marker

    vocab = model.config.vocab_size
    ids = torch.randint(0, vocab, (plan["batch"], plan["seq"]), generator=torch.Generator().manual_seed(1))

    def train_step() -> None:
        optimizer.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()

    def complete(saving) -> None:
        files = finish_saving_shards(saving)
        write_marker(storage, saving.step, files, "stall", f"step-{saving.step}")

    train_step()  # untimed warm-up
    times: list[float] = []
    spans: list[tuple[int, int]] = []
    in_flight = None
    for step in range(1, plan["steps"] + 1):
        began = time.perf_counter()
        train_step()
        due = step % plan["every"] == 0 and step < plan["steps"]
        if in_flight is not None:  # as the fine-tune does: completed after the step that follows it
            complete(in_flight)
            spans.append((in_flight.step, step))
            in_flight = None
        if due:
            where = ("stall", f"step-{step}")
            in_flight = start_saving_shards(model, optimizer, progress(step), storage, where, group, buffers=buffers)
        times.append(time.perf_counter() - began)
    stalls = stalled_steps(times, spans)
    storage.remove("stall", recursive=True)
    worst = max(stalls)
    say(
        f"  checkpoint async stall: steps stalled per checkpoint {[round(x, 2) for x in stalls]} (max {worst:.2f}, "
        f"ok {worst <= 1}); median step {statistics.median(times):.2f} s at {plan['batch']}x{plan['seq']} tokens"
    )
    return {
        "stall_steps": [round(x, 3) for x in stalls],
        "max": round(worst, 3),
        "ok": worst <= 1,
        "target": "at most one step stalled per checkpoint",
        "checkpoint_spans": spans,
        "step_seconds": [round(t, 3) for t in times],
        **plan,
    }


def run(bench, repeats: int, quick: bool) -> BenchResult:
    from tuneproof.core.storage import Storage

    results = {}
    size = "quick" if quick else "full"
    with one_rank():
        import torch.distributed as dist

        model, optimizer = trained_model(SIZES[size])
        from training.checkpointing import StagingBuffers

        group = dist.new_group(backend="gloo")  # the async save's own group, as the fine-tune gives it
        buffers = StagingBuffers()  # kept across saves, as a fine-tune worker keeps its own
        local = Storage(str(bench.fresh_dir("checkpoint-store")))
        save_ours(
            model, optimizer, group, buffers, local, "warm-up"
        )  # untimed: first-use costs are no one's throughput
        local.remove("ckpt", "warm-up", recursive=True)
        results["local"] = measure("local", local, None, model, optimizer, group, buffers, max(repeats, MIN_REPEATS))
        stall = measure_stall(model, optimizer, group, buffers, local, STALL[size])
        with moto_server() as url:
            s3 = Storage(f"s3://{S3_BUCKET}/checkpoint-bench", url)
            results["s3"] = measure("s3", s3, url, model, optimizer, group, buffers, max(repeats, MIN_REPEATS))
    worst = min(results.values(), key=lambda r: r["ratio"])["ratio"]
    return BenchResult(
        ratio=worst,
        target=TARGET.text(),
        ok=TARGET.met(worst),
        repeats=max(repeats, MIN_REPEATS),
        details={
            **results,
            "judged": "the worse of local and s3",
            "size": size,
            "shape": SIZES[size],
            "miss": TARGET.miss(worst),
            "async_stall": stall,
        },
    )
