"""training/flops.py: the FLOP count against a hand count and against torch's FLOP counter; the peak table.

.venv/bin/python -m pytest -q tests/test_flops.py
"""

from __future__ import annotations

import pytest

from training.flops import (
    ModelShape,
    attention_flops_per_token,
    matmul_weights,
    mfu,
    peak_bf16_flops,
    train_flops_per_token,
)

# A tiny Qwen2: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, SwiGLU width 128, vocab 100, tied.
TINY = ModelShape(
    hidden=64, layers=2, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100, tied_embeddings=True
)
QWEN25_1_5B = ModelShape(
    hidden=1536, layers=28, heads=12, kv_heads=2, head_dim=128, intermediate=8960, vocab=151936, tied_embeddings=True
)


def tiny_hf_config(attn_implementation: str = "eager"):
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=100,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation=attn_implementation,  # type: ignore[call-arg]  # taken by PreTrainedConfig, not in its annotations
    )


def test_the_tiny_config_matches_a_hand_count():
    # One layer's weights that multiply activations:
    #   q 64x64 = 4096, k 64x32 = 2048, v 64x32 = 2048, o 64x64 = 4096,
    #   gate 64x128 = 8192, up 64x128 = 8192, down 128x64 = 8192          -> 36864
    # Two layers 73728, plus the lm_head 100x64 = 6400 (tied, but still a matmul) -> N = 80128.
    assert matmul_weights(TINY) == 80128
    # Weights: 2 FLOPs per weight forward, x3 for forward + backward: 6 x 80128 = 480768.
    # Attention at s = 8: QK^T and AV are 2 x 64 FLOPs each per key, per layer; causal, a token
    # attends to (8 + 1) / 2 = 4.5 keys on average: 4 x 64 x 4.5 x 2 layers x 3 = 6912.
    assert attention_flops_per_token(TINY, 8) == 6912
    assert train_flops_per_token(TINY, 8) == 480768 + 6912


def test_the_count_agrees_with_torch_flop_counter_on_a_real_step():
    """Eager attention computes the full s x s square then masks it: the counter sees every
    matmul, so its weight matmuls equal 6 N per token and its attention bmm's are the causal
    count times 2s / (s + 1)."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen2ForCausalLM

    config = tiny_hf_config()
    assert ModelShape.from_hf(config) == TINY
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(config)
    batch, seq = 2, 8
    ids = torch.randint(0, 100, (batch, seq))
    with FlopCounterMode(display=False) as counter:
        model(input_ids=ids, labels=ids).loss.backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    tokens = batch * seq
    assert counts["aten.mm"] + counts["aten.addmm"] == 6 * matmul_weights(TINY) * tokens
    assert counts["aten.bmm"] * (seq + 1) / (2 * seq) == attention_flops_per_token(TINY, seq) * tokens


def test_qwen25_1_5b_per_token_count():
    # 28 layers x 46,792,704 = 1.31e9: the model card's "1.31B non-embedding parameters" (those
    # add biases and norms, 0.01 % more); + lm_head 151936 x 1536 = 1.54e9, the card's total.
    assert matmul_weights(QWEN25_1_5B) == 28 * 46_792_704 + 151_936 * 1536 == 1_543_569_408
    flops = train_flops_per_token(QWEN25_1_5B, 2048)
    assert flops == 6 * 1_543_569_408 + 6 * 28 * 1536 * 2049
    assert round(flops / 1e9, 3) == 9.790


def test_seq_len_must_be_positive():
    with pytest.raises(ValueError, match="seq_len must be >= 1, got 0"):
        train_flops_per_token(TINY, 0)


def test_mfu_is_achieved_flops_over_the_peak():
    assert mfu(flops_per_token=1e9, tokens_per_s_per_device=450_000, peak_flops=1e15) == pytest.approx(0.45)


@pytest.mark.parametrize(
    "name, peak",
    [
        ("NVIDIA H200", 989e12),
        ("NVIDIA H200 NVL", 835e12),
        ("NVIDIA H100 80GB HBM3", 989e12),
        ("NVIDIA H100 PCIe", 756e12),
        ("NVIDIA H100 NVL", 835e12),
        ("NVIDIA A100-SXM4-80GB", 312e12),
        ("NVIDIA A100 80GB PCIe", 312e12),
        ("NVIDIA A10G", 70e12),
        ("NVIDIA L4", 121e12),
        ("NVIDIA L40S", 362e12),
        ("NVIDIA GeForce RTX 4090", None),
        ("Tesla T4", None),
    ],
)
def test_peak_is_looked_up_by_whole_name_tokens(name, peak):
    assert peak_bf16_flops(name) == peak
