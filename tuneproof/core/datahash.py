"""Pure logic of data preparation: row checks, drop accounting, the split, fitting and packing, hashes.

No I/O: training/data_prep.py reads the source, tokenizes and writes; everything it decides goes
through these functions, which take and return plain values and are unit-tested directly.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from tuneproof.core.hashing import IGNORE_INDEX, sha256_bytes, sha256_json
from tuneproof.core.results import one_line

# Why a row was left out; every dropped row has exactly one reason, the first that applies.
COLUMN_REASONS = ("undecodable", "wrong_type", "missing_field", "empty", "too_long")
# A CSV row with more values than the header names columns (training/data_sources.parse_csv).
CSV_REASONS = ("extra_fields",)
# The template and messages shapes add their own (tuneproof/core/shapes.py decides them).
SHAPE_REASONS = (
    "missing_template_column",  # a column the prompt template names is not in the row
    "empty_conversation",  # the messages column is an empty list
    "bad_turn",  # a turn that is not a {role, content} mapping
    "unknown_role",  # a role other than system, user, assistant
    "non_string_content",  # a turn whose content is not a string
    "no_assistant_turn",  # nothing to learn and nothing to evaluate
    "no_user_turn",  # the first assistant turn answers no user turn
    "template_rejected",  # the tokenizer's chat template raised on the conversation
    "not_a_prefix",  # an assistant turn's tokens cannot be told apart from the conversation before it
    "special_token",  # a text holds a special token's text (<|im_end|>), which the tokenizer reads as that token
)
# An eval row whose conversation an earlier eval row already holds (training/data_sources.each_once).
SPLIT_REASONS = ("repeated_eval_item",)
REASONS = COLUMN_REASONS + CSV_REASONS + SHAPE_REASONS + SPLIT_REASONS
# What to change in the data, for the reasons whose fix the row alone does not show.
REMEDIES = {
    "non_string_content": "each turn's content must be one string: a list of content parts, as OpenAI's API "
    "takes, is not read (join its text parts into one string)",
    "unknown_role": "roles are system, user and assistant: tool and function turns are not read",
    "bad_turn": "each turn must be a mapping with 'role' and 'content'",
    "extra_fields": "a CSV row has more values than its header names columns: quote a value that holds a comma "
    '("1,000"); a header of one column means the file has another delimiter (;), so save it with commas',
    "no_user_turn": "a conversation opens with a user turn (after any system turn): an assistant turn before it "
    "answers nothing, and its eval prompt would ask nothing",
    "not_a_prefix": "the tokens of the conversation before an assistant turn are not a prefix of the whole "
    "conversation's: a reply starting with whitespace the tokenizer merges with the text before it (strip it), or, "
    "when every conversation drops, a chat template that re-renders earlier turns as more follow (use "
    "data.loss_on last_assistant, or the columns shape)",
    "special_token": "the tokenizer reads a special token written in a row's text (<|im_end|>, say) as that control "
    "token, which ends or opens a turn inside the text: remove it from the data, or spell it otherwise",
    "repeated_eval_item": "the eval split keeps one copy of each conversation, since a repeat would count twice in "
    "every gate's n: remove the repeated rows from the source",
}
EXAMPLES_PER_REASON = 3

# Bump when the shard layout, the meaning of a setting or the rows kept change: old datasets must not be reused.
PREP_VERSION = 5
"""2 (2026-12-07): the eval split holds each conversation once, and a JSON row naming a key twice is dropped as
undecodable; a dataset prepared before may count an eval item twice, or hold the last of two values.
3 (2026-12-07): a row whose text holds a special token of the tokenizer is dropped (special_token).
4 (2026-12-07): dropped are a CSV row with more values than its header (extra_fields, was kept cut at the comma), a
template row whose named columns are all blank (empty), a conversation with a blank user or assistant turn (empty)
or whose first assistant turn answers no user turn (no_user_turn), and one whose turn tokens cannot be located
(not_a_prefix, was a stage failure).
5 (2026-12-07): the eval split holds each conversation once as the overlap check reads it (a repeat differing only in
case, punctuation, spacing or character width is dropped as repeated_eval_item), and the overlap check reads width
variants and invisible characters as the plain text; a dataset prepared before may count one item in several
spellings, and its recorded overlap, judged again on a cache hit, missed those."""


def content_hash(
    source_sha256: str,
    eval_source_sha256: str | None,
    fields: dict[str, str | None],
    system_prompt: str | None,
    tokenizer_sha256: str,
    settings: dict[str, Any],
    shape: dict[str, Any] | None = None,
) -> str:
    """The dataset's identity: equal inputs give an equal hash, so a rerun reuses the written dataset.

    shape is the template or messages shape's identity (shapes.shape_identity); the columns shape
    passes None and hashes exactly as before shapes existed, so its prepared datasets stay cache hits.
    """
    identity: dict[str, Any] = {
        "prep_version": PREP_VERSION,
        "source": source_sha256,
        "eval_source": eval_source_sha256,
        "fields": fields,
        "system_prompt": system_prompt,
        "tokenizer": tokenizer_sha256,
        "settings": settings,
    }
    if shape is not None:
        identity["shape"] = shape
    return sha256_json(identity)


@dataclass
class Drops:
    """Rows left out, counted by reason, with the first few kept as evidence.

    A row is counted once, by its source and row number: data.replay repeats its rows in the training
    split, and a replayed row too long for data.max_seq_len is dropped once per copy. Counted per copy,
    the drops outgrew the rows read ("116.3% of rows malformed") against a total that counts each once."""

    counts: dict[str, int] = field(default_factory=dict)
    examples: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    rows: dict[tuple[str, int], str] = field(default_factory=dict, repr=False)
    """(source, row) -> reason of every row counted."""

    def add(self, reason: str, where: str, row: int, value: Any) -> None:
        if reason not in REASONS:
            raise ValueError(f"drop reason must be one of {REASONS}, got {reason!r}")
        if (where, row) in self.rows:
            return
        self.rows[(where, row)] = reason
        self.counts[reason] = self.counts.get(reason, 0) + 1
        kept = self.examples.setdefault(reason, [])
        if len(kept) < EXAMPLES_PER_REASON:
            kept.append({"source": where, "row": row, "value": one_line(repr(value), 120)})

    def merge(self, later: Drops) -> None:
        """Take in the drops `later` counted after this one's: as if every row had been added here (chunks of a
        split counted apart), each row once, the evidence the first few rows in order."""
        evidence = {(e["source"], e["row"]): e for kept in later.examples.values() for e in kept}
        for key, reason in later.rows.items():
            if key in self.rows:
                continue
            self.rows[key] = reason
            self.counts[reason] = self.counts.get(reason, 0) + 1
            kept = self.examples.setdefault(reason, [])
            if len(kept) < EXAMPLES_PER_REASON and key in evidence:
                kept.append(evidence[key])

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def to_json(self) -> dict[str, dict[str, Any]]:
        return {r: {"count": self.counts[r], "examples": self.examples[r]} for r in REASONS if r in self.counts}


def drop_failure(drops: Drops, total_rows: int, limit: float) -> str | None:
    """The one-line cause when too many rows were dropped, else None: the counts by reason, and the first row
    of the commonest reason, whose keys show at once a column named otherwise than data.fields says, or a CSV
    read whole into one column (another delimiter)."""
    if total_rows == 0:
        return "the source has no rows"
    fraction = drops.total / total_rows
    if fraction <= limit:
        return None
    counts = ", ".join(f"{r}={drops.counts[r]}" for r in REASONS if r in drops.counts)
    top = max((r for r in REASONS if r in drops.counts), key=lambda r: drops.counts[r])  # ties: REASONS' order
    first = drops.examples[top][0]
    remedy = f"; {REMEDIES[top]}" if top in REMEDIES else ""
    return (
        f"{fraction:.1%} of rows dropped (over data.max_dropped_fraction {limit:.1%}): {counts} of {total_rows} rows; "
        f"the first {top} is {first['source']} row {first['row']}: {first['value']}{remedy}"
    )


def check_row(row: Any, fields: dict[str, str | None]) -> tuple[str | None, dict[str, str]]:
    """(reason, {}) for a row to drop, or (None, {role: text}) for a usable one.

    fields maps a role (prompt/response/system) to the source column; None means 'not read'.
    """
    if not isinstance(row, dict):
        return "wrong_type", {}
    parts = {}
    for role, column in fields.items():
        if column is None:
            continue
        value = row.get(column)
        if value is None:
            return "missing_field", {}
        if not isinstance(value, str):
            return "wrong_type", {}
        if not value.strip():
            return "empty", {}
        parts[role] = value
    return None, parts


def split_key(parts: dict[str, Any]) -> str:
    """What decides a row's split: its content, so identical rows always land on the same side."""
    return json.dumps(parts, sort_keys=True, ensure_ascii=False)


def rank_for_split(keys: list[str], seed: int) -> list[int]:
    """Row indices ordered by a seeded hash of their content: a deterministic shuffle."""
    return sorted(range(len(keys)), key=lambda i: (sha256_bytes(f"{seed}\0{keys[i]}".encode()), i))


def split_indices(keys: list[str], eval_fraction: float, seed: int) -> tuple[list[int], list[int]]:
    """(train, eval) row indices: the first round(n * eval_fraction) of the hash order are eval."""
    order = rank_for_split(keys, seed)
    n_eval = round(len(keys) * eval_fraction)
    return order[n_eval:], order[:n_eval]


def fit(ids: list[int], labels: list[int], max_len: int, overflow: str) -> tuple[list[int], list[int]] | None:
    """The example within max_len, or None when it is too long (drop), or truncation leaves no target."""
    if len(ids) <= max_len:
        return ids, labels
    if overflow != "truncate":
        return None
    ids, labels = ids[:max_len], labels[:max_len]
    return (ids, labels) if any(label != IGNORE_INDEX for label in labels) else None


def pack(examples: Iterable[tuple[list[int], list[int]]], max_len: int) -> list[tuple[list[int], list[int]]]:
    """Concatenate consecutive examples into rows of at most max_len tokens (greedy, order kept).

    Every example must already fit max_len; an example never spans two rows.
    """
    rows: list[tuple[list[int], list[int]]] = []
    ids: list[int] = []
    labels: list[int] = []
    for ex_ids, ex_labels in examples:
        if len(ex_ids) > max_len:
            raise ValueError(f"example of {len(ex_ids)} tokens cannot be packed into rows of {max_len}")
        if ids and len(ids) + len(ex_ids) > max_len:
            rows.append((ids, labels))
            ids, labels = [], []
        ids = ids + ex_ids
        labels = labels + ex_labels
    if ids:
        rows.append((ids, labels))
    return rows


def shard_ranges(n_rows: int, shard_rows: int) -> list[tuple[int, int]]:
    """[start, end) row ranges of the shards."""
    return [(start, min(start + shard_rows, n_rows)) for start in range(0, n_rows, shard_rows)]
