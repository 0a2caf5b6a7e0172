"""data.overflow: pack keeps examples apart: restarting positions, a block-diagonal mask, labels within
their example, and the fine-tune's first-batch probe that fails a packing which leaks."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.tiny import tiny_qwen2
from training.data_encode import pack_split
from training.data_files import Example, examples_table, table_examples
from training.finetune_worker import probe_first_batch
from training.packing import PROBE_TOLERANCE, probe_packing
from training.step import block_causal_mask, forward_inputs, token_loss_sum
from training.train_data import BatchLayout, StepBatches, TrainExample, collate
from tuneproof.core.results import FailureClass, StageFailure

VOCAB = 40


def example(rng: np.random.Generator, prompt: int, answer: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(3, VOCAB, prompt + answer)
    return ids, np.concatenate([np.full(prompt, -100), ids[prompt:]])


def packed_rows(seed: int = 0) -> list[TrainExample]:
    """Four rows of two or three examples each (prompt -100, answer labelled), unequal lengths."""
    rng = np.random.default_rng(seed)
    rows = []
    for shape in ([(3, 4), (2, 5)], [(4, 3), (3, 3), (2, 2)], [(5, 6)], [(2, 3), (4, 4)]):
        parts = [example(rng, p, a) for p, a in shape]
        segments = tuple(len(ids) for ids, _ in parts) if len(parts) > 1 else None
        rows.append(
            TrainExample(np.concatenate([i for i, _ in parts]), np.concatenate([lab for _, lab in parts]), segments)
        )
    return rows


def flat_collate(rows: list[TrainExample], pad_id: int) -> dict:
    """Packing as it was: the examples of a row as one sequence (one run of positions, one causal mask)."""
    return collate([TrainExample(r.input_ids, r.labels) for r in rows], pad_id)


def test_collate_restarts_positions_per_example_and_at_the_padding_and_masks_boundary_labels():
    row = TrainExample(np.arange(10, 15), np.array([-100, 11, -100, 13, 14]), segments=(2, 3))
    alone = TrainExample(np.arange(20, 27), np.array([-100] * 3 + [23, 24, 25, 26]))
    batch = collate([row, alone], pad_id=0)
    assert batch["position_ids"].tolist() == [[0, 1, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 6]]
    # Label 12 (the second example's first token) would be predicted by the first example's last token.
    row_with_target_at_start = TrainExample(np.arange(10, 15), np.array([-100, 11, 12, 13, 14]), segments=(2, 3))
    assert collate([row_with_target_at_start], 0)["labels"].tolist() == [[-100, 11, -100, 13, 14]]
    assert batch["attention_mask"].tolist() == [[1] * 5 + [0, 0], [1] * 7]
    assert "position_ids" not in collate([alone], 0)  # nothing packed: the batch is what it always was


def test_block_causal_mask_lets_a_token_see_only_earlier_tokens_of_its_own_example():
    mask = block_causal_mask(torch.tensor([[0, 1, 0, 1, 2, 0]]))
    assert mask.shape == (1, 1, 6, 6)
    assert mask[0, 0].int().tolist() == [
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    additive = block_causal_mask(torch.tensor([[0, 1, 0]]), eager=True)[0, 0]
    assert additive[2, 1] == torch.finfo(torch.float32).min and additive[1, 0] == 0 and additive.dtype == torch.float32


@pytest.mark.parametrize("attention", ["flash_attention_2", "flex_attention"])
def test_packed_rows_are_refused_under_an_attention_that_would_not_keep_them_apart(attention):
    # flash cut sequences from the position ids only for a batch of one row; flex added the boolean mask to the
    # scores: a micro-batch of packed rows attended across examples (logits 17 apart from each example alone).
    model = tiny_qwen2(VOCAB, seed=0)
    model.config._attn_implementation = attention
    with pytest.raises(StageFailure, match=f"runs {attention} attention") as refused:
        forward_inputs(model, collate(packed_rows(), 0))
    assert refused.value.failure_class == FailureClass.modeling


@pytest.mark.parametrize(
    ("overrides", "setting"),
    [
        ({"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 0}, "use_sliding_window true"),
        ({"layer_types": ["full_attention", "sliding_attention"], "sliding_window": 4}, "layer_types"),
    ],
)
def test_packed_rows_are_refused_for_a_model_with_sliding_window_attention(overrides, setting):
    # The block-diagonal mask replaces the model's own, window included: packed per-example losses were 4e-3 off.
    from transformers import Qwen2ForCausalLM

    from tests.tiny import tiny_qwen2_config

    model = Qwen2ForCausalLM(tiny_qwen2_config(VOCAB, **overrides))
    with pytest.raises(StageFailure, match=f"sliding-window attention \\({setting}") as refused:
        forward_inputs(model, collate(packed_rows(), 0))
    assert refused.value.failure_class == FailureClass.modeling
    assert "input_ids" in forward_inputs(model, collate([r.unpacked()[0] for r in packed_rows()], 0))  # unpacked: runs


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_flat_packing_fails_the_probe_and_packing_with_boundaries_passes(attention):
    model = tiny_qwen2(VOCAB, seed=3).eval()
    model.config._attn_implementation = attention
    rows = packed_rows()
    worst = probe_packing(model, rows, pad_id=0)
    assert worst <= PROBE_TOLERANCE
    with pytest.raises(StageFailure, match="packing probe") as failed:
        probe_packing(model, rows, pad_id=0, collate_fn=flat_collate)
    assert failed.value.failure_class == FailureClass.infrastructure


def test_a_packed_batch_trains_on_the_loss_of_its_examples_alone():
    """The fine-tune's own loss: summed over a packed batch, it equals the sum over the examples one by one."""
    model = tiny_qwen2(VOCAB, seed=1).eval()
    rows = packed_rows(seed=2)
    alone = [e for row in rows for e in row.unpacked()]
    with torch.no_grad():
        packed, single = token_loss_sum(model, collate(rows, 0)), token_loss_sum(model, collate(alone, 0))
    assert abs(float(packed) - float(single)) < 1e-4 * len(alone)


def test_pack_split_records_each_rows_example_lengths_and_they_survive_the_table():
    examples = [Example(list(range(n)), [-100] + list(range(1, n)), "p", "r") for n in (4, 3, 5, 2, 6)]
    rows = pack_split(examples, max_seq_len=8)
    assert [r.segments for r in rows] == [[4, 3], [5, 2], [6]]
    assert [len(r.input_ids) for r in rows] == [7, 7, 6]
    assert [r.segments for r in table_examples(examples_table(rows))] == [[4, 3], [5, 2], [6]]


def test_the_fine_tune_probes_its_first_packed_batch_and_fails_a_leaking_model_as_infrastructure(monkeypatch):
    batches = StepBatches(packed_rows() * 2, BatchLayout(4, 1, 1), seed=0, rank=0, pad_id=0)
    model = tiny_qwen2(VOCAB, seed=4).eval()
    probe_first_batch(model, batches, rank=0)  # packed rows kept apart: passes

    def ignoring_boundaries(model, batch):  # a forward that drops the position ids and the block mask
        return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}

    monkeypatch.setattr("training.packing.forward_inputs", ignoring_boundaries)
    with pytest.raises(StageFailure, match="packing probe") as failed:
        probe_first_batch(model, batches, rank=0)
    assert failed.value.failure_class == FailureClass.infrastructure
