"""Does the eval split repeat the training split? Normalised exact matches and word n-gram overlap (pure).

Called by the data stage (training/data_prep.py) on the conversations of both splits, before anything is
encoded or trained: an eval set that repeats training rows passes every gate on memorised answers.

Text is normalised (NFKC, so full-width and compatibility forms read as their plain letters and digits; invisible
format characters removed; case folded; punctuation to spaces; whitespace collapsed) and cut into words. An eval
item overlaps when its normalised text equals a training item's, or when any of its word n-grams
(n = 13, as in GPT-3's and the Pile's decontamination) occurs in a training item; an item shorter than n
words is compared whole, with training items of any length compared whole. Linear in rows: each side is
hashed once into sets (Python's hash, stable within the one process that compares), no pairwise scan.
An item with no words (all of it boilerplate the caller left out) says nothing of a row and matches nothing.
"""

from __future__ import annotations

import re
import unicodedata
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from tuneproof.core.summaries_data import Contamination

NGRAM = 13
"""Words per n-gram."""
IDS_KEPT = 50
"""Overlapping item ids kept in the manifest; the counts are always complete."""

_PUNCTUATION = re.compile(r"[^\w\s]+")
_INVISIBLE = re.compile("[\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff]")
"""Format characters that show nothing (soft hyphen, zero-width space and joiners, direction marks, BOM): removed,
not made spaces, so 'Par\u200bis' reads as 'paris' rather than two words."""


def words(text: str) -> list[str]:
    """NFKC, invisible format characters removed, case folded, punctuation to spaces, split on whitespace:
    'Jan. 5,  2024' -> ['jan', '5', '2024'], 'add ２ and １７' -> ['add', '2', 'and', '17']."""
    return _PUNCTUATION.sub(" ", unicodedata.normalize("NFKC", _INVISIBLE.sub("", text)).casefold()).split()


def ngram_hashes(tokens: list[str], n: int = NGRAM) -> set[int]:
    return {hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1)}


@dataclass(frozen=True)
class TrainingIndex:
    """The training texts normalised and hashed once (whole and as word n-grams): every eval set and
    regression suite of a run is measured against the one index, not against the rows re-read each time."""

    whole: frozenset[int]
    grams: frozenset[int]
    n: int = NGRAM

    @classmethod
    def of(cls, train: Iterable[str], n: int = NGRAM) -> TrainingIndex:
        whole: set[int] = set()
        grams: set[int] = set()
        for text in train:
            tokens = words(text)
            if not tokens:
                continue
            whole.add(hash(tuple(tokens)))
            grams.update(hash(tuple(tokens[i : i + n])) for i in range(len(tokens) - n + 1))
        return cls(frozenset(whole), frozenset(grams), n)

    def measure(self, eval_items: Iterable[tuple[str, str]]) -> Contamination:
        """Overlap of `eval_items` ((item id, text)) with the indexed training texts."""
        n = self.n
        exact, overlapping, total = 0, [], 0
        for item_id, text in eval_items:
            total += 1
            tokens = words(text)
            same = bool(tokens) and hash(tuple(tokens)) in self.whole
            exact += same
            if same or (len(tokens) >= n and not self.grams.isdisjoint(ngram_hashes(tokens, n))):
                overlapping.append(item_id)
        return Contamination(
            ngram=n,
            eval_items=total,
            exact_matches=exact,
            overlapping=len(overlapping),
            fraction=len(overlapping) / total if total else 0.0,
            overlapping_ids=overlapping[:IDS_KEPT],
        )


def measure(train: Iterable[str], eval_items: Iterable[tuple[str, str]], n: int = NGRAM) -> Contamination:
    """Overlap of `eval_items` ((item id, text)) with the `train` texts."""
    return TrainingIndex.of(train, n).measure(eval_items)


def shared_texts(texts: Iterable[str]) -> frozenset[str]:
    """The non-blank texts that occur more than once: boilerplate rows share (a system prompt for all), which
    the caller leaves out of the comparison as it leaves out a template's own text."""
    counts = Counter(t for t in texts if t.strip())
    return frozenset(t for t, k in counts.items() if k > 1)
