"""Generate the bundled Alpaca-style task: instruction, an optional input, output.

Regenerate the committed file (the output is byte-for-byte deterministic; a test checks it):

    python data/alpaca/make_alpaca.py > data/alpaca/alpaca.jsonl

The date task (data/dates/make_dates.py: a date in one of six formats -> ISO 8601) in the shape most
instruction datasets take: `instruction`, `input`, `output` columns, where half the rows carry their
date in the input column and the other half put it in the instruction and leave the input empty. A
prompt template over the columns (configs/local-alpaca.yaml) must render both halves cleanly: an empty
input collapses with its heading instead of leaving a stray "### Input:" behind.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 20240307
ROWS = 3000
WITH_INPUT = "Write the date below as YYYY-MM-DD."
INLINE = "Write this date as YYYY-MM-DD: {date}"


# The date task's own formats, date range and file shape, not copies: data/ is scripts, not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dates"))
from make_dates import FORMATS, random_day, render  # noqa: E402


def make_rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """n rows, the formats in equal turns; even rows carry the date in `input`, odd rows leave it empty."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        day = random_day(rng)
        text = FORMATS[i % len(FORMATS)](day)
        if i % 2 == 0:
            rows.append({"instruction": WITH_INPUT, "input": text, "output": day.isoformat()})
        else:
            rows.append({"instruction": INLINE.format(date=text), "input": "", "output": day.isoformat()})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    sys.stdout.write(render(make_rows()))
