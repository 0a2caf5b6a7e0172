"""Batched greedy generation and eval loss for one model over the eval split (inside the evaluate job).

CPU in fp32 here, one GPU in bf16 on EKS (`pick_device`). The prompts are the data stage's `prompt`
column: chat-templated text that already ends with the assistant turn's opening, so they are
tokenized without adding special tokens again. Generation pads on the left (every row's prompt ends
where its answer starts); the loss batches pad on the right with labels -100, which the loss skips.

Answers are greedy under the evaluation's own settings alone: the model's own generation settings
(generation_config.json: sampling, repetition_penalty, no_repeat_ngram_size, suppress_tokens, bad_words_ids,
min_new_tokens, ...) are ignored for scoring. Each would change a greedy answer (suppress_tokens=['5'] turns
'2024-01-05' into '2024-01-0') and the change would read as the model's.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tuneproof.core.hashing import IGNORE_INDEX

if TYPE_CHECKING:
    from transformers import GenerationConfig, PreTrainedModel, PreTrainedTokenizerBase

IM_END = "<|im_end|>"


def pick_device() -> tuple[torch.device, torch.dtype]:
    """bf16 on a GPU (halves memory, the dtype Qwen ships in); fp32 on CPU, where bf16 is slow and lossy."""
    if torch.cuda.is_available():
        return torch.device("cuda"), torch.bfloat16
    return torch.device("cpu"), torch.float32


def stop_token_ids(tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """Generation stops at the eos token and at ChatML's <|im_end|> (a chat model ends its turn there)."""
    ids = []
    for token in (tokenizer.eos_token, IM_END):
        token_id = tokenizer.convert_tokens_to_ids(token) if token else None
        # isinstance: one token (a str) converts to one id; the list form is for a list of tokens.
        if isinstance(token_id, int) and token_id != tokenizer.unk_token_id and token_id not in ids:
            ids.append(token_id)
    if not ids:
        raise ValueError(
            f"tokenizer has neither an eos_token nor {IM_END} (eos_token={tokenizer.eos_token!r}): generation would never stop"
        )
    return ids


def pad_token_id(tokenizer: PreTrainedTokenizerBase) -> int:
    """The tokenizer's pad token; without one, the first stop token (masked by the attention mask anyway)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else stop_token_ids(tokenizer)[0]


def generate(*args: Any, **kwargs: Any) -> list[str]:
    """generate_checked's answers alone, for callers that do not count cut-off answers (benches)."""
    return generate_checked(*args, **kwargs)[0]


# inference_mode, not no_grad: a decode step is a few hundred small ops, and inference mode skips their autograd
# bookkeeping (version counters, view tracking), 8-10 % of a batch on CPU (bench eval_batching). Only strings and
# bools leave this function, so no inference tensor reaches autograd later.
@torch.inference_mode()
def generate_checked(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[str],
    max_new_tokens: int,
    batch_size: int,
    on_batch: Callable[[int], None] | None = None,
) -> tuple[list[str], list[bool]]:
    """Greedy answers, one per prompt, stripped, and cut: cut[i] is true when answer i stopped at
    max_new_tokens without a stop token. `on_batch(n)` after each batch of n prompts."""
    # Prompts of similar token count share a batch, so left padding wastes little compute, and a batch without any
    # padding drops its attention mask. Sorted by characters, the dates split's first 256 prompts padded 266 tokens
    # (138 by tokens) and all 3,000 padded 1,337 (121).
    if not prompts:  # a tokenizer call with no texts raises IndexError
        return [], []
    ids = tokenizer(list(prompts), add_special_tokens=False)["input_ids"]
    order = sorted(range(len(prompts)), key=lambda i: len(ids[i]))
    answers, cut = [""] * len(prompts), [False] * len(prompts)
    for start in range(0, len(order), batch_size):
        rows = order[start : start + batch_size]
        texts, cuts = _generate_batch(model, tokenizer, [ids[i] for i in rows], max_new_tokens)
        for row, text, was_cut in zip(rows, texts, cuts):
            answers[row], cut[row] = text, was_cut
        if on_batch:
            on_batch(len(rows))
    return answers, cut


def _generate_batch(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[list[int]], max_new_tokens: int
) -> tuple[list[str], list[bool]]:
    from transformers import GenerationMixin

    if not isinstance(model, GenerationMixin):  # a bare PreTrainedModel has no generate()
        raise TypeError(f"{type(model).__name__} cannot generate: load the model with AutoModelForCausalLM")
    enc = tokenizer.pad({"input_ids": prompt_ids}, padding_side="left", return_tensors="pt").to(model.device)
    stops = stop_token_ids(tokenizer)
    greedy = greedy_config(max_new_tokens, pad_token_id(tokenizer), stops)
    with only_settings(model, greedy):
        out = model.generate(**enc, generation_config=greedy)
    new = out[:, enc["input_ids"].shape[1] :]
    answers = tokenizer.batch_decode(new, skip_special_tokens=True)
    # A row that never produced a stop token within max_new_tokens was cut off, whatever it decoded to.
    # One tensor op for the batch: a Python loop over its tokens cost as much as a tenth of the batch's time.
    full = new.shape[1] >= max_new_tokens
    stopped = torch.isin(new, torch.tensor(stops, device=new.device)).any(dim=1).tolist()
    return [a.strip() for a in answers], [full and not s for s in stopped]


def greedy_config(max_new_tokens: int, pad_id: int, stops: list[int]) -> GenerationConfig:
    """Greedy decoding, the answer's length bound and its stop and pad ids: every setting scoring decodes with."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False, num_beams=1, max_new_tokens=max_new_tokens, pad_token_id=pad_id, eos_token_id=stops
    )


@contextmanager
def only_settings(model: PreTrainedModel, config: GenerationConfig) -> Iterator[None]:
    """`config` as the model's generation settings for the block. generate() fills every setting a passed config
    leaves unset from model.generation_config (a Qwen instruct's sampling and repetition_penalty=1.05, a
    checkpoint's suppress_tokens): with the model's own swapped out, nothing of it applies."""
    own = model.generation_config
    model.generation_config = config
    try:
        yield
    finally:
        model.generation_config = own


@torch.no_grad()
def eval_loss(
    model: PreTrainedModel,
    input_ids: Sequence[Sequence[int]],
    labels: Sequence[Sequence[int]],
    batch_size: int,
    pad_id: int,
) -> dict[str, float]:
    """Token-weighted mean cross-entropy over unmasked labels, and its exp as perplexity.

    Labels follow the Hugging Face convention: aligned with input_ids (the model predicts
    labels[t] from tokens < t), -100 where no loss is taken (prompt, padding).
    """
    total_nll, total_tokens = 0.0, 0
    for start in range(0, len(input_ids), batch_size):
        ids, lab, mask = right_padded(input_ids[start : start + batch_size], labels[start : start + batch_size], pad_id)
        logits = model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device)).logits
        nll, tokens = _summed_nll(logits, lab.to(model.device))
        total_nll, total_tokens = total_nll + nll, total_tokens + tokens
    loss = total_nll / total_tokens if total_tokens else float("nan")
    return {"eval_loss": loss, "perplexity": _exp(loss)}


def right_padded(
    input_ids: Sequence[Sequence[int]], labels: Sequence[Sequence[int]], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input_ids, labels, attention_mask) tensors, padded on the right to the longest row."""
    width = max(len(row) for row in input_ids)
    ids = torch.full((len(input_ids), width), pad_id, dtype=torch.long)
    lab = torch.full((len(input_ids), width), IGNORE_INDEX, dtype=torch.long)
    mask = torch.zeros((len(input_ids), width), dtype=torch.long)
    for i, (row, row_labels) in enumerate(zip(input_ids, labels)):
        if len(row) != len(row_labels):
            raise ValueError(f"eval row {i}: {len(row)} input_ids but {len(row_labels)} labels; expected equal lengths")
        ids[i, : len(row)] = torch.as_tensor(row)
        lab[i, : len(row)] = torch.as_tensor(row_labels)
        mask[i, : len(row)] = 1
    return ids, lab, mask


def _summed_nll(logits: torch.Tensor, labels: torch.Tensor) -> tuple[float, int]:
    """Sum of next-token NLL over unmasked positions; one row at a time so the fp32 upcast stays small."""
    total, tokens = 0.0, 0
    for row_logits, row_labels in zip(logits[:, :-1], labels[:, 1:]):
        total += F.cross_entropy(row_logits.float(), row_labels, ignore_index=IGNORE_INDEX, reduction="sum").item()
        tokens += int((row_labels != IGNORE_INDEX).sum())
    return total, tokens


def _exp(loss: float) -> float:
    try:
        return math.exp(loss)
    except OverflowError:
        return float("inf")
