"""pipeline: the demo pipeline's wall time, split per stage into work and orchestration. Target orchestration <= 50 %.

    python -m bench.run --only pipeline [--pipeline-repeats N]

`tuneproof run` (configs/local.yaml: every stage, the bundled date task, 400 steps on 2 workers)
as a user runs it, against this benchmark's Ray head and its own Prefect server, with nothing to
install (the environment exists). Work is what the stages exist to do, read from what they record:
fine-tune and resume-test steps (`step_seconds` of every job's metrics.jsonl), generation (each
scored model's `seconds` in the evaluate summary), tokenization (the corpus batch-encoded with the
raw tokenizer, measured here: the data summary records no timing). Verify, connectivity and promote
are checks, not work. Orchestration is the rest of the wall time: process and job start-up, Ray
Train start and stop, imports, model loads, checkpoints, export, uploads, Prefect.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import time
from datetime import datetime
from pathlib import Path

from bench.common import BenchResult, Target, say
from bench.harness import QUIET_ENV, Bench, run_python
from tuneproof.core.config import PROJECT_ROOT

TARGET = Target("<=", 0.5)


@contextlib.contextmanager
def prefect_server(home: Path):
    """`prefect server start` on 127.0.0.1 with its own home; yields the environment that reports to it."""
    from tuneproof.app import servers

    with servers.prefect_server(home) as url:
        api = f"{url}/api"
        yield {**os.environ, **QUIET_ENV, "PREFECT_HOME": str(home), "PREFECT_API_URL": api, "PREFECT_UI_API_URL": api}


def seconds_between(start: str, end: str) -> float:
    return (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds()


def step_seconds(storage: Path, run_id: str, job: str) -> float:
    path = storage / "runs" / run_id / "stages" / job / "metrics.jsonl"
    if not path.exists():
        return 0.0
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return sum(r.get("step_seconds") or 0.0 for r in rows)


def stage_work(storage: Path, run_id: str, entry: dict, tokenize_s: float) -> tuple[float, str]:
    """(seconds of work, what the work was) for one stage entry of the record."""
    stage, summary = entry["stage"], entry.get("summary") or {}
    if stage == "finetune":
        jobs = [job["result"]["stage"] for job in entry.get("jobs", [])]
        return sum(step_seconds(storage, run_id, job) for job in jobs), "training steps"
    if stage == "resume":  # one job whose two phases log their steps in folders of their own (training/resume.py)
        job_summaries = [job["result"].get("summary") or {} for job in entry.get("jobs", [])]
        phases = [s[key] for s in job_summaries for key in ("interrupt_job", "continue_job") if s.get(key)]
        return sum(step_seconds(storage, run_id, phase) for phase in phases), "training steps"
    if stage == "evaluate":
        return sum((m or {}).get("seconds", 0.0) for m in summary.get("models", {}).values()), "generation"
    if stage == "data":
        return tokenize_s, "tokenization (raw tokenizer, measured apart)"
    return 0.0, "checks only"


def breakdown(storage: Path, run_id: str, wall: float, tokenize_s: float) -> dict:
    record = json.loads((storage / "runs" / run_id / "record.json").read_text())
    stages = {}
    for entry in sorted(record["stages"].values(), key=lambda e: e["started_at"]):  # pipeline order
        seconds = seconds_between(entry["started_at"], entry["ended_at"])
        work, what = stage_work(storage, run_id, entry, tokenize_s)
        stages[entry["stage"]] = {
            "status": entry["status"],
            "seconds": round(seconds, 2),
            "work_s": round(work, 2),
            "orchestration_s": round(seconds - work, 2),
            "work_is": what,
        }
    work = sum(s["work_s"] for s in stages.values())
    in_stages = sum(s["seconds"] for s in stages.values())
    return {
        "wall_s": round(wall, 2),
        "work_s": round(work, 2),
        "orchestration_s": round(wall - work, 2),
        "outside_stages_s": round(wall - in_stages, 2),
        "orchestration_fraction": round((wall - work) / wall, 4),
        "stages": stages,
    }


def run_once(bench: Bench, env: dict[str, str], tag: str, tokenize_s: float) -> dict:
    storage = bench.fresh_dir("pipeline")
    cfg_sets = [
        f"cluster.address={bench.head.address}",
        f"cluster.auth_token_file={bench.head.token_file}",
        f"storage.root={storage}",
        f"model.source={bench.model_dir}",
    ]
    run_id = f"bench-{tag}"
    args = ["-m", "tuneproof.app.cli", "run", "--run-id", run_id, *sum((["--set", s] for s in cfg_sets), [])]
    began = time.perf_counter()
    run_python(args, {**bench.env(), **{k: env[k] for k in ("PREFECT_HOME", "PREFECT_API_URL", "PREFECT_UI_API_URL")}})
    return breakdown(storage, run_id, time.perf_counter() - began, tokenize_s)


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    from bench.data_prep import bare_tokens_per_s

    _, _, tokenize_s = bare_tokens_per_s(bench.model_dir, PROJECT_ROOT / "data" / "dates" / "dates.jsonl")
    runs = []
    home = bench.fresh_dir("prefect-home")
    with prefect_server(home) as env:
        for i in range(repeats):
            result = run_once(bench, env, str(i), tokenize_s)
            say(f"  pipeline #{i}: {result['wall_s']:.0f} s, orchestration {result['orchestration_fraction']:.0%}")
            for name, s in result["stages"].items():
                say(f"    {name:<13} {s['seconds']:7.1f} s  work {s['work_s']:6.1f} s  ({s['work_is']})")
            runs.append(result)
    fraction = statistics.median(r["orchestration_fraction"] for r in runs)
    return BenchResult(
        ratio=fraction,
        target=TARGET.text(),
        ok=TARGET.met(fraction),
        repeats=len(runs),
        details={
            "figure": "orchestration seconds / pipeline wall seconds (median over runs)",
            "wall_s": [r["wall_s"] for r in runs],
            "miss": TARGET.miss(fraction),
            "runs": runs,
        },
    )
