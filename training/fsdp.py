"""FSDP2 for a Hugging Face decoder LM: shard it, clip its gradients, gather it back for export.

Runs inside Ray Train workers, after TorchTrainer has set up the process group (gloo on CPU,
nccl on GPU). Each decoder layer is its own FSDP group so only one layer's parameters are
unsharded at a time; the root group holds the rest: embeddings, final norm and lm_head. With
tie_word_embeddings the lm_head weight IS the embedding weight, and torch 2.13 rejects a tied
parameter split across groups, so both must stay in the root group together.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def worker_device(use_gpu: bool) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    import ray.train.torch

    device = ray.train.torch.get_device()
    torch.cuda.set_device(device)
    return device


def decoder_layers(model) -> list[torch.nn.Module]:
    """The transformer blocks of a *ForCausalLM (Qwen2, Llama, ...: model.model.layers)."""
    try:
        return list(model.model.layers)
    except AttributeError:
        raise TypeError(f"{type(model).__name__} has no model.layers: expected a decoder-only *ForCausalLM") from None


def shard_model(model, device: torch.device, activation_checkpointing: bool):
    """fully_shard each decoder layer, then the root; bf16 compute with fp32 reduction on GPU, fp32 on CPU."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        # Non-reentrant checkpointing recomputes each block in backward and composes with FSDP2.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    options: dict = {"mesh": init_device_mesh(device.type, (dist.get_world_size(),))}
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)  # root group: embed_tokens and a tied lm_head stay together here
    return model


def clip_gradients(model, max_norm: float) -> float:
    """Clip the global gradient norm (across all shards) and return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor when the parameters are sharded
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(model) -> dict[str, torch.Tensor]:
    """The unsharded state dict, on CPU, on rank 0 (other ranks get an empty dict). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this GPU, or None (CPU, or a GPU not in the table: then no MFU is reported)."""
    from training.flops import peak_bf16_flops

    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))
