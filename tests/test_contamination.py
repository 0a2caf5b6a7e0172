"""training/contamination.py: normalised exact matches, short items inside a row and 13-word n-gram overlap, linear
in rows."""

from __future__ import annotations

import dataclasses

from training import contamination, data_overlap, data_sources
from training.contamination import NGRAM, measure, words

LONG = "the quick brown fox jumps over the lazy dog while the cat watches from the old wooden fence"


def test_words_fold_case_punctuation_and_whitespace():
    assert words("  Jan. 5,\t2024!  ") == ["jan", "5", "2024"] == words("jan 5 2024")


def test_words_read_width_and_invisible_variants_as_the_plain_text():
    assert words("ＪＡＮ ５，２０２４") == ["jan", "5", "2024"]  # full-width letters, digits and comma
    assert words("Par\u200bis\ufeff, \u00adﬁne") == ["paris", "fine"]  # zero-width space, BOM, soft hyphen, ligature


def test_verbatim_and_reformatted_rows_match_exactly():
    train = ["5 Mar 2021 2021-03-05", "December 14, 1999 1999-12-14"]
    found = measure(
        train,
        [
            ("eval:0", "5 Mar 2021 2021-03-05"),
            ("eval:1", "december 14 1999  1999 12 14"),
            ("eval:2", "7 May 2001 2001-05-07"),
        ],
    )
    assert (found.exact_matches, found.overlapping, found.eval_items) == (2, 2, 3)
    assert found.overlapping_ids == ["eval:0", "eval:1"] and round(found.fraction, 4) == 0.6667


def test_a_shared_13_word_run_overlaps_and_a_shorter_one_does_not():
    train = [LONG]
    shared = " ".join(LONG.split()[2 : 2 + NGRAM])
    twelve = " ".join(LONG.split()[:12])  # an item of 13 words and more overlaps by a whole n-gram only
    found = measure(
        train,
        [("a", f"prefix words then {shared} and more"), ("b", f"other words {twelve} x"), ("c", "unrelated " * 20)],
    )
    assert found.overlapping_ids == ["a"] and found.exact_matches == 0


def test_a_short_item_inside_a_training_row_overlaps():
    """Every bundled suite item is under 13 words: a prompt and its answer wrapped in more text, packed with other
    items, or written in full-width or with invisible characters is still the item."""
    train = [
        "Q: capital of France \n Paris",  # a prefix
        "capital of Spain\nMadrid\ncapital of Italy \n Rome",  # a few-shot pack: two items in one row
        "add ２ and １７ \n １９",  # full-width digits, NFKC equal to ASCII
        "Convert to ISO: Jan 5, 2024 \n 2024-01-05 (a date)",
        "Par\u200bis is in \u00adFrance",  # a zero-width space and a soft hyphen inside words
    ]
    items = [
        ("france", "capital of France \n Paris"),
        ("spain", "capital of Spain \n Madrid"),
        ("italy", "capital of Italy \n Rome"),
        ("add", "add 2 and 17 \n 19"),
        ("date", "Jan 5, 2024 \n 2024-01-05"),
        ("zero-width", "Paris is in France"),
    ]
    found = measure(train, items)
    assert found.overlapping_ids == [i for i, _ in items]
    assert found.exact_matches == 2  # the full-width and the zero-width rows are the items whole, once normalised


def test_an_eval_conversation_wrapped_in_a_training_row_overlaps():
    """The eval split read as the training rows are: a training prompt that adds an instruction before the eval
    item's prompt still holds the item; a word between the prompt and its answer hides it (the stated limit)."""
    train = [
        data_sources.Conversation("source", 0, {"prompt": "Convert to ISO: Jan 5, 2024", "response": "2024-01-05"}),
        data_sources.Conversation("source", 1, {"prompt": "Mar 7, 2021 please", "response": "2021-03-07"}),
    ]
    evals = [
        data_sources.Conversation("eval_source", 0, {"prompt": "Jan 5, 2024", "response": "2024-01-05"}),
        data_sources.Conversation("eval_source", 1, {"prompt": "Mar 7, 2021", "response": "2021-03-07"}),
    ]
    assert data_overlap.TrainingSplit(train).overlap(evals).overlapping_ids == ["eval_source:0"]


def test_a_short_item_needs_three_adjacent_words_in_order():
    """One or two words occur in unrelated rows by chance; a word between a prompt and its answer, or the two in
    other rows, is not the item."""
    train = ["The capital of France is Paris, of course", "Rome is the capital of Italy", "capital of Spain", "Madrid"]
    found = measure(
        train,
        [
            ("one word", "Paris"),
            ("two words", "France \n Paris"),  # adjacent in no row; would they be, still only two words
            ("word between", "capital of France \n Paris"),  # 'is' between them
            ("other order", "capital of Italy \n Rome"),
            ("two rows", "capital of Spain \n Madrid"),
            ("two inside", "is Paris"),
        ],
    )
    assert found.overlapping == 0
    assert measure(["say France Paris now"], [("two", "France Paris")]).overlapping == 0  # two words: whole only
    assert measure(["France Paris"], [("two", "france, paris!")]).exact_matches == 1  # still compared whole


def test_nothing_shared_is_clean_and_an_empty_eval_set_is_zero():
    assert measure(["a b c"], [("x", "d e f")]).overlapping == 0
    empty = measure(["a b c"], [])
    assert empty.eval_items == 0 and empty.fraction == 0.0


def test_hash_operations_grow_with_words_not_with_pairs_of_rows(monkeypatch):
    """Linear in rows, by count rather than by clock: measure hashes each training row and each of its
    n-grams once, each run of 3 words once more when there are short items, each eval row and its n-grams a
    fixed number of times, and nothing per pair of rows (a pairwise scan would make the count grow with
    train x eval)."""
    calls = {"n": 0}

    def counting_hash(value):
        calls["n"] += 1
        return hash(value)

    monkeypatch.setattr(contamination, "hash", counting_hash, raising=False)  # shadows the builtin there

    def hashes(train_rows: int, eval_rows: int) -> int:
        calls["n"] = 0
        train = [f"row {i} " + LONG for i in range(train_rows)]  # 20 words: 8 n-grams each
        measure(train, [(str(i), f"item {i} of the eval split, with words of its own") for i in range(eval_rows)])
        return calls["n"]

    row_words = len(words("row 0 " + LONG))
    grams = row_words - NGRAM + 1
    starts = row_words - contamination.SHORTEST + 1  # the pass for short items: each run of 3 words, no match
    # Eval items of 11 words (under n): hashed whole, by their first 3 words, and whole again to compare.
    assert hashes(1_000, 100) == 1_000 * (1 + grams) + 1_000 * starts + 100 * 3
    assert hashes(4_000, 400) == 4 * hashes(1_000, 100)  # four times the rows, four times the work
    assert hashes(1_000, 400) - hashes(1_000, 100) == 300 * 3  # more eval rows cost their own hashes, no more


def test_short_items_of_every_group_cost_one_more_pass_over_the_training_texts():
    """measure_all splits the normalised training texts once more for the short items of the eval split and
    every suite together (they are not normalised again), and not at all when every item has 13 words or more."""
    index = contamination.TrainingIndex.of([LONG, "capital of France \n Paris", "add 2 and 17 \n 19"])
    splits = {"n": 0}

    class Counted(str):
        def split(self, *args, **kwargs):
            splits["n"] += 1
            return super().split(*args, **kwargs)

    index = dataclasses.replace(index, normalised=tuple(Counted(t) for t in index.normalised))
    eval_split, suite_a, suite_b = [("e", "quick brown fox")], [("a", "capital of France \n Paris")], [("b", "x y z")]
    found = index.measure_all([eval_split, suite_a, suite_b])
    assert [f.overlapping for f in found] == [1, 1, 0]
    assert splits["n"] == 3  # the three training texts, once for the three groups
    splits["n"] = 0
    index.measure_all([[("long", LONG)], [("none", "")]])
    assert splits["n"] == 0


def test_a_templates_own_text_is_not_overlap():
    """Alpaca-style rows share the template's long preamble: that says nothing of the rows, only their fields do."""
    from tuneproof.core.config_data import DataConfig

    preamble = (
        "Below is an instruction that describes a task. Write a response that appropriately completes the request."
    )
    data = DataConfig.model_validate(
        {
            "shape": "template",
            "template": {"prompt": preamble + "\n\n### Instruction:\n{instruction}\n\n### Response:\n"},
        }
    )
    literals = data_overlap.template_literals(data)
    rows = [
        f"{preamble}\n\n### Instruction:\nName colour number {i} of the rainbow\n\n### Response:\n" for i in range(4)
    ]
    convs = [
        data_sources.Conversation("source", i, {"prompt": p, "response": f"colour {i}"}) for i, p in enumerate(rows)
    ]
    assert data_overlap.TrainingSplit(convs[:3], literals).overlap(convs[3:]).fraction == 0
    assert (
        data_overlap.TrainingSplit(convs[:3], literals).overlap(convs[2:3]).fraction == 1
    )  # a real repeat still counts


SYSTEM = "You are a careful assistant: answer every date in ISO form and never add commentary"
"""A 15-word system prompt, on every row: two 13-word runs every row would share."""


def test_a_system_prompt_every_row_shares_is_not_overlap():
    """A data.fields.system column and system turns of one prompt for all: distinct rows stay distinct."""
    assert len(words(SYSTEM)) == 15
    columns = [
        data_sources.Conversation("source", i, {"system": SYSTEM, "prompt": f"question {i}", "response": f"answer {i}"})
        for i in range(4)
    ]
    turns = [
        data_sources.Conversation(
            "source",
            i,
            {},
            messages=[
                {"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ],
        )
        for i in range(4)
    ]
    for convs in (columns, turns):
        assert data_overlap.TrainingSplit(convs[:3]).overlap(convs[3:]).overlapping == 0
        repeated = data_overlap.TrainingSplit(convs[:3]).overlap(convs[1:2])  # a real repeat still counts
        assert (repeated.overlapping, repeated.exact_matches) == (1, 1)
    shared_run = " ".join(LONG.split()[:NGRAM])
    quoting = data_sources.Conversation("eval_source", 0, {"system": SYSTEM, "prompt": shared_run, "response": "x"})
    with_long = [
        *columns[:3],
        data_sources.Conversation("source", 9, {"system": SYSTEM, "prompt": LONG, "response": "y"}),
    ]
    assert data_overlap.TrainingSplit(with_long).overlap([quoting]).overlapping_ids == [
        "eval_source:0"
    ]  # a shared n-gram


def test_one_rows_own_system_text_is_compared():
    """A system text only one training row carries may hold that row's content: an eval row repeating it overlaps."""
    train = [
        data_sources.Conversation("source", i, {"system": f"{LONG} {i}", "prompt": f"q {i}", "response": f"a {i}"})
        for i in range(3)
    ]
    again = data_sources.Conversation("eval_source", 0, {"system": f"{LONG} 1", "prompt": "other", "response": "b"})
    assert data_overlap.TrainingSplit(train).overlap([again]).overlapping == 1


def test_an_item_left_without_words_matches_nothing():
    assert measure(["", "  ..."], [("x", " , "), ("y", "")]).overlapping == 0
