"""Pre-train the tiny base on the bundled general skills, so the demo fine-tunes a model that knows something.

    python -m tuneproof.app.tiny_model OUT_DIR     (builds the tokenizer, then calls `pretrain` here)

The skills are data/skills/train.jsonl (data/skills/make_skills.py writes it): adding small numbers,
spelling a word backwards, the capital of a country in a bundled table. Each row becomes the same ChatML
chat the data stage renders (user turn, assistant turn, loss on the answer), and one process trains on
them with AdamW under a warmup + cosine schedule. Everything is seeded and the intra-op thread count is
fixed, so on one machine the same inputs give the same weights. `SkillsRecipe` is the how-it-was-made the
base's card carries; `content_hash` names it: the recipe, the tokenizer corpus and the skills data, so a
build is reused (tiny_model.ensure_tiny_model's cache) exactly while none of them changed.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

from tuneproof.core.hashing import IGNORE_INDEX

RECIPE_VERSION = 2
"""Bumped when the training code below changes what a recipe produces (2: rows of unseen tokens stay at init)."""


@dataclass(frozen=True)
class SkillsRecipe:
    """How the tiny base is pre-trained; recorded whole in base.json and the model card."""

    steps: int = 900
    batch_size: int = 64
    lr: float = 3e-3
    warmup_steps: int = 30
    weight_decay: float = 0.0
    seed: int = 0
    threads: int = 1
    """torch intra-op threads during the build: fixed, since CPU reductions may split work by thread count.
    One: on a shared machine two threads that wait for each other spin (30 steps took 195 s with two
    against 17 s with one at a load of 30 on 2 cores), and a model this small gains little from a second."""
    data: str = "data/skills/train.jsonl"
    version: int = RECIPE_VERSION

    def to_json(self) -> dict:
        return asdict(self)


def skills_rows(path: Path) -> list[dict[str, str]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def content_hash(recipe: SkillsRecipe, model_shape: dict, corpus_files: list[Path]) -> str:
    """sha256 over the recipe, the model's shape and the bytes of every input file, in order. Pure but for reads."""
    digest = hashlib.sha256(json.dumps({"recipe": recipe.to_json(), "shape": model_shape}, sort_keys=True).encode())
    for path in corpus_files:
        digest.update(b"\0" + hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def encode_chat(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """(input_ids, labels) of one user/assistant chat; labels -100 on the prompt and the generation prompt."""
    user = [{"role": "user", "content": prompt}]
    head = tokenizer.apply_chat_template(user, tokenize=False, add_generation_prompt=True)
    full = tokenizer.apply_chat_template([*user, {"role": "assistant", "content": answer}], tokenize=False)
    head_ids = tokenizer(head, add_special_tokens=False)["input_ids"]
    # What follows the end-of-turn token is a newline, not something to learn to generate (as the data stage).
    answer_ids = tokenizer(full[len(head) :].rstrip(), add_special_tokens=False)["input_ids"]
    return head_ids + answer_ids, [IGNORE_INDEX] * len(head_ids) + answer_ids


def lr_at(step: int, recipe: SkillsRecipe) -> float:
    """Linear warmup, then cosine to a tenth of the peak. Pure."""
    if step <= recipe.warmup_steps:
        return recipe.lr * step / recipe.warmup_steps
    progress = (step - recipe.warmup_steps) / max(recipe.steps - recipe.warmup_steps, 1)
    return recipe.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


@contextmanager
def fixed_threads(n: int) -> Iterator[None]:
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def pretrain(model, tokenizer, recipe: SkillsRecipe, root: Path) -> list[float]:
    """Train `model` in place on the recipe's skills; returns the loss every 100 steps (and the last)."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    examples = [encode_chat(tokenizer, row["input"], row["output"]) for row in skills_rows(root / recipe.data)]
    frozen = freeze_unseen_rows(model, {token for ids, _ in examples for token in ids})
    rng = np.random.default_rng(recipe.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=recipe.lr, weight_decay=recipe.weight_decay)
    losses = []
    model.train()
    with fixed_threads(recipe.threads), torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        for step in range(1, recipe.steps + 1):
            batch = padded([examples[i] for i in rng.choice(len(examples), recipe.batch_size, replace=False)])
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step, recipe)
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten())
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step % 100 == 0 or step == recipe.steps:
                losses.append(round(float(loss.detach()), 4))
    frozen.remove()
    model.eval()
    return losses


def freeze_unseen_rows(model, seen: set[int]):
    """Zero the gradient of every embedding row (tied: every head row) of a token the skills never contain.

    A token absent from the data only ever gets the softmax's "not this one" push, and Adam scales that
    tiny, constant gradient up to full-size steps: in a 900-step build all 287 such tokens of the date
    tokenizer (every month name, "-", "/") drifted onto one shared direction (mean pairwise cosine 0.96,
    norm 0.16 -> 0.76), so the fine-tune first had to pull them apart, and the demo stopped at 0.84 exact
    match. Kept at their (seeded, distinct) init they are what a real base's rare tokens are: untrained,
    not collapsed. Adam never moves a parameter whose gradient has always been zero."""
    import torch

    weight = model.get_input_embeddings().weight
    mask = torch.zeros(weight.shape[0], 1, dtype=weight.dtype)
    mask[sorted(seen)] = 1.0
    return weight.register_hook(lambda grad: grad * mask)  # the handle: pretrain removes it when done


def padded(examples: list[tuple[list[int], list[int]]], pad_id: int = 0) -> dict:
    """Right-padded input_ids, labels (-100 on padding) and attention_mask."""
    import torch

    width = max(len(ids) for ids, _ in examples)
    batch = {
        "input_ids": torch.full((len(examples), width), pad_id),
        "labels": torch.full((len(examples), width), IGNORE_INDEX),
        "attention_mask": torch.zeros((len(examples), width), dtype=torch.long),
    }
    for row, (ids, labels) in enumerate(examples):
        batch["input_ids"][row, : len(ids)] = torch.tensor(ids)
        batch["labels"][row, : len(ids)] = torch.tensor(labels)
        batch["attention_mask"][row, : len(ids)] = 1
    return batch


def suite_scores(model, tokenizer, suites_dir: Path, max_new_tokens: int = 12) -> dict[str, float]:
    """Exact match of greedy answers on each suites/<skill>.jsonl (items: id, input, output)."""
    return {
        path.stem: exact_match(model, tokenizer, skills_rows(path), max_new_tokens)
        for path in sorted(suites_dir.glob("*.jsonl"))
    }


def exact_match(model, tokenizer, items: list[dict[str, str]], max_new_tokens: int) -> float:
    import torch

    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": x["input"]}], tokenize=False, add_generation_prompt=True
        )
        for x in items
    ]
    tokenizer.padding_side = "left"
    batch = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.no_grad():
        out = model.generate(**batch, max_new_tokens=max_new_tokens, do_sample=False)
    answers = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(a.strip() == x["output"] for a, x in zip(answers, items)) / len(items)
