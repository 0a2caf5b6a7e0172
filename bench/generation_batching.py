"""Batched greedy generation vs one prompt at a time, measured side by side in one run.

    .venv/bin/python bench/generation_batching.py [--examples 200] [--repeats 3]

Prints the median seconds of each and the speed-up ratio. The evaluate stage relies on batching
(left padding, length-sorted batches); answers must be identical either way, and this checks that
too. Ratios, not absolute times: this machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from eval.generation import generate  # noqa: E402
from tuneproof.app.tiny_model import ensure_tiny_model  # noqa: E402
from tuneproof.core.config import PROJECT_ROOT  # noqa: E402

DATA = PROJECT_ROOT / "data" / "dates" / "dates.jsonl"


def prompts(tokenizer, n: int) -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["input"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]


def timed(fn) -> tuple[float, list[str]]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def measure(examples: int, repeats: int, batch_size: int) -> dict[str, list[float]]:
    """Seconds of batched and of one-by-one generation, interleaved; raises if their answers differ."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(tempfile.gettempdir()) / "tuneproof-bench-model"
    ensure_tiny_model(model_dir, DATA)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = prompts(tokenizer, examples)

    batched, single = [], []
    for _ in range(repeats):  # interleaved so both see the same machine load
        t_b, out_b = timed(lambda: generate(model, tokenizer, texts, 16, batch_size))
        t_s, out_s = timed(lambda: generate(model, tokenizer, texts, 16, 1))
        batched.append(t_b)
        single.append(t_s)
        if out_b != out_s:
            raise AssertionError("batched answers differ from one-at-a-time answers")
    return {"batched": batched, "one_by_one": single}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    measured = measure(args.examples, args.repeats, args.batch_size)
    b, s = statistics.median(measured["batched"]), statistics.median(measured["one_by_one"])
    print(f"examples={args.examples} batch_size={args.batch_size} repeats={args.repeats}")
    print(f"batched   median {b:.3f} s")
    print(f"one-by-one median {s:.3f} s")
    print(f"speed-up (one-by-one / batched): {s / b:.1f}x; answers identical: yes")


if __name__ == "__main__":
    main()
