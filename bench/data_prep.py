"""data_prep: tokens/s of the data stage vs raw `tokenizers` batch encoding of the same corpus. Target >= 0.6.

    python -m bench.run --only data_prep [--quick]

The corpus is generated (bench.harness.write_corpus: the bundled date task's generator, each prompt
made distinct by its row number): 800,000 rows, so that the job's start-up (reported beside each run, as
a fraction of the stage) is under the 10 % the issue asks; 10,000 with --quick. Ours: the data stage as the pipeline runs
it (a Ray job: read, parse, split; chat template, tokenize and fit on Ray actors, one per free CPU, from
20,000 rows on; write the parquet shards and the manifest), from submission to validated result, into a
fresh storage root; its tokens are the manifest's. Without the demo's replay rows (data.replay: null): they
are rows the bare side would not encode (41.9 M tokens against 34.0 M with them), and the work must be the same.
Bare: this process reads the same JSONL, renders each row as the same ChatML text and encodes it
with the model's `tokenizers.Tokenizer` in one `encode_batch` call: a lower bound on the work.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from bench.common import BenchResult, Target, ours_against_bare, say
from bench.harness import Bench, prepare_dataset, write_corpus

TARGET = Target(">=", 0.6)
ROWS = 800_000


def chatml(prompt: str, response: str) -> str:
    """The text of one row as the data stage tokenizes it: ChatML, less the newline after the last turn
    (the stage does not train on it), so both sides encode the same tokens."""
    return f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n{response}<|im_end|>"


def bare_tokens_per_s(model_dir: Path, corpus: Path) -> tuple[float, int, float]:
    """(tokens/s, tokens, seconds) of reading, rendering and batch-encoding the corpus."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    began = time.perf_counter()
    rows = [json.loads(line) for line in corpus.read_text().splitlines()]
    encoded = tokenizer.encode_batch([chatml(r["input"], r["output"]) for r in rows], add_special_tokens=False)
    seconds = time.perf_counter() - began
    tokens = sum(len(e.ids) for e in encoded)
    return tokens / seconds, tokens, seconds


def ours_tokens_per_s(bench: Bench, corpus: Path, tag: str) -> tuple[float, int, float, float | None]:
    """(tokens/s, tokens, seconds, start-up seconds) of the data stage, submission to result."""
    root = bench.fresh_dir("data-ours")
    _, job = prepare_dataset(bench, root, f"bench-data-{tag}", f"data.source={corpus}", "data.replay=null")
    assert job.summary is not None
    tokens = sum(split["tokens"] for split in job.summary["manifest"]["splits"].values())
    return tokens / job.seconds, tokens, job.seconds, job.startup_s


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    rows = 10_000 if quick else ROWS
    corpus = write_corpus(bench.scratch / f"corpus-{rows}.jsonl", rows)
    seen: dict[str, list[tuple[int, float]]] = {"ours": [], "bare": []}
    startup_fraction: list[float] = []

    def ours(i: int) -> float:
        tps, tokens, seconds, startup = ours_tokens_per_s(bench, corpus, str(i))
        seen["ours"].append((tokens, seconds))
        if startup is not None:
            startup_fraction.append(round(startup / seconds, 3))
            startup = round(startup, 1)
        say(f"  data_prep ours #{i}: {tokens:,} tokens in {seconds:.1f} s = {tps:,.0f} tokens/s (start-up {startup} s)")
        return tps

    def bare(i: int) -> float:
        tps, tokens, seconds = bare_tokens_per_s(bench.model_dir, corpus)
        seen["bare"].append((tokens, seconds))
        say(f"  data_prep bare #{i}: {tokens:,} tokens in {seconds:.1f} s = {tps:,.0f} tokens/s")
        return tps

    return ours_against_bare(
        ours,
        bare,
        repeats,
        TARGET,
        unit="tokens/s",
        rows=rows,
        tokens_and_seconds=seen,
        startup_fraction_of_stage=startup_fraction,
    )
