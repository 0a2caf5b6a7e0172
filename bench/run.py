"""`make bench`: tuneproof measured against the bare stack, side by side, interleaved, in one run.

    python -m bench.run                                  # every benchmark, 5 repeats, 3 for pipeline (about 30 min on 2 idle cores)
    python -m bench.run --only resume,checkpoint --repeats 5
    python -m bench.run --quick                          # smaller corpora, fewer steps and sizes (a smoke run)

Starts a local Ray head on 127.0.0.1 (and moto, a Prefect server where a benchmark needs them),
runs each benchmark, prints min/median/max of each side and the ratio against its target with its
95 % bootstrap interval (noisy when the interval holds the target), writes bench/out/summary.json
({name: {ratio, target, ok, repeats, interval, noisy, details}}; a partial run updates only
its own entries) and stops everything it started. A benchmark that fails is reported as failed
(ok false, the error in details) and the others still run. Exit code 0 when every benchmark ran,
whatever the verdicts: a missed target is a finding, not a crash.
"""

from __future__ import annotations

import argparse
import importlib
import signal
import sys
import time
import traceback
from pathlib import Path

from bench.common import MIN_REPEATS, BenchResult, table, write_summary

OUT = Path(__file__).resolve().parent / "out"
BENCHMARKS = (
    "eval_batching",
    "contamination",
    "packing",
    "checkpoint",
    "data_prep",
    "finetune_step",
    "resume",
    "resume_load",
    "pipeline",
    "scaling",
)
"""Run order: the quick ones first, so a broken environment shows in seconds."""
IN_PROCESS = {"eval_batching", "contamination", "packing", "checkpoint", "resume_load"}
"""Benchmarks that run in this process and need no Ray head."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(BENCHMARKS), help=f"comma-separated, of: {','.join(BENCHMARKS)}")
    parser.add_argument(
        "--repeats",
        type=int,
        default=MIN_REPEATS,
        help=f"interleaved rounds per side-by-side benchmark (default {MIN_REPEATS}: fewer make the intervals coarse)",
    )
    parser.add_argument(
        "--pipeline-repeats",
        type=int,
        default=3,
        help="pipeline: interleaved rounds of every stage (about 4 min each here, so 3 rather than --repeats)",
    )
    parser.add_argument("--quick", action="store_true", help="smaller sizes everywhere (the output says which ran)")
    parser.add_argument("--max-rows", type=int, default=None, help="scaling: largest data-prep corpus to run")
    parser.add_argument("--max-eval", type=int, default=None, help="scaling: largest evaluation set to run")
    args = parser.parse_args(argv)
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = [name for name in chosen if name not in BENCHMARKS]
    if unknown or not chosen:
        parser.error(f"--only {args.only!r}: unknown benchmark(s) {unknown}; choose from {','.join(BENCHMARKS)}")
    if args.repeats < 1 or args.pipeline_repeats < 1:
        parser.error(
            f"--repeats and --pipeline-repeats must be at least 1, got {args.repeats}, {args.pipeline_repeats}"
        )
    args.chosen = list(dict.fromkeys(chosen))  # the order given: a partial run can put what matters most first
    return args


def run_one(name: str, bench, args: argparse.Namespace) -> BenchResult:
    module = importlib.import_module(f"bench.{name}")
    if name == "pipeline":
        return module.run(bench, args.pipeline_repeats, args.quick)
    if name == "scaling":
        return module.run(bench, args.repeats, args.quick, args.max_rows, args.max_eval)
    return module.run(bench, args.repeats, args.quick)


def main(argv: list[str] | None = None) -> int:
    from bench.harness import bench_cluster

    args = parse_args(argv)
    # A SIGTERM (a timeout, a CI cancel) unwinds like Ctrl-C, so the Ray head and servers are still stopped.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    began = time.perf_counter()
    results: dict[str, BenchResult] = {}
    for name in args.chosen:
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            # A cluster per benchmark: none inherits another's leftovers, and a head lost on this shared
            # machine costs one benchmark, not the rest. 8 logical CPUs: the scaling curve's 4 training
            # workers plus Ray Train's controller and the job drivers.
            with bench_cluster(num_cpus=8, ray=name not in IN_PROCESS) as bench:
                result = run_one(name, bench, args)
        except Exception as e:  # noqa: BLE001 - one broken benchmark must not hide the others' figures
            traceback.print_exc()
            result = BenchResult(
                ratio=None, target=None, ok=False, repeats=0, details={"error": f"{type(e).__name__}: {e}"}
            )
        result.details["bench_seconds"] = round(time.perf_counter() - started, 1)
        results[name] = result
        write_summary(OUT / "summary.json", {name: result})
        print(
            f"== {name}: ratio {result.ratio} target {result.target} ok {result.ok} ({result.details['bench_seconds']} s)",
            flush=True,
        )
    total = time.perf_counter() - began
    print()
    print(table(results))
    print(f"\ntotal {total:.0f} s; summary: {OUT / 'summary.json'}")
    failed = [name for name, r in results.items() if "error" in r.details]
    if failed:
        print(f"benchmarks that could not run: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
