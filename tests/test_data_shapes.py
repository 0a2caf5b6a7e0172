"""Data shapes: columns, template and messages; the assistant-only label mask; bad rows by reason; identity.

Unit tests run the pure shape logic (tuneproof/core/shapes.py) and the data stage's messages encoder
with a real tiny Qwen2 tokenizer (ChatML, Qwen's template layout). Stage tests run `prepare_data` on
a local storage root. The integration test runs the data job's entrypoint on the bundled chat data,
then a short 2-worker fine-tune and the evaluate job on what it wrote, through a real Ray head.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import runpy
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest

from tests.conftest import run_job_module
from tests.reading import present
from training import data_encode
from training.data_encode import encode_messages, encode_split
from training.data_files import read_split
from training.data_prep import prepare_data
from training.data_sources import Conversation
from training.jobkit import JobContext, encode_job
from tuneproof.app.tiny_model import DEFAULT_DATA, build_tiny_model, ensure_tiny_model, train_tokenizer
from tuneproof.core import datahash, shapes
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config
from tuneproof.core.config_data import DataConfig
from tuneproof.core.envelope import ENV_VAR
from tuneproof.core.hashing import IGNORE_INDEX, sha256_json
from tuneproof.core.results import StageFailure
from tuneproof.core.storage import Storage

CHAT_DATA = PROJECT_ROOT / "data" / "chat" / "chat.jsonl"
CHAT = [json.loads(line) for line in CHAT_DATA.read_text().splitlines()]
ALPACA_DATA = PROJECT_ROOT / "data" / "alpaca" / "alpaca.jsonl"
ALPACA_ROWS = [json.loads(line) for line in ALPACA_DATA.read_text().splitlines()]
SYSTEM = "Answer briefly."
TWO_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "5 Mar 2021"},
    {"role": "assistant", "content": "2021-03-05"},
    {"role": "user", "content": "year?"},
    {"role": "assistant", "content": "2021"},
]
ALPACA = "Below is an instruction.\n\n### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:"
# The date content hash of configs/local.yaml: shapes and replay left it as it was (columns datasets stayed cache
# hits); it moves only with datahash.PREP_VERSION, on purpose (0a34d21b... at version 1, before the eval split
# kept each conversation once; 31bc2fed... at version 2, before rows holding a special token's text were dropped;
# be5e662b... at version 3, before CSV rows with extra fields, blank template rows and blank or assistant-first
# turns were dropped; 9c2d8692... at version 4, before the eval split dropped near-duplicate conversations).
LOCAL_DATES_HASH = "df9e69b0d085b79be5519a69f5ed14d9ea4e6d65b3c36700e3d2e30d34bd3b0b"


def chat_text(messages: list[dict]) -> str:
    return "".join(f"{m['role']}\n{m['content']}\n" for m in messages)


def tokenizer_corpus():
    rows = [r["messages"] for r in CHAT[:300]] + [TWO_TURNS]
    return [chat_text(m) for m in rows] + [ALPACA]


@pytest.fixture(scope="module")
def tokenizer():
    return train_tokenizer(tokenizer_corpus())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_corpus(), hidden=32)


def labelled_spans(tokenizer, ids: list[int], labels: list[int]) -> list[tuple[int, str]]:
    """(character offset in the decoded text, decoded text) of each run of labelled tokens."""
    spans, position = [], 0
    for labelled, group in itertools.groupby(zip(ids, labels), key=lambda pair: pair[1] != IGNORE_INDEX):
        run = list(group)
        text = tokenizer.decode([i for i, _ in run])
        if labelled:
            assert [label for _, label in run] == [i for i, _ in run], "a labelled token must be its input token"
            spans.append((position, text))
        position += len(text)
    return spans


def encode(tokenizer, messages: list[dict], **data):
    return encode_messages(tokenizer, messages, DataConfig(shape="messages", **data))


# ---- messages: the label mask against the rendered text -------------------------------------------------


def test_two_turn_label_mask_covers_exactly_the_assistant_tokens(tokenizer):
    example = encode(tokenizer, TWO_TURNS)
    rendered = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    assert tokenizer.decode(example.input_ids) == rendered.rstrip()  # the whole conversation, nothing after its end
    spans = labelled_spans(tokenizer, example.input_ids, example.labels)
    assert [text for _, text in spans] == ["2021-03-05<|im_end|>", "2021<|im_end|>"]
    for offset, text in spans:
        # Each span sits in the rendered text right where the template opens an assistant turn.
        assert rendered[offset : offset + len(text)] == text
        assert rendered[:offset].endswith("<|im_start|>assistant\n")
    # Everything else (system, user turns, the template's own markup) carries no label.
    assert SYSTEM in rendered[: spans[0][0]] and "year?" in rendered[spans[0][0] + len(spans[0][1]) : spans[1][0]]


def test_last_assistant_labels_only_the_final_turn(tokenizer):
    example = encode(tokenizer, TWO_TURNS, loss_on="last_assistant")
    rendered = tokenizer.apply_chat_template(TWO_TURNS, tokenize=False)
    [(offset, text)] = labelled_spans(tokenizer, example.input_ids, example.labels)
    assert text == "2021<|im_end|>" and rendered[offset:].rstrip() == text
    assert example.input_ids == encode(tokenizer, TWO_TURNS).input_ids  # the mask changes, the tokens do not


def test_eval_prompt_is_everything_before_the_last_assistant_turn(tokenizer):
    example = encode(tokenizer, TWO_TURNS[1:], system_prompt=SYSTEM)  # system_prompt supplies the system turn
    assert example.input_ids == encode(tokenizer, TWO_TURNS).input_ids
    assert example.prompt == tokenizer.apply_chat_template(TWO_TURNS[:-1], tokenize=False, add_generation_prompt=True)
    assert example.reference == "2021"
    assert example.prompt + "2021<|im_end|>" == tokenizer.decode(example.input_ids)


def test_turns_after_the_last_assistant_turn_are_cut_and_extra_keys_dropped():
    row = {"messages": [*TWO_TURNS[1:], {"role": "user", "content": "thanks", "name": "x"}]}
    assert shapes.check_messages(row, "messages") == (None, TWO_TURNS[1:])
    assert shapes.check_messages({"chat": TWO_TURNS}, "chat") == (None, TWO_TURNS)


@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_a_batch_of_conversations_encodes_as_each_one_alone(tokenizer, loss_on):
    """The stage renders and tokenizes a split in batches; each example equals the row-by-row encoding."""
    data = DataConfig(shape="messages", loss_on=loss_on, system_prompt=SYSTEM)
    chats = [row["messages"] for row in CHAT[:40]] + [TWO_TURNS, TWO_TURNS[1:], TWO_TURNS]  # a repeat shares text
    convs = [Conversation("source", i, {}, messages) for i, messages in enumerate(chats)]
    examples, kept = encode_split(tokenizer, convs, data, datahash.Drops())
    assert kept == convs
    assert examples == [encode_messages(tokenizer, messages, data) for messages in chats]
    assert examples[-1].input_ids is not examples[-3].input_ids  # equal texts, separate lists


def test_a_rejected_conversation_is_dropped_and_its_batch_neighbours_kept(tokenizer, monkeypatch):
    strict = copy.deepcopy(tokenizer)
    strict.chat_template = SYSTEM_FIRST_GUARD + tokenizer.chat_template
    monkeypatch.setattr(data_encode, "RENDER_CHUNK", 4)  # the rejected row's chunk goes one by one, the others batched
    chats = [row["messages"] for row in CHAT[:9]]
    chats.insert(5, [TWO_TURNS[1], TWO_TURNS[0], *TWO_TURNS[2:]])  # a system turn after the first
    data = DataConfig(shape="messages")
    drops = datahash.Drops()
    examples, kept = encode_split(strict, [Conversation("source", i, {}, m) for i, m in enumerate(chats)], data, drops)
    assert [conv.row for conv in kept] == [i for i in range(10) if i != 5]
    assert drops.counts == {"template_rejected": 1}
    assert "System role only as the first message" in drops.examples["template_rejected"][0]["value"]
    assert examples == [encode_messages(tokenizer, m, data) for i, m in enumerate(chats) if i != 5]


# Like Qwen2's, this tokenizer has "\n\n" as one token: a reply opening with "\n" merges with the newline that ends
# the generation prompt, so the prompt's tokens are no prefix of the conversation's.
NEWLINE_FIRST = [{"role": "user", "content": "write code"}, {"role": "assistant", "content": "\nprint(1)"}]


def test_a_conversation_whose_turn_cannot_be_located_is_dropped_and_the_others_kept(tokenizer):
    # It failed the whole stage, saying the template re-renders earlier turns and to label the last turn alone,
    # which fails on it too.
    chats = [row["messages"] for row in CHAT[:6]]
    chats.insert(3, NEWLINE_FIRST)
    data = DataConfig(shape="messages", loss_on="last_assistant")
    drops = datahash.Drops()
    examples, kept = encode_split(
        tokenizer, [Conversation("source", i, {}, m) for i, m in enumerate(chats)], data, drops
    )
    assert [conv.row for conv in kept] == [0, 1, 2, 4, 5, 6]
    assert drops.counts == {"not_a_prefix": 1}
    assert (
        "assistant turn 1 '\\\\nprint(1)': the conversation up to or through it"
        in drops.examples["not_a_prefix"][0]["value"]
    )
    assert examples == [encode_messages(tokenizer, m, data) for i, m in enumerate(chats) if i != 3]


# Like templates that hide earlier assistant turns' reasoning: a reply renders otherwise once more turns follow.
HIDE_EARLIER_REPLIES = (
    "{%- for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and not loop.last %}…{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_a_template_that_re_renders_earlier_turns_drops_every_conversation_and_the_failure_names_the_fix(tokenizer):
    hiding = copy.deepcopy(tokenizer)
    hiding.chat_template = HIDE_EARLIER_REPLIES
    convs = [Conversation("source", i, {}, TWO_TURNS) for i in range(4)]
    drops = datahash.Drops()
    assert encode_split(hiding, convs, DataConfig(shape="messages"), drops) == ([], [])
    cause = datahash.drop_failure(drops, 4, 0.05) or ""
    assert cause.startswith("100.0% of rows dropped (over data.max_dropped_fraction 5.0%): not_a_prefix=4 of 4 rows")
    assert cause.endswith("(use data.loss_on last_assistant, or the columns shape)")
    # The fix it names: the last turn alone is labelled, after the earlier turns as they render.
    last = DataConfig(shape="messages", loss_on="last_assistant")
    assert len(encode_split(hiding, convs, last, datahash.Drops())[1]) == 4


@pytest.mark.parametrize("loss_on", ["all_assistant", "last_assistant"])
def test_renderings_names_every_prefix_the_mask_and_the_eval_pair_render(loss_on):
    seen: set[tuple[int, bool]] = set()

    def render(messages, add_generation_prompt):
        seen.add((len(messages), add_generation_prompt))
        return chat_text(messages) + ("assistant\n" if add_generation_prompt else "")

    for messages in (TWO_TURNS, TWO_TURNS[1:], CHAT[0]["messages"], CHAT[1]["messages"]):
        seen.clear()
        shapes.assistant_labels(messages, render, lambda text: [ord(c) for c in text], loss_on)
        shapes.eval_pair(messages, render)
        assert seen == shapes.renderings(messages, loss_on)


def test_a_template_that_rewrites_earlier_turns_cannot_be_masked():
    def render(messages, add_generation_prompt):
        # Like templates that hide earlier assistant turns' reasoning: a turn renders differently once more follow.
        parts = [
            f"<{m['role']}>{m['content'] if i == len(messages) - 1 or m['role'] != 'assistant' else '…'}"
            for i, m in enumerate(messages)
        ]
        return "".join(parts) + ("<assistant>" if add_generation_prompt else "")

    def tokenize(text):
        return [ord(c) for c in text]

    with pytest.raises(shapes.NotAPrefix, match="assistant turn 1"):
        shapes.assistant_labels(TWO_TURNS[1:], render, tokenize)
    ids, labels = shapes.assistant_labels(TWO_TURNS[1:], render, tokenize, "last_assistant")
    assert "".join(chr(t) for t, label in zip(ids, labels) if label != IGNORE_INDEX) == "2021"


# ---- template --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("empty", ["", "  ", None])
def test_template_collapses_an_empty_input_without_stray_separators(empty):
    reason, parts = shapes.check_template_row(
        {"instruction": "Normalise the date.", "input": empty, "output": "2021-03-05"}, ALPACA, "output", None
    )
    assert reason is None
    assert parts == {
        "prompt": "Below is an instruction.\n\n### Instruction:\nNormalise the date.\n\n### Response:",
        "response": "2021-03-05",
    }


def test_template_keeps_a_given_input_and_collapses_lines_too():
    row = {"instruction": "Normalise the date.", "input": "5 Mar 2021"}
    assert shapes.render_template(ALPACA, row) == (
        "Below is an instruction.\n\n### Instruction:\nNormalise the date.\n\n### Input:\n5 Mar 2021\n\n### Response:"
    )
    assert shapes.render_template("{instruction}\nContext: {input}\nAnswer:", {**row, "input": ""}) == (
        "Normalise the date.\nAnswer:"
    )
    assert shapes.render_template("{a} and {b}", {"a": "x", "b": ""}) == "x and"  # a mixed line stays


@pytest.mark.parametrize(
    "row, reason",
    [
        ({"instruction": "x", "output": "y"}, "missing_template_column"),
        ({"instruction": 3, "input": "", "output": "y"}, "wrong_type"),
        ({"instruction": "x", "input": ""}, "missing_field"),
        ({"instruction": "x", "input": "", "output": " "}, "empty"),
        ({"instruction": "", "input": None, "output": "y"}, "empty"),  # nothing left of the prompt
        (["x", "y"], "wrong_type"),
    ],
)
def test_template_row_reasons(row, reason):
    assert shapes.check_template_row(row, "{instruction}\n\n{input}", "output", None)[0] == reason


@pytest.mark.parametrize("blank", ["", "  ", None])
def test_a_template_row_whose_columns_are_all_blank_is_empty(blank):
    # It trained on a prompt of the template's fixed text alone ("Below is an instruction.\n\n### Response:").
    row = {"instruction": blank, "input": None, "output": "an answer to no question"}
    assert shapes.check_template_row(row, ALPACA, "output", None) == ("empty", {})
    assert shapes.check_template_row({**row, "input": "5 Mar 2021"}, ALPACA, "output", None)[0] is None


# ---- messages rows ---------------------------------------------------------------------------------------


def turns(*pairs) -> dict:
    return {"messages": [{"role": role, "content": content} for role, content in pairs]}


BAD_MESSAGES = {
    "missing_field": {"conversation": TWO_TURNS},
    "wrong_type": {"messages": "user: hi"},
    "empty_conversation": {"messages": []},
    "bad_turn": {"messages": [["user", "5 Mar 2021"], {"role": "assistant", "content": "2021-03-05"}]},
    "unknown_role": turns(("user", "5 Mar 2021"), ("robot", "2021-03-05")),
    "non_string_content": {"messages": [{"role": "user", "content": ["5 Mar 2021"]}, TWO_TURNS[2]]},
    "no_assistant_turn": turns(("system", SYSTEM), ("user", "5 Mar 2021")),
    # Without a system turn the stage failed as infrastructure: the first turn's prompt is an empty conversation.
    "no_user_turn": turns(("assistant", "Hello! How can I help?"), ("user", "5 Mar 2021"), ("assistant", "2021-03-05")),
    "empty": turns(("user", "5 Mar 2021"), ("assistant", " ")),
}


@pytest.mark.parametrize("reason", sorted(BAD_MESSAGES))
def test_messages_row_reasons(reason):
    assert shapes.check_messages(BAD_MESSAGES[reason], "messages") == (reason, [])


@pytest.mark.parametrize(
    "row, reason",
    [
        (turns(("user", "  "), ("assistant", "Paris.")), "empty"),  # a prompt that asks nothing
        (turns(("user", "hi"), ("assistant", " \n "), ("user", "hello?"), ("assistant", "Here.")), "empty"),  # a label
        (turns(("system", SYSTEM), ("assistant", "Hello! How can I help?")), "no_user_turn"),
        (turns(("user", "hi"), ("assistant", "Hello!"), ("user", " ")), None),  # cut after the last assistant turn
    ],
)
def test_a_blank_turn_or_an_assistant_turn_first_drops_the_conversation(row, reason):
    # Both trained: the labels taught a blank reply, and the eval prompt of an assistant-first row asked nothing.
    assert shapes.check_messages(row, "messages")[0] == reason


def test_auto_detection():
    assert shapes.resolve_shape("auto", CHAT[0], "messages", has_template=False) == "messages"
    assert shapes.resolve_shape("auto", {"input": "x", "output": "y"}, "messages", has_template=False) == "columns"
    assert shapes.resolve_shape("auto", {"instruction": "x"}, "messages", has_template=True) == "template"
    assert shapes.resolve_shape("auto", {"messages": "not a list"}, "messages", has_template=False) == "columns"
    assert shapes.resolve_shape("auto", {"chat": []}, "chat", has_template=True) == "messages"
    assert shapes.resolve_shape("columns", CHAT[0], "messages", has_template=False) == "columns"


def test_config_ties_the_template_to_its_shape():
    from tuneproof.core.config import ConfigError, validate

    with pytest.raises(ConfigError, match="shape template needs template.prompt"):
        validate({"data": {"shape": "template"}})
    with pytest.raises(ConfigError, match="template is set but shape is 'messages'"):
        validate({"data": {"shape": "messages", "template": {"prompt": "{x}"}}})
    with pytest.raises(ConfigError, match="data.template.prompt: prompt must name at least one column"):
        validate({"data": {"template": {"prompt": "no columns"}}})


# ---- the stage: bad rows by reason, the manifest, the content hash -------------------------------------------


def write_jsonl(path: Path, rows: list, raw_lines: Sequence[bytes] = ()) -> Path:
    path.write_bytes(b"\n".join([json.dumps(r).encode() for r in rows] + list(raw_lines)) + b"\n")
    return path


def config(root: Path, model_dir: Path, source: Path, **data) -> PipelineConfig:
    return PipelineConfig.model_validate(
        {
            "storage": {"root": str(root)},
            "model": {"source": str(model_dir)},
            "data": {"name": "shapes", "source": str(source), "max_seq_len": 96, **data},
        }
    )


def prepare(cfg: PipelineConfig):
    return prepare_data(JobContext("run-1", "data", cfg))


# Like many real templates: a system turn anywhere but first is refused.
SYSTEM_FIRST_GUARD = (
    "{%- for message in messages %}{%- if message['role'] == 'system' and not loop.first %}"
    "{{- raise_exception('System role only as the first message') }}{%- endif %}{%- endfor %}"
)


@pytest.fixture(scope="module")
def strict_template_dir(tiny_dir, tmp_path_factory) -> Path:
    """The tiny model with a chat template that, like many real ones, rejects a system turn after the first."""
    model = tmp_path_factory.mktemp("strict") / "model"
    shutil.copytree(tiny_dir, model)
    template = (model / "chat_template.jinja").read_text()
    (model / "chat_template.jinja").write_text(SYSTEM_FIRST_GUARD + template)
    return model


def test_each_bad_messages_row_is_counted_by_reason(tmp_path, strict_template_dir):
    bad = [*BAD_MESSAGES.values(), turns(("user", "5 Mar 2021"), ("system", SYSTEM), ("assistant", "2021-03-05"))]
    bad += [turns(("user", "5 Mar 2021 " * 40), ("assistant", "2021-03-05")), {"messages": NEWLINE_FIRST}]
    source = write_jsonl(tmp_path / "chat.jsonl", CHAT[:40] + bad, [b'{"messages": [}'])
    summary = prepare(config(tmp_path / "store", strict_template_dir, source, max_dropped_fraction=0.5))
    counted = {reason: drop.count for reason, drop in summary.manifest.dropped.items()}
    assert counted == dict.fromkeys([*BAD_MESSAGES, "template_rejected", "too_long", "not_a_prefix", "undecodable"], 1)
    rejected = summary.manifest.dropped["template_rejected"].examples[0]
    assert rejected.row == 49 and "System role only as the first message" in rejected.value  # the template's own words
    assert summary.manifest.shape == "messages" and summary.total_rows == 53


def test_too_many_bad_conversations_fail_the_stage_naming_the_reasons(tmp_path, tiny_dir):
    source = write_jsonl(tmp_path / "chat.jsonl", CHAT[:20] + [BAD_MESSAGES["no_assistant_turn"]] * 5)
    with pytest.raises(
        StageFailure,
        match=r"20.0% of rows dropped \(over data.max_dropped_fraction 5.0%\): no_assistant_turn=5 of 25 rows",
    ):
        prepare(config(tmp_path / "store", tiny_dir, source))


def test_alpaca_rows_with_empty_inputs_prepare_through_the_template(tmp_path, tiny_dir):
    rows = [
        {"instruction": "Normalise the date.", "input": r["input"] if i % 2 else "", "output": r["output"]}
        for i, r in enumerate(json.loads(line) for line in DEFAULT_DATA.read_text().splitlines()[:60])
    ]
    blank = {"instruction": " ", "input": None, "output": "an answer to no question"}  # the template's text alone
    source = write_jsonl(tmp_path / "alpaca.jsonl", [*rows, {"instruction": "x", "output": "y"}, blank])
    cfg = config(
        tmp_path / "store", tiny_dir, source, template={"prompt": ALPACA}, max_dropped_fraction=0.1, max_seq_len=192
    )
    summary = prepare(cfg)
    manifest = summary.manifest
    assert manifest.shape == "template" and manifest.loss_on is None
    assert manifest.template_sha256 == sha256_json({"prompt": ALPACA, "response": "output"})
    assert {r: d.count for r, d in manifest.dropped.items()} == {"missing_template_column": 1, "empty": 1}
    eval_rows = read_split(Storage(cfg.storage.root), summary.dataset_path, "eval").to_pylist()
    assert len(eval_rows) == 6
    for row in eval_rows:
        user = row["prompt"].split("<|im_start|>user\n")[1].split("<|im_end|>")[0]
        assert "\n\n\n" not in user and user.endswith("### Response:")
        assert ("### Input:" in user) == (user.count("\n\n") == 3)  # the input paragraph, or no trace of it


def test_manifest_records_the_shape_and_the_hash_covers_it(tmp_path, tiny_dir):
    chat = write_jsonl(tmp_path / "chat.jsonl", CHAT[:40])
    store = tmp_path / "store"
    auto = prepare(config(store, tiny_dir, chat))
    assert (auto.manifest.shape, auto.manifest.loss_on, auto.manifest.template_sha256) == (
        "messages",
        "all_assistant",
        None,
    )
    assert prepare(config(store, tiny_dir, chat, shape="messages")).cache_hit  # auto resolved: the same dataset
    last = prepare(config(store, tiny_dir, chat, loss_on="last_assistant"))
    assert last.content_hash != auto.content_hash and last.manifest.loss_on == "last_assistant"

    # Distinct rows: 20 copies of one row would put the eval items in the training split (contamination).
    rows = [{"instruction": f"a b {i}", "input": "", "output": f"c {i}"} for i in range(20)]
    columns = write_jsonl(tmp_path / "cols.jsonl", rows)
    templated = [
        prepare(config(store, tiny_dir, columns, template={"prompt": p})).content_hash
        for p in ("{instruction}\n\n{input}", "{instruction}\n{input}")
    ]
    plain = prepare(config(store, tiny_dir, columns, fields={"prompt": "instruction", "response": "output"}))
    assert len({*templated, plain.content_hash}) == 3 and plain.manifest.shape == "columns"


def test_columns_content_hash_is_unchanged_by_shapes():
    legacy = sha256_json(
        {
            "prep_version": datahash.PREP_VERSION,
            "source": "a",
            "eval_source": None,
            "fields": {"prompt": "input", "response": "output", "system": None},
            "system_prompt": None,
            "tokenizer": "t",
            "settings": {"max_seq_len": 64},
        }
    )
    fields = {"prompt": "input", "response": "output", "system": None}
    assert datahash.content_hash("a", None, fields, None, "t", {"max_seq_len": 64}) == legacy
    assert shapes.shape_identity("columns", None, "messages", "all_assistant") is None


@pytest.mark.usefixtures("base_model")  # built once a session: ensure_tiny_model copies it
def test_local_profile_dates_content_hash_is_pinned(tmp_path):
    """configs/local.yaml's dataset, without its data.replay, keeps the hash it had before shapes (and before
    replay): prepared dates stay cache hits, and a dataset that mixes in no replay file keeps its identity.

    Run as the job runs, without the test session's HF_HUB_OFFLINE: transformers writes local_files_only
    into the saved tokenizer_config.json that the tokenizer hash covers, so the variable moves the hash.
    """
    model = tmp_path / "tiny-qwen2"
    ensure_tiny_model(model)  # what `tuneproof local up` builds
    cfg = load_config(
        PROJECT_ROOT / "configs" / "local.yaml",
        [f"storage.root={tmp_path / 'store'}", f"model.source={model}", "data.replay=null"],
    )
    result = run_data_job(cfg, "run-pin", offline=False)
    assert result["summary"]["content_hash"] == LOCAL_DATES_HASH and result["summary"]["manifest"]["shape"] == "columns"


def run_data_job(cfg: PipelineConfig, run_id: str, offline: bool = True) -> dict:
    """The data stage through its job entrypoint, as a Ray job runs it; returns its result.json."""
    env = {**os.environ, ENV_VAR: encode_job(run_id, "data", cfg)}
    if not offline:
        for name in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"):
            env.pop(name, None)
    proc = run_job_module("training.data_prep", env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return Storage(cfg.storage.root).read_json("runs", run_id, "stages", "data", "result.json")


# ---- the bundled datasets ---------------------------------------------------------------------------------


@pytest.mark.parametrize("task", ["dates", "chat", "alpaca"])
def test_committed_file_is_the_generators_output(task: str):
    generator = runpy.run_path(str(PROJECT_ROOT / "data" / task / f"make_{task}.py"))
    assert (PROJECT_ROOT / "data" / task / f"{task}.jsonl").read_text() == generator["render"](
        generator["make_rows"]()
    ), f"regenerate: python data/{task}/make_{task}.py > data/{task}/{task}.jsonl"


# ---- the bundled chat example ------------------------------------------------------------------------------


def test_chat_conversations_end_on_a_follow_up_answered_by_the_iso_date():
    assert len(CHAT) == 3000
    for row in CHAT:
        messages = row["messages"]
        assert [m["role"] for m in messages] in (["user", "assistant"] * 2, ["user", "assistant"] * 3)
        iso, question, answer = messages[1]["content"], messages[-2]["content"], messages[-1]["content"]
        year, month, day = iso.split("-")
        assert answer == {"year?": year, "month?": month, "day?": day}[question]


def test_local_chat_profile_reads_messages_and_gates_on_exact_match():
    cfg = load_config(PROJECT_ROOT / "configs" / "local-chat.yaml")
    assert (cfg.data.shape, cfg.data.source) == ("messages", str(CHAT_DATA))
    assert cfg.eval.gates["exact_match"].min == 0.8 and cfg.model.name != load_config().model.name
    # LoRA on the pre-trained tiny base trains the adapters only, as on any pre-trained Qwen: the frozen
    # tied embedding no longer caps the logits (measured in configs/local-chat.yaml's comment).
    assert cfg.train.method == "lora" and cfg.train.lora.modules_to_save == []


def test_every_bundled_local_profile_recovers_a_lost_worker_as_the_eks_profile_does():
    for name in ("local.yaml", "local-chat.yaml", "local-alpaca.yaml", "eks.yaml"):
        assert load_config(PROJECT_ROOT / "configs" / name).train.max_failures >= 1, name


# ---- the bundled Alpaca-style example -------------------------------------------------------------------


def test_half_the_alpaca_rows_have_an_empty_input_and_every_row_names_its_date_once():
    assert len(ALPACA_ROWS) == 3000 and sum(row["input"] == "" for row in ALPACA_ROWS) == 1500
    for row in ALPACA_ROWS:
        year = row["output"][:4]
        assert (year in row["instruction"]) != (year in row["input"]), row  # the date is in exactly one column


def test_local_alpaca_profile_renders_instruction_and_input_through_its_template():
    cfg = load_config(PROJECT_ROOT / "configs" / "local-alpaca.yaml")
    assert (cfg.data.shape, cfg.data.source) == ("template", str(ALPACA_DATA))
    assert cfg.data.template is not None and shapes.template_columns(cfg.data.template.prompt) == [
        "instruction",
        "input",
    ]
    assert cfg.train.method == "full" and cfg.eval.gates["exact_match"].min_improvement == 0.5
    assert cfg.model.name not in (
        load_config().model.name,
        load_config(PROJECT_ROOT / "configs" / "local-chat.yaml").model.name,
    )


# ---- integration: the data job, a short fine-tune and the evaluate job on the chat data --------------------


def short_run_config(profile: str, rows: list[dict], tmp_path: Path, steps: int, examples: int) -> PipelineConfig:
    """A bundled profile cut to a few steps on its own storage, a fresh tiny model and the given rows."""
    model = tmp_path / "tiny-qwen2"
    ensure_tiny_model(model)
    return load_config(
        PROJECT_ROOT / "configs" / profile,
        [
            f"storage.root={tmp_path / 'store'}",
            f"model.source={model}",
            f"data.source={write_jsonl(tmp_path / 'rows.jsonl', rows)}",
            f"train.max_steps={steps}",
            "train.warmup_steps=2",  # the profile's 20 would take every step (refused)
            f"train.checkpoint_every={steps // 2}",
            "train.micro_batch_size=8",
            "train.log_every=4",
            "resume.enabled=false",
            f"eval.max_examples={examples}",
            "eval.gates={exact_match: {min: 0.0}}",
            "eval.max_truncated_fraction=1.0",  # a few steps need not teach the end of an answer: counted, not capped
        ],
    )


def fine_tune_on(ray_head, cfg: PipelineConfig, run_id: str, dataset: str):
    """The fine-tune's body as its job runs it, through a driver on the test's Ray head."""
    from tests.conftest import ray_driver
    from training.finetune import finetune

    runtime_env = {"env_vars": {"PYTHONPATH": str(PROJECT_ROOT), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}}
    with ray_driver(ray_head, runtime_env=runtime_env):
        return finetune(JobContext(run_id, "finetune", cfg, {"dataset": dataset}))


@pytest.mark.integration
def test_chat_data_job_then_fine_tune_and_evaluate_read_it(ray_head, tmp_path):
    from eval.evaluate_job import evaluate_body

    cfg = short_run_config("local-chat.yaml", CHAT[:400], tmp_path, steps=8, examples=32)  # 400 rows: a quicker job
    result = run_data_job(cfg, "run-chat")
    storage = Storage(cfg.storage.root)
    data = result["summary"]
    assert result["status"] == "succeeded" and data["manifest"]["shape"] == "messages"
    assert (data["manifest"]["splits"]["train"]["rows"], data["manifest"]["splits"]["eval"]["rows"]) == (360, 40)
    assert data["dropped"] == {}

    trained = fine_tune_on(ray_head, cfg, "run-chat", data["dataset_path"])
    assert trained.steps == 8 and len(trained.loss_curve) >= 2

    evaluated = evaluate_body(
        JobContext("run-chat", "evaluate", cfg, {"candidate": "runs/run-chat/model", "dataset": data["dataset_path"]})
    )
    assert evaluated.examples == 32 and evaluated.gates.passed
    predictions = [
        json.loads(line)
        for line in storage.read_bytes("runs", "run-chat", "stages", "evaluate", "predictions.jsonl").splitlines()
    ]
    for row in predictions:
        # The prompt is the conversation up to the last assistant turn; the reference is that turn (a follow-up).
        assert (
            row["prompt"].endswith("?<|im_end|>\n<|im_start|>assistant\n")
            and row["prompt"].count("<|im_start|>assistant") >= 2
        )
        assert row["reference"].isdigit() and len(row["reference"]) in (2, 4)


@pytest.mark.integration
def test_alpaca_rows_half_without_input_train_through_the_template_and_beat_the_base(ray_head, tmp_path):
    """The committed Alpaca-style file through the data job, a short full fine-tune and the evaluate job:
    the fine-tuned model's held-out loss beats the base model's, and an empty input left no trace in a prompt."""
    from eval.evaluate_job import evaluate_body

    cfg = short_run_config("local-alpaca.yaml", ALPACA_ROWS[:400], tmp_path, steps=12, examples=40)
    result = run_data_job(cfg, "run-alpaca")
    data = result["summary"]
    assert result["status"] == "succeeded" and data["manifest"]["shape"] == "template"
    assert cfg.data.template is not None
    assert data["manifest"]["template_sha256"] == sha256_json(cfg.data.template.model_dump())
    assert (data["manifest"]["splits"]["train"]["rows"], data["manifest"]["splits"]["eval"]["rows"]) == (360, 40)
    assert data["dropped"] == {}

    trained = fine_tune_on(ray_head, cfg, "run-alpaca", data["dataset_path"])
    assert trained.steps == 12 and trained.loss_curve[-1][1] < trained.loss_curve[0][1]

    evaluated = evaluate_body(
        JobContext(
            "run-alpaca", "evaluate", cfg, {"candidate": "runs/run-alpaca/model", "dataset": data["dataset_path"]}
        )
    )
    candidate, base = evaluated.models["candidate"], evaluated.models["base"]
    assert candidate is not None and base is not None
    # Held-out loss on the eval split: twelve steps already move it well below the random base's.
    assert present(candidate.metrics["eval_loss"]) < 0.9 * present(base.metrics["eval_loss"]), (
        candidate.metrics,
        base.metrics,
    )

    storage = Storage(cfg.storage.root)
    predictions = [
        json.loads(line)
        for line in storage.read_bytes("runs", "run-alpaca", "stages", "evaluate", "predictions.jsonl").splitlines()
    ]
    with_input = [row for row in predictions if "### Input:\n" in row["prompt"]]
    assert 0 < len(with_input) < len(predictions)  # both halves are in the held-out split
    for row in predictions:
        assert "\n\n\n" not in row["prompt"] and "### Input:\n\n" not in row["prompt"]
