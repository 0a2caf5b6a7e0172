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

import datetime as dt
import importlib.util
import json
import random
import sys
from pathlib import Path

SEED = 20240307
ROWS = 3000
WITH_INPUT = "Write the date below as YYYY-MM-DD."
INLINE = "Write this date as YYYY-MM-DD: {date}"


def _date_task():
    """data/dates/make_dates.py, loaded by path: the formats and the date range are its, not copies."""
    spec = importlib.util.spec_from_file_location(
        "make_dates", Path(__file__).resolve().parent.parent / "dates" / "make_dates.py"
    )
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """n rows, the formats in equal turns; even rows carry the date in `input`, odd rows leave it empty."""
    dates = _date_task()
    rng = random.Random(seed)
    span = (dates.LAST_DAY - dates.FIRST_DAY).days
    rows = []
    for i in range(n):
        day = dates.FIRST_DAY + dt.timedelta(days=rng.randint(0, span))
        text = dates.FORMATS[i % len(dates.FORMATS)](day)
        if i % 2 == 0:
            rows.append({"instruction": WITH_INPUT, "input": text, "output": day.isoformat()})
        else:
            rows.append({"instruction": INLINE.format(date=text), "input": "", "output": day.isoformat()})
    rng.shuffle(rows)
    return rows


def render(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


if __name__ == "__main__":
    sys.stdout.write(render(make_rows()))
