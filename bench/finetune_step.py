"""finetune_step: the fine-tune stage's median step time vs a bare Ray Train FSDP2 loop. Target <= 1.05.

    python -m bench.run --only finetune_step

Both sides: the same tiny Qwen2, the same prepared dataset cut into identical batches (the same
seed, order, rank slices and padding), micro-batch 32 per rank, 2 workers on the same local Ray
head, the same number of steps. Ours is the fine-tune stage's job (checkpoint at
the end, no export); its step times are the `step_seconds` rank 0 writes to metrics.jsonl. Bare is
bench/bare_train.py. The median over a run's steps is one measurement; runs alternate ours / bare.
"""

from __future__ import annotations

import json
import statistics

from bench.common import BenchResult, Target, ours_against_bare, say
from bench.harness import Bench, prepare_dataset, read_metrics, run_python

TARGET = Target("<=", 1.05)


def ours_step(bench: Bench, storage, dataset: str, steps: int, workers: int, tag: str) -> float:
    """Median step seconds of one fine-tune job of `steps` steps."""
    cfg = bench.config(storage, f"train.num_workers={workers}")
    params = {"dataset": dataset, "run_name": tag, "max_steps": steps, "checkpoint_every": 10_000, "export": False}
    bench.run_job(cfg, "bench-ft", tag, "training.finetune", params)
    rows = read_metrics(cfg, "bench-ft", tag)
    return statistics.median(r["step_seconds"] for r in rows)


def bare_step(bench: Bench, storage, dataset: str, steps: int, workers: int, tag: str) -> float:
    out = bench.fresh_dir("bare-train") / "times.json"
    args = ["bench/bare_train.py", "--model", str(bench.model_dir), "--data", str(storage / dataset)]
    args += ["--workers", str(workers), "--steps", str(steps), "--batch", "32", "--out", str(out)]
    args += ["--storage", str(bench.fresh_dir("bare-train-storage")), "--seed", str(bench.config(storage).train.seed)]
    run_python(args, bench.driver_env())
    return statistics.median(json.loads(out.read_text())["step_seconds"])


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    storage = bench.fresh_dir("finetune-step")
    dataset, _ = prepare_dataset(bench, storage)
    steps = 10 if quick else 20

    def ours(i: int) -> float:
        s = ours_step(bench, storage, dataset, steps, 2, f"ft-{i}")
        say(f"  finetune_step ours  #{i}: median step {s * 1000:.1f} ms")
        return s

    def bare(i: int) -> float:
        s = bare_step(bench, storage, dataset, steps, 2, f"bare-{i}")
        say(f"  finetune_step bare  #{i}: median step {s * 1000:.1f} ms")
        return s

    return ours_against_bare(
        ours,
        bare,
        repeats,
        TARGET,
        unit="s per step (median over a run)",
        steps=steps,
        workers=2,
        micro_batch_size=32,
        batches="identical: training.train_data.StepBatches with the fine-tune's seed on both sides",
    )
