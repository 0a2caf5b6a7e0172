"""tuneproof's batched evaluation against the generation loop a user writes with plain Hugging Face.

    .venv/bin/python bench/generation_batching.py [--examples 200] [--repeats 5]

Three sides, interleaved, the same prompts and greedy decoding: ours (eval.generation.generate:
length-sorted, left-padded batches), plain `model.generate` over padded batches in the order given,
and plain `model.generate` one prompt at a time. Prints the median seconds of each. Ratios, not
absolute times: this machine is shared and noisy.
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

from bench.common import interleave  # noqa: E402
from eval.generation import generate, pad_token_id, stop_token_ids  # noqa: E402
from tuneproof.app.tiny_model import ensure_tiny_model  # noqa: E402
from tuneproof.core.config import PROJECT_ROOT  # noqa: E402

DATA = PROJECT_ROOT / "data" / "dates" / "dates.jsonl"
NEW_TOKENS = 16


def prompts(tokenizer, n: int) -> list[str]:
    rows = [json.loads(line) for line in DATA.read_text().splitlines()[:n]]
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": r["input"]}], tokenize=False, add_generation_prompt=True
        )
        for r in rows
    ]


def plain_hf(model, tokenizer, texts: list[str], batch_size: int) -> list[str]:
    """The loop from the transformers docs: batches in the order given, left padding, greedy."""
    import torch

    # The same greedy decoding as ours: a fair user does not sample when scoring.
    greedy = {
        "do_sample": False,
        "num_beams": 1,
        "repetition_penalty": 1.0,
        "max_new_tokens": NEW_TOKENS,
        "pad_token_id": pad_token_id(tokenizer),
        "eos_token_id": stop_token_ids(tokenizer),
    }
    answers: list[str] = []
    with torch.no_grad():
        for start in range(0, len(texts), batch_size):
            batch = texts[start : start + batch_size]
            enc = tokenizer(batch, return_tensors="pt", padding=True, padding_side="left", add_special_tokens=False)
            new = model.generate(**enc, **greedy)[:, enc["input_ids"].shape[1] :]
            answers += [a.strip() for a in tokenizer.batch_decode(new, skip_special_tokens=True)]
    return answers


def measure(examples: int, repeats: int, batch_size: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """Seconds per pass of each side, interleaved, and the share of each plain loop's answers equal to ours."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = Path(tempfile.gettempdir()) / "tuneproof-bench-model"
    ensure_tiny_model(model_dir, DATA)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    texts = prompts(tokenizer, examples)
    answers: dict[str, list[str]] = {}

    def side(name: str, run):
        def timed(_round: int) -> float:
            began = time.perf_counter()
            answers[name] = run()
            return time.perf_counter() - began

        return timed

    sides = {
        "ours": side("ours", lambda: generate(model, tokenizer, texts, NEW_TOKENS, batch_size)),
        "hf_batched": side("hf_batched", lambda: plain_hf(model, tokenizer, texts, batch_size)),
        "hf_one_by_one": side("hf_one_by_one", lambda: plain_hf(model, tokenizer, texts, 1)),
    }
    for timed in sides.values():  # one untimed pass each: the first call's allocations belong to no side
        timed(-1)
    measured = interleave(sides, repeats)
    agree = {
        name: sum(a == b for a, b in zip(answers[name], answers["ours"])) / len(texts)
        for name in ("hf_batched", "hf_one_by_one")
    }
    return measured, agree


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--examples", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=64)
    args = parser.parse_args()

    measured, agree = measure(args.examples, args.repeats, args.batch_size)
    print(f"examples={args.examples} batch_size={args.batch_size} repeats={args.repeats}")
    for name, seconds in measured.items():
        print(f"{name:<14} median {statistics.median(seconds):.3f} s")
    print(f"answers equal to ours: {agree}")


if __name__ == "__main__":
    main()
