"""LoRA (peft) for the fine-tune: adapters on a frozen base, sharded by FSDP2 like the full model.

Used by training/finetune.py when train.method is lora; peft is not in the published Ray image, so
a LoRA run's jobs get it through their runtime_env (PipelineConfig.job_pip, recorded per job).

    base model --apply_lora--> adapters injected in place, base frozen --shard_model--> FSDP2
    checkpoints: the trained parameters (adapters) and their optimizer state only (checkpointing's
        trainable_only); a resume reloads the base from model.source and the adapters from DCP
    export (rank 0): runs/<run>/model/            the merged model (merge_and_unload): what evaluation
                                                  loads and the registry promotes, a plain HF model
                     runs/<run>/model/adapter/    the peft adapter: adapter_config.json + adapter_model.safetensors

The export gathers only the adapter weights; rank 0 rebuilds the adapter on a fresh copy of the
base, so the frozen weights never cross ranks.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_train import LORA_ADAPTER_DIR, LoraSettings
from tuneproof.core.markers import ExportManifest
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage

if TYPE_CHECKING:
    import torch
    from peft import LoraConfig, PeftModel
    from transformers import PreTrainedModel

ADAPTER_DIR = LORA_ADAPTER_DIR
TIED_MODULES = {"embed_tokens", "lm_head"}
"""The modules a tied Qwen2 shares one weight between (tie_word_embeddings)."""


def peft_config(settings: LoraSettings) -> LoraConfig:
    from peft import LoraConfig, TaskType

    return LoraConfig(
        task_type=TaskType.CAUSAL_LM,
        r=settings.rank,
        lora_alpha=settings.alpha,
        lora_dropout=settings.dropout,
        target_modules=list(settings.target_modules),
        modules_to_save=list(settings.modules_to_save) or None,
        # With a tied head (tie_word_embeddings) the embedding IS the output layer: training a copy of one
        # must train the other through the same tensor, as in the base model, or the head stays frozen.
        ensure_weight_tying=bool(TIED_MODULES & {name.rsplit(".", 1)[-1] for name in settings.modules_to_save}),
    )


def apply_lora(model: PreTrainedModel, settings: LoraSettings, seed: int) -> PeftModel:
    """Inject adapters into `model` in place and freeze everything else; returns the PeftModel around it.

    `model` itself keeps working as the causal LM (its target layers now carry the adapters), so it
    is what FSDP2 shards and the loop calls. The adapters' random init draws from `seed` on every
    rank alike (fully_shard keeps each rank's slice of its own copy, so the copies must agree) and
    leaves the global RNG untouched.
    """
    import torch
    from peft import get_peft_model

    # peft skips a modules_to_save name that matches nothing: a typo would silently leave it frozen.
    modules = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    unknown = [n for n in settings.modules_to_save if n.rsplit(".", 1)[-1] not in modules]
    if unknown:
        raise StageFailure(
            FailureClass.modeling,
            f"train.lora.modules_to_save {unknown} match no module of {type(model).__name__}; "
            f"e.g. embed_tokens, norm, lm_head",
        )
    refuse_adapters_on_a_tied_head(model, settings)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        try:
            return get_peft_model(model, peft_config(settings))
        except ValueError as e:
            if "not found in the base model" not in str(e):
                raise
            raise StageFailure(
                FailureClass.modeling,
                f"train.lora.target_modules {settings.target_modules} match no layer of {type(model).__name__}; "
                f"its linear layers are {sorted(linear_names(model))}: name some of those",
            ) from None


def refuse_adapters_on_a_tied_head(model: PreTrainedModel, settings: LoraSettings) -> None:
    """A model whose input embedding and output head are one tensor (tie_word_embeddings) cannot take a LoRA
    adapter on either: trained, the adapter changes one side only, and merging it for the export writes the
    change into the shared tensor, both sides, so the exported model (what evaluation scores and the registry
    serves) is not the one trained (logits 12 to 57 apart on the tiny model). modules_to_save trains the shared
    tensor itself, through ensure_weight_tying, and exports it exactly."""
    named = sorted(TIED_MODULES & {name.rsplit(".", 1)[-1] for name in settings.target_modules})
    if named and getattr(model.config, "tie_word_embeddings", False):
        raise StageFailure(
            FailureClass.modeling,
            f"train.lora.target_modules names {', '.join(named)}, but {type(model).__name__} ties its input "
            "embedding and output head (tie_word_embeddings): an adapter there would export a model other than "
            f"the one trained; list {', '.join(named)} in train.lora.modules_to_save instead",
        )


def linear_names(model: torch.nn.Module) -> set[str]:
    import torch

    return {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}


def parameter_counts(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total) parameters, a tied weight counted once; call before sharding (full sizes)."""
    params = list(model.parameters())  # parameters() yields a shared tensor once
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def trained_state_dict(model: torch.nn.Module) -> dict[str, Any]:
    """The trained parameters (the adapters) unsharded, on CPU, on rank 0 (others: empty). Collective."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    from training.checkpointing import without_frozen

    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)
    return without_frozen(model, get_model_state_dict(model, options=options))


def write_lora_export(
    adapters: dict[str, torch.Tensor],
    step: int,
    cfg: PipelineConfig,
    storage: Storage,
    path: str,
    made_by: dict[str, Any],
) -> ExportManifest:
    """Rank 0: the adapter on a fresh base, saved in peft format, and merged into a full model beside it.

    One manifest (and one content hash) covers both: the merged model's files and adapter/'s."""
    from training.hf_export import write_hf_export

    peft_model = adapted_base(adapters, cfg)
    with tempfile.TemporaryDirectory(prefix="tuneproof-adapter-") as adapter_dir:
        peft_model.save_pretrained(adapter_dir, safe_serialization=True)
        merged = peft_model.merge_and_unload()  # base weights += B @ A * alpha / rank; plain modules again
        return write_hf_export(
            merged.state_dict(),
            step,
            cfg.model,
            cfg.storage.endpoint_url,
            storage,
            path,
            made_by,
            also=lambda export_dir: _copy_tree(Path(adapter_dir), export_dir / ADAPTER_DIR),
        )


def adapted_base(adapters: dict[str, torch.Tensor], cfg: PipelineConfig) -> PeftModel:
    """The base model (fp32, from model.source) with adapters holding the trained values."""
    import torch

    from training.modeling import load_model

    base = load_model(cfg.model.source, cfg.model.revision, cfg.storage.endpoint_url, dtype=torch.float32)
    peft_model = apply_lora(base, cfg.train.lora, cfg.train.seed)
    result = peft_model.get_base_model().load_state_dict(adapters, strict=False)
    trained = {name for name, p in peft_model.get_base_model().named_parameters() if p.requires_grad}
    unfilled = trained & set(result.missing_keys)
    if result.unexpected_keys or unfilled:
        raise RuntimeError(
            f"adapter weights do not fit the adapters built from train.lora: unexpected {result.unexpected_keys[:3]}, "
            f"missing {sorted(unfilled)[:3]}"
        )
    return peft_model


def _copy_tree(src: Path, dest: Path) -> None:
    import shutil

    shutil.copytree(src, dest)
