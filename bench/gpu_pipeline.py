"""The whole pipeline on one GPU machine, then the MFU benchmark; prints the figures.

    python3 bench/gpu_pipeline.py                    # a fresh clone, one NVIDIA GPU, PyPI, python3 3.11-3.13
    python3 bench/gpu_pipeline.py --venv DIR         # an environment with CUDA torch and the project: no install

Unattended, meant to finish within 10 minutes on a fresh single-H200 machine (expected: install
3-5 min, mostly the CUDA torch wheel and its nvidia-* wheels; cluster start under 1 min; pipeline
about 2 min; benchmark about 1 min):

1. a virtualenv with the pinned versions of constraints.txt, except torch: constraints.txt pins
   the CPU wheel, so the same torch version comes from PyPI, whose Linux wheel is the CUDA build;
2. `tuneproof local up`: the local Ray head (it advertises the GPU), Prefect, the tiny Qwen2;
3. `tuneproof run` on the GPU (settings in GPU_SETTINGS): verify (torch sees the GPU Ray
   advertises; CUDA and NCCL versions recorded), connectivity over NCCL with its transport
   verdict (one GPU has no network hop, so "inconclusive" is the expected verdict there), data,
   bf16 fine-tune, resume test, evaluation, promotion;
4. bench/gpu_mfu.py: Qwen2.5-1.5B, FSDP2, bf16, sequence length 2048, activation checkpointing
   off and on;
5. the figures: each stage's status and seconds, the transport verdict and bus bandwidth, the
   fine-tune's tokens/s, MFU and losses, the resume check, the evaluation metrics, the benchmark.

Writes bench/out/gpu_pipeline.json (the run record) and bench/out/gpu_mfu.json; stops what it
started. Exit code: the pipeline's (0 when every stage passed), else the benchmark's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "bench" / "out"
GPU_SETTINGS = [
    "train.use_gpu=true",
    "train.num_workers=1",  # one worker per GPU, and this machine has one
    "train.sharding=full",
    "connectivity.expect_transport=any",  # one process: NCCL never reaches for a network transport
    "resume.loss_rtol=0.02",  # bf16 replays are close, not bit for bit (the config's own advice)
]


def sh(*command: str | Path, check: bool = True) -> int:
    """Run a command in the project root with its output on ours; returns its exit code."""
    print("+", " ".join(map(str, command)), flush=True)
    code = subprocess.run([str(c) for c in command], cwd=ROOT).returncode
    if check and code:
        sys.exit(f"{command[0]} exited {code}")
    return code


def timed(label: str, fn, *args, **kwargs):
    began = time.monotonic()
    result = fn(*args, **kwargs)
    print(f"== {label}: {time.monotonic() - began:.0f} s", flush=True)
    return result


def install(venv: Path) -> None:
    """The project's pinned dependencies with torch's CUDA build of the same version."""
    pip = venv / "bin" / "pip"
    sh(sys.executable, "-m", "venv", venv)
    sh(pip, "install", "-q", "--upgrade", "pip")
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    torch_pin = next(line for line in lines if line.startswith("torch=="))
    gpu_constraints = venv / "constraints-gpu.txt"
    gpu_constraints.write_text("\n".join(line for line in lines if line != torch_pin) + "\n")
    sh(pip, "install", "-q", torch_pin.split("+")[0])  # torch==2.13.0+cpu -> torch==2.13.0, the CUDA wheel
    sh(pip, "install", "-q", "-c", gpu_constraints, "-e", ".")


def check_gpu(python: Path) -> None:
    sh(
        python,
        "-c",
        "import torch; assert torch.cuda.is_available(), f'torch {torch.__version__} sees no GPU'; "
        "print('GPU:', torch.cuda.get_device_name(0), '| torch', torch.__version__, "
        "'| CUDA', torch.version.cuda, '| NCCL', torch.cuda.nccl.version())",
    )


def run_pipeline(tuneproof: Path) -> int:
    sets = [arg for setting in GPU_SETTINGS for arg in ("--set", setting)]
    return sh(tuneproof, "run", *sets, check=False)


def latest_record(tuneproof: Path) -> dict:
    """The run just made: `runs list` is newest first; `runs show --json` is its whole record."""
    listed = subprocess.run(
        [str(tuneproof), "runs", "list", "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    run_id = json.loads(listed.stdout)[0]["run_id"]
    shown = subprocess.run(
        [str(tuneproof), "runs", "show", run_id, "--json"], cwd=ROOT, capture_output=True, text=True, check=True
    )
    return json.loads(shown.stdout)


# ---------------------------------------------------------------- figures (pure: record -> lines)


def seconds(stage: dict) -> float:
    started, ended = (datetime.fromisoformat(stage[k]) for k in ("started_at", "ended_at"))
    return (ended - started).total_seconds()


def stage_lines(record: dict) -> list[str]:
    in_order = sorted(record["stages"].items(), key=lambda item: item[1]["started_at"])
    return [
        f"{name:<13} {stage['status']:<10} {seconds(stage):6.0f} s  {stage['cause'] or ''}" for name, stage in in_order
    ]


def connectivity_lines(summary: dict) -> list[str]:
    verdict, largest = summary["transport"], summary["allreduce"][-1]
    return [
        f"transport: {verdict['kind']} ({verdict['evidence'][0]}), backend {summary['backend']}",
        f"all-reduce {largest['size_bytes']:,} B: busbw {largest['busbw_GBps']:.1f} GB/s",
    ]


def finetune_lines(summary: dict) -> list[str]:
    mfu = f"{summary['mfu']:.1%}" if "mfu" in summary else "n/a (CPU, or a GPU training/flops.py has no peak for)"
    return [
        f"fine-tune: {summary['steps']} steps in {summary['seconds']:.0f} s, "
        f"{summary['tokens_per_s']:,.0f} tokens/s, MFU {mfu}, "
        f"loss {summary['first_loss']:.3f} -> {summary['final_loss']:.3f}"
    ]


def resume_lines(summary: dict) -> list[str]:
    return [
        f"resume: restored step {summary['restored_step']}, max loss diff {summary['max_loss_diff']:.3g} "
        f"(rtol {summary['loss_rtol']})"
    ]


def evaluate_lines(summary: dict) -> list[str]:
    return [
        f"evaluate ({summary['device']}): {role} " + ", ".join(f"{k}={v:.3f}" for k, v in model["metrics"].items())
        for role, model in summary["models"].items()
        if model
    ]


FIGURES = {
    "connectivity": connectivity_lines,
    "finetune": finetune_lines,
    "resume": resume_lines,
    "evaluate": evaluate_lines,
}
"""Stage -> the lines its summary gives, printed for each stage that succeeded."""


def figures(record: dict) -> list[str]:
    lines = [f"run {record['run_id']}: {record['status']}", *stage_lines(record)]
    for name, lines_of in FIGURES.items():
        stage = record["stages"].get(name)
        if stage and stage["status"] == "succeeded":
            lines += lines_of(stage["summary"])
    return lines


# ---------------------------------------------------------------- the story


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    # Under .tuneproof/ (git-ignored) and apart from .venv, which `make setup` fills with the CPU wheel.
    parser.add_argument(
        "--venv",
        type=Path,
        default=ROOT / ".tuneproof" / "venv-gpu",
        help="installed into when it has no bin/tuneproof yet",
    )
    args = parser.parse_args()
    venv = args.venv.resolve()
    python, tuneproof = venv / "bin" / "python", venv / "bin" / "tuneproof"
    if not tuneproof.exists():
        timed("install", install, venv)
    check_gpu(python)
    OUT.mkdir(parents=True, exist_ok=True)
    try:
        timed("local up", sh, tuneproof, "local", "up")
        pipeline_code = timed("pipeline", run_pipeline, tuneproof)
        record = latest_record(tuneproof)
    finally:
        sh(tuneproof, "local", "down", check=False)
    (OUT / "gpu_pipeline.json").write_text(json.dumps(record, indent=1) + "\n")
    bench_code = timed("benchmark", sh, python, "bench/gpu_mfu.py", check=False)
    print("\n".join(["", "== figures", *figures(record)]), flush=True)
    sys.exit(pipeline_code or bench_code)


if __name__ == "__main__":
    main()
