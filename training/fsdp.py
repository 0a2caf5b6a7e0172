"""FSDP2 for a Hugging Face decoder LM: shard it, clip its gradients, gather it back for export.

Runs inside Ray Train workers, after TorchTrainer has set up the process group (gloo on CPU,
nccl on GPU). Each decoder layer is its own FSDP group so only one layer's parameters are
unsharded at a time; the root group holds the rest: embeddings, final norm and lm_head. With
tie_word_embeddings the lm_head weight IS the embedding weight, and torch 2.13 rejects a tied
parameter split across groups, so both must stay in the root group together.

train.sharding picks the device mesh the groups live on (see `mesh_shape`): full shards over
every rank; hybrid shards within groups of consecutive ranks and replicates across the groups
(HSDP, a 2-D mesh); ddp is the 2-D mesh with groups of one, i.e. every rank holds everything.
All three use the same fully_shard calls, so gradient sync, clipping and DCP checkpoints work
the same way, and a checkpoint saved under one resumes under another.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def worker_device(use_gpu: bool) -> torch.device:
    if not use_gpu:
        return torch.device("cpu")
    import ray.train.torch

    device = ray.train.torch.get_device()
    torch.cuda.set_device(device)
    return device


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a *ForCausalLM (Qwen2, Llama, ...: model.model.layers)."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__} has no model.layers: expected a decoder-only *ForCausalLM")
    return list(layers)


def mesh_shape(sharding: str, world_size: int, shard_group_size: int | None, local_world_size: int) -> tuple[int, ...]:
    """The device mesh for a sharding choice: (shard,) or (replicate, shard). Pure.

    full: (world,). hybrid: (world / group, group) with group = shard_group_size, else the ranks
    on one node; rank r shards with the ranks of r // group, so consecutive ranks (Ray Train
    numbers workers node by node) form a group. ddp: (world, 1).
    """
    if sharding == "full":
        return (world_size,)
    if sharding == "ddp":
        return (world_size, 1)
    if sharding != "hybrid":
        raise ValueError(f"sharding must be one of full, hybrid, ddp, got {sharding!r}")
    group = shard_group_size or local_world_size
    if world_size % group:
        source = "train.shard_group_size" if shard_group_size else "the workers on this node"
        raise ValueError(
            f"hybrid sharding needs the shard group size to divide the world size, "
            f"got a group of {group} ({source}) and world size {world_size}"
        )
    return (world_size // group, group)


def local_world_size() -> int:
    """Ranks on this node: LOCAL_WORLD_SIZE, which Ray Train and torchrun both set; else the world."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))


def shard_model(
    model: PreTrainedModel,
    device: torch.device,
    activation_checkpointing: bool,
    sharding: str = "full",
    shard_group_size: int | None = None,
) -> PreTrainedModel:
    """fully_shard each decoder layer, then the root, on the mesh `sharding` asks for; bf16 compute
    with fp32 reduction on GPU, fp32 on CPU. Collective: every rank calls it with the same choice."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if activation_checkpointing:
        # Non-reentrant checkpointing recomputes each block in backward and composes with FSDP2.
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    shape = mesh_shape(sharding, dist.get_world_size(), shard_group_size, local_world_size())
    names = ("shard",) if len(shape) == 1 else ("replicate", "shard")
    options: dict[str, Any] = {"mesh": init_device_mesh(device.type, shape, mesh_dim_names=names)}
    if sharding == "ddp":
        options["reshard_after_forward"] = False  # every rank holds whole layers: nothing to free, no re-gather
    if device.type == "cuda":
        options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    fully_shard(model, **options)  # root group: embed_tokens and a tied lm_head stay together here
    return model


def clip_gradients(model: torch.nn.Module, max_norm: float) -> float:
    """Clip the global gradient norm (across all shards) and return the norm before clipping."""
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if hasattr(norm, "full_tensor"):  # a DTensor when the parameters are sharded
        norm = norm.full_tensor()
    return float(norm)


def full_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The unsharded state dict, on CPU, on rank 0 (other ranks get an empty dict). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def peak_flops(device: torch.device) -> float | None:
    """Dense bf16 peak of this GPU, or None (CPU, or a GPU not in the table: then no MFU is reported)."""
    from training.flops import peak_bf16_flops

    if device.type != "cuda":
        return None
    return peak_bf16_flops(torch.cuda.get_device_name(device))
