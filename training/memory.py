"""Memory as evidence, job side: each rank's peak, and the inputs of the fit estimate (tuneproof.core.fit).

`rank_memory` is what a fine-tune worker and the evaluate job record at their end. `fit_estimate` is what the
fine-tune's driver computes before it starts any Ray Train run: parameter counts of the model built on the
meta device (no memory, no FLOPs) and the bytes autograd saves in one probe forward of that model at the
configured micro-batch and sequence length, in the dtype the GPU computes in. A meta tensor has a shape and
a dtype but no data, so the probe measures what the real forward would save without doing it.
"""

from __future__ import annotations

import resource
import sys
from typing import TYPE_CHECKING

import torch

from tuneproof.core.fit import ParamCounts, estimate, shard_degree
from tuneproof.core.summaries_training import FitEstimate, RankMemory

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from tuneproof.core.config import TrainConfig


def rank_memory(rank: int, device: torch.device) -> RankMemory:
    """This process's peak memory so far: CUDA's allocator peaks on a GPU, the peak resident set always."""
    # ru_maxrss is KiB on Linux, bytes on macOS.
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    if device.type != "cuda":
        return RankMemory(rank=rank, device="cpu", peak_rss_bytes=rss)
    return RankMemory(
        rank=rank,
        device=str(device),
        max_allocated_bytes=torch.cuda.max_memory_allocated(device),
        max_reserved_bytes=torch.cuda.max_memory_reserved(device),
        peak_rss_bytes=rss,
    )


def param_counts(model: torch.nn.Module) -> ParamCounts:
    """Total and trainable parameters (a tied weight once), those outside the decoder layers (FSDP2's root
    group) and the largest layer's."""
    from training.fsdp import decoder_layers

    layers = decoder_layers(model)
    per_layer = [sum(p.numel() for p in layer.parameters()) for layer in layers]
    total = sum(p.numel() for p in model.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return ParamCounts(total, trainable, total - sum(per_layer), max(per_layer, default=0), len(layers))


def probe_activation_bytes(model: PreTrainedModel, micro_batch: int, seq_len: int, checkpointing: bool) -> int:
    """Bytes of the tensors autograd saves for backward in one training forward of `model` (on the meta
    device) over micro_batch x seq_len tokens, parameters not counted, each saved tensor once. With
    checkpointing, transformers' per-layer checkpoint keeps each layer's input instead (counted here as
    the layer inputs), and backward recomputes one layer at a time (one layer's share of the un-checkpointed
    bytes is added).

    `model` must use eager attention: the others ask the data (.item()) whether the mask may be skipped,
    which no meta tensor can answer. Its (batch, heads, seq, seq) score matrices are left out: the fused
    attention a GPU (or torch's CPU flash kernel) runs saves no such matrix, only a row statistic."""
    from training.fsdp import decoder_layers
    from training.step import final_hidden_states

    params = {id(p) for p in model.parameters()}
    heads = model.config.num_attention_heads
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        scores = base.dim() == 4 and tuple(base.shape[1:]) == (heads, seq_len, seq_len)
        if id(base) not in params and not scores:
            seen[id(base)] = base.numel() * base.element_size()
        return t

    ids = torch.zeros((micro_batch, seq_len), dtype=torch.long, device="meta")
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hidden = final_hidden_states(model, batch)
    saved = sum(seen.values())
    if not checkpointing:
        return saved
    layers = len(decoder_layers(model))
    layer_inputs = layers * hidden.numel() * hidden.element_size()
    return layer_inputs + saved // max(layers, 1)


def fit_estimate(
    model_config: PretrainedConfig,
    train: TrainConfig,
    seq_len: int,
    world_size: int,
    gpu: bool,
    capacity_bytes: int | None,
) -> FitEstimate:
    """The estimate of tuneproof.core.fit for train (a TrainConfig) on this model config. Under LoRA the
    trainable count is the adapters' (training.lora applies them to the meta model)."""
    from transformers import AutoModelForCausalLM

    from training.step import LOGITS_PER_CHUNK

    dtype = torch.bfloat16 if gpu else torch.float32
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, dtype=dtype, attn_implementation="eager")
    if train.method == "lora":
        from training.lora import apply_lora

        apply_lora(model, train.lora, train.seed)
    counts = param_counts(model)
    activations = probe_activation_bytes(model, train.micro_batch_size, seq_len, train.activation_checkpointing)
    vocab = model.get_output_embeddings().out_features
    loss_elements = min(LOGITS_PER_CHUNK // vocab or 1, train.micro_batch_size * seq_len) * vocab
    degree = shard_degree(train.sharding, world_size, train.shard_group_size)
    return estimate(counts, degree, gpu, activations, loss_elements, train.sharding == "ddp", capacity_bytes)
