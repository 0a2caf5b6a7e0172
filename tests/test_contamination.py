"""training/contamination.py: normalised exact matches and 13-word n-gram overlap, linear in rows."""

from __future__ import annotations

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
    short = " ".join(LONG.split()[:5])  # compared whole: it is not a whole training row
    found = measure(train, [("a", f"prefix words then {shared} and more"), ("b", short), ("c", "unrelated " * 20)])
    assert found.overlapping_ids == ["a"] and found.exact_matches == 0


def test_nothing_shared_is_clean_and_an_empty_eval_set_is_zero():
    assert measure(["a b c"], [("x", "d e f")]).overlapping == 0
    empty = measure(["a b c"], [])
    assert empty.eval_items == 0 and empty.fraction == 0.0


def test_hash_operations_grow_with_words_not_with_pairs_of_rows(monkeypatch):
    """Linear in rows, by count rather than by clock: measure hashes each training row and each of its
    n-grams once, each eval row and its n-grams once, and nothing per pair of rows (a pairwise scan would
    make the count grow with train x eval)."""
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

    grams = len(words("row 0 " + LONG)) - NGRAM + 1
    assert hashes(1_000, 100) == 1_000 * (1 + grams) + 100 * 1  # eval items of 10 words: compared whole
    assert hashes(4_000, 400) == 4 * hashes(1_000, 100)  # four times the rows, four times the work
    assert hashes(1_000, 400) - hashes(1_000, 100) == 300  # more eval rows cost their own hashes, no more


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
