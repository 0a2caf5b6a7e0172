"""scaling: how cost grows with work. A table per curve and its log-log slope (1 = linear, 0 = flat).

    python -m bench.run --only scaling [--quick] [--max-rows N] [--max-eval N]

- data prep: the data stage's wall time (a Ray job, submission to result) at 10k, 100k, 1M rows;
- fine-tune: the stage's median step time at 1, 2, 4 workers (32 examples per rank per step, so
  the global batch grows with the workers: on 2 cores, more workers means more work per core);
- evaluation: batched greedy generation (eval.generation.generate, batch 64, 16 new tokens) of the
  tiny model over 100, 1,000, 10,000 prompts, in this process;
- `runs list`: the command in this process over 10, 100, 1,000 synthetic run records.

Linear costs (issue 30), also alone: `python -m bench.scaling [--quick]` (a moto S3 server of its own):
- `runs list` (record.list_rows) over 100, 1,000, 10,000 runs, local and S3: seconds per run should
  stay flat (it reads one small row.json per run);
- metrics writing: the fine-tune's metrics.jsonl appends (tuneproof/core/rowlog.py, a flush every 10
  steps) from 1,000 to 100,000 steps: seconds should grow linearly with steps.
Each size is sampled 3 times; the fit (least squares over every sample) gives intercept and slope.

--quick runs smaller sizes; --max-rows and --max-eval cap the largest ones. The output and the
summary say which sizes ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import BenchResult, curve_table, loglog_slope, say, stopwatch
from bench.finetune_step import ours_step
from bench.harness import S3_BUCKET, Bench, moto_server, prepare_dataset, write_corpus
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.storage import Storage


def curve(name: str, sizes: Sequence[int], measure: Callable[[int], float], unit_x: str, unit_y: str) -> dict:
    points = []
    for size in sizes:
        y = measure(size)
        say(f"  scaling {name} at {size:,} {unit_x}: {y:.4g} {unit_y}")
        points.append((size, y))
    say(curve_table(f"{name} ({unit_y} by {unit_x})", unit_x, unit_y, points))
    slope = loglog_slope([p[0] for p in points], [p[1] for p in points]) if len(points) > 1 else None
    return {"unit_x": unit_x, "unit_y": unit_y, "points": points, "slope": None if slope is None else round(slope, 3)}


def data_prep_seconds(bench: Bench, rows: int) -> float:
    corpus = write_corpus(bench.scratch / f"scaling-{rows}.jsonl", rows)
    _, job = prepare_dataset(bench, bench.fresh_dir("scaling-data"), f"bench-scale-{rows}", f"data.source={corpus}")
    return job.seconds


def eval_seconds(bench: Bench, examples: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from eval.generation import generate

    tokenizer = AutoTokenizer.from_pretrained(bench.model_dir)
    model = AutoModelForCausalLM.from_pretrained(bench.model_dir).eval()
    corpus = write_corpus(bench.scratch / f"eval-{examples}.jsonl", examples)
    chats = [[{"role": "user", "content": json.loads(line)["input"]}] for line in corpus.read_text().splitlines()]
    prompts = [str(tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)) for c in chats]
    with stopwatch() as elapsed:
        generate(model, tokenizer, prompts, 16, 64)
    return elapsed()


def write_records(root: Path, count: int) -> None:
    """`count` run records like a finished run's: every stage entry, a 400-point loss curve."""
    from tuneproof.control.record import CodeIdentity, StageEntry, new_record, save
    from tuneproof.core.config import load_config
    from tuneproof.core.storage import Storage

    cfg = load_config(PROJECT_ROOT / "configs" / "local.yaml")
    storage = Storage(str(root))
    curve_points = [[step, 3.0 / step] for step in range(1, 401)]
    for i in range(count):
        record = new_record(f"20261201-{i:06d}-bench", cfg, CodeIdentity(git_sha="0" * 40, dirty=False), None)
        record.status = "succeeded"
        for stage in ("verify", "connectivity", "data", "finetune", "resume", "evaluate", "promote"):
            summary = {"loss_curve": curve_points} if stage == "finetune" else {}
            record.stages[stage] = StageEntry(
                stage=stage,
                status="succeeded",
                started_at=record.created_at,
                ended_at=record.created_at,
                summary=summary,
            )
        save(storage, record)


def runs_list_seconds(bench: Bench, count: int) -> float:
    from typer.testing import CliRunner

    from tuneproof.app.cli import app

    root = bench.fresh_dir(f"runs-{count}")
    write_records(root, count)
    with stopwatch() as elapsed:
        result = CliRunner().invoke(app, ["runs", "list", "--json", "--set", f"storage.root={root}"])
    if result.exit_code:
        raise RuntimeError(f"runs list exited {result.exit_code}: {result.output[-2000:]}")
    listed = len(json.loads(result.output))
    if listed != count:
        raise RuntimeError(f"runs list showed {listed} runs, {count} were written")
    return elapsed()


def linear_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through (x, y) points. Pure."""
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    if spread == 0:
        raise ValueError(f"a fit needs at least two different sizes, got {sorted(set(xs))}")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread
    return my - slope * mx, slope


def sampled(name: str, sizes: Sequence[int], measure: Callable[[int], float], unit_x: str, samples: int = 3) -> dict:
    """Every size measured `samples` times; the median per size, seconds per unit, and the linear fit."""
    points = [(size, measure(size)) for size in sizes for _ in range(samples)]
    medians = {size: statistics.median(y for x, y in points if x == size) for size in sizes}
    for size, y in medians.items():
        say(f"  {name} at {size:,} {unit_x}: median {y:.4g} s, {y / size * 1e6:.1f} us per {unit_x[:-1]}")
    intercept, slope = linear_fit(points)
    say(f"  {name}: fit {intercept:.4g} s + {slope * 1e6:.2f} us x {unit_x}")
    return {
        "unit_x": unit_x,
        "samples": [[x, round(y, 6)] for x, y in points],
        "median_s": {str(k): round(v, 6) for k, v in medians.items()},
        "us_per_unit": {str(k): round(v / k * 1e6, 2) for k, v in medians.items()},
        "fit": {"intercept_s": round(intercept, 6), "slope_s_per_unit": slope},
    }


def indexed_runs(storage_root: str, count: int, endpoint: str | None = None) -> Storage:
    """`count` runs as `save` leaves them (record.json + a row stamped with it), one record's bytes with its id
    replaced."""
    from tuneproof.control.record import RECORD, load, row_of, save, write_row

    storage = Storage(storage_root, endpoint)
    template = "20261201-000000-bench"
    if not storage.exists("runs", template, RECORD):
        local = Storage(str(Path(tempfile.mkdtemp(prefix="bench-record-"))))
        write_records(Path(local.root), 1)
        save(storage, load(local, template))
    record = storage.read_text("runs", template, RECORD)
    row = row_of(load(storage, template))
    have = len(storage.listdir("runs"))
    for i in range(have, count):
        run_id = f"20261201-{i:06d}-bench"
        storage.write_bytes(record.replace(template, run_id).encode(), "runs", run_id, RECORD)
        write_row(storage, row.model_copy(update={"run_id": run_id}))  # stamped with its own record, as save does
    return storage


def runs_list_by_runs(root: str, sizes: Sequence[int], endpoint: str | None = None) -> Callable[[int], float]:
    """Seconds `record.list_rows` takes over `n` runs; the store grows to each size in turn (sizes ascending)."""
    from tuneproof.control.record import list_rows

    def measure(n: int) -> float:
        storage = indexed_runs(root, n, endpoint)
        with stopwatch() as elapsed:
            listed = list_rows(storage)
        if len(listed) != n or any(r.status == "unreadable" for r in listed):
            raise RuntimeError(f"list_rows over {n} runs gave {len(listed)} rows")
        return elapsed()

    return measure


def metrics_writing(root: str, endpoint: str | None = None) -> Callable[[int], float]:
    """Seconds to log `n` steps as the fine-tune does: a row per step, appended every 10 steps."""
    from tuneproof.core.rowlog import append_rows, remove_log

    def measure(n: int) -> float:
        storage, parts = Storage(root, endpoint), ("runs", f"m{n}", "stages", "finetune", "metrics.jsonl")
        remove_log(storage, *parts)
        pending: list[dict] = []
        chunk: int | None = None
        with stopwatch() as elapsed:
            for step in range(1, n + 1):
                pending.append({"step": step, "loss": 1.0 / step, "lr": 1e-4, "tokens_per_s": 1e4, "time": 0.0})
                if step % 10 == 0:
                    chunk = append_rows(storage, pending, *parts, chunk=None if chunk is None else chunk + 1)
                    pending = []
        return elapsed()

    return measure


def linear_costs(scratch: Path, endpoint: str | None, quick: bool) -> dict:
    """The `runs list` and metrics-writing rows, local and (with an endpoint) on S3."""
    runs = [100, 300, 1_000] if quick else [100, 1_000, 10_000]
    steps = [1_000, 3_000, 10_000] if quick else [1_000, 10_000, 100_000]
    rows = {
        "runs_list_local": sampled("runs list (local)", runs, runs_list_by_runs(str(scratch / "index"), runs), "runs"),
        "metrics_writing_local": sampled("metrics writing (local)", steps, metrics_writing(str(scratch)), "steps"),
    }
    if endpoint:
        bucket = f"s3://{S3_BUCKET}/linear-{os.getpid()}"
        rows["runs_list_s3"] = sampled("runs list (S3)", runs, runs_list_by_runs(bucket, runs, endpoint), "runs")
        s3_steps = steps[:2]  # a PUT per flush on moto: 100,000 steps is 10,000 objects
        rows["metrics_writing_s3"] = sampled(
            "metrics writing (S3)", s3_steps, metrics_writing(bucket, endpoint), "steps"
        )
    return rows


def capped(sizes: Sequence[int], cap: int | None) -> list[int]:
    return [s for s in sizes if cap is None or s <= cap]


def run(
    bench: Bench, repeats: int, quick: bool, max_rows: int | None = None, max_eval: int | None = None
) -> BenchResult:
    rows = capped([2_000, 10_000, 30_000] if quick else [10_000, 100_000, 1_000_000], max_rows)
    evals = capped([100, 300, 1_000] if quick else [100, 1_000, 10_000], max_eval)
    workers = [1, 2] if quick else [1, 2, 4]
    records = [10, 30, 100] if quick else [10, 100, 1_000]
    ft_storage = bench.fresh_dir("scaling-ft")
    dataset, _ = prepare_dataset(bench, ft_storage)
    began = time.perf_counter()
    linear = linear_costs(bench.fresh_dir("linear-costs"), None, quick)
    curves = {
        "data_prep_seconds_by_rows": curve("data prep", rows, lambda n: data_prep_seconds(bench, n), "rows", "s"),
        "finetune_step_seconds_by_workers": curve(
            "fine-tune step",
            workers,
            lambda n: ours_step(bench, ft_storage, dataset, 20, n, f"scale-w{n}"),
            "workers",
            "s/step",
        ),
        "eval_seconds_by_examples": curve("evaluation", evals, lambda n: eval_seconds(bench, n), "examples", "s"),
        "runs_list_seconds_by_runs": curve("runs list", records, lambda n: runs_list_seconds(bench, n), "runs", "s"),
    }
    return BenchResult(
        ratio=None,
        target=None,
        ok=None,
        repeats=1,
        details={
            "curves": curves,
            "linear_costs": linear,
            "sizes_ran": {"rows": rows, "workers": workers, "eval_examples": evals, "runs": records},
            "quick": quick,
            "seconds": round(time.perf_counter() - began, 1),
        },
    )


def main() -> None:
    """The linear-cost rows alone, local and on a moto S3 server of their own; JSON on stdout."""
    parser = argparse.ArgumentParser(description="runs list and metrics-writing scaling rows")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-linear-") as scratch, moto_server() as endpoint:
        print(json.dumps(linear_costs(Path(scratch), endpoint, args.quick), indent=2))


if __name__ == "__main__":
    main()
