"""stage_overhead: a stage's wall time as the pipeline runs it vs a bare `ray job submit` of the same body. <= 1.2.

    python -m bench.run --only stage_overhead

The body is the data stage (the bundled 3,000-row corpus, a fresh storage root each time so the
content-addressed cache never hits). Ours: tasks.rayjob.RayJobRunner in this process (working_dir
staging and hashing, submission, log following over the websocket, result.json validation), the
way the stage's Prefect task runs it, minus Prefect's own task bookkeeping. Bare: the `ray job
submit` command line with the same working_dir, entrypoint and job envelope, waiting for the end
(its own process start and imports are part of what it costs, as they are for a user).
"""

from __future__ import annotations

import json
import time

from bench.common import BenchResult, Target, compare, interleave, say
from bench.harness import BIN, Bench, prepare_dataset
from tuneproof.core.envelope import ENV_VAR, JobEnvelope

TARGET = Target("<=", 1.2)


def bare_submit(bench: Bench, tag: str) -> float:
    """`ray job submit` of the data stage into a fresh storage root; seconds until the command returns."""
    import subprocess

    from tuneproof.control.identity import stage_working_dir

    cfg = bench.config(bench.fresh_dir("stage-bare"))
    workdir, _ = stage_working_dir()
    envelope = JobEnvelope(run_id="bench-bare", job="data", config=cfg, params={}).encode()
    runtime_env = {"env_vars": {ENV_VAR: envelope, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}
    cmd = [str(BIN / "ray"), "job", "submit", "--address", bench.head.address, "--submission-id", f"bench-bare-{tag}"]
    cmd += ["--working-dir", str(workdir), "--runtime-env-json", json.dumps(runtime_env), "--"]
    cmd += ["python", "-m", "training.data_prep"]
    began = time.perf_counter()
    done = subprocess.run(cmd, env=bench.env(), capture_output=True, text=True, timeout=1800)
    seconds = time.perf_counter() - began
    if done.returncode or "succeeded" not in done.stdout.lower():
        raise RuntimeError(f"ray job submit failed ({done.returncode}):\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    return seconds


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    prepare_dataset(bench, bench.fresh_dir("stage-warm"))  # the first upload of the working_dir is paid once, here

    def ours(i: int) -> float:
        s = prepare_dataset(bench, bench.fresh_dir("stage-ours"), f"bench-ours-{i}")[1].seconds
        say(f"  stage_overhead ours #{i}: {s:.2f} s")
        return s

    def bare(i: int) -> float:
        s = bare_submit(bench, str(i))
        say(f"  stage_overhead bare #{i}: {s:.2f} s")
        return s

    measured = interleave({"ours": ours, "bare": bare}, repeats)
    return compare(
        measured["ours"], measured["bare"], TARGET, unit="s per stage", stage="data (3,000 rows)", samples=measured
    )
