"""The data stage: the bundled dataset, the pure prep logic, and the stage end to end on real storage."""

from __future__ import annotations

import codecs
import contextlib
import copy
import csv
import gzip
import hashlib
import io
import itertools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import TEST_BUCKET, all_cpus_free, ray_driver, run_job_module
from tests.reading import present
from training import data_encode, data_prep, modeling, parallel
from training.data_encode import ChatRenderer, encode, token_ids, verify_sample
from training.data_files import SCHEMA, read_split
from training.data_prep import prepare_data
from training.data_sources import Conversation, read_source
from training.jobkit import JobContext, encode_job
from training.modeling import direct_tokenizer_class, load_text_tokenizer, load_tokenizer
from tuneproof.app.tiny_model import CHAT_TEMPLATE, DEFAULT_DATA, build_tiny_model, task_corpus
from tuneproof.control.stages import data_evidence
from tuneproof.core import datahash
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_eval import SuiteConfig
from tuneproof.core.envelope import ENV_VAR
from tuneproof.core.hashing import IGNORE_INDEX, sha256_bytes
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary

PROJECT = Path(__file__).resolve().parent.parent
DATES = [json.loads(line) for line in DEFAULT_DATA.read_text().splitlines()]
# A system turn exercises the whole chat template (the demo profile sends none).
SYSTEM = "Rewrite the date in ISO 8601 (YYYY-MM-DD)."


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    corpus = itertools.islice(task_corpus(DEFAULT_DATA, SYSTEM), 300)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus)


def config(root, model_dir, source, **data) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "storage": {"root": str(root)},
            "model": {"source": str(model_dir)},
            "data": {"source": str(source), "system_prompt": SYSTEM, **data},
        }
    )


def prepare(cfg: PipelineConfig) -> dict:
    """The stage's summary as the run record holds it (JSON)."""
    return prepare_data(JobContext("run-1", "data", cfg)).to_json()


def data_failure(cfg: PipelineConfig) -> StageFailure:
    """The failure the stage raises for `cfg`, asserted to be in the data class; the caller checks its words."""
    with pytest.raises(StageFailure) as info:
        prepare(cfg)
    assert info.value.failure_class is FailureClass.data
    return info.value


def write_csv(path: Path, rows: list[dict[str, str]], prefix: bytes = b"") -> Path:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    path.write_bytes(prefix + buf.getvalue().encode())
    return path


def write_jsonl(path: Path, rows: list, raw_lines: Sequence[bytes] = ()) -> Path:
    lines = [json.dumps(r).encode() for r in rows] + list(raw_lines)
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


# ---- the bundled dataset ---------------------------------------------------------------------


def test_dates_are_valid_iso_in_range_and_formats_are_balanced():
    import datetime as dt

    assert len(DATES) == 3000
    for row in DATES:
        day = dt.date.fromisoformat(row["output"])
        assert 1950 <= day.year <= 2049 and str(day.year) in row["input"]
    shapes = {"/": 0, "the ": 0, "day, ": 0}
    for row in DATES:
        for marker in shapes:
            shapes[marker] += marker in row["input"]
    assert all(count == 500 for count in shapes.values()), shapes


# ---- pure logic (tuneproof.core.datahash) -----------------------------------------------------------


FIELDS = {"prompt": "input", "response": "output", "system": None}


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"input": "5 Mar 2021", "output": "2021-03-05"}, None),
        ({"input": "5 Mar 2021"}, "missing_field"),
        ({"input": "5 Mar 2021", "output": None}, "missing_field"),
        ({"input": 20210305, "output": "2021-03-05"}, "wrong_type"),
        (["5 Mar 2021", "2021-03-05"], "wrong_type"),
        ({"input": "  ", "output": "2021-03-05"}, "empty"),
    ],
)
def test_check_row_reasons(row, reason):
    assert datahash.check_row(row, FIELDS)[0] == reason


def test_drops_keep_three_examples_and_the_failure_names_every_count():
    drops = datahash.Drops()
    for i in range(5):
        drops.add("empty", "source", i, {"input": ""})
    drops.add("too_long", "eval_source", 9, "80 tokens > 64")
    assert drops.to_json()["empty"]["count"] == 5 and len(drops.to_json()["empty"]["examples"]) == 3
    assert drops.to_json()["too_long"]["examples"] == [{"source": "eval_source", "row": 9, "value": "'80 tokens > 64'"}]
    assert datahash.drop_failure(drops, 100, 0.06) is None
    assert datahash.drop_failure(drops, 50, 0.05) == (
        "12.0% of rows dropped (over data.max_dropped_fraction 5.0%): empty=5, too_long=1 of 50 rows; the first empty is source row 0: "
        "{'input': ''}"
    )
    with pytest.raises(ValueError, match="drop reason"):
        drops.add("ugly", "source", 0, None)


def test_a_drop_whose_fix_the_row_does_not_show_says_what_to_change():
    """OpenAI's content arrays are the common case: the row shows a list, not why a list is refused."""
    drops = datahash.Drops()
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "5 Mar 2021"}]}]}
    for i in range(3):
        drops.add("non_string_content", "source", i, parts)
    cause = datahash.drop_failure(drops, 3, 0.05) or ""
    assert cause.startswith("100.0% of rows dropped (over data.max_dropped_fraction 5.0%): non_string_content=3 of 3")
    assert cause.endswith(
        "; each turn's content must be one string: a list of content parts, as OpenAI's API takes, is not read "
        "(join its text parts into one string)"
    )
    assert set(datahash.REMEDIES) <= set(datahash.REASONS)


def test_drops_counted_in_chunks_and_merged_in_order_equal_drops_counted_in_one():
    events = [("empty", i) for i in range(4)] + [("too_long", 9), ("empty", 11), ("too_long", 12), ("too_long", 13)]
    whole, merged = datahash.Drops(), datahash.Drops()
    for reason, row in events:
        whole.add(reason, "source", row, row)
    for chunk in (events[:2], [], events[2:5], events[5:]):
        part = datahash.Drops()
        for reason, row in chunk:
            part.add(reason, "source", row, row)
        merged.merge(part)
    assert merged.to_json() == whole.to_json() and merged.total == 8
    assert [e["row"] for e in merged.to_json()["too_long"]["examples"]] == [9, 12, 13]


def test_split_is_seeded_exact_disjoint_and_content_based():
    keys = [f"row {i}" for i in range(1000)]
    train, eval_ = datahash.split_indices(keys, 0.1, seed=0)
    assert len(eval_) == 100 and sorted(train + eval_) == list(range(1000))
    assert datahash.split_indices(keys, 0.1, seed=0) == (train, eval_)
    assert set(datahash.split_indices(keys, 0.1, seed=1)[1]) != set(eval_)
    # Inserting a row moves at most the one row at the boundary between the splits.
    grown = ["new row"] + keys
    grown_eval = {grown[i] for i in datahash.split_indices(grown, 0.1, seed=0)[1]}
    assert len(grown_eval ^ {keys[i] for i in eval_}) <= 2


def test_fit_and_pack():
    ids, labels = list(range(10)), [-100] * 6 + list(range(6, 10))
    assert datahash.fit(ids, labels, 10, "drop") == (ids, labels)
    assert datahash.fit(ids, labels, 8, "drop") is None
    assert datahash.fit(ids, labels, 8, "truncate") == (ids[:8], labels[:8])
    assert datahash.fit(ids, labels, 5, "truncate") is None  # nothing left to learn
    packed = datahash.pack([([1, 2], [-100, 2]), ([3, 4, 5], [-100, 4, 5]), ([6], [6])], max_len=5)
    assert packed == [([1, 2, 3, 4, 5], [-100, 2, -100, 4, 5]), ([6], [6])]
    assert datahash.shard_ranges(10, 4) == [(0, 4), (4, 8), (8, 10)]


def test_content_hash_moves_with_every_input():
    base: dict[str, Any] = dict(
        source_sha256="a",
        eval_source_sha256=None,
        fields=FIELDS,
        system_prompt="s",
        tokenizer_sha256="t",
        settings={"max_seq_len": 64},
    )
    variants: list[dict[str, Any]] = [
        {"source_sha256": "b"},
        {"eval_source_sha256": "e"},
        {"fields": {**FIELDS, "prompt": "q"}},
        {"system_prompt": None},
        {"tokenizer_sha256": "u"},
        {"settings": {"max_seq_len": 65}},
    ]
    hashes = {datahash.content_hash(**{**base, **v}) for v in variants} | {datahash.content_hash(**base)}
    assert len(hashes) == len(variants) + 1


# ---- the stage, on a local storage root ------------------------------------------------------


def test_batched_encoding_equals_one_template_and_tokenizer_call_per_row(tiny_dir):
    """The stage renders and tokenizes whole splits at once; every example is what one call per row gives."""
    tokenizer = load_tokenizer(str(tiny_dir))
    rows = [json.loads(line) for line in DEFAULT_DATA.read_text().splitlines()[:50]]
    convs = [
        Conversation(
            "source", i, {"prompt": r["input"], "response": r["output"], **({"system": "Be brief."} if i % 3 else {})}
        )
        for i, r in enumerate(rows)
    ]
    examples = encode(tokenizer, convs, "Answer with an ISO date.")
    assert len(examples) == len(convs)
    for conv, example in zip(convs, examples):
        system = conv.parts.get("system", "Answer with an ISO date.")
        messages = [{"role": "system", "content": system}, {"role": "user", "content": conv.parts["prompt"]}]
        prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        full = tokenizer.apply_chat_template(
            [*messages, {"role": "assistant", "content": conv.parts["response"]}], tokenize=False
        )
        assert isinstance(prompt, str) and isinstance(full, str)  # tokenize=False: the rendered text
        p = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        c = tokenizer(full[len(prompt) :].rstrip(), add_special_tokens=False)["input_ids"]
        assert (example.input_ids, example.labels) == (p + c, [IGNORE_INDEX] * len(p) + c)
        assert (example.prompt, example.reference) == (prompt, conv.parts["response"])


def test_token_ids_from_the_backend_equal_the_tokenizers_own(tiny_dir):
    tokenizer = load_tokenizer(str(tiny_dir))
    texts = ["<|im_start|>user\n5 Mar 2021<|im_end|>\n", "", "  spaced   out ", "héllo wörld 2021-03-05", "<|im_end|>"]
    texts += texts[::2]  # repeats are encoded once and give the same ids
    assert token_ids(tokenizer, texts) == tokenizer(texts, add_special_tokens=False)["input_ids"]
    assert token_ids(tokenizer, []) == []


# Conversations whose text could trip a hand-written renderer: empty, unicode, template syntax, newlines.
ODD_CHATS = [
    [{"role": "user", "content": "5 Mar 2021"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  "}, {"role": "assistant", "content": "x"}],
    [{"role": "user", "content": "{{ messages }} {% if x %}é\n\n<|im_end|>"}, {"role": "assistant", "content": "\t"}],
    [{"role": "tool", "content": "ok", "name": "calc"}, {"role": "user", "content": "日本 2021年3月5日"}],
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}, {"role": "user", "content": "c"}],
]


def test_the_tiny_models_template_is_the_one_rendered_in_plain_python(tiny_dir):
    assert hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest() == data_encode.CHATML_TEMPLATE_SHA256
    assert ChatRenderer(load_tokenizer(str(tiny_dir))).python is not None


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_plain_python_chatml_renders_what_jinja_renders(tiny_dir, add_generation_prompt):
    tokenizer = load_tokenizer(str(tiny_dir))
    chats = ODD_CHATS + [[{"role": "user", "content": r["input"]}] for r in DATES[:200]]
    render = ChatRenderer(tokenizer)
    assert render.fast(chats, add_generation_prompt) == render.jinja(chats, add_generation_prompt)
    assert render.python is not None  # verified, still on


def test_the_verified_sample_is_the_first_rows_and_a_spread_to_the_last():
    assert verify_sample(0) == [] and verify_sample(10) == list(range(10))
    sample = verify_sample(1000)
    assert sample[:64] == list(range(64)) and sample[-1] == 999 and len(sample) == 64 + 16


def test_a_mismatch_anywhere_in_the_sample_sends_the_rest_of_the_run_to_jinja(tiny_dir, monkeypatch, capsys):
    tokenizer = copy.deepcopy(load_tokenizer(str(tiny_dir)))
    # Differs from plain ChatML only for a content of "odd": past the first 64, only the spread can see it.
    tokenizer.chat_template = CHAT_TEMPLATE.replace(
        "message['content']", "(message['content'] | replace('odd', 'ODD'))"
    )
    monkeypatch.setattr(
        data_encode, "CHATML_TEMPLATE_SHA256", hashlib.sha256(tokenizer.chat_template.encode()).hexdigest()
    )
    chats = [[{"role": "user", "content": str(i)}] for i in range(500)] + [[{"role": "user", "content": "odd"}]]
    render = ChatRenderer(tokenizer)
    assert render.fast(chats[:500], True) is not None  # no "odd" row: the two agree
    assert render.texts(chats, True) == render.jinja(chats, True) and render.texts(chats, True)[-1].count("ODD") == 1
    assert render.python is None and render.fast(chats[:10], True) is None  # off for the rest of the run
    assert "conversation 500 differs from jinja's" in capsys.readouterr().out


def test_turns_that_are_not_plain_strings_go_to_jinja(tiny_dir):
    render = ChatRenderer(load_tokenizer(str(tiny_dir)))
    # ignore: the point of the test, turns whose content is not a string.
    assert render.fast([[{"role": "user", "content": None}]], True) is None  # type: ignore[dict-item]
    assert render.fast([[{"role": "user", "content": 5}]], True) is None  # type: ignore[dict-item]
    assert render.python is not None  # not a mismatch: those batches are jinja's to render or reject


@pytest.mark.parametrize("shape", ["columns", "messages"])
def test_the_stage_writes_the_same_bytes_with_the_plain_python_template_as_with_jinja(
    tmp_path, tiny_dir, monkeypatch, shape
):
    rows = DATES[:300]
    if shape == "messages":
        rows = [
            {"messages": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}]}
            for r in rows
        ]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    fast = prepare(config(tmp_path / "fast", tiny_dir, source, shape=shape, shard_rows=100))
    monkeypatch.setattr(data_encode, "CHATML_TEMPLATE_SHA256", "no template has this hash")
    jinja = prepare(config(tmp_path / "jinja", tiny_dir, source, shape=shape, shard_rows=100))
    assert fast["content_hash"] == jinja["content_hash"]
    assert fast["manifest"]["splits"] == jinja["manifest"]["splits"]  # every shard's sha256 and token count


@contextlib.contextmanager
def on_a_pool(ray_head, chunk_rows: int = 7) -> Iterator[None]:
    """The stage encodes on Ray actors of the session's head from the first row, in chunks of `chunk_rows`.

    This process is the head's driver, as a Ray job's entrypoint is; the head has 4 CPUs, so 4 actors (as far as
    the machine has cores) once the actors of a pool before have given theirs back (Ray frees them asynchronously after they are killed).
    """
    with pytest.MonkeyPatch.context() as patch, ray_driver(ray_head):
        all_cpus_free()
        patch.setattr(data_encode, "POOL_MIN_ROWS", 1)
        patch.setattr(data_encode, "POOL_CHUNK_ROWS", chunk_rows)
        yield


@pytest.mark.integration
@pytest.mark.parametrize("shape", ["columns", "messages"])
def test_the_stage_writes_the_same_bytes_and_drops_on_ray_actors_as_in_one_process(
    tmp_path, tiny_dir, ray_head, capsys, shape
):
    def shaped(rows: list[dict]) -> list[dict]:
        if shape == "columns":
            return rows
        return [
            {"messages": [{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}]}
            if isinstance(r["input"], str) and "output" in r
            else {"messages": [{"role": "user", "content": "no answer"}]}
            for r in rows
        ]

    bad, raw = malformed_rows(4)
    source = write_jsonl(tmp_path / "rows.jsonl", shaped(DATES[:150] + bad), raw)
    eval_source = write_jsonl(tmp_path / "eval.jsonl", shaped(DATES[150:190]))
    for n, eval_from in enumerate((None, eval_source)):
        settings = dict(shape=shape, shard_rows=50, max_dropped_fraction=0.2, eval_source=eval_from and str(eval_from))
        one = prepare(config(tmp_path / f"one{n}", tiny_dir, source, **settings))
        assert "Ray actors" not in capsys.readouterr().out
        with on_a_pool(ray_head):
            pooled = prepare(config(tmp_path / f"pool{n}", tiny_dir, source, **settings))
        assert f"on {min(4, parallel.usable_cores())} Ray actors" in capsys.readouterr().out
        assert pooled["manifest"]["dropped"]["too_long"]["count"] == 4 and pooled["manifest"]["dropped"] != {}
        for key in ("content_hash", "total_rows", "dropped"):
            assert pooled[key] == one[key]
        assert pooled["manifest"]["splits"] == one["manifest"]["splits"]  # every shard's sha256 and token count


def test_each_pooled_task_carries_its_own_rows_and_the_shared_part_none(tmp_path, tiny_dir, monkeypatch):
    """Every actor used to be sent every row (the splits in `shared`): 8 actors on 400,000 rows took 45 s
    against 32 s when each task carries its own."""
    sent: list[tuple[Any, list[Any]]] = []
    real_map = parallel.map_in_order

    def recorded(work, tasks, shared, workers):
        sent.append((shared, list(tasks)))
        return real_map(work, sent[-1][1], shared, 1)

    monkeypatch.setattr(data_encode, "POOL_MIN_ROWS", 1)
    monkeypatch.setattr(data_encode, "POOL_CHUNK_ROWS", 16)
    monkeypatch.setattr(parallel, "ray_workers", lambda tasks: 3)
    monkeypatch.setattr(parallel, "map_in_order", recorded)
    summary = prepare(config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "d.jsonl", DATES[:100])))
    [(shared, tasks)] = sent

    def rows_in(value: Any) -> int:
        if isinstance(value, Conversation):
            return 1
        parts = value.values() if isinstance(value, dict) else value if isinstance(value, (list, tuple)) else ()
        return sum(rows_in(part) for part in parts)

    assert rows_in(shared) == 0
    assert [len(convs) for _, convs in tasks] == [16] * 5 + [10, 10]  # 90 training rows, 10 eval rows
    assert all(isinstance(c, Conversation) for _, convs in tasks for c in convs)
    assert summary["manifest"]["splits"]["train"]["rows"] == 90


# A ChatML variant whose full conversation does not begin with its generation prompt when the answer is BAD.
UNMASKABLE = "{%- if messages[-1]['content'] == 'BAD' %}<|im_start|>ASSISTANT\n{%- endif %}"


@pytest.mark.integration
def test_a_pool_fails_the_stage_on_the_same_row_with_the_same_words(tmp_path, tiny_dir, ray_head):
    model = tmp_path / "model"
    shutil.copytree(tiny_dir, model)
    (model / "chat_template.jinja").write_text(UNMASKABLE + CHAT_TEMPLATE)
    rows = DATES[:120]
    rows[40:41] = [{"input": "first bad", "output": "BAD"}]
    rows[90:91] = [{"input": "second bad", "output": "BAD"}]
    source = write_jsonl(tmp_path / "rows.jsonl", rows)
    with pytest.raises(StageFailure) as one:
        prepare(config(tmp_path / "one", model, source))
    with on_a_pool(ray_head), pytest.raises(StageFailure) as pooled:
        prepare(config(tmp_path / "pool", model, source))
    assert "not render the generation prompt as a prefix" in one.value.cause
    assert (pooled.value.failure_class, pooled.value.cause) == (one.value.failure_class, one.value.cause)


def test_prepares_splits_with_masked_prompts_then_hits_the_cache(tmp_path, tiny_dir):
    source = write_jsonl(tmp_path / "dates.jsonl", DATES[:200])
    cfg = config(tmp_path / "store", tiny_dir, source, shard_rows=64)
    summary = prepare(cfg)
    manifest = summary["manifest"]
    assert summary["cache_hit"] is False
    assert summary["dataset_path"] == f"datasets/dates/{summary['content_hash']}"
    assert summary["dataset_uri"] == str(tmp_path / "store" / summary["dataset_path"])
    assert manifest["splits"]["train"]["rows"] == 180 and manifest["splits"]["eval"]["rows"] == 20
    assert [s["rows"] for s in manifest["splits"]["train"]["shards"]] == [64, 64, 52]
    assert manifest["source"]["sha256"] == sha256_bytes(source.read_bytes())
    assert manifest["dropped"] == {} and manifest["total_rows"] == 200 and manifest["dropped_fraction"] == 0
    # what evaluate checks each model's template against: the one these prompts were rendered with
    assert manifest["chat_template_sha256"] == hashlib.sha256(CHAT_TEMPLATE.encode()).hexdigest()

    storage = Storage(str(tmp_path / "store"))
    train, eval_ = (read_split(storage, summary["dataset_path"], s) for s in ("train", "eval"))
    assert train.schema == SCHEMA and train.num_rows == 180
    answers = {r["input"]: r["output"] for r in DATES[:200]}
    for row in eval_.to_pylist():
        assert row["prompt"].startswith(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n")
        assert row["prompt"].endswith("<|im_start|>assistant\n")
        user = row["prompt"].split("user\n")[1].split("<|im_end|>")[0]
        assert row["reference"] == answers[user]
        target = [t for t, label in zip(row["input_ids"], row["labels"]) if label != -100]
        assert len(row["input_ids"]) == len(row["labels"]) <= 64
        assert row["labels"][: len(row["input_ids"]) - len(target)] == [-100] * (len(row["input_ids"]) - len(target))
        assert target == row["input_ids"][-len(target) :]  # the answer and <|im_end|>, at the end

    shard = Path(summary["dataset_uri"]) / "train" / "part-00000.parquet"
    mtime = shard.stat().st_mtime_ns
    again = prepare(cfg)
    assert again["cache_hit"] is True and again["content_hash"] == summary["content_hash"]
    assert shard.stat().st_mtime_ns == mtime


def test_changing_one_row_changes_the_hash(tmp_path, tiny_dir):
    rows = DATES[:100]
    first = prepare(config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "a.jsonl", rows)))
    edited = [*rows[:50], {"input": rows[50]["input"], "output": "1999-01-01"}, *rows[51:]]
    second = prepare(config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "b.jsonl", edited)))
    assert second["content_hash"] != first["content_hash"] and second["cache_hit"] is False
    assert sorted(Storage(str(tmp_path / "store")).listdir("datasets", "dates")) == sorted(
        [first["content_hash"], second["content_hash"]]
    )


def malformed_rows(n_each: int) -> tuple[list[dict], list[bytes]]:
    """n_each rows of every kind of malformed row: (json rows, raw undecodable lines)."""
    bad = []
    for i in range(n_each):
        bad += [
            {"input": DATES[i]["input"]},
            {"input": 20210305 + i, "output": "2021-03-05"},
            {"input": " ", "output": "2021-03-05"},
            # each its own text: copies of one row would all land in one split, and in eval all but one would be
            # dropped as repeats before any is found too long
            {"input": "March 5, 2021 " * 20 + f"(copy {i})", "output": "2021-03-05"},
        ]
    not_utf8, not_json = b'{"input": "5 M\xe4r 2021", "output": "2021-03-05"}', b'{"input": "5 Mar 2021", "output": '
    return bad, [not_utf8, not_json] * (n_each // 2)


def test_thirty_percent_malformed_is_a_data_failure_with_counts(tmp_path, tiny_dir):
    bad, raw = malformed_rows(6)
    source = write_jsonl(tmp_path / "bad.jsonl", DATES[:70] + bad, raw)
    failure = data_failure(config(tmp_path / "store", tiny_dir, source))
    assert failure.cause.startswith(
        "30.0% of rows dropped (over data.max_dropped_fraction 5.0%): undecodable=6, wrong_type=6, missing_field=6, "
        "empty=6, too_long=6 of 100 rows; the first undecodable is source row 94: "
    )
    assert isinstance(failure.summary, DataSummary)
    assert {r: d.count for r, d in failure.summary.dropped.items()} == dict.fromkeys(datahash.COLUMN_REASONS, 6)
    assert failure.summary.manifest is None and failure.summary.total_rows == 100
    assert not Storage(str(tmp_path / "store")).exists("datasets")


def test_two_percent_malformed_trains_and_the_manifest_lists_them(tmp_path, tiny_dir):
    source = write_jsonl(
        tmp_path / "mostly.jsonl", DATES[:49] + [{"input": "5 Mar 2021"}] + DATES[49:97], [b"{not json at all"]
    )
    summary = prepare(config(tmp_path / "store", tiny_dir, source))
    manifest = summary["manifest"]
    assert manifest["total_rows"] == 99 and manifest["dropped_fraction"] == pytest.approx(2 / 99)
    assert manifest["dropped"] == {
        "undecodable": {"count": 1, "examples": [{"source": "source", "row": 98, "value": "b'{not json at all'"}]},
        "missing_field": {
            "count": 1,
            "examples": [{"source": "source", "row": 49, "value": "{'input': '5 Mar 2021'}"}],
        },
    }
    assert manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"] == 97


def test_csv_and_parquet_sources_give_the_same_examples_as_jsonl(tmp_path, tiny_dir):
    rows = DATES[:60]
    write_csv(tmp_path / "d.csv", rows)
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    write_jsonl(tmp_path / "d.jsonl", rows)
    storage = Storage(str(tmp_path / "store"))
    tables = {}
    for ext in ("jsonl", "csv", "parquet"):
        summary = prepare(config(tmp_path / "store", tiny_dir, tmp_path / f"d.{ext}"))
        tables[ext] = read_split(storage, summary["dataset_path"], "train").to_pylist()
    assert tables["csv"] == tables["jsonl"] == tables["parquet"]
    assert len(tables["csv"]) == 54


def test_a_byte_order_mark_is_not_part_of_the_first_row(tmp_path, tiny_dir):
    # Excel's "CSV UTF-8" and Notepad start a file with one: the first JSON line was undecodable (dropped), and a
    # CSV's first column read as "\ufeffinput", so every row lacked its prompt and the stage failed as a data failure.
    rows = DATES[:60]
    write_csv(tmp_path / "d.csv", rows, prefix=codecs.BOM_UTF8)
    plain = write_jsonl(tmp_path / "plain.jsonl", rows)
    (tmp_path / "d.jsonl").write_bytes(codecs.BOM_UTF8 + plain.read_bytes())
    storage = Storage(str(tmp_path / "store"))
    expected = read_split(storage, prepare(config(tmp_path / "store", tiny_dir, plain))["dataset_path"], "train")
    for name in ("d.jsonl", "d.csv"):
        summary = prepare(config(tmp_path / "store", tiny_dir, tmp_path / name))
        assert summary["manifest"]["dropped"] == {}, name
        assert read_split(storage, summary["dataset_path"], "train").to_pylist() == expected.to_pylist(), name
        # A dataset that an earlier release read with the mark (its first row dropped) has another hash.
        assert summary["manifest"]["settings"]["utf8_bom"] == "stripped"
    assert "utf8_bom" not in data_prep.prep_settings(config(tmp_path, tiny_dir, plain).data)


@pytest.mark.parametrize("indent", [None, 2])
def test_a_json_array_file_is_refused_naming_the_conversion(tmp_path, tiny_dir, indent):
    # It was read as JSON Lines: one row that is a list (one line) or one fragment a line (pretty-printed), all dropped.
    (tmp_path / "d.json").write_text(json.dumps(DATES[:40], indent=indent))
    failure = data_failure(config(tmp_path / "store", tiny_dir, tmp_path / "d.json"))
    assert "is one JSON array of 40 records, not JSON Lines" in failure.cause and "jq -c '.[]'" in failure.cause


def test_a_csv_with_another_delimiter_fails_showing_the_columns_it_read(tmp_path, tiny_dir):
    # European Excel writes ";": every row had one column "input;output", and the failure said only missing_field=60.
    # A date with a comma ("March 5, 2021") is two values of that one column.
    (tmp_path / "d.csv").write_text("input;output\n" + "".join(f"{r['input']};{r['output']}\n" for r in DATES[:60]))
    failure = data_failure(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv"))
    assert (
        "missing_field=37, extra_fields=23 of 60 rows; the first missing_field is source row 0: {'input;output': "
        in failure.cause
    )


def test_csv_row_with_bytes_that_are_not_utf8_is_undecodable(tmp_path, tiny_dir):
    text = "input,output\n" + "".join(f"{r['input'].replace(',', '')},{r['output']}\n" for r in DATES[:40])
    (tmp_path / "d.csv").write_bytes(text.encode() + b"5 M\xe4r 2021,2021-03-05\n")
    summary = prepare(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv", max_dropped_fraction=0.1))
    assert summary["manifest"]["dropped"]["undecodable"]["count"] == 1


def test_a_csv_row_with_more_values_than_the_header_is_dropped_as_extra_fields(tmp_path, tiny_dir):
    # csv.DictReader kept the values past the header under the key None: the row trained with its text cut at the
    # unquoted comma ("What is 1" -> "000 plus 1"), and nothing was dropped.
    text = "input,output\n" + "".join(f"{r['input'].replace(',', '')},{r['output']}\n" for r in DATES[:40])
    extra = "What is 1,000 plus 1,000?,2000\nlist three colours,red, green, blue\n"
    (tmp_path / "d.csv").write_text(text + extra + '"What is 1,000 plus 1,000?",2000\nonly an input\n')
    summary = prepare(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv", max_dropped_fraction=0.1))
    manifest = summary["manifest"]
    dropped = manifest["dropped"]
    assert {r: d["count"] for r, d in dropped.items()} == {"extra_fields": 2, "missing_field": 1}  # too few: None
    assert dropped["extra_fields"]["examples"][0]["value"] == repr(
        "4 fields, the header has 2: ['What is 1', '000 plus 1', '000?', '2000']"
    )
    assert manifest["splits"]["train"]["rows"] + manifest["splits"]["eval"]["rows"] == 41  # the quoted one kept


def test_a_csv_field_longer_than_the_csv_modules_limit_is_a_row_dropped_as_too_long(tmp_path, tiny_dir):
    # csv refuses fields over 131,072 characters by default: the stage failed as infrastructure, `Error: field larger than
    # field limit (131072)`, for a source with one long document among short rows.
    text = "input,output\n" + "".join(f"{r['input'].replace(',', '')},{r['output']}\n" for r in DATES[:40])
    (tmp_path / "d.csv").write_text(text + "a " * 100_000 + ",2021-03-05\n")
    summary = prepare(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv", max_dropped_fraction=0.1))
    assert summary["manifest"]["dropped"]["too_long"]["count"] == 1 and summary["manifest"]["total_rows"] == 41


def test_a_csv_column_named_twice_fails_naming_it(tmp_path, tiny_dir):
    # A row kept the last one's value: `input,output,input` trained every row on the third column's text.
    rows = "".join(f"{r['input'].replace(',', '')},{r['output']},x\n" for r in DATES[:40])
    (tmp_path / "d.csv").write_text("input,output,input\n" + rows)
    failure = data_failure(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv"))
    assert "names column(s) 'input' more than once (columns: ['input', 'output', 'input'])" in failure.cause


def test_a_csv_quote_never_closed_fails_naming_its_line_and_stray_quotes_still_read(tmp_path, tiny_dir):
    # The csv module read everything after the open quote as one value: rows 13-40 vanished without a drop.
    rows = [f"{r['input'].replace(',', '')},{r['output']}\n" for r in DATES[:40]]
    rows[11] = '"12 Jan 2021,2021-01-12\n'
    (tmp_path / "d.csv").write_text("input,output\n" + "".join(rows))
    failure = data_failure(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv"))
    assert failure.failure_class.value == "data"
    assert "a quote opened in the row on line 13 is never closed, so the file from there to its end (29 lines)" in (
        failure.cause
    )
    # A quote inside a value, or a space after a closing one, is not CSV to the letter but reads as before.
    rows[11], rows[12] = '"12 Jan 2021" ,2021-01-12\n', '13" Jan 2021,2021-01-13\n'
    (tmp_path / "d.csv").write_text("input,output\n" + "".join(rows))
    assert prepare(config(tmp_path / "store", tiny_dir, tmp_path / "d.csv"))["manifest"]["total_rows"] == 40


def test_overflow_truncate_and_pack(tmp_path, tiny_dir):
    source = write_jsonl(tmp_path / "d.jsonl", DATES[:60])
    with pytest.raises(StageFailure, match="too_long=60 of 60 rows"):
        prepare(config(tmp_path / "store", tiny_dir, source, max_seq_len=44))
    storage = Storage(str(tmp_path / "store"))
    truncated = prepare(config(tmp_path / "store", tiny_dir, source, max_seq_len=44, overflow="truncate"))
    train = read_split(storage, truncated["dataset_path"], "train").to_pylist()
    assert len(train) == 54 and all(len(r["input_ids"]) == 44 and r["segments"] is None for r in train)
    packed = prepare(config(tmp_path / "store", tiny_dir, source, max_seq_len=160, overflow="pack"))
    train = read_split(storage, packed["dataset_path"], "train").to_pylist()
    eval_ = read_split(storage, packed["dataset_path"], "eval").to_pylist()
    assert sum(r["labels"].count(2) for r in train) == 54  # every example's <|im_end|> target, packed ~3 per row
    assert len(train) < 54 and all(len(r["input_ids"]) <= 160 and r["prompt"] == "" for r in train)
    assert sum(len(r["segments"]) for r in train) == 54  # each row names the lengths of the examples in it
    assert all(sum(r["segments"]) == len(r["input_ids"]) for r in train)
    assert len(eval_) == 6 and all(r["prompt"] and r["reference"] for r in eval_)


def test_separate_eval_source(tmp_path, tiny_dir):
    train_src = write_jsonl(tmp_path / "train.jsonl", DATES[:50])
    eval_src = write_jsonl(tmp_path / "eval.jsonl", DATES[50:60])
    summary = prepare(config(tmp_path / "store", tiny_dir, train_src, eval_source=str(eval_src)))
    manifest = summary["manifest"]
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["eval"]["rows"]) == (50, 10)
    assert manifest["eval_source"]["sha256"] == sha256_bytes(eval_src.read_bytes())
    assert manifest["settings"]["eval_fraction"] is None


def test_the_eval_split_holds_each_conversation_once(tmp_path, tiny_dir):
    # A repeat counted twice in every gate's n: an interval narrower than the evidence. Training keeps its repeats.
    twice = write_jsonl(tmp_path / "twice.jsonl", DATES[:60] + DATES[:60])
    summary = prepare(config(tmp_path / "store", tiny_dir, twice, max_dropped_fraction=0.1))
    manifest = summary["manifest"]
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["eval"]["rows"]) == (108, 6)
    assert manifest["dropped"]["repeated_eval_item"]["count"] == 6
    eval_src = write_jsonl(tmp_path / "eval.jsonl", DATES[50:58] + [DATES[52], DATES[52]])
    train_src = write_jsonl(tmp_path / "train.jsonl", DATES[:50])
    summary = prepare(
        config(tmp_path / "store", tiny_dir, train_src, eval_source=str(eval_src), max_dropped_fraction=0.1)
    )
    assert summary["manifest"]["splits"]["eval"]["rows"] == 8
    repeats = summary["manifest"]["dropped"]["repeated_eval_item"]
    assert repeats["count"] == 2 and repeats["examples"][0] == {
        "source": "eval_source",
        "row": 8,
        "value": "'the same conversation as eval_source row 2'",
    }


def test_the_eval_split_drops_a_conversation_that_repeats_one_once_normalised():
    """Spacing, case, punctuation and character width make no new item: five spellings of one question with one
    answer are one item of evidence, not five in every gate's n. The turns stay apart: the same words cut into
    other turns, or another role, are another conversation."""
    from training.data_sources import each_once

    spellings = ["Jan 5, 2024", "Jan 5, 2024 ", "jan 5 2024", "JAN. 5, 2024", "Jan  5,2024", "Ｊａｎ ５, ２０２４"]
    convs = [Conversation("eval_source", i, {"prompt": p, "response": "2024-01-05"}) for i, p in enumerate(spellings)]
    other = [
        Conversation("eval_source", 6, {"prompt": "Jan 5, 2024", "response": "2024-01-06"}),  # another answer
        Conversation("eval_source", 7, {"prompt": "Jan 5,", "response": "2024 2024-01-05"}),  # other turns
        Conversation("eval_source", 8, {"prompt": "Jan 5, 2024", "response": "2024-01-05"}),  # verbatim
    ]
    drops = datahash.Drops()
    kept = each_once(convs + other, drops)
    assert [c.row for c in kept] == [0, 6, 7]
    repeats = drops.to_json()["repeated_eval_item"]
    assert repeats["count"] == 6 and repeats["examples"][0] == {
        "source": "eval_source",
        "row": 1,
        "value": "'the same conversation as eval_source row 0 once normalised (case, punctuation, spacing, width)'",
    }
    turns = [
        [{"role": "user", "content": "5 Mar 2021"}, {"role": "assistant", "content": "2021-03-05"}],
        [{"role": "user", "content": "5 MAR 2021."}, {"role": "assistant", "content": "2021-03-05"}],
        [{"role": "system", "content": "5 Mar 2021"}, {"role": "assistant", "content": "2021-03-05"}],
    ]
    chats = [Conversation("source", i, {}, messages=m) for i, m in enumerate(turns)]
    assert [c.row for c in each_once(chats, datahash.Drops())] == [0, 2]


def test_a_row_holding_a_special_tokens_text_is_dropped_and_a_system_prompt_holding_one_fails(tmp_path, tiny_dir):
    # The tokenizer reads "<|im_end|>" in a text as the end-of-turn token: a response would end there in training,
    # a prompt would open a turn the template never wrote, and no generation gives a reference holding one.
    planted = [
        {"input": "3 May 2021", "output": "2021-05-03<|im_end|>"},
        {"input": "4 May 2021<|im_end|>\n<|im_start|>assistant\n2021-05-04", "output": "2021-05-04"},
        {"input": "5 May 2021 <|im_end", "output": "2021-05-05"},  # not the token: read as text
    ]
    source = write_jsonl(tmp_path / "d.jsonl", DATES[:60] + planted)
    summary = prepare(config(tmp_path / "store", tiny_dir, source, max_dropped_fraction=0.1))
    dropped = summary["manifest"]["dropped"]["special_token"]
    assert dropped["count"] == 2 and [e["row"] for e in dropped["examples"]] == [60, 61]
    assert dropped["examples"][0]["value"] == "\"response: '<|im_end|>' in …2021-05-03<|im_end|>…\""
    assert dropped["examples"][1]["value"].startswith("\"prompt: '<|im_end|>' in …4 May 2021<|im_end|>")
    assert sum(s["rows"] for s in summary["manifest"]["splits"].values()) == 61
    train, held_out = (summary["manifest"]["splits"][name]["rows"] for name in ("train", "eval"))
    assert data_evidence(DataSummary.model_validate(summary)).endswith(  # the run's table shows the drop too
        f": train {train}, eval {held_out} rows of 63 read; dropped special_token 2"
    )
    rows = DATES[:60] + [{"input": "6 May 2021", "output": "<|endoftext|>"}]
    turns = [[{"role": "user", "content": r["input"]}, {"role": "assistant", "content": r["output"]}] for r in rows]
    messages = write_jsonl(tmp_path / "m.jsonl", [{"messages": t} for t in turns])
    summary = prepare(config(tmp_path / "store", tiny_dir, messages, max_dropped_fraction=0.1))
    assert summary["manifest"]["dropped"]["special_token"]["examples"][0]["value"] == (
        "\"assistant: '<|endoftext|>' in …<|endoftext|>…\""
    )
    failure = data_failure(config(tmp_path / "store", tiny_dir, source, system_prompt="Answer.<|im_end|>"))
    assert "data.system_prompt holds '<|im_end|>', one of the tokenizer's special tokens" in failure.cause


@pytest.mark.parametrize(
    "source, match",
    [
        ("{tmp}/missing.jsonl", "missing.jsonl is unreadable: FileNotFoundError"),
        ("{tmp}/data.txt", "cannot tell the format of .*data.txt from its extension '.txt'"),
        ("hf://tuneproof/no-such-dataset:train", "could not be loaded from the Hugging Face hub"),
    ],
)
def test_unreadable_sources_are_data_failures(tmp_path, tiny_dir, source, match):
    (tmp_path / "data.txt").write_text("5 Mar 2021\n")
    with pytest.raises(StageFailure, match=match) as info:
        prepare(config(tmp_path / "store", tiny_dir, source.format(tmp=tmp_path)))
    assert info.value.failure_class is FailureClass.data


def test_read_split_rejects_missing_manifest_and_corrupt_or_missing_shards(tmp_path, tiny_dir):
    summary = prepare(config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "d.jsonl", DATES[:40])))
    storage, path = Storage(str(tmp_path / "store")), summary["dataset_path"]
    with pytest.raises(StageFailure, match="has no manifest.json") as info:
        read_split(storage, "datasets/dates/0000", "train")
    assert info.value.failure_class is FailureClass.infrastructure
    shard = Path(summary["dataset_uri"]) / "eval" / "part-00000.parquet"
    shard.write_bytes(shard.read_bytes()[:-10] + b"0123456789")
    with pytest.raises(StageFailure, match="eval/part-00000.parquet is corrupt: sha256"):
        read_split(storage, path, "eval")
    shard.unlink()
    with pytest.raises(StageFailure, match="eval/part-00000.parquet is missing"):
        read_split(storage, path, "eval")
    assert read_split(storage, path, "train").num_rows == 36


def test_entrypoint_writes_a_stage_result(tmp_path, tiny_dir):
    cfg = config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "d.jsonl", DATES[:40]))
    env = {**os.environ, ENV_VAR: encode_job("run-7", "data", cfg)}
    proc = run_job_module("training.data_prep", env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = Storage(str(tmp_path / "store")).read_json("runs", "run-7", "stages", "data", "result.json")
    assert result["status"] == "succeeded" and result["summary"]["manifest"]["splits"]["eval"]["rows"] == 4


def test_the_direct_tokenizer_is_the_one_autotokenizer_loads(tiny_dir):
    """The data stage's tokenizer (load_text_tokenizer) against AutoTokenizer's: class, saved files, ids, template."""
    auto, direct = load_tokenizer(str(tiny_dir)), load_text_tokenizer(str(tiny_dir))
    assert direct_tokenizer_class(tiny_dir) == "Qwen2Tokenizer" and type(direct) is type(auto)
    assert data_prep.tokenizer_sha256(direct) == data_prep.tokenizer_sha256(auto)
    texts = [chat[0]["content"] for chat in ODD_CHATS] + ["<|im_start|>user\nx<|im_end|>\n<|endoftext|>", ""]
    for add_special_tokens in (False, True):
        assert direct(texts, add_special_tokens=add_special_tokens) == auto(
            texts, add_special_tokens=add_special_tokens
        )
    assert token_ids(direct, texts) == token_ids(auto, texts)
    assert (direct.chat_template, direct.all_special_ids, direct.eos_token_id, direct.pad_token_id) == (
        auto.chat_template,
        auto.all_special_ids,
        auto.eos_token_id,
        auto.pad_token_id,
    )


def test_other_models_go_through_autotokenizer(tmp_path, tiny_dir, monkeypatch):
    def variant(name: str, config: dict | None = None, tokenizer: dict | None = None, drop: str = "") -> Path:
        out = tmp_path / name
        out.mkdir()
        for f in tiny_dir.iterdir():
            if f.name != drop:
                (out / f.name).write_bytes(f.read_bytes())
        for file, changes in (("config.json", config), ("tokenizer_config.json", tokenizer)):
            if changes:
                (out / file).write_text(json.dumps({**json.loads((out / file).read_text()), **changes}))
        return out

    assert direct_tokenizer_class(Path("Qwen/Qwen2.5-1.5B")) is None  # a hub id: no local files
    assert direct_tokenizer_class(variant("llama", config={"model_type": "llama"})) is None
    assert direct_tokenizer_class(variant("class", tokenizer={"tokenizer_class": "LlamaTokenizer"})) is None
    assert direct_tokenizer_class(variant("remote", tokenizer={"auto_map": {"AutoTokenizer": ["a", "b"]}})) is None
    assert direct_tokenizer_class(variant("nojson", drop="tokenizer.json")) is None
    assert direct_tokenizer_class(variant("fast", tokenizer={"tokenizer_class": "Qwen2TokenizerFast"})) == (
        "Qwen2TokenizerFast"
    )
    # A class this transformers release does not export: AutoTokenizer decides, as before.
    monkeypatch.setattr(modeling, "DIRECT_TOKENIZERS", {"qwen2": ("NotInTransformers",)})
    missing = variant("missing", tokenizer={"tokenizer_class": "NotInTransformers"})
    texts = ["<|im_start|>user\n5 Mar 2021<|im_end|>\n"]
    assert token_ids(load_text_tokenizer(str(missing)), texts) == token_ids(load_tokenizer(str(tiny_dir)), texts)


def test_the_data_job_never_imports_torch(tmp_path, tiny_dir):
    """The job entrypoint, as Ray runs it; its dataset names the tokenizer AutoTokenizer would have loaded."""
    cfg = config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "d.jsonl", DATES[:40]))
    watch = (
        "import atexit, runpy, sys; atexit.register(lambda: print('torch imported:', 'torch' in sys.modules)); "
        "runpy.run_module('training.data_prep', run_name='__main__')"
    )
    env = {**os.environ, ENV_VAR: encode_job("run-8", "data", cfg)}
    proc = subprocess.run(
        [sys.executable, "-c", watch], cwd=PROJECT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0 and "torch imported: False" in proc.stdout, proc.stdout + proc.stderr
    result = Storage(str(tmp_path / "store")).read_json("runs", "run-8", "stages", "data", "result.json")
    auto_sha = data_prep.tokenizer_sha256(load_tokenizer(str(tiny_dir)))
    assert result["summary"]["manifest"]["tokenizer_sha256"] == auto_sha


# ---- the stage, with storage and source on an S3-compatible server ---------------------------


@pytest.mark.integration
def test_prepare_on_s3_and_read_back(s3_endpoint, tmp_path, tiny_dir):
    bucket = Storage(f"s3://{TEST_BUCKET}", s3_endpoint)
    bucket.write_bytes(write_jsonl(tmp_path / "d.jsonl", DATES[:100]).read_bytes(), "sources", "dates.jsonl")
    cfg = PipelineConfig.model_validate(
        {
            "storage": {"root": f"s3://{TEST_BUCKET}/prep", "endpoint_url": s3_endpoint},
            "model": {"source": str(tiny_dir)},
            "data": {"source": f"s3://{TEST_BUCKET}/sources/dates.jsonl", "shard_rows": 50, "system_prompt": SYSTEM},
        }
    )
    summary = prepare(cfg)
    assert summary["dataset_uri"] == f"s3://{TEST_BUCKET}/prep/{summary['dataset_path']}"
    local = prepare(config(tmp_path / "store", tiny_dir, tmp_path / "d.jsonl", shard_rows=50))
    assert local["content_hash"] == summary["content_hash"]  # identity is content, not location
    storage = Storage(cfg.storage.root, s3_endpoint)
    train = read_split(storage, summary["dataset_path"], "train")
    assert train.num_rows == 90 and len(summary["manifest"]["splits"]["train"]["shards"]) == 2
    assert train.to_pylist() == read_split(Storage(str(tmp_path / "store")), local["dataset_path"], "train").to_pylist()
    assert prepare(cfg)["cache_hit"] is True


def test_an_eval_file_that_repeats_training_rows_is_refused_naming_the_overlap(tmp_path, tiny_dir):
    train = DATES[:50]
    verbatim = DATES[3:5]
    reformatted = [{"input": DATES[7]["input"].upper() + " ", "output": DATES[7]["output"].replace("-", " - ")}]
    eval_src = write_jsonl(tmp_path / "eval.jsonl", DATES[60:67] + verbatim + reformatted)
    cfg = config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "train.jsonl", train), eval_source=str(eval_src))
    failure = data_failure(cfg)
    assert failure.cause == (
        "eval split overlaps the training split: 3 of 10 eval items (30.0%; 3 normalised exact matches, the rest a "
        "shared 13-word n-gram or a short item whole inside a training row) > data.max_contamination 0: eval_source:7, "
        "eval_source:8, eval_source:9"
    )
    assert isinstance(failure.summary, DataSummary)
    found = present(failure.summary.contamination)
    assert (found.overlapping, found.eval_items, found.overlapping_ids) == (
        3,
        10,
        [f"eval_source:{i}" for i in (7, 8, 9)],
    )
    assert not list((tmp_path / "store").rglob("manifest.json"))  # refused before anything was written

    allowed = cfg.model_copy(update={"data": cfg.data.model_copy(update={"max_contamination": 0.3})})
    manifest = prepare(allowed)["manifest"]
    assert manifest["contamination"]["overlapping"] == 3 and manifest["contamination"]["fraction"] == 0.3
    with pytest.raises(StageFailure, match="overlaps the training split: 3 of 10"):
        prepare(cfg)  # the cached dataset is judged again under the stricter limit


def test_a_clean_split_records_zero_contamination(tmp_path, tiny_dir):
    manifest = prepare(config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "d.jsonl", DATES[:200])))["manifest"]
    assert manifest["contamination"]["overlapping"] == 0 and manifest["contamination"]["eval_items"] > 0


def test_a_suite_the_training_split_repeats_is_a_data_failure_also_on_a_cache_hit(tmp_path, tiny_dir):
    """A regression suite's items in the training split measure recall, not retention: refused naming the
    suite; the suites are not in the dataset's identity, so a cache hit checks them again."""
    source = write_jsonl(tmp_path / "dates.jsonl", DATES[:100])
    clean = write_jsonl(tmp_path / "clean.jsonl", [{"input": "add 1 and 2", "output": "3"}])
    leaked = write_jsonl(tmp_path / "leaked.jsonl", DATES[:100])  # every row: 90 train, 10 eval
    cfg = config(tmp_path / "store", tiny_dir, source)
    cfg.eval.suites = {"clean": SuiteConfig(source=str(clean))}
    first = prepare(cfg)
    [suite] = first["suites"]
    assert (suite["name"], suite["items"], suite["contamination"]["overlapping"]) == ("clean", 1, 0)
    assert suite["sha256"] == sha256_bytes(clean.read_bytes())
    cfg.eval.suites = {"leaked": SuiteConfig(source=str(leaked))}
    assert data_failure(cfg).cause.startswith(
        f"suite leaked ({leaked}) overlaps the training split: 90 of 100 eval items"
    )


def test_a_base_model_whose_tokenizer_has_no_chat_template_is_a_data_failure_naming_it(tmp_path, tiny_dir):
    bare = tmp_path / "no-template"
    shutil.copytree(tiny_dir, bare)
    (bare / "chat_template.jinja").unlink()
    source = write_jsonl(tmp_path / "d.jsonl", DATES[:20])
    assert data_failure(config(tmp_path / "store", bare, source)).cause.startswith(
        f"model.source {bare}: its tokenizer has no chat template, so no row can be rendered as a conversation"
    )


def test_a_suite_item_holding_a_special_tokens_text_fails_the_data_stage_before_any_training(tmp_path, tiny_dir):
    marked = write_jsonl(tmp_path / "marked.jsonl", [{"input": "add 1 and 2<|im_end|>", "output": "3"}])
    cfg = config(tmp_path / "store", tiny_dir, write_jsonl(tmp_path / "dates.jsonl", DATES[:100]))
    cfg.eval.suites = {"marked": SuiteConfig(source=str(marked))}
    assert data_failure(cfg).cause == (
        "suite marked: item marked:1's input holds '<|im_end|>', one of the tokenizer's special tokens, which it "
        "reads as that control token and not as text"
    )


def test_the_training_split_is_normalised_once_for_the_eval_split_and_every_suite(tmp_path, tiny_dir, monkeypatch):
    """Each suite used to re-read every training row: the stage's overlap checks cost rows x (1 + suites)."""
    from training import contamination

    source = write_jsonl(tmp_path / "dates.jsonl", DATES[:100])
    suites = {
        f"s{i}": write_jsonl(tmp_path / f"s{i}.jsonl", [{"input": f"add {i} and 2", "output": "x"}]) for i in range(3)
    }
    cfg = config(tmp_path / "store", tiny_dir, source)
    cfg.eval.suites = {name: SuiteConfig(source=str(path)) for name, path in suites.items()}
    read, real_words = [], contamination.words

    def counted(text: str) -> list[str]:
        read.append(text)
        return real_words(text)

    monkeypatch.setattr(contamination, "words", counted)
    summary = prepare(cfg)
    eval_items = summary["manifest"]["contamination"]["eval_items"]
    assert [s["contamination"]["overlapping"] for s in summary["suites"]] == [0, 0, 0]
    assert len(read) == 90 + eval_items + 3  # 90 training rows once, then each eval row and suite item once


def test_replayed_rows_join_the_training_split_at_their_share_and_are_checked_like_it(tmp_path, tiny_dir):
    """data.replay: the file's rows (whole copies, then a seeded sample) make `share` of the training split,
    never the eval split; its hash and share are in the dataset's identity; a suite it repeats is refused."""
    source = write_jsonl(tmp_path / "dates.jsonl", DATES[:100])  # 90 train, 10 eval
    skills = [{"input": f"add {i} and {i + 1}", "output": str(2 * i + 1)} for i in range(20)]
    replay = write_jsonl(tmp_path / "skills.jsonl", skills)
    plain = prepare(config(tmp_path / "store", tiny_dir, source))
    cfg = config(tmp_path / "store", tiny_dir, source, replay={"source": str(replay), "share": 0.4})
    summary = prepare(cfg)
    manifest = summary["manifest"]
    # 90 task rows at a 0.4 share: 60 replayed rows, three whole copies of the 20.
    assert (manifest["splits"]["train"]["rows"], manifest["splits"]["eval"]["rows"]) == (150, 10)
    assert manifest["replay"]["sha256"] == sha256_bytes(replay.read_bytes())
    assert manifest["settings"]["replay"] == {"sha256": manifest["replay"]["sha256"], "share": 0.4}
    assert summary["content_hash"] != plain["content_hash"] and "replay" not in plain["manifest"]["settings"]
    store = Storage(str(tmp_path / "store"))
    train = read_split(store, summary["dataset_path"], "train").to_pylist()
    evals = read_split(store, summary["dataset_path"], "eval").to_pylist()
    replayed = [r for r in train if r["reference"] in {s["output"] for s in skills} and "add" in r["prompt"]]
    assert len(replayed) == 60 and not any("add" in r["prompt"] for r in evals)
    # The run's line says why the training split holds more rows than were read: 150 + 10 from 120.
    assert data_evidence(DataSummary.model_validate(summary)).endswith(
        ": train 150 (40% replayed), eval 10 rows of 120 read, none dropped"
    )

    # A share that is not a whole number of copies: 90 * 0.3 / 0.7 = 38.6 -> 39 rows, one copy and 19 sampled.
    assert cfg.data.replay is not None
    cfg.data.replay.share = 0.3
    assert prepare(cfg)["manifest"]["splits"]["train"]["rows"] == 90 + 39

    # A suite the replayed rows repeat measures recall: refused like a suite the task's rows repeat.
    cfg.eval.suites = {"add": SuiteConfig(source=str(replay))}
    with pytest.raises(StageFailure, match=r"suite add .* overlaps the training split: 20 of 20"):
        prepare(cfg)
    cfg.eval.suites = {}
    assert cfg.data.replay is not None
    cfg.data.replay.source = str(write_jsonl(tmp_path / "broken.jsonl", [{"question": "?"}]))
    with pytest.raises(StageFailure, match=r"data.replay.source .*broken.jsonl: no usable rows \(all 1 dropped\)"):
        prepare(cfg)


@pytest.mark.parametrize(
    ("share", "says"),
    [
        # Replay configured, nothing replayed, and the run said nothing.
        (1e-300, "data.replay.share 1e-300 asks for no replayed row beside 90 training rows, expected 1 to 810: raise"),
        # Past the config's bound (a caller that skipped it): 0.9999999 asked for ~27 billion rows, out of memory.
        (0.95, "asks for 1,710 replayed rows beside 90 training rows, expected 1 to 810: lower it to at most 0.9"),
    ],
)
def test_a_replay_share_that_asks_for_no_row_or_too_many_is_a_data_failure(share: float, says: str):
    from training.data_sources import replayed

    rows = [Conversation("replay", 0, {"input": "add 1 and 2", "output": "3"})]
    with pytest.raises(StageFailure) as info:
        replayed(rows, 90, share, 0)
    assert info.value.failure_class is FailureClass.data and says in info.value.cause, info.value.cause
    assert len(replayed(rows, 90, 0.9, 0)) == 810  # the bound itself: 9 replayed rows per task row


def test_a_replayed_row_too_long_is_one_dropped_row_not_one_per_copy(tmp_path, tiny_dir):
    # The demo at data.max_seq_len=8 failed as "116.3% of rows malformed: too_long=4157 of 3574 rows": each
    # replayed copy of a too-long row was counted against a total that counts the row once.
    source = write_jsonl(tmp_path / "dates.jsonl", DATES[:100])  # 90 train, 10 eval
    long_skill = {"input": "add " + " ".join(["1"] * 200), "output": "200"}
    replay = write_jsonl(tmp_path / "skills.jsonl", [long_skill] + [{"input": "add 1 and 2", "output": "3"}] * 9)
    cfg = config(tmp_path / "store", tiny_dir, source, replay={"source": str(replay), "share": 0.4}, max_seq_len=128)
    summary = prepare(cfg)  # 60 replayed rows: six copies of the 10, the long one dropped from each
    assert summary["manifest"]["splits"]["train"]["rows"] == 90 + 60 - 6
    assert summary["dropped"]["too_long"]["count"] == 1 and summary["total_rows"] == 110
    assert [e["row"] for e in summary["dropped"]["too_long"]["examples"]] == [0]


def test_drops_count_each_row_once_across_chunks_and_keep_the_first_rows_as_evidence():
    first, later = datahash.Drops(), datahash.Drops()
    first.add("too_long", "replay", 3, "x")
    first.add("too_long", "replay", 3, "x")  # a second copy of the row
    for row in (3, 5, 7, 9):  # a later chunk met the same replayed row, then three new ones
        later.add("too_long", "replay", row, row)
    first.merge(later)
    assert first.counts == {"too_long": 4} and first.total == 4
    assert [e["row"] for e in first.examples["too_long"]] == [3, 5, 7]


def test_a_compressed_or_utf16_text_source_is_named_for_what_it_is(tmp_path: Path):
    # Read as text, a gzip or UTF-16 file was "100.0% of rows dropped ... undecodable=3 of 3 rows; the first
    # undecodable is source row 0: b'\x1f\x8b...'", naming neither the file nor why.
    row = '{"input": "a", "output": "b"}\n' * 3
    files = {
        "rows.jsonl": (gzip.compress(row.encode()), "gzip-compressed"),
        "rows-utf16.jsonl": (row.encode("utf-16"), "UTF-16 text"),
        "rows.csv": (b"PK\x03\x04" + b"\0" * 20, "a zip archive"),
    }
    for name, (data, what) in files.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(StageFailure) as info:
            read_source(str(tmp_path / name), "auto", None)
        assert info.value.failure_class is FailureClass.data
        assert f"data source {tmp_path / name} is {what}" in str(info.value), str(info.value)
    (tmp_path / "plain.jsonl").write_text(row)
    assert read_source(str(tmp_path / "plain.jsonl"), "auto", None).format == "jsonl"
