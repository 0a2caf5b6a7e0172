"""The fine-tune's final export: a Hugging Face model directory with its manifest and marker, and its publication.

`write_hf_export` (rank 0 of the fine-tune's workers, training/finetune_saving.py; training/lora.py for
a merged LoRA model) writes safetensors, the config, the base's tokenizer and generation files, the
manifest (tuneproof-export.json: every file's sha256, one content hash, the run that made it) and the
marker last; `publish_export` writes one from a local directory. Runs inside Ray jobs.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from training.checkpoint_listing import write_marker
from training.checkpointing import MARKER
from tuneproof.core import markers
from tuneproof.core.markers import ExportManifest
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage


class ModelRef(Protocol):
    """Where the base model is: config.model (ModelConfig), or anything with the same two fields (bench/gpu_check.py
    runs the export without the pipeline's config)."""

    source: str
    revision: str | None


# Files of a base model directory that the export carries over unchanged (all but weights and config).
_BASE_FILES = re.compile(
    r"^(tokenizer.*|special_tokens_map\.json|added_tokens\.json|vocab\.(json|txt)|merges\.txt"
    r"|chat_template\.(jinja|json)|.*\.model|.*\.tiktoken|generation_config\.json)$"
)


def write_hf_export(
    state: dict,
    step: int,
    model_cfg: ModelRef,
    endpoint_url: str | None,
    storage: Storage,
    path: str,
    made_by: dict[str, Any],
    also: Callable[[Path], None] | None = None,
) -> ExportManifest:
    """Write the full state dict as a Hugging Face model at storage `path`: files, manifest, marker last.

    made_by names the producer for the manifest: run_id, invocation and run_name (the Ray Train run).

    The weights take the base config's dtype (fp32 when it names none); tokenizer and generation
    config come from the base model, so the export loads and generates like the base does.
    `also` writes further files into the export directory (the LoRA adapter) before it is hashed and
    uploaded: the manifest's content hash and the marker cover them.
    """
    import torch
    from transformers import AutoModelForCausalLM

    from training.modeling import load_config, materialize

    config = load_config(model_cfg.source, model_cfg.revision, endpoint_url)
    with torch.device("meta"):  # no random init: every tensor comes from `state`
        model = AutoModelForCausalLM.from_config(config)
    model.load_state_dict(state, assign=True)
    model.tie_weights()
    dtype = config.dtype if isinstance(config.dtype, torch.dtype) else getattr(torch, config.dtype or "float32")
    with tempfile.TemporaryDirectory(prefix="tuneproof-export-") as tmp:
        model.to(dtype).save_pretrained(tmp, safe_serialization=True)
        copy_base_files(materialize(model_cfg.source, endpoint_url), model_cfg, endpoint_url, Path(tmp))
        if also is not None:
            also(Path(tmp))
        return publish_export(storage, tmp, path, step, made_by)


def publish_export(
    storage: Storage, local_dir: str | Path, path: str, step: int, made_by: dict[str, Any]
) -> ExportManifest:
    """Upload a finished local export to storage `path`, emptied first: files, then its manifest, then the
    marker last."""
    storage.remove(path, MARKER)  # an earlier, superseded export stops counting before any file changes
    # None of its files stays either: the folder loads as a whole, and one this export lacks (an adapter of
    # an earlier LoRA export) would load with it unhashed.
    storage.remove(path, recursive=True)
    storage.upload_dir(local_dir, path)
    files = markers.local_digests(local_dir)
    manifest = ExportManifest(
        content_sha256=markers.content_sha256(files),
        files=markers.content_files(files),
        step=step,
        written_at=now_iso(),
        **made_by,
    )
    storage.write_bytes(manifest.model_dump_json(indent=1).encode(), path, markers.EXPORT_MANIFEST)
    listed = {**files, **markers.stored_digests(storage, path, names=[markers.EXPORT_MANIFEST])}
    write_marker(storage, step, listed, path)
    return manifest


def copy_base_files(source_ref: str, model_cfg: ModelRef, endpoint_url: str | None, out_dir: Path) -> None:
    """Tokenizer and generation config of the base: copied from a local directory, re-saved from a hub id."""
    if os.path.isdir(source_ref):
        for file in sorted(Path(source_ref).iterdir()):
            if file.is_file() and _BASE_FILES.match(file.name):
                shutil.copy2(file, out_dir / file.name)
        return
    from training.modeling import load_tokenizer

    load_tokenizer(model_cfg.source, model_cfg.revision, endpoint_url).save_pretrained(out_dir)
