"""Will a fine-tune fit on the cluster's GPUs? An estimate per GPU, and the refusal when it cannot. Pure.

training/finetune.py estimates before it starts any Ray Train run, from the model's parameter counts and a
probe forward's saved activations (training.memory), and refuses a configuration whose estimate exceeds the
smallest GPU the verify stage reported (NodeFacts.gpu_memory_bytes). The estimate is kept in the fine-tune's
summary beside every rank's measured peak, so how far it is off can be read from any run.

Per GPU, with s the ranks a parameter is sharded over, P the parameters and T the trainable ones:

    params       4 P / s     fp32 master weights (FSDP2 keeps the sharded originals in fp32)
    grads        4 T / s     fp32 gradients (reduced in fp32)
    optimizer    8 T / s     AdamW's exp_avg and exp_avg_sq
    gathered     c (R + 2 L) the unsharded compute copies (c = 2 bytes in bf16 on GPU, 4 in fp32 on CPU) of
                             the root group R (embeddings, lm_head, final norm) and two decoder layers L (one
                             computing, one prefetched); every layer's under ddp, which never reshards
    activations  measured    what autograd saves in one forward at the configured micro-batch and length
    loss         3 x chunk   one chunk of the chunked loss: fp32 logits, their softmax and gradient

Not counted: the CUDA context and NCCL buffers (a few hundred MiB), allocator fragmentation, and the
asynchronous checkpoint's staging copy, which is in host memory.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from tuneproof.core.summaries import NodeFacts
from tuneproof.core.summaries_training import FitEstimate

GIB = 2**30


@dataclass(frozen=True)
class ParamCounts:
    """The model's parameter counts the estimate needs (training.memory.param_counts reads them)."""

    total: int
    trainable: int
    root: int
    """Parameters outside the decoder layers: the root FSDP group (a tied lm_head counted once)."""
    layer: int
    """Parameters of the largest decoder layer."""
    layers: int


def shard_degree(sharding: str, world_size: int, shard_group_size: int | None) -> int:
    """Ranks one parameter is split over: training.fsdp.mesh_shape's last dimension."""
    if sharding == "full":
        return world_size
    if sharding == "ddp":
        return 1
    return shard_group_size or world_size


def estimate(
    counts: ParamCounts,
    degree: int,
    gpu: bool,
    activation_bytes: int,
    loss_chunk_elements: int,
    replicated_layers: bool = False,
    capacity_bytes: int | None = None,
) -> FitEstimate:
    """The bytes per GPU of the table above. replicated_layers: ddp (every layer stays gathered)."""
    compute_bytes = 2 if gpu else 4
    gathered_params = counts.total if replicated_layers else counts.root + 2 * counts.layer
    parts = {
        "params_bytes": 4 * counts.total // degree,
        "grads_bytes": 4 * counts.trainable // degree,
        "optimizer_bytes": 8 * counts.trainable // degree,
        "gathered_bytes": compute_bytes * gathered_params,
        "activation_bytes": activation_bytes,
        "loss_bytes": 3 * 4 * loss_chunk_elements,
    }
    return FitEstimate(**parts, total_bytes=sum(parts.values()), shard_degree=degree, capacity_bytes=capacity_bytes)


def gpu_capacity(nodes: Iterable[NodeFacts]) -> int | None:
    """The smallest GPU memory any live node reports; None when no node reports one."""
    sizes = [size for node in nodes if node.alive for size in node.gpu_memory_bytes]
    return min(sizes) if sizes else None


def refusal(fit: FitEstimate, micro_batch: int) -> str | None:
    """Why the configuration cannot fit, naming the estimate and the capacity; None when it fits or the
    capacity is unknown."""
    if fit.capacity_bytes is None or fit.total_bytes <= fit.capacity_bytes:
        return None
    parts = ", ".join(
        f"{name} {gib(getattr(fit, name + '_bytes'))}"
        for name in ("params", "grads", "optimizer", "gathered", "activation", "loss")
    )
    return (
        f"this fine-tune needs about {gib(fit.total_bytes)} per GPU ({parts}; sharded over {fit.shard_degree}) "
        f"but the verified cluster's smallest GPU has {gib(fit.capacity_bytes)}: lower train.micro_batch_size "
        f"(now {micro_batch}), turn on train.activation_checkpointing, shard over more workers "
        "(train.sharding=full, train.num_workers) or train only adapters (train.method=lora)"
    )


def gib(size: int) -> str:
    return f"{size / GIB:.1f} GiB"
