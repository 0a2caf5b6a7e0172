"""The tiny Qwen2 the in-process FSDP tests shard: 2 layers, hidden 32, tied embeddings (as the demo's)."""

from __future__ import annotations

from typing import Any


def tiny_qwen2_config(vocab_size: int, **overrides: Any):
    """The tiny Qwen2 config: 2 layers, hidden 32, 4 heads, 2 KV heads, tied embeddings; `overrides` replace fields."""
    from transformers import Qwen2Config

    fields = {
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": True,
    }
    return Qwen2Config(vocab_size=vocab_size, **(fields | overrides))


def tiny_qwen2(vocab_size: int, seed: int):
    """A fresh Qwen2ForCausalLM, the same weights for the same seed (so every rank starts alike)."""
    import torch
    from transformers import Qwen2ForCausalLM

    config = tiny_qwen2_config(vocab_size)
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_checkpoint(model, optimizer, progress, directory):
    """Save one checkpoint into `directory` through the fine-tune's own save path (start, then wait at once),
    then its completion marker over every rank's files, as finetune_saving does; returns this rank's files with
    size and sha256. Collective: every rank of the default group calls it."""
    from pathlib import Path

    import torch.distributed as dist

    from training.checkpoint_listing import write_marker
    from training.checkpointing import finish_saving_shards, start_saving_shards
    from tuneproof.core.storage import Storage

    directory = Path(directory)
    storage = Storage(str(directory.parent))
    group = dist.new_group(backend="gloo")  # the save's collectives stay off the default group, as in training
    files = finish_saving_shards(start_saving_shards(model, optimizer, progress, storage, (directory.name,), group))
    every_rank: list = [None] * dist.get_world_size()
    dist.all_gather_object(every_rank, files, group=group)
    if dist.get_rank() == 0:
        write_marker(
            storage, progress.step, {k: v for rank_files in every_rank for k, v in rank_files.items()}, directory.name
        )
    dist.barrier(group=group)
    return files
