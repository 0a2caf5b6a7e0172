"""Does the eval split repeat the training split? Normalised exact matches, short items inside a training text and
word n-gram overlap (pure).

Called by the data stage (training/data_prep.py) on the conversations of both splits, before anything is
encoded or trained: an eval set that repeats training rows passes every gate on memorised answers.

Text is normalised (NFKC, so full-width and compatibility forms read as their plain letters and digits; invisible
format characters removed; case folded; punctuation to spaces; whitespace collapsed) and cut into words. An eval
item's text is all of it the caller passes: for a conversation every turn in order, for a regression suite item its
input then its output. It overlaps when
  - its words equal a training text's (an exact match), or
  - it has at least n words (n = 13, as in GPT-3's and the Pile's decontamination) and one of its word n-grams
    occurs in a training text, or
  - it has SHORTEST to n - 1 words and all of them, in order and adjacent, occur inside one training text: a
    prompt and its answer wrapped in more text ("Q: capital of France" -> "Paris") or packed with other items
    (a few-shot prompt). A word between the prompt and its answer hides it, as one inside any n-gram does.
Linear in rows: each side is hashed once into sets (Python's hash, stable within the one process that compares),
no pairwise scan. Short items are found in one more pass over the normalised training texts per measure_all call:
each text's runs of SHORTEST words are looked up among the items' first SHORTEST words, and only a run that starts an
item is hashed at that item's lengths. An item with no words (all of it boilerplate the caller left out) says
nothing of a row and matches nothing.
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
SHORTEST = 3
"""Fewest words of an item that overlaps by occurring inside a training text: one or two words ('Paris',
'France Paris') occur in unrelated rows by chance, so such an item is compared whole only."""
IDS_KEPT = 50
"""Overlapping item ids kept in the manifest; the counts are always complete."""

_PUNCTUATION = re.compile(r"[^\w\s]+")
_INVISIBLE = re.compile("[\u00ad\u061c\u180e\u200b-\u200f\u202a-\u202e\u2060-\u2064\u2066-\u206f\ufeff]")
"""Format characters that show nothing (soft hyphen, zero-width space and joiners, direction marks, BOM): removed,
not made spaces, so 'Par\u200bis' reads as 'paris' rather than two words."""

Items = Iterable[tuple[str, str]]
"""(item id, text) of an eval split or a regression suite."""


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
    normalised: tuple[str, ...]
    """Each training text's words joined by spaces: normalised once, split again (once per measure_all) only when
    items shorter than n words are measured."""
    n: int = NGRAM

    @classmethod
    def of(cls, train: Iterable[str], n: int = NGRAM) -> TrainingIndex:
        whole: set[int] = set()
        grams: set[int] = set()
        normalised = []
        for text in train:
            tokens = words(text)
            if not tokens:
                continue
            whole.add(hash(tuple(tokens)))
            grams.update(ngram_hashes(tokens, n))
            normalised.append(" ".join(tokens))
        return cls(frozenset(whole), frozenset(grams), tuple(normalised), n)

    def measure(self, eval_items: Items) -> Contamination:
        """Overlap of `eval_items` with the indexed training texts."""
        return self.measure_all([eval_items])[0]

    def measure_all(self, groups: list[Items]) -> list[Contamination]:
        """Overlap of each group of eval items (the eval split, each suite) with the indexed training texts, the
        short items of every group found in one pass over them."""
        tokenised = [[(item_id, words(text)) for item_id, text in group] for group in groups]
        short = [tokens for group in tokenised for _, tokens in group if SHORTEST <= len(tokens) < self.n]
        inside = self.short_items_inside(short)
        return [self.contamination(group, inside) for group in tokenised]

    def contamination(self, items: list[tuple[str, list[str]]], inside: set[int]) -> Contamination:
        """The overlap of tokenised `items`; `inside`: the hashes of the short items a training text holds."""
        n = self.n
        exact, overlapping = 0, []
        for item_id, tokens in items:
            key = hash(tuple(tokens))
            same = bool(tokens) and key in self.whole
            exact += same
            if len(tokens) >= n:
                found = same or not self.grams.isdisjoint(ngram_hashes(tokens, n))
            else:
                found = same or key in inside
            if found:
                overlapping.append(item_id)
        return Contamination(
            ngram=n,
            eval_items=len(items),
            exact_matches=exact,
            overlapping=len(overlapping),
            fraction=len(overlapping) / len(items) if items else 0.0,
            overlapping_ids=overlapping[:IDS_KEPT],
        )

    def short_items_inside(self, short: list[list[str]]) -> set[int]:
        """The hashes of the `short` items (SHORTEST to n - 1 words) whose words occur, adjacent and in order,
        inside a training text. Keyed by their first SHORTEST words, so a training text costs one hash per word
        and more only where a run starts an item: the cost of one more n-gram pass, not one per item length."""
        starts: dict[int, dict[int, set[int]]] = {}  # first words -> item length -> item hashes
        for tokens in short:
            starts.setdefault(hash(tuple(tokens[:SHORTEST])), {}).setdefault(len(tokens), set()).add(
                hash(tuple(tokens))
            )
        inside: set[int] = set()
        if not starts:
            return inside
        for text in self.normalised:
            tokens = text.split()
            for i in range(len(tokens) - SHORTEST + 1):
                lengths = starts.get(hash(tuple(tokens[i : i + SHORTEST])))
                if lengths is None:  # no item starts here: the common case, one hash per word
                    continue
                for k, items in lengths.items():
                    if i + k <= len(tokens) and (run := hash(tuple(tokens[i : i + k]))) in items:
                        inside.add(run)
        return inside


def measure(train: Iterable[str], eval_items: Items, n: int = NGRAM) -> Contamination:
    """Overlap of `eval_items` ((item id, text)) with the `train` texts."""
    return TrainingIndex.of(train, n).measure(eval_items)


def shared_texts(texts: Iterable[str]) -> frozenset[str]:
    """The non-blank texts that occur more than once: boilerplate rows share (a system prompt for all), which
    the caller leaves out of the comparison as it leaves out a template's own text."""
    counts = Counter(t for t in texts if t.strip())
    return frozenset(t for t, k in counts.items() if k > 1)
