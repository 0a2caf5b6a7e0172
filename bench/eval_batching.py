"""eval_batching: batched greedy generation vs one prompt at a time (bench/generation_batching.py). >= 10.

    python -m bench.run --only eval_batching

The ratio is the speed-up, median(one-by-one seconds) / median(batched seconds); the answers must
be identical either way (it raises otherwise).
"""

from __future__ import annotations

from bench import generation_batching
from bench.common import BenchResult, Target, compare, say

TARGET = Target(">=", 10)


def run(bench, repeats: int, quick: bool) -> BenchResult:
    examples = 32 if quick else 64  # one full batch: affordable one by one on 2 busy cores
    measured = generation_batching.measure(examples, repeats, batch_size=64)
    say(f"  eval_batching: batched {measured['batched']} s, one by one {measured['one_by_one']} s")
    return compare(
        measured["one_by_one"],
        measured["batched"],
        TARGET,
        unit="s per pass (ratio = speed-up)",
        ours_is="one_by_one",
        bare_is="batched",
        examples=examples,
        batch_size=64,
        answers_identical=True,
    )
