"""Generate the bundled chat task: multi-turn conversations in the messages shape.

Regenerate the committed file (the output is byte-for-byte deterministic; a test checks it):

    python data/chat/make_chat.py > data/chat/chat.jsonl

Each conversation opens like the date task (a date in one of its six formats -> ISO 8601), then asks
one or two follow-ups about that date: its "year?", "month?" or "day?", answered with the digits of
the ISO date ("2021", "03", "05"). The last assistant turn, which evaluation scores, is always a
follow-up, so a model passes only by reading the earlier turns of the conversation: it is a function
of the date given two turns before. Dates come from the date task's own formats and range.
"""

from __future__ import annotations

import random
import sys
from pathlib import Path

SEED = 20240306
ROWS = 3000
FOLLOW_UPS = {
    "year?": lambda d: f"{d.year:04d}",
    "month?": lambda d: f"{d.month:02d}",
    "day?": lambda d: f"{d.day:02d}",
}


# The date task's own formats, date range and file shape, not copies: data/ is scripts, not a package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "dates"))
from make_dates import FORMATS, random_day, render  # noqa: E402


def make_rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, list[dict[str, str]]]]:
    """n conversations: the formats in equal turns, half with one follow-up and half with two (two different ones)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        day = random_day(rng)
        messages = [
            {"role": "user", "content": FORMATS[i % len(FORMATS)](day)},
            {"role": "assistant", "content": day.isoformat()},
        ]
        for question in rng.sample(sorted(FOLLOW_UPS), 1 + (i // len(FORMATS)) % 2):
            messages += [
                {"role": "user", "content": question},
                {"role": "assistant", "content": FOLLOW_UPS[question](day)},
            ]
        rows.append({"messages": messages})
    rng.shuffle(rows)
    return rows


if __name__ == "__main__":
    sys.stdout.write(render(make_rows()))
