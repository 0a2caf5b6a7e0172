"""The fine-tune's optimizer step: loss, gradient accumulation, clipping, AdamW. Imports torch only.

training/finetune_worker.py's train_step runs `optimizer_step` once per step; bench/gpu_check.py runs the same
function on a GPU machine that has torch and transformers but no Ray, Prefect or pydantic, which is why
nothing here imports more than torch and tuneproof.core.hashing (the standard library only).

The loss never holds the full fp32 logits: `token_loss_sum` takes the decoder's final hidden states,
keeps the labelled positions, and computes logits and cross entropy a chunk of rows at a time, each
chunk recomputed in backward (activation checkpointing of the lm_head). At Qwen2.5-1.5B's 151,936
classes the full fp32 logits of one 2,048-token sequence are 1.2 GB, and the log-softmax saved for
backward as much again; a chunk is LOGITS_PER_CHUNK elements (512 MB in fp32) whatever the sequence.
`full_logits_loss_sum` is the path it replaced: the reference of the equality test and the bench's
baseline.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from tuneproof.core.hashing import IGNORE_INDEX

if TYPE_CHECKING:  # annotations only: at run time this module imports torch alone (see above)
    from transformers import PreTrainedModel

Batch = dict[str, torch.Tensor]
"""A collated micro-batch: input_ids, labels, attention_mask, and position_ids when packed."""

LOGITS_PER_CHUNK = 2**27
"""Logit elements one chunk of the loss computes at once (rows = this // vocab, at least 1)."""

LossFn = Callable[["PreTrainedModel", Batch], torch.Tensor]


def token_loss_sum(model: PreTrainedModel, batch: Batch, chunk_rows: int | None = None) -> torch.Tensor:
    """Summed next-token cross entropy over the labelled positions, in fp32, chunk by chunk.

    Equal (to fp32 rounding) to full_logits_loss_sum, in value and gradients; chunk_rows overrides the
    rows per chunk (tests use small chunks to cross chunk boundaries)."""
    hidden = final_hidden_states(model, batch)[:, :-1]
    labels = batch["labels"][:, 1:]
    keep = labels != IGNORE_INDEX
    rows, targets = hidden[keep], labels[keep]  # prompt and padding positions cost no lm_head FLOPs
    head = model.get_output_embeddings()
    per_chunk = chunk_rows or max(1, LOGITS_PER_CHUNK // head.out_features)
    total = rows[:0].float().sum()  # zero, connected to the graph even with no labelled row
    for start in range(0, len(targets), per_chunk):
        end = start + per_chunk
        total = total + checkpoint(_chunk_loss, head, rows[start:end], targets[start:end], use_reentrant=False)
    return total


def _chunk_loss(head: torch.nn.Module, rows: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(rows).float(), targets, reduction="sum")


def final_hidden_states(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The decoder's last hidden states (after its final norm), from one forward of the whole model.

    The whole model runs, not its decoder alone, so FSDP2's root unshards the embedding and lm_head as it
    does for any forward (its root keeps them unsharded until backward); logits_to_keep=1 makes the
    model's own lm_head compute one position instead of every one."""
    seen: list[torch.Tensor] = []
    hook = model.get_decoder().register_forward_hook(lambda _m, _a, out: seen.append(out.last_hidden_state))
    try:
        model(**forward_inputs(model, batch), logits_to_keep=1)
    finally:
        hook.remove()
    return seen[-1]


PACKED_ATTENTION = ("sdpa", "eager")
"""The attention implementations that honour block_causal_mask. transformers' flash path cuts sequences from the
position ids only for a batch of one row (`_is_packed_sequence`), so a micro-batch of several packed rows ran
plainly causal across examples; its flex path adds a boolean mask to the scores (+1 or +0), masking nothing."""


def forward_inputs(model: PreTrainedModel, batch: Batch) -> Batch:
    """Keyword arguments of model(...) for a collated batch (its labels stay out). Packed rows need an attention
    implementation that keeps their examples apart (PACKED_ATTENTION) and a model without sliding-window attention;
    anything else is refused before a step (the first-batch probe runs this first)."""
    if "position_ids" not in batch:  # one example per row: the padding mask says everything
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
    implementation = str(getattr(model.config, "_attn_implementation", None) or "sdpa")
    if implementation not in PACKED_ATTENTION:
        # Imported here: the step runs where pydantic, which the results module needs, may be absent (the GPU check).
        from tuneproof.core.results import FailureClass, StageFailure

        raise StageFailure(
            FailureClass.modeling,
            f"data.overflow pack: the model runs {implementation} attention, which would let a packed row's "
            f"examples attend to each other; packing is kept apart under {' or '.join(PACKED_ATTENTION)} only: "
            "load the model with one of those, or use data.overflow drop or truncate",
        )
    if window := sliding_window_setting(model.config):
        from tuneproof.core.results import FailureClass, StageFailure

        raise StageFailure(
            FailureClass.modeling,
            f"data.overflow pack: the model uses sliding-window attention ({window}), which block_causal_mask "
            "does not apply, so a packed row's tokens would see further back than the same example alone: "
            "use data.overflow drop or truncate, or a model config without sliding-window attention",
        )
    return {
        "input_ids": batch["input_ids"],
        "position_ids": batch["position_ids"],
        "attention_mask": block_causal_mask(batch["position_ids"], eager=implementation == "eager"),
    }


def sliding_window_setting(config: object) -> str | None:
    """The setting that turns on sliding-window attention in a model config, or None when every layer attends in
    full. A 4D mask passed to the model replaces its own, window included, so packed rows cannot keep the window.
    Qwen2-style configs say it with use_sliding_window and layer_types; Mistral-style ones (neither field) slide
    whenever sliding_window is set."""
    if getattr(config, "use_sliding_window", False) is True:
        return f"use_sliding_window true, sliding_window {getattr(config, 'sliding_window', None)}"
    layer_types = getattr(config, "layer_types", None)
    if layer_types and "sliding_attention" in layer_types:
        return f"layer_types has sliding_attention, sliding_window {getattr(config, 'sliding_window', None)}"
    window = getattr(config, "sliding_window", None)
    if layer_types is None and not hasattr(config, "use_sliding_window") and window is not None:
        return f"sliding_window {window}"
    return None


def block_causal_mask(position_ids: torch.Tensor, eager: bool = False) -> torch.Tensor:
    """(batch, 1, L, L) mask: query q sees key k when k <= q and both lie in one example (a run of position
    ids from 0). Boolean (True: attend) for SDPA; additive fp32 (0 or the dtype's min) for eager attention,
    which adds the mask it is given to its scores."""
    example = (position_ids == 0).cumsum(dim=-1)
    width = position_ids.shape[-1]
    causal = torch.ones(width, width, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (example[:, :, None] == example[:, None, :]) & causal
    if not eager:
        return allowed[:, None]
    return torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device).masked_fill(
        ~allowed, torch.finfo(torch.float32).min
    )[:, None]


def full_logits_loss_sum(model: PreTrainedModel, batch: Batch) -> torch.Tensor:
    """The loss as it was before chunking: every position's fp32 logits at once. Reference only."""
    logits = model(**forward_inputs(model, batch)).logits
    return F.cross_entropy(
        logits[:, :-1].float().flatten(0, 1),
        batch["labels"][:, 1:].flatten(),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )


def global_counts(micro: list[Batch], device: torch.device) -> tuple[int, int]:
    """(target tokens, real tokens) of this step across every rank and micro-batch. Collective."""
    import torch.distributed as dist

    counts = torch.tensor(
        [
            sum(int((b["labels"][:, 1:] != IGNORE_INDEX).sum()) for b in micro),
            sum(int(b["attention_mask"].sum()) for b in micro),
        ],
        dtype=torch.float64,
        device=device,
    )
    dist.all_reduce(counts)
    return max(int(counts[0]), 1), int(counts[1])


def optimizer_step(
    model: PreTrainedModel,
    optimizer: torch.optim.Optimizer,
    micro: list[Batch],
    targets: int,
    max_grad_norm: float,
    loss_fn: LossFn = token_loss_sum,
    poison: bool = False,
) -> tuple[float, float]:
    """Forward and backward over the micro-batches, one gradient reduction, clip, AdamW; returns the step's
    mean loss over all `targets` target tokens of every rank, and the gradient norm before clipping. With a
    non-finite gradient norm (the same on every rank) no update is applied.

    FSDP averages gradients over ranks, so each micro-batch's summed loss is scaled by world_size / targets
    to get sum / global targets. poison: multiply the loss by NaN (the divergence test's hook). Collective."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule

    from training.fsdp import clip_gradients

    if not isinstance(model, FSDPModule):  # set_requires_gradient_sync below is FSDP2's
        raise TypeError(f"optimizer_step needs a model sharded by shard_model, got an unsharded {type(model).__name__}")
    world_size = dist.get_world_size()
    loss_sum = torch.zeros((), device=next(iter(model.parameters())).device)
    for i, batch in enumerate(micro):
        model.set_requires_gradient_sync(i == len(micro) - 1)  # FSDP2: reduce-scatter once per step
        summed = loss_fn(model, batch)
        if poison:
            summed = summed * float("nan")
        (summed * world_size / targets).backward()
        loss_sum += summed.detach()
    dist.all_reduce(loss_sum)
    grad_norm = clip_gradients(model, max_grad_norm)
    # A non-finite norm clips every gradient to NaN: stepping would write NaN into the weights (and into the
    # checkpoint saved after this step). The weights stay as they were; the caller stops the run as diverged.
    if math.isfinite(grad_norm):
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return float(loss_sum) / targets, grad_norm


def build_optimizer(
    params: Iterable[torch.nn.Parameter],
    lr: float,
    weight_decay: float,
    device: torch.device,
    fused: bool | None = None,
) -> torch.optim.AdamW:
    """AdamW, fused (one kernel for every parameter's update) on CUDA, torch's default elsewhere.

    fused: None picks by device; the bench sets it to compare both."""
    use_fused = device.type == "cuda" if fused is None else fused
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=use_fused)


def compile_layers(model: PreTrainedModel, backend: str = "inductor") -> None:
    """torch.compile each decoder layer in place, before sharding (per-block, as torchtitan does): one
    compiled graph shared by every layer, FSDP2's collectives left outside it."""
    from training.fsdp import decoder_layers

    for layer in decoder_layers(model):
        layer.compile(backend=backend)


def set_activation_checkpointing(model: PreTrainedModel, mode: str) -> None:
    """off, full (every decoder layer recomputed in backward) or selective (every second layer).

    Uses transformers' own per-layer switch, so parameter names (and checkpoints) do not change."""
    if mode not in ("off", "selective", "full"):
        raise ValueError(f"activation checkpointing must be off, selective or full, got {mode!r}")
    if mode == "off":
        return
    from training.fsdp import decoder_layers

    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode == "selective":
        for layer in decoder_layers(model)[1::2]:
            setattr(layer, "gradient_checkpointing", False)  # noqa: B010 - an attribute mypy cannot see on a Module
