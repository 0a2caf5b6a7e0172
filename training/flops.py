"""Training FLOPs per token of a decoder-only LM, and MFU against a GPU's dense bf16 peak. Pure.

Used by the fine-tune (its per-step MFU on GPU) and bench/gpu_check.py; tests/test_flops.py checks
the count against a hand count and against torch's own FLOP counter on a tiny Qwen2.

The convention (model FLOPs, as MFU counts them; PaLM, Chowdhery et al. 2022, appendix B):

- A matmul of (m x k) by (k x n) costs 2mkn. Training costs 3 x forward: the backward computes
  the gradient of both the input and the weight, two matmuls for each forward one.
- Weights: 6 N per token, N the weights that multiply activations: q, k, v, o and the three SwiGLU
  projections of every layer, plus the lm_head (vocab x hidden). The lm_head counts even when tied
  to the embedding (the logits are still a matmul); the embedding lookup is a gather, 0 FLOPs.
  Biases, norms, RoPE, SiLU and softmax are elementwise and left out (well under 1 %).
- Attention: per layer, a query costs 2 d FLOPs for QK^T and 2 d for AV per key it attends to
  (d = heads x head_dim). Causal masking halves the square: the token at position p attends to
  p + 1 keys, (s + 1) / 2 on average over a sequence of s, so training costs 3 x 4 d (s + 1) / 2
  = 6 d (s + 1) per layer and token. PaLM and nanoGPT count the full square (12 L d s); flash
  attention skips the masked half, so the halved count is the work the model needs, and MFU is not
  inflated by FLOPs nobody runs. For Qwen2.5-1.5B at s = 2048 the full square would add 5.7 %.
- Activation checkpointing re-runs the forward (hardware FLOPs ~ 4/3 of these); MFU counts model
  FLOPs only, so checkpointing shows as a lower MFU rather than as work done.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from transformers import PretrainedConfig


@dataclass(frozen=True)
class ModelShape:
    """The dimensions FLOPs depend on; read from a Hugging Face config with `from_hf`."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied_embeddings: bool
    """The lm_head shares the embedding's weight: one fewer parameter matrix, the same FLOPs."""

    @classmethod
    def from_hf(cls, config: PretrainedConfig) -> ModelShape:
        """From a Qwen2/Llama-style config (head_dim when it sets one, else hidden / heads)."""
        heads = config.num_attention_heads
        return cls(
            hidden=config.hidden_size,
            layers=config.num_hidden_layers,
            heads=heads,
            kv_heads=config.num_key_value_heads or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads,
            intermediate=config.intermediate_size,
            vocab=config.vocab_size,
            tied_embeddings=bool(config.tie_word_embeddings),
        )

    @property
    def attention_width(self) -> int:
        return self.heads * self.head_dim


def matmul_weights_per_layer(shape: ModelShape) -> int:
    """Weights of one decoder layer that multiply activations: q, k, v, o and gate, up, down."""
    q_and_o = 2 * shape.hidden * shape.attention_width
    k_and_v = 2 * shape.hidden * shape.kv_heads * shape.head_dim
    swiglu = 3 * shape.hidden * shape.intermediate
    return q_and_o + k_and_v + swiglu


def matmul_weights(shape: ModelShape) -> int:
    """N of the 6 N term: every layer's matmul weights plus the lm_head, tied or not."""
    return shape.layers * matmul_weights_per_layer(shape) + shape.vocab * shape.hidden


def attention_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Training FLOPs of QK^T and AV per token, averaged over a causal sequence of seq_len."""
    return 6.0 * shape.layers * shape.attention_width * (seq_len + 1)


def train_flops_per_token(shape: ModelShape, seq_len: int) -> float:
    """Model FLOPs (forward + backward) per trained token at this sequence length."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    return 6.0 * matmul_weights(shape) + attention_flops_per_token(shape, seq_len)


def mfu(flops_per_token: float, tokens_per_s_per_device: float, peak_flops: float) -> float:
    """Model FLOPs utilization: achieved model FLOP/s of one device over its dense peak."""
    return flops_per_token * tokens_per_s_per_device / peak_flops


# Dense (no 2:4 sparsity) bf16 tensor-core peak per GPU, FLOP/s. NVIDIA's pages print the sparse
# figure with an asterisk; dense is half of it.
#   H200 SXM 1,979 / NVL 1,671 TFLOPS sparse   nvidia.com/en-us/data-center/h200/
#   H100 SXM 1,979 / NVL 1,671 / PCIe 1,513    nvidia.com/en-us/data-center/h100/
#   A100 (SXM and PCIe) 312 dense               A100 datasheet, nvidia.com/en-us/data-center/a100/
#   L40S 733 sparse                             nvidia.com/en-us/data-center/l40s/
#   L4 242 sparse                               nvidia.com/en-us/data-center/l4/
#   B200 4.5 PFLOPS sparse (HGX B200, per GPU)  nvidia.com/en-us/data-center/hgx/
#   A10G (AWS G5) 70 dense: NVIDIA publishes no A10G datasheet; this is the figure in Baseten's
#     "NVIDIA A10 vs A10G" spec comparison (the A10, same GA102 die, is 125 dense), i.e. half the
#     per-SM tensor rate of the A10. Treat A10G MFU as approximate.
PEAK_BF16_DENSE: tuple[tuple[str, str | None, float], ...] = (
    # (model token, variant token or None, FLOP/s); first match wins, so variants precede their base.
    ("H200", "NVL", 835e12),
    ("H200", None, 989e12),
    ("H100", "NVL", 835e12),
    ("H100", "PCIE", 756e12),
    ("H100", None, 989e12),
    ("A100", None, 312e12),
    ("A10G", None, 70e12),
    ("L40S", None, 362e12),
    ("L4", None, 121e12),
    ("B200", None, 2250e12),
)


def peak_bf16_flops(device_name: str) -> float | None:
    """Dense bf16 peak for a CUDA device name (torch.cuda.get_device_name); None when not in the table.

    Names are matched by whole tokens ("NVIDIA A100-SXM4-80GB" -> A100, SXM4, 80GB), so L4 never
    matches an L40S and A10G never an A100.
    """
    tokens = set(re.split(r"[\s\-_]+", device_name.upper()))
    for model, variant, flops in PEAK_BF16_DENSE:
        if model in tokens and (variant is None or variant in tokens):
            return flops
    return None
