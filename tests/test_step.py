"""training.step: the chunked loss equals the full-logits loss in value and gradients, FSDP2 included,
and never asks the lm_head for more rows than one chunk."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from tests.tiny import tiny_qwen2  # noqa: E402
from training.step import (  # noqa: E402
    build_optimizer,
    full_logits_loss_sum,
    optimizer_step,
    set_activation_checkpointing,
    token_loss_sum,
)
from tuneproof.core.hashing import IGNORE_INDEX  # noqa: E402

VOCAB = 96


def batch(seed: int = 1) -> dict:
    """Two sequences: a masked prompt, a padded tail, labelled answer tokens in between."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, VOCAB, (2, 12), generator=g)
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX  # the prompt
    mask = torch.ones_like(ids)
    mask[1, 9:] = 0  # padding
    labels[1, 9:] = IGNORE_INDEX
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    """A one-rank gloo group, as Ray Train gives a CPU worker."""
    import torch.distributed as dist

    if not dist.is_initialized():
        init = f"file://{tmp_path_factory.mktemp('pg') / 'store'}"
        dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def loss_and_grads(model, loss_fn):
    loss = loss_fn(model, batch())
    loss.backward()
    grads = {
        name: p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad for name, p in model.named_parameters()
    }
    return float(loss), grads


def assert_same(reference, chunked) -> None:
    (ref_loss, ref_grads), (loss, grads) = reference, chunked
    assert loss == pytest.approx(ref_loss, rel=1e-6)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-7, msg=f"gradient of {name}")


def test_chunked_loss_matches_full_logits_unsharded():
    reference = loss_and_grads(tiny_qwen2(VOCAB, seed=3), full_logits_loss_sum)
    assert_same(reference, loss_and_grads(tiny_qwen2(VOCAB, seed=3), lambda m, b: token_loss_sum(m, b, chunk_rows=5)))


def test_chunked_loss_matches_under_fsdp2_with_activation_checkpointing(one_rank):
    from training.fsdp import shard_model

    def sharded(checkpointing: str):
        model = tiny_qwen2(VOCAB, seed=4)
        set_activation_checkpointing(model, checkpointing)
        return shard_model(model, torch.device("cpu"), activation_checkpointing=False).train()

    reference = loss_and_grads(sharded("off"), full_logits_loss_sum)
    assert_same(reference, loss_and_grads(sharded("off"), lambda m, b: token_loss_sum(m, b, chunk_rows=4)))
    assert_same(reference, loss_and_grads(sharded("selective"), lambda m, b: token_loss_sum(m, b, chunk_rows=4)))


def test_lm_head_sees_one_chunk_at_a_time():
    model = tiny_qwen2(VOCAB, seed=5)
    rows: list[int] = []
    model.get_output_embeddings().register_forward_hook(lambda _m, args, _o: rows.append(args[0].shape[-2]))
    token_loss_sum(model, batch(), chunk_rows=4).backward()
    labelled = int((batch()["labels"][:, 1:] != IGNORE_INDEX).sum())
    assert rows[0] == 1  # the model's own lm_head call: logits_to_keep=1, one position per sequence
    assert max(rows[1:]) == 4 and sum(rows[1:]) == 2 * labelled  # each chunk, forward then its recompute


def test_optimizer_step_matches_the_full_logits_path(one_rank):
    """The job's step with each loss: the same loss, gradient norm and updated weights."""
    from training.fsdp import shard_model

    def step(loss_fn):
        model = shard_model(tiny_qwen2(VOCAB, seed=6), torch.device("cpu"), activation_checkpointing=False).train()
        optimizer = build_optimizer(model.parameters(), 1e-2, 0.0, torch.device("cpu"))
        targets = int((batch()["labels"][:, 1:] != IGNORE_INDEX).sum())
        loss, norm = optimizer_step(model, optimizer, [batch(1), batch(2)], 2 * targets, 1.0, loss_fn)
        return loss, norm, {n: p.full_tensor() for n, p in model.named_parameters()}

    loss, norm, weights = step(full_logits_loss_sum)
    chunked_loss, chunked_norm, chunked_weights = step(token_loss_sum)
    assert chunked_loss == pytest.approx(loss, rel=1e-6) and chunked_norm == pytest.approx(norm, rel=1e-5)
    for name, weight in weights.items():
        torch.testing.assert_close(chunked_weights[name], weight, rtol=1e-5, atol=1e-6, msg=name)


def test_activation_checkpointing_mode_is_checked():
    with pytest.raises(ValueError, match="off, selective or full, got 'some'"):
        set_activation_checkpointing(tiny_qwen2(VOCAB, seed=0), "some")
