"""Memory as evidence: the fit estimate (tuneproof.core.fit, training.memory), the refusal of a configuration
that cannot fit the verified cluster's GPUs before any Ray Train run starts, and each rank's peak."""

from __future__ import annotations

import json

import pytest

from tuneproof.core.fit import GIB, ParamCounts, estimate, gpu_capacity, refusal, shard_degree
from tuneproof.core.summaries import NodeFacts, VerifySummary

COUNTS = ParamCounts(total=1000, trainable=1000, root=200, layer=100, layers=8)


def test_estimate_adds_the_sharded_state_the_gathered_copies_activations_and_the_loss_chunk():
    fit = estimate(COUNTS, degree=4, gpu=True, activation_bytes=5000, loss_chunk_elements=10)
    assert (fit.params_bytes, fit.grads_bytes, fit.optimizer_bytes) == (1000, 1000, 2000)
    assert fit.gathered_bytes == 2 * (200 + 2 * 100)  # bf16: the root group and two layers
    assert fit.loss_bytes == 120 and fit.activation_bytes == 5000
    assert fit.total_bytes == 1000 + 1000 + 2000 + 800 + 5000 + 120
    ddp = estimate(COUNTS, degree=1, gpu=False, activation_bytes=0, loss_chunk_elements=0, replicated_layers=True)
    assert ddp.params_bytes == 4000 and ddp.gathered_bytes == 4 * 1000  # fp32 on CPU, every layer kept


def test_lora_state_covers_only_the_adapters():
    lora = estimate(ParamCounts(1000, 10, 200, 100, 8), degree=1, gpu=True, activation_bytes=0, loss_chunk_elements=0)
    assert (lora.params_bytes, lora.grads_bytes, lora.optimizer_bytes) == (4000, 40, 80)


@pytest.mark.parametrize(
    ("sharding", "world", "group", "degree"),
    [("full", 8, None, 8), ("ddp", 8, None, 1), ("hybrid", 8, 4, 4), ("hybrid", 8, None, 8)],
)
def test_shard_degree_follows_the_mesh(sharding, world, group, degree):
    assert shard_degree(sharding, world, group) == degree


def test_capacity_is_the_smallest_gpu_of_a_live_node():
    nodes = [
        NodeFacts(node_id="h", node_ip="1", is_head=True),
        NodeFacts(node_id="a", node_ip="2", is_head=False, gpu_memory_bytes=[80 * GIB, 80 * GIB]),
        NodeFacts(node_id="b", node_ip="3", is_head=False, gpu_memory_bytes=[24 * GIB]),
        NodeFacts(node_id="c", node_ip="4", is_head=False, alive=False, gpu_memory_bytes=[16 * GIB]),
    ]
    assert gpu_capacity(nodes) == 24 * GIB
    assert gpu_capacity(nodes[:1]) is None


def test_no_refusal_when_it_fits_or_the_capacity_is_unknown():
    fit = estimate(COUNTS, 1, True, 0, 0)
    assert refusal(fit, 1) is None
    assert refusal(fit.model_copy(update={"capacity_bytes": fit.total_bytes}), 1) is None
    assert "per GPU" in (refusal(fit.model_copy(update={"capacity_bytes": fit.total_bytes - 1}), 1) or "")


# ---------------------------------------------------------------- the planted cluster

QWEN25_1_5B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "vocab_size": 151936,
    "hidden_size": 1536,
    "intermediate_size": 8960,
    "num_hidden_layers": 28,
    "num_attention_heads": 12,
    "num_key_value_heads": 2,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
}
"""Qwen/Qwen2.5-1.5B's config.json (the fields that size it): the estimate reads no weights."""


@pytest.fixture
def planted(tmp_path):
    """A saved verify result of a cluster whose GPU nodes report 24 GiB GPUs (L4s), and the base model's
    config.json; returns (capacity read back from the saved JSON, model directory)."""
    verified = VerifySummary(
        nodes=[
            NodeFacts(node_id="head", node_ip="10.0.1.10", is_head=True),
            NodeFacts(
                node_id="w1", node_ip="10.0.2.20", is_head=False, gpus_advertised=4, gpu_memory_bytes=[24 * GIB] * 4
            ),
            NodeFacts(
                node_id="w2", node_ip="10.0.2.21", is_head=False, gpus_advertised=4, gpu_memory_bytes=[24 * GIB] * 4
            ),
        ],
        findings=[],
        cluster={"nodes": []},
    )
    saved = tmp_path / "verify-result.json"
    saved.write_text(json.dumps(verified.to_json()))
    model = tmp_path / "qwen2.5-1.5b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(QWEN25_1_5B_CONFIG))
    return gpu_capacity(VerifySummary.model_validate_json(saved.read_text()).nodes), model


def context(tmp_path, model, capacity: int, **train):
    from training.jobkit import JobContext
    from tuneproof.core.config import PipelineConfig

    config = PipelineConfig.model_validate(
        {
            "storage": {"root": str(tmp_path / "store")},
            "model": {"source": str(model)},
            "data": {"max_seq_len": 2048},
            "train": {"use_gpu": True, "num_workers": 8, **train},
        }
    )
    return JobContext("run-fit", "finetune", config, {"dataset": "datasets/d/h", "gpu_memory_bytes": capacity})


def test_a_configuration_that_cannot_fit_is_refused_before_any_ray_train_run(planted, tmp_path, monkeypatch):
    from training import finetune
    from tuneproof.core.results import FailureClass, StageFailure

    capacity, model = planted

    def no_run(*_args):
        raise AssertionError("a Ray Train run was started for a configuration that cannot fit")

    monkeypatch.setattr(finetune, "run_trainer", no_run)
    with pytest.raises(StageFailure) as refused:
        finetune.finetune(context(tmp_path, model, capacity, micro_batch_size=8))
    assert refused.value.failure_class == FailureClass.infrastructure
    cause = refused.value.cause
    assert "per GPU" in cause and "smallest GPU has 24.0 GiB" in cause and "train.micro_batch_size (now 8)" in cause
    needed = float(cause.split("needs about ")[1].split(" GiB")[0])
    assert needed > 24.0  # 8 x 2,048 tokens of activations alone are about 47 GiB in bf16


def test_the_same_model_fits_with_one_sequence_and_activation_checkpointing(planted, tmp_path):
    from training.finetune import check_fit
    from training.finetune_state import TrainParams

    capacity, model = planted
    ctx = context(tmp_path, model, capacity, micro_batch_size=1, activation_checkpointing=True)
    fit = check_fit(ctx, TrainParams.resolve(ctx))
    assert fit is not None and fit.capacity_bytes == 24 * GIB and fit.total_bytes < fit.capacity_bytes
    assert fit.shard_degree == 8 and fit.params_bytes == 4 * 1_543_714_304 // 8


def test_a_rank_records_its_peak_memory():
    import torch

    from training.memory import rank_memory

    memory = rank_memory(3, torch.device("cpu"))
    assert memory.rank == 3 and memory.device == "cpu" and memory.peak_rss_bytes > 50 * 2**20
    assert memory.max_allocated_bytes is None
