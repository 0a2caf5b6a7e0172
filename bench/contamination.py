"""contamination: the data stage's overlap check (training/contamination.measure) by rows. Target: a flat cost per row.

    python -m bench.run --only contamination [--quick]

In this process, no Ray: generated rows of 40 words (seeded, from a 5,000-word vocabulary, so every 13-word
run is distinct unless planted) at 10,000, 30,000 and 100,000 rows (2,000, 6,000, 20,000 with --quick), split
as the data stage splits them (90 % training, 10 % eval), half the eval items short (8 words, as a prompt and its
answer are: the pass for short items inside a training row runs), 1 % of the eval rows planted as verbatim training
rows and 1 % as 8 words from inside one. Each size is measured 3 times in CPU seconds of this process (the shared machine's other load does not
count), and the least-squares fit over every sample (bench.scaling.linear_fit) gives intercept and slope.
The figure is the largest median microseconds per row over the smallest: a hashed, linear check keeps it
near 1, a pairwise scan would grow it tenfold from 10,000 to 100,000 rows; `ok` when it is at most 2.
"""

from __future__ import annotations

import random
import time

from bench.common import BenchResult, Target, say
from bench.scaling import sampled

TARGET = Target("<=", 2.0)
WORDS_PER_ROW = 40
SHORT_ITEM = 8
VOCABULARY = [f"w{i}" for i in range(5_000)]
EVAL_SHARE = 0.1
PLANTED_SHARE = 0.01


def rows(n: int, seed: str, words: int = WORDS_PER_ROW) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(VOCABULARY, k=words)) for _ in range(n)]


def cpu_seconds(size: int) -> float:
    """CPU seconds of one `measure` over `size` rows; raises when it misses the planted repeats."""
    from training.contamination import measure

    n_eval = int(size * EVAL_SHARE)
    train = rows(size - n_eval, seed=f"train-{size}")
    planted = int(n_eval * PLANTED_SHARE)
    inside = [" ".join(row.split()[10 : 10 + SHORT_ITEM]) for row in train[planted : 2 * planted]]
    rest = n_eval - 2 * planted
    texts = [
        *train[:planted],
        *inside,
        *rows(rest // 2, seed=f"eval-{size}"),
        *rows(rest - rest // 2, seed=f"short-{size}", words=SHORT_ITEM),
    ]
    eval_items = [(str(i), text) for i, text in enumerate(texts)]
    began = time.process_time()
    found = measure(train, eval_items)
    seconds = time.process_time() - began
    if found.overlapping != 2 * planted:
        raise RuntimeError(
            f"measure found {found.overlapping} overlapping items at {size:,} rows, {2 * planted} planted"
        )
    return seconds


def run(bench, repeats: int, quick: bool) -> BenchResult:
    sizes = [2_000, 6_000, 20_000] if quick else [10_000, 30_000, 100_000]
    curve = sampled("contamination", sizes, cpu_seconds, "rows", samples=max(3, repeats))
    per_row = [curve["us_per_unit"][str(size)] for size in sizes]
    figure = max(per_row) / min(per_row)
    say(f"  contamination: {min(per_row):.1f}..{max(per_row):.1f} us per row, largest / smallest {figure:.2f}")
    return BenchResult(
        ratio=round(figure, 3),
        target=TARGET.text(),
        ok=TARGET.met(figure),
        repeats=max(3, repeats),
        details={
            **curve,
            "words_per_row": WORDS_PER_ROW,
            "short_item_words": SHORT_ITEM,
            "quick": quick,
            "clock": "process CPU seconds",
        },
    )
