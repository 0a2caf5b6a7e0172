"""LoRA (train.method: lora) without a cluster: the config and the runtime_env dependency it adds,
the wrapping (what trains, what is frozen, how much), and the export (adapter + merged model).

The fine-tune itself under Ray Train (FSDP2, adapter-only checkpoints, DCP resume with loss_rtol 0, the merged
export against the adapter, evaluation of it) is tests/test_lora_pipeline.py, on a pipeline run.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from tasks.rayjob import JobSpec, RayJobRunner
from tests.test_finetune import make_config, write_tiny_model
from training.checkpoint_listing import check_complete
from training.checkpointing import MARKER
from training.lora import ADAPTER_DIR, apply_lora, parameter_counts, write_lora_export
from tuneproof.control.record import RuntimeEnvAdditions
from tuneproof.core import forward_env, markers
from tuneproof.core.config import ConfigError, validate
from tuneproof.core.config_train import PEFT_REQUIREMENT, QWEN2_LINEAR, LoraSettings
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

HIDDEN, LAYERS, VOCAB = 32, 2, 270
MADE_BY = {"run_id": "r1", "invocation": 1, "run_name": "r1"}


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("base") / "tiny-qwen2")


def load_base(base_dir):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)


# ---------------------------------------------------------------- config and runtime_env


def test_lora_defaults_target_every_qwen2_projection():
    cfg = validate({"train": {"method": "lora"}})
    assert cfg.train.lora == LoraSettings(rank=8, alpha=16, dropout=0.05, target_modules=QWEN2_LINEAR)
    assert validate({}).train.method == "full"


def test_bad_lora_settings_are_named():
    with pytest.raises(ConfigError) as info:
        validate({"train": {"method": "lora", "lora": {"rank": 0, "target_modules": [], "dropout": 1.0}}})
    problems = "\n".join(info.value.problems)
    assert "train.lora.rank: Input should be greater than or equal to 1 (got 0)" in problems
    assert "train.lora.target_modules: target_modules must be a non-empty list" in problems
    assert "train.lora.dropout" in problems
    with pytest.raises(ConfigError, match="train.method: Input should be 'full' or 'lora' .*got 'qlora'"):
        validate({"train": {"method": "qlora"}})


@pytest.mark.parametrize(
    ("lora", "why"),
    [
        ({"rank": 10**9}, "train.lora.rank: Input should be less than or equal to 4096"),
        ({"alpha": 10**9}, "train.lora.alpha: Input should be less than or equal to 65536"),
        ({"dropout": float("nan")}, "train.lora.dropout: Input should be a finite number"),
        ({"target_modules": ["q_proj", "../x"]}, "train.lora.target_modules: ['../x'] are not module names"),
        ({"modules_to_save": ["norm", "norm"]}, "train.lora.modules_to_save: must list distinct module names"),
        ({"target_modules": [f"m{i}" for i in range(300)]}, "train.lora.target_modules: 300 module names; at most 256"),
    ],
)
def test_lora_settings_are_bounded(lora, why):
    with pytest.raises(ConfigError) as info:
        validate({"train": {"method": "lora", "lora": lora}})
    assert why in "\n".join(info.value.problems)


def test_a_lora_fine_tune_job_gets_peft_and_the_forwarded_env_and_records_names_only(tmp_path, monkeypatch):
    """peft (a recorded dependency) and guard's forward_env (names recorded, values only in a private file)."""
    monkeypatch.setenv("TUNEPROOF_TEST_FORWARDED", "value-never-recorded")
    cfg = validate(
        {
            "storage": {"root": str(tmp_path)},
            "train": {"method": "lora"},
            "runtime_env": {"forward_env": ["TUNEPROOF_TEST_FORWARDED"], "env_vars": {"LOG_LEVEL": "info"}},
        }
    )
    spec = JobSpec("finetune", "training.finetune", 60, FinetuneSummary)
    client: Any = object()  # runtime_env() builds the request only; nothing is submitted
    env = RayJobRunner(cfg, "r1", client=client).runtime_env(spec, "/wd")
    assert env["pip"] == [PEFT_REQUIREMENT] and env["env_vars"]["LOG_LEVEL"] == "info"
    assert "value-never-recorded" not in json.dumps(env) and forward_env.FILE_VAR in env["env_vars"]
    added = RuntimeEnvAdditions.of(cfg, "training.finetune")
    assert (added.pip, added.forwarded_env) == ([PEFT_REQUIREMENT], ["TUNEPROOF_TEST_FORWARDED"])
    assert "value-never-recorded" not in added.model_dump_json()
    assert RuntimeEnvAdditions.of(cfg, "eval.evaluate_job").forwarded_env == ["TUNEPROOF_TEST_FORWARDED"]


def test_only_a_lora_runs_fine_tune_jobs_get_peft_in_their_runtime_env(tmp_path):
    full = validate({"storage": {"root": str(tmp_path)}, "runtime_env": {"pip": ["emoji==2.0.0"]}})
    lora = validate({**full.model_dump(), "train": {"method": "lora"}})
    assert PEFT_REQUIREMENT == "peft==0.21.2"
    assert full.job_pip() == ["emoji==2.0.0"] and lora.job_pip() == ["emoji==2.0.0", "peft==0.21.2"]
    spec = JobSpec("finetune", "training.finetune", 60, FinetuneSummary)
    client: Any = object()  # runtime_env() builds the request only; nothing is submitted
    assert RayJobRunner(lora, "r1", client=client).runtime_env(spec, "/wd")["pip"] == ["emoji==2.0.0", "peft==0.21.2"]
    assert RayJobRunner(full, "r1", client=client).runtime_env(spec, "/wd")["pip"] == ["emoji==2.0.0"]
    evaluate = JobSpec("evaluate", "eval.evaluate_job", 60, FinetuneSummary)  # loads the merged model: no peft
    assert RayJobRunner(lora, "r1", client=client).runtime_env(evaluate, "/wd")["pip"] == ["emoji==2.0.0"]
    assert "pip" not in RayJobRunner(validate({"storage": {"root": str(tmp_path)}}), "r1", client=client).runtime_env(
        spec, "/wd"
    )
    # The record's "dependencies added at submission" (per job and for the run) come from the same place.
    assert RuntimeEnvAdditions.of(lora).pip == RuntimeEnvAdditions.of(lora, "training.finetune").pip
    assert RuntimeEnvAdditions.of(lora).pip == ["emoji==2.0.0", "peft==0.21.2"]
    assert RuntimeEnvAdditions.of(lora, "eval.evaluate_job").pip == ["emoji==2.0.0"]
    same_pin = validate({"train": {"method": "lora"}, "runtime_env": {"pip": ["peft==0.21.2"]}})
    assert same_pin.job_pip() == ["peft==0.21.2"]


def test_another_peft_pin_is_refused_for_a_lora_run():
    with pytest.raises(ConfigError, match="adds peft==0.21.2 .*got another peft requirement 'PEFT>=0.10': remove it"):
        validate({"train": {"method": "lora"}, "runtime_env": {"pip": ["PEFT>=0.10"]}})
    assert validate({"runtime_env": {"pip": ["peft>=0.10"]}}).job_pip() == ["peft>=0.10"]  # full: the user's choice


# ---------------------------------------------------------------- wrapping


def test_lora_trains_only_the_adapters_and_counts_them(base_dir):
    model = load_base(base_dir)
    base_total = sum(p.numel() for p in model.parameters())
    apply_lora(model, LoraSettings(rank=4), seed=0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert all("lora_" not in n for n in frozen) and "model.embed_tokens.weight" in frozen
    # Each adapted Linear(in, out) adds A (r x in) and B (out x r): r * (in + out).
    shapes = {
        name.rsplit(".", 1)[-1]: (m.in_features, m.out_features)
        for name, m in model.named_modules()
        if name.endswith(tuple(QWEN2_LINEAR)) and hasattr(m, "in_features")
    }
    expected = LAYERS * sum(4 * (i + o) for i, o in shapes.values())
    assert len(shapes) == 7
    assert parameter_counts(model) == (expected, base_total + expected)


def test_adapter_init_is_seeded_and_leaves_the_global_rng_alone(base_dir):
    import torch

    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = load_base(base_dir), load_base(base_dir)
    apply_lora(a, LoraSettings(), seed=7)
    assert torch.equal(torch.get_rng_state(), before)
    apply_lora(b, LoraSettings(), seed=7)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


def test_unknown_target_modules_name_the_layers_there_are(base_dir):
    with pytest.raises(StageFailure, match=r"target_modules \['c_attn'\] match no layer .*'q_proj'") as info:
        apply_lora(load_base(base_dir), LoraSettings(target_modules=["c_attn"]), seed=0)
    assert info.value.failure_class is FailureClass.modeling


# ---------------------------------------------------------------- export


def test_export_holds_the_adapter_and_a_merged_model_with_the_same_logits(base_dir, tmp_path):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    config = make_config(str(tmp_path), base_dir, method="lora")
    model = load_base(base_dir)
    apply_lora(model, config.train.lora, config.train.seed)
    with torch.no_grad():  # B starts at zero (the adapter a no-op): make it say something
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(std=0.5)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    storage = Storage(str(tmp_path))
    manifest = write_lora_export(adapters, 12, config, storage, "runs/r1/model", MADE_BY)

    export = tmp_path / "runs/r1/model"
    assert check_complete(storage, "runs/r1/model") is None
    # One manifest, one content hash over the merged model and the adapter alike (what evaluation records).
    assert {"model.safetensors", f"{ADAPTER_DIR}/adapter_model.safetensors"} <= set(manifest.files)
    assert markers.verify_export(storage, "runs/r1/model").content_sha256 == manifest.content_sha256
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (export / ADAPTER_DIR).iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", MARKER} <= {p.name for p in export.iterdir()}
    merged = AutoModelForCausalLM.from_pretrained(export).eval()  # plain transformers, no peft
    assert not any("lora" in n for n, _ in merged.named_parameters())
    adapted = PeftModel.from_pretrained(load_base(base_dir), export / ADAPTER_DIR).eval()
    ids = torch.tensor([[3, 4, 5, 6, 13, 6, 5, 4, 3, 14]])
    with torch.no_grad():
        want, got, base = adapted(input_ids=ids).logits, merged(input_ids=ids).logits, load_base(base_dir)(ids).logits
    assert torch.allclose(want, got, atol=1e-5, rtol=1e-5), (want - got).abs().max()
    assert not torch.allclose(base, got, atol=1e-3)  # the merge changed the model


def test_a_tied_head_does_not_smuggle_the_frozen_embedding_into_a_checkpoint(base_dir):
    from training.checkpointing import without_frozen

    model = load_base(base_dir)
    assert model.config.tie_word_embeddings
    apply_lora(model, LoraSettings(), seed=0)
    kept = without_frozen(model, model.state_dict())
    assert "lm_head.weight" in model.state_dict() and "lm_head.weight" not in kept
    assert kept and all(".lora_A." in k or ".lora_B." in k for k in kept)


def test_modules_to_save_train_in_full_and_land_in_the_merged_export(base_dir, tmp_path):
    """The tiny random base needs its RMSNorms trainable (train.lora.modules_to_save: [norm]) to fit a task."""
    import torch
    from transformers import AutoModelForCausalLM

    config = make_config(str(tmp_path), base_dir, method="lora", lora={"modules_to_save": ["norm"]})
    model = load_base(base_dir)
    apply_lora(model, config.train.lora, config.train.seed)
    saved = {n for n, p in model.named_parameters() if p.requires_grad and "lora_" not in n}
    assert "model.norm.modules_to_save.default.weight" in saved and len(saved) == 1 + 2 * LAYERS
    with torch.no_grad():
        dict(model.named_parameters())["model.norm.modules_to_save.default.weight"].fill_(3.0)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    write_lora_export(adapters, 1, config, Storage(str(tmp_path)), "runs/r1/model", MADE_BY)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs/r1/model")
    assert torch.equal(merged.model.norm.weight, torch.full_like(merged.model.norm.weight, 3.0))


def test_a_trained_embedding_is_the_tied_head_in_training_checkpoints_and_the_export(base_dir, tmp_path):
    """modules_to_save [embed_tokens] on a tied base: the output layer is the trained copy (one tensor), the
    checkpoint keeps that copy and never the frozen original, and the merged export is tied to the trained values."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.checkpointing import without_frozen

    config = make_config(str(tmp_path), base_dir, method="lora", lora={"modules_to_save": ["embed_tokens"]})
    model = load_base(base_dir)
    apply_lora(model, config.train.lora, config.train.seed)
    trained_embedding = model.model.embed_tokens.modules_to_save["default"].weight
    assert model.lm_head.modules_to_save["default"].weight is trained_embedding and trained_embedding.requires_grad

    # One optimizer step on a loss only the head sees moves the embedding: they are one weight.
    before = trained_embedding.detach().clone()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=1.0)
    model(input_ids=torch.tensor([[3, 4, 5]]), labels=torch.tensor([[3, 4, 5]])).loss.backward()
    optimizer.step()
    assert not torch.equal(before, trained_embedding)

    kept = without_frozen(model, model.state_dict())
    assert "model.embed_tokens.modules_to_save.default.weight" in kept
    assert not any("original_module" in k for k in kept)
    adapters = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    write_lora_export(adapters, 1, config, Storage(str(tmp_path)), "runs/r1/model", MADE_BY)
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "runs/r1/model")
    assert merged.lm_head.weight is merged.model.embed_tokens.weight
    assert torch.equal(merged.model.embed_tokens.weight, trained_embedding.detach())


def test_a_modules_to_save_name_that_matches_nothing_is_named(base_dir):
    with pytest.raises(StageFailure, match=r"modules_to_save \['embed_token'\] match no module") as info:
        apply_lora(load_base(base_dir), LoraSettings(modules_to_save=["embed_token"]), seed=0)
    assert info.value.failure_class == FailureClass.modeling


@pytest.mark.parametrize("head", ["lm_head", "embed_tokens"])
def test_an_adapter_on_a_tied_head_is_refused_for_modules_to_save(base_dir, head):
    # Trained, it changed one side of the tied tensor; merged for the export, both: the exported model's logits
    # were 12 to 57 apart from the trained one's, and evaluation scored the export.
    model = load_base(base_dir)
    assert model.config.tie_word_embeddings
    with pytest.raises(StageFailure, match=f"names {head}, but .*train.lora.modules_to_save instead") as info:
        apply_lora(model, LoraSettings(target_modules=["q_proj", head]), seed=0)
    assert info.value.failure_class == FailureClass.modeling
