"""Generate the general skills the tiny base model learns before any fine-tune, and their test items.

Regenerate the committed files (byte-for-byte deterministic; a test checks it):

    python data/skills/make_skills.py data/skills

Three skills, each a small task with one right answer:
- add:      "add 7 and 15"              -> "22"         (operands 0-19)
- reverse:  "reverse l e m o n"         -> "n o m e l"  (words of words.txt, letters spaced so each is a token)
- capital:  "capital of Peru"           -> "Lima"       (a lookup in capitals.tsv, the bundled table)

Writes train.jsonl (what the base trains on: input, output, skill), suites/<skill>.jsonl (what a
suite scores: id, input, output) and replay.jsonl (what a fine-tune may rehearse: data.replay). add and
reverse hold out their suite items from training, so the suite measures the skill, not recall; capital is
knowledge of the table, so its suite is the table. replay.jsonl is therefore the training rows of add and
reverse only: rehearsing the capital table would be training on the capital suite's own items, which the
data stage's contamination check refuses (such a suite would measure recall of the fine-tune's data).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

SEED = 20261203
HERE = Path(__file__).resolve().parent
ADD_MAX = 19
ADD_HELD_OUT = 80
REVERSE_HELD_OUT = 40
REPLAYABLE = ("add", "reverse")
"""Skills whose suite items are held out of train.jsonl: their training rows can be rehearsed by a fine-tune."""
CAPITAL_REPEATS = 6
"""The table is small: each fact appears this many times in train.jsonl, so the lookup is seen as often as the others."""


def words() -> list[str]:
    return (HERE / "words.txt").read_text(encoding="utf-8").split()


def capitals() -> list[tuple[str, str]]:
    rows = (HERE / "capitals.tsv").read_text(encoding="utf-8").splitlines()
    return [tuple(row.split("\t")) for row in rows if row.strip()]  # type: ignore[misc]


def add_items() -> list[dict[str, str]]:
    return [{"input": f"add {a} and {b}", "output": str(a + b)} for a in range(ADD_MAX + 1) for b in range(ADD_MAX + 1)]


def reverse_items() -> list[dict[str, str]]:
    return [{"input": "reverse " + " ".join(w), "output": " ".join(reversed(w))} for w in words()]


def capital_items() -> list[dict[str, str]]:
    return [{"input": f"capital of {country}", "output": city} for country, city in capitals()]


def held_out(items: list[dict[str, str]], n: int, rng: random.Random) -> tuple[list[dict], list[dict]]:
    """(train, suite): n items drawn for the suite, the rest for training, each in its original order."""
    chosen = set(rng.sample(range(len(items)), n))
    return [x for i, x in enumerate(items) if i not in chosen], [x for i, x in enumerate(items) if i in chosen]


def make(seed: int = SEED) -> tuple[list[dict[str, str]], dict[str, list[dict[str, str]]]]:
    """(train rows with their skill, {skill: suite items with ids})."""
    rng = random.Random(seed)
    add_train, add_suite = held_out(add_items(), ADD_HELD_OUT, rng)
    reverse_train, reverse_suite = held_out(reverse_items(), REVERSE_HELD_OUT, rng)
    table = capital_items()
    parts = {"add": (add_train, add_suite), "reverse": (reverse_train, reverse_suite)}
    parts["capital"] = (table * CAPITAL_REPEATS, table)
    train = [{**row, "skill": skill} for skill, (rows, _) in parts.items() for row in rows]
    rng.shuffle(train)
    suites = {
        skill: [{"id": f"{skill}-{i:03d}", **row} for i, row in enumerate(suite)] for skill, (_, suite) in parts.items()
    }
    return train, suites


def jsonl(rows: list[dict[str, str]]) -> str:
    return "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)


def main(out_dir: str) -> None:
    train, suites = make()
    out = Path(out_dir)
    (out / "suites").mkdir(parents=True, exist_ok=True)
    (out / "train.jsonl").write_text(jsonl(train), encoding="utf-8")
    (out / "replay.jsonl").write_text(jsonl([row for row in train if row["skill"] in REPLAYABLE]), encoding="utf-8")
    for skill, items in suites.items():
        (out / "suites" / f"{skill}.jsonl").write_text(jsonl(items), encoding="utf-8")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else str(HERE))
