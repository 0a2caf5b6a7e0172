"""Generate the bundled date-normalisation task: a date in one of six formats -> ISO 8601.

Regenerate the committed file (the output is byte-for-byte deterministic; a test checks it):

    python data/dates/make_dates.py > data/dates/dates.jsonl

Every format is unambiguous (month by name, or year first, or a four-digit year in a fixed
position), so the answer is a function of the input. Years run 1950-2049, and each day is drawn once: a day
drawn twice in two formats ("June 19, 2022", "Sunday, June 19, 2022") put an eval item, its question and answer,
inside a training row, which the data stage's contamination check refuses.
"""

from __future__ import annotations

import datetime as dt
import json
import random
import sys

SEED = 20240305
ROWS = 3000
FIRST_DAY = dt.date(1950, 1, 1)
LAST_DAY = dt.date(2049, 12, 31)

MONTHS = (
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
)
WEEKDAYS = ("Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday")


def ordinal(day: int) -> str:
    """1 -> '1st', 12 -> '12th', 22 -> '22nd'."""
    suffix = "th" if 11 <= day <= 13 else {1: "st", 2: "nd", 3: "rd"}.get(day % 10, "th")
    return f"{day}{suffix}"


# Month and weekday names are spelled out here rather than taken from strftime, which follows the locale.
FORMATS = (
    lambda d: f"{MONTHS[d.month - 1]} {d.day}, {d.year}",  # March 5, 2021
    lambda d: f"{d.day} {MONTHS[d.month - 1][:3]} {d.year}",  # 5 Mar 2021
    lambda d: f"{d.year}/{d.month:02d}/{d.day:02d}",  # 2021/03/05
    lambda d: f"{WEEKDAYS[d.weekday()]}, {MONTHS[d.month - 1]} {d.day}, {d.year}",  # Friday, March 5, 2021
    lambda d: f"{d.year}{d.month:02d}{d.day:02d}",  # 20210305
    lambda d: f"the {ordinal(d.day)} of {MONTHS[d.month - 1]} {d.year}",  # the 5th of March 2021
)


def random_day(rng: random.Random) -> dt.date:
    """A day drawn uniformly from the range, with one draw of rng (the committed files depend on the draws)."""
    return FIRST_DAY + dt.timedelta(days=rng.randint(0, (LAST_DAY - FIRST_DAY).days))


def make_rows(n: int = ROWS, seed: int = SEED) -> list[dict[str, str]]:
    """n rows, the formats in equal turns, n distinct dates drawn uniformly from the range."""
    rng = random.Random(seed)
    days = [FIRST_DAY + dt.timedelta(days=k) for k in rng.sample(range((LAST_DAY - FIRST_DAY).days + 1), n)]
    rows = [{"input": FORMATS[i % len(FORMATS)](day), "output": day.isoformat()} for i, day in enumerate(days)]
    rng.shuffle(rows)
    return rows


def render(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


if __name__ == "__main__":
    sys.stdout.write(render(make_rows()))
