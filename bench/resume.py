"""resume: resubmission to the first resumed step vs a cold start's submission to its first step. Target <= 2.

    python -m bench.run --only resume

Each round trains a fresh run cold for 4 steps (a checkpoint at step 4, no export), then submits
it again with max_steps 6: the second job restores step 4's DCP checkpoint (model, optimizer,
RNG, data position) and trains on. Both are the fine-tune stage's job as the pipeline submits it;
the time is from just before submission to the `time` rank 0 logged for the job's first step
(metrics.jsonl). What a resume adds over a cold start is finding and downloading the checkpoint and
loading it; the start-up both pay (Ray job, Ray Train workers, model load) is the cold side.
"""

from __future__ import annotations

from bench.common import BenchResult, Target, compare, interleave, say
from bench.harness import Bench, prepare_dataset, read_metrics

TARGET = Target("<=", 2)
COLD_STEPS, MORE_STEPS = 4, 2


def to_first_step(bench: Bench, storage, dataset: str, run_name: str, job: str, max_steps: int) -> float:
    """Seconds from submitting a fine-tune job to rank 0 finishing its first step."""
    cfg = bench.config(storage)
    params = {"dataset": dataset, "run_name": run_name, "max_steps": max_steps, "checkpoint_every": COLD_STEPS}
    ran = bench.run_job(cfg, "bench-resume", job, "training.finetune", {**params, "export": False})
    first = min(read_metrics(cfg, "bench-resume", job), key=lambda r: r["step"])
    return first["time"] - ran.submitted_at


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    storage = bench.fresh_dir("resume")
    dataset, _ = prepare_dataset(bench, storage)

    def cold(i: int) -> float:
        s = to_first_step(bench, storage, dataset, f"res-{i}", f"cold-{i}", COLD_STEPS)
        say(f"  resume cold   #{i}: submission to first step {s:.1f} s")
        return s

    def resumed(i: int) -> float:
        s = to_first_step(bench, storage, dataset, f"res-{i}", f"resumed-{i}", COLD_STEPS + MORE_STEPS)
        say(f"  resume resumed #{i}: resubmission to first resumed step {s:.1f} s")
        return s

    measured = interleave({"cold": cold, "resumed": resumed}, repeats)
    return compare(
        measured["resumed"],
        measured["cold"],
        TARGET,
        unit="s to first step",
        ours_is="resumed",
        bare_is="cold",
    )
