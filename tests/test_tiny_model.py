"""The locally created base model: shape, tokenizer, chat template, determinism, and that the task fits."""

from __future__ import annotations

import hashlib
import itertools
import json
from pathlib import Path

import pytest

from training.modeling import load_config, load_model, load_tokenizer
from tuneproof.app.tiny_model import (
    CHAT_TEMPLATE,
    DEFAULT_DATA,
    ENDOFTEXT,
    IM_END,
    build_tiny_model,
    ensure_tiny_model,
    main,
    task_corpus,
)
from tuneproof.core.config_data import DataConfig

# A system turn exercises the whole chat template (the demo profile sends none).
SYSTEM = "Rewrite the date in ISO 8601 (YYYY-MM-DD)."


def small_corpus(rows: int = 300):
    return list(itertools.islice(task_corpus(DEFAULT_DATA, SYSTEM), rows))


def file_hashes(directory: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(directory.iterdir())}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", small_corpus())


def test_build_is_deterministic_and_seed_changes_only_weights(tiny_dir, tmp_path):
    again = file_hashes(build_tiny_model(tmp_path / "again", small_corpus()))
    other_seed = file_hashes(build_tiny_model(tmp_path / "seed1", small_corpus(), seed=1))
    first = file_hashes(tiny_dir)
    assert again == first
    assert other_seed["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other_seed.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }


def test_config_is_a_tiny_tied_qwen2(tiny_dir):
    config, tokenizer = load_config(str(tiny_dir)), load_tokenizer(str(tiny_dir))
    assert (config.model_type, config.num_hidden_layers, config.hidden_size) == ("qwen2", 2, 64)
    assert (config.num_attention_heads, config.num_key_value_heads, config.intermediate_size) == (4, 2, 128)
    assert config.max_position_embeddings == 256 and config.tie_word_embeddings is True
    assert config.vocab_size == len(tokenizer)
    assert config.eos_token_id == tokenizer.convert_tokens_to_ids(IM_END)
    assert config.pad_token_id == tokenizer.convert_tokens_to_ids(ENDOFTEXT)
    assert (tiny_dir / "model.safetensors").exists() and not list(tiny_dir.glob("*.bin"))


def test_tokenizer_speaks_chatml_and_round_trips(tiny_dir):
    tok = load_tokenizer(str(tiny_dir))
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Friday, March 5, 2021"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        f"<|im_start|>system\n{SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nFriday, March 5, 2021<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.chat_template == CHAT_TEMPLATE
    assert (tok.eos_token, tok.pad_token) == (IM_END, ENDOFTEXT)
    ids = tok(prompt + "2021-03-05<|im_end|>", add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == prompt + "2021-03-05<|im_end|>"
    # Digits stay single tokens (the task copies them); special tokens are single tokens too.
    assert tok.convert_ids_to_tokens(tok("2021-03-05", add_special_tokens=False)["input_ids"]) == list("2021-03-05")
    assert tok("<|im_start|>", add_special_tokens=False)["input_ids"] == [tok.convert_tokens_to_ids("<|im_start|>")]
    # Text the corpus never showed still encodes (byte level), with no unknown token.
    odd = "Ünïcödé 日付"
    assert tok.decode(tok(odd, add_special_tokens=False)["input_ids"]) == odd


def test_untrained_model_generates_from_a_prompt(tiny_dir):
    import torch
    from transformers import GenerationMixin

    tok, model = load_tokenizer(str(tiny_dir)), load_model(str(tiny_dir))
    batch = tok(
        ["<|im_start|>user\n5 Mar 2021<|im_end|>\n<|im_start|>assistant\n"],
        return_tensors="pt",
        add_special_tokens=False,
    )
    assert isinstance(model, GenerationMixin)  # AutoModelForCausalLM's class: it generates
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=4, do_sample=False)
    assert out.shape[1] <= batch["input_ids"].shape[1] + 4


def test_ensure_creates_once_and_bundled_task_fits_max_seq_len(tmp_path, capsys):
    """The model `tuneproof local up` creates: every bundled row, as a full chat, fits data.max_seq_len."""
    out = tmp_path / "tiny-qwen2"
    main([str(out)])
    assert "created" in capsys.readouterr().out
    assert ensure_tiny_model(out) is False
    tok = load_tokenizer(str(out))
    rows = [json.loads(line) for line in DEFAULT_DATA.read_text().splitlines()]
    demo = DataConfig()  # the chat the demo trains on: its system prompt (none by default) and limit
    system = [{"role": "system", "content": demo.system_prompt}] if demo.system_prompt else []
    lengths = [
        len(
            tok(
                tok.apply_chat_template(
                    [
                        *system,
                        {"role": "user", "content": row["input"]},
                        {"role": "assistant", "content": row["output"]},
                    ],
                    tokenize=False,
                ),
                add_special_tokens=False,
            )["input_ids"]
        )
        for row in rows
    ]
    assert len(lengths) == 3000
    assert max(lengths) <= demo.max_seq_len, f"longest chat is {max(lengths)} tokens"
