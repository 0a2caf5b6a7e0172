"""The export folder is exactly its manifest: a file the manifest does not list fails verification, and a
re-export leaves none of the earlier export's files behind.

A Hugging Face folder loads as a whole (from_pretrained attaches an adapter_config.json beside the weights),
so a file the manifest does not hash would change the model that evaluate scored and promote copies.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.conftest import TEST_BUCKET
from tests.test_registry import MODELS_DIR, NAME, card
from training.hf_export import publish_export
from tuneproof.control.registry import promote
from tuneproof.core import markers
from tuneproof.core.storage import Storage

MADE_BY = {"run_id": "r1", "invocation": 1, "run_name": "r1"}


def built_export(directory: Path, **extra: bytes) -> Path:
    """A local export folder: config, weights and any `extra` files (name -> bytes)."""
    directory.mkdir(parents=True)
    (directory / "config.json").write_text('{"model_type": "qwen2"}')
    (directory / "model.safetensors").write_bytes(b"weights")
    for name, data in extra.items():
        (directory / name).write_bytes(data)
    return directory


def test_a_file_the_manifest_does_not_list_fails_verification_by_name(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    manifest = publish_export(storage, built_export(tmp_path / "built"), "runs/r1/model", 10, MADE_BY)
    storage.write_bytes(b"{}", "runs/r1/model", "MODEL_CARD.md")  # describes the model, is not part of it
    assert markers.verify_export(storage, "runs/r1/model").content_sha256 == manifest.content_sha256

    storage.write_bytes(b'{"peft_type": "LORA"}', "runs/r1/model", "adapter_config.json")
    with pytest.raises(markers.ExportUnverified, match=r"adapter_config\.json \(not listed in the manifest\)"):
        markers.verify_export(storage, "runs/r1/model")
    local = Path(storage.path("runs/r1/model"))  # the mirrored copy is what loads: it is checked the same way
    with pytest.raises(markers.ExportUnverified, match=r"adapter_config\.json \(not listed"):
        markers.verify_export(storage, "runs/r1/model", local_dir=local)


def test_a_re_export_leaves_no_file_of_the_earlier_export(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    earlier = built_export(tmp_path / "earlier", **{"adapter_config.json": b"{}", "adapter_model.safetensors": b"a"})
    publish_export(storage, earlier, "runs/r1/model", 10, MADE_BY)
    manifest = publish_export(storage, built_export(tmp_path / "later"), "runs/r1/model", 20, MADE_BY)
    assert sorted(storage.listdir("runs/r1/model")) == sorted(
        ["config.json", "model.safetensors", markers.EXPORT_MANIFEST, markers.COMPLETION_MARKER]
    )
    assert markers.verify_export(storage, "runs/r1/model").content_sha256 == manifest.content_sha256


def test_promotion_refuses_an_export_with_an_unlisted_file_and_keeps_no_copy(tmp_path):
    storage = Storage(str(tmp_path / "store"))
    manifest = publish_export(storage, built_export(tmp_path / "built"), "runs/r1/model", 10, MADE_BY)
    storage.write_bytes(b"a", "runs/r1/model", "adapter_model.safetensors")
    with pytest.raises(markers.ExportUnverified, match=r"adapter_model\.safetensors \(not listed"):
        promote(storage, NAME, "r1", "runs/r1/model", card("r1"), None, content_sha256=manifest.content_sha256)
    assert storage.listdir(MODELS_DIR, NAME) == []


@pytest.mark.integration
def test_on_s3_a_re_export_leaves_no_stray_and_an_unlisted_file_is_named(s3_endpoint, tmp_path):
    storage = Storage(f"s3://{TEST_BUCKET}/hf-export", s3_endpoint)
    earlier = built_export(tmp_path / "earlier", **{"adapter_config.json": b"{}"})
    publish_export(storage, earlier, "runs/r1/model", 10, MADE_BY)
    manifest = publish_export(storage, built_export(tmp_path / "later"), "runs/r1/model", 20, MADE_BY)
    assert not storage.exists("runs/r1/model", "adapter_config.json")
    assert markers.verify_export(storage, "runs/r1/model").content_sha256 == manifest.content_sha256
    storage.write_bytes(b"a", "runs/r1/model", "adapter_model.safetensors")
    with pytest.raises(markers.ExportUnverified, match=r"adapter_model\.safetensors \(not listed"):
        markers.verify_export(storage, "runs/r1/model")
