"""Where the data stage's time goes: its body run in this process, wall and CPU seconds per phase.

    python -m bench.data_prep_profile [--rows 50000]

The same generated corpus and configs/local.yaml settings as `bench.data_prep`, but no Ray job: the
stage function runs here, with each phase's function wrapped in a timer. CPU seconds (this process,
every thread) move much less with the machine's load than wall seconds do, so they are what to compare
against the bare `encode_batch`'s. The stage's encoding pool (Ray actors, from POOL_MIN_ROWS rows inside a
Ray job) is kept off, even should RAY_ADDRESS be set: an actor's CPU is no child's of this process and its
phases would go untimed, so every phase runs and is timed here. What a job pays before its first row (importing the stage
and loading the tokenizer, which imports transformers and whatever it pulls in) is measured apart, in a
fresh child process, since this one has imported transformers already to build the tiny model.
Last, the bare side of `bench.data_prep` on the same corpus, and the two sides' tokens per CPU second
(ours: start-up plus body; the Ray job's own submission and process start are not in it).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.data_prep import bare_tokens_per_s
from bench.harness import write_corpus
from tuneproof.core.config import PROJECT_ROOT, load_config

PHASES = (
    ("training.data_prep", "load_text_tokenizer"),
    ("training.data_prep", "tokenizer_sha256"),
    ("training.data_prep", "parse_rows"),
    ("training.data_sources", "conversations"),
    ("training.data_encode", "render_batch"),
    ("training.data_encode", "token_ids"),
    ("training.data_encode", "fit_rows"),
    ("training.data_prep", "write_splits"),
)
"""(module that calls it, function): each a phase of the data stage (render_batch: the chat template), timed
where it is called from."""


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def timed(fn, label: str, seen: dict[str, list[float]]):
    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any):
        wall, cpu = clocks()
        try:
            return fn(*args, **kwargs)
        finally:
            total = seen.setdefault(label, [0.0, 0.0])
            total[0] += time.perf_counter() - wall
            total[1] += time.process_time() - cpu

    return wrapper


STARTUP = (
    "import sys, training.data_prep as stage; stage.load_text_tokenizer(sys.argv[1]); "
    "print(' '.join(sorted(m for m in ('torch', 'transformers', 'tokenizers') if m in sys.modules)))"
)
"""A job's start-up in the stage's own process: the import and the tokenizer load, nothing else."""


def children_cpu() -> float:
    """CPU seconds of this process's ended children (the start-up probe's process)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def startup_cost(model: Path) -> tuple[float, float, str]:
    """(wall s, CPU s, the heavy modules it imported) of a fresh process's STARTUP."""
    cpu = children_cpu()
    wall = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-c", STARTUP, str(model)], cwd=PROJECT_ROOT, capture_output=True, text=True, check=True
    )
    wall = time.perf_counter() - wall
    return wall, children_cpu() - cpu, done.stdout.strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.data_prep_profile", description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=50_000, help="rows of the generated corpus (at least 1)")
    args = parser.parse_args(argv)
    if args.rows < 1:
        parser.error(f"--rows must be at least 1, got {args.rows}")
    from tuneproof.app.tiny_model import ensure_tiny_model

    with tempfile.TemporaryDirectory(prefix="tuneproof-dp-profile-") as tmp:
        scratch = Path(tmp)
        model = scratch / "tiny-qwen2"
        ensure_tiny_model(model, PROJECT_ROOT / "data" / "dates" / "dates.jsonl")
        corpus = write_corpus(scratch / f"corpus-{args.rows}.jsonl", args.rows)
        cfg = load_config(
            PROJECT_ROOT / "configs" / "local.yaml",
            [f"storage.root={scratch / 'store'}", f"model.source={model}", f"data.source={corpus}"],
        )
        startup_wall, startup_cpu, imported = startup_cost(model)
        print(
            f"start-up (a fresh process imports the stage and loads the tokenizer): {startup_wall:.2f} s wall, "
            f"{startup_cpu:.2f} CPU s (imports {imported})"
        )
        import training.data_encode
        import training.data_prep as stage
        from training.jobkit import JobContext

        seen: dict[str, list[float]] = {}
        for where, name in PHASES:
            module = importlib.import_module(where)
            setattr(module, name, timed(getattr(module, name), name, seen))
        training.data_encode.POOL_MIN_ROWS = sys.maxsize
        wall, cpu = clocks()
        summary = stage.prepare_data(JobContext("profile", "data", cfg))
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        bare_cpu = time.process_time()
        _, bare_tokens, bare_wall = bare_tokens_per_s(model, corpus)
        bare_cpu = time.process_time() - bare_cpu
    tokens = sum(split.tokens for split in summary.manifest.splits.values()) if summary.manifest else 0
    print(f"stage body: {args.rows:,} rows, {tokens:,} tokens in {wall:.2f} s wall, {cpu:.2f} CPU s (one process)")
    for name, (phase_wall, phase_cpu) in seen.items():
        print(f"  {name:18s} {phase_wall:7.2f} s wall {phase_cpu:7.2f} CPU s {100 * phase_cpu / cpu:5.1f} % of CPU")
    rest = cpu - sum(c for _, c in seen.values())
    print(f"  {'(the rest)':18s} {'':7s}   wall {rest:7.2f} CPU s {100 * rest / cpu:5.1f} % of CPU")
    print(f"bare: {bare_tokens:,} tokens in {bare_wall:.2f} s wall, {bare_cpu:.2f} CPU s")
    ours_rate, bare_rate = tokens / (startup_cpu + cpu), bare_tokens / bare_cpu
    print(f"tokens per CPU s: ours {ours_rate:,.0f}, bare {bare_rate:,.0f}, ratio {ours_rate / bare_rate:.2f}")


if __name__ == "__main__":
    main()
