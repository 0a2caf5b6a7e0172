"""scaling: how cost grows with work. A table per curve and its log-log slope (1 = linear, 0 = flat).

    python -m bench.run --only scaling [--quick] [--max-rows N] [--max-eval N]

- data prep: the data stage's wall time (a Ray job, submission to result) at 10k, 100k, 1M rows;
- fine-tune: the stage's median step time at 1, 2, 4 workers (32 examples per rank per step, so
  the global batch grows with the workers: on 2 cores, more workers means more work per core);
- evaluation: batched greedy generation (eval.generation.generate, batch 64, 16 new tokens) of the
  tiny model over 100, 1,000, 10,000 prompts, in this process;
- `runs list`: the command in this process over 10, 100, 1,000 synthetic run records.

--quick runs smaller sizes; --max-rows and --max-eval cap the largest ones. The output and the
summary say which sizes ran.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from bench.common import BenchResult, curve_table, loglog_slope, say, stopwatch
from bench.finetune_step import ours_step
from bench.harness import Bench, prepare_dataset, write_corpus
from tuneproof.core.config import PROJECT_ROOT


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
            "sizes_ran": {"rows": rows, "workers": workers, "eval_examples": evals, "runs": records},
            "quick": quick,
            "seconds": round(time.perf_counter() - began, 1),
        },
    )
