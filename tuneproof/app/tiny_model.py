"""Create the tiny local base model: a Qwen2-shaped causal LM with a tokenizer trained on the task.

    python -m tuneproof.app.tiny_model OUT_DIR [--data data/dates/dates.jsonl] [--seed 0]

`tuneproof local up` calls `ensure_tiny_model` to create .tuneproof/base-models/tiny-qwen2. Nothing is
downloaded: the tokenizer is trained here with the `tokenizers` library, the weights start random
(seeded) and are then pre-trained on the bundled general skills (tuneproof/app/tiny_base.py), so the
base knows something a fine-tune can lose, and scores 0 on the date task: any gain there is the
fine-tune's. The build is cached by its content hash (the recipe, the model's shape, the tokenizer
corpus and the skills data) under BASE_CACHE and copied into place; base.json in the model directory
names the hash, the recipe and the skills' scores at build time.

The tokenizer follows Qwen2's design at toy size: byte-level BPE over Qwen2's pre-tokenizer split,
which keeps every digit its own token (the task is copying and reordering digits), while words
such as month names and the system prompt merge into single tokens. That keeps a whole chat
(system prompt, date, answer) within 64 tokens; a purely character-level vocabulary needs about 110.
The output is deterministic given the corpus and the seed.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import shutil
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from tuneproof.app.tiny_base import SkillsRecipe, content_hash, pretrain, suite_scores
from tuneproof.core.config import PROJECT_ROOT

ENDOFTEXT, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = [ENDOFTEXT, IM_START, IM_END]

# Qwen2's pre-tokenizer pattern: words with one leading space, single digits, punctuation runs.
QWEN2_SPLIT = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen's ChatML layout, without Qwen2.5's injected default system prompt.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

DEFAULT_DATA = PROJECT_ROOT / "data" / "dates" / "dates.jsonl"
BASE_CACHE = PROJECT_ROOT / ".tuneproof" / "base-models" / "cache"
"""Built bases by content hash: a second `local up` (or a test session) copies one instead of training."""
BASE_FACTS = "base.json"
MODEL_FILES = ("config.json", "model.safetensors", "tokenizer.json", BASE_FACTS)


def build_tiny_model(
    out_dir: str | Path,
    corpus: Iterable[str],
    hidden: int = 64,
    layers: int = 2,
    seed: int = 0,
    vocab_size: int = 512,
    recipe: SkillsRecipe | None = None,
    base_hash: str | None = None,
) -> Path:
    """Write tokenizer + Qwen2 config + safetensors weights to out_dir (replacing it whole): random
    (seeded), or with `recipe` pre-trained on the skills and base.json written (naming `base_hash`).

    vocab_size caps the BPE vocabulary (256 bytes + 3 special tokens + merges); 259 gives a pure
    byte/character-level tokenizer.
    """
    out_dir = Path(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:
        tokenizer = train_tokenizer(corpus, vocab_size)
        tokenizer.save_pretrained(staging)
        model = init_model(tokenizer, hidden, layers, seed)
        if recipe is not None:
            facts = pretrained_facts(model, tokenizer, recipe, base_hash)
            (staging / BASE_FACTS).write_text(json.dumps(facts, indent=2, sort_keys=True) + "\n")
        model.save_pretrained(staging, safe_serialization=True)
        # Written in a staging dir and moved into place, so a half-built model is never picked up.
        # mkdtemp (and the safetensors writer) make files private; Ray workers and uploads read them.
        staging.chmod(0o755)
        for file in staging.iterdir():
            file.chmod(0o644)
        if out_dir.exists():
            shutil.rmtree(out_dir)
        staging.rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return out_dir


def pretrained_facts(model, tokenizer, recipe: SkillsRecipe, base_hash: str | None) -> dict:
    """Pre-train `model` in place; what base.json says about it: hash, recipe, losses, suite scores, seconds."""
    began = time.perf_counter()
    losses = pretrain(model, tokenizer, recipe, PROJECT_ROOT)
    seconds = time.perf_counter() - began
    return {
        "content_hash": base_hash,
        "recipe": recipe.to_json(),
        "losses": losses,
        "skills_exact_match": suite_scores(model, tokenizer, PROJECT_ROOT / "data" / "skills" / "suites"),
        "train_seconds": round(seconds, 1),
    }


def train_tokenizer(corpus: Iterable[str], vocab_size: int = 512):
    """Train byte-level BPE on the corpus and wrap it as Qwen's own tokenizer class with the chat template.

    Qwen2Tokenizer rebuilds its pipeline (NFC, Qwen2's split, byte level) from vocab + merges when
    loaded, so training uses the very same pipeline: what is trained is what loads.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import Qwen2Tokenizer

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # The full byte alphabet, so text the corpus never showed still encodes without an unknown token.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    trained = json.loads(tok.to_str())["model"]
    return Qwen2Tokenizer(
        vocab=trained["vocab"],
        # tokenizers writes merges as [a, b] pairs (older releases: "a b" strings).
        merges=[tuple(m.split(" ") if isinstance(m, str) else m) for m in trained["merges"]],  # type: ignore[misc]
        unk_token=None,  # type: ignore[arg-type]  # byte-level BPE covers every byte: no unknown token
        eos_token=IM_END,
        pad_token=ENDOFTEXT,
        additional_special_tokens=[IM_START],
        chat_template=CHAT_TEMPLATE,
        model_max_length=256,
        clean_up_tokenization_spaces=False,
    )


def init_model(tokenizer, hidden: int = 64, layers: int = 2, seed: int = 0):
    """A randomly initialised Qwen2ForCausalLM sized to the tokenizer, seeded without touching global RNG."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    )
    return model


def conversation_text(system: str | None, prompt: str, response: str) -> str:
    """The chat as the tokenizer will see it, minus the special tokens (which are never merged)."""
    head = f"system\n{system}\n" if system else ""
    return f"{head}user\n{prompt}\nassistant\n{response}\n"


def task_corpus(data_path: str | Path, system_prompt: str | None) -> Iterator[str]:
    """Training text for the tokenizer: every row of a JSONL task file rendered as a conversation."""
    with open(data_path, encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                yield conversation_text(system_prompt, row["input"], row["output"])


def ensure_tiny_model(
    out_dir: str | Path, data_path: str | Path = DEFAULT_DATA, seed: int = 0, recipe: SkillsRecipe = SkillsRecipe()
) -> bool:
    """Put the pre-trained tiny base at out_dir unless the one there has this build's content hash; True
    when it was (re)placed. Built once per hash into BASE_CACHE, then copied from there."""
    from tuneproof.core.config_data import DataConfig

    out_dir = Path(out_dir)
    key = content_hash(recipe, {"hidden": 64, "layers": 2, "seed": seed}, [Path(data_path), PROJECT_ROOT / recipe.data])
    if built_hash(out_dir) == key:
        return False
    cached = BASE_CACHE / key
    with building(cached):
        if built_hash(cached) != key:
            build_tiny_model(
                cached, task_corpus(data_path, DataConfig().system_prompt), seed=seed, recipe=recipe, base_hash=key
            )
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=out_dir.parent, prefix=f".{out_dir.name}-"))
    try:  # copied beside the target and renamed into place: a half-copied base is never picked up
        shutil.copytree(cached, staging / "model")
        if out_dir.exists():
            shutil.rmtree(out_dir)
        (staging / "model").rename(out_dir)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return True


@contextlib.contextmanager
def building(cached: Path) -> Iterator[None]:
    """One process at a time builds (or checks) a cached base: a second one (two `local up`s, the two pytest
    processes of `make test`) waits under an flock on a sidecar file, then finds it built and copies it,
    instead of training it again into the same files as the first writes them."""
    cached.parent.mkdir(parents=True, exist_ok=True)
    with open(cached.with_name(cached.name + ".lock"), "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # said once, so a wait of a minute is not mistaken for a hang
            print(
                f"waiting for another process's build of the tiny base {cached.name[:12]} ({lock.name})",
                file=sys.stderr,
            )
            fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def built_hash(model_dir: Path) -> str | None:
    """The content hash a complete model directory's base.json names; None when absent or incomplete."""
    if not all((model_dir / name).exists() for name in MODEL_FILES):
        return None
    try:
        return json.loads((model_dir / BASE_FACTS).read_text()).get("content_hash")
    except (OSError, ValueError, AttributeError):
        return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Create the tiny Qwen2 base model and its tokenizer.")
    parser.add_argument("out_dir")
    parser.add_argument("--data", default=str(DEFAULT_DATA), help="JSONL task file the tokenizer is trained on")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    created = ensure_tiny_model(args.out_dir, args.data, args.seed)
    print(f"{'created' if created else 'already present'}: {args.out_dir}")


if __name__ == "__main__":
    main()
