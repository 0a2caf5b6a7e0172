"""training.modeling: the same loaders read a local model directory and an s3:// prefix."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.conftest import TEST_BUCKET
from training import modeling
from training.data_prep import tokenizer_sha256
from tuneproof.app.tiny_model import DEFAULT_DATA, build_tiny_model, task_corpus
from tuneproof.core.config_data import DataConfig
from tuneproof.core.storage import Storage


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    corpus = itertools.islice(task_corpus(DEFAULT_DATA, DataConfig().system_prompt), 200)
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", corpus, hidden=32)


@pytest.fixture
def model_cache(tmp_path, monkeypatch) -> Path:
    """A private sync cache, so every test really downloads."""
    cache = tmp_path / "model-cache"
    monkeypatch.setattr(modeling, "CACHE_ROOT", cache)
    return cache


def weights(model) -> dict:
    return {name: tensor.clone() for name, tensor in model.state_dict().items()}


def test_local_directory_loads_as_it_is(tiny_dir, model_cache):
    assert modeling.materialize(str(tiny_dir)) == str(tiny_dir)
    model = modeling.load_model(str(tiny_dir))
    assert model.config.hidden_size == 32 and model.config.tie_word_embeddings
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    assert modeling.load_tokenizer(str(tiny_dir)).eos_token == "<|im_end|>"
    assert not model_cache.exists()


def test_pickled_weights_are_refused(tiny_dir, tmp_path):
    """Only safetensors load: a directory holding just a pickled checkpoint is an error, not a load."""
    import shutil

    import torch

    pickled = tmp_path / "pickled"
    shutil.copytree(tiny_dir, pickled)
    (pickled / "model.safetensors").unlink()
    torch.save(modeling.load_model(str(tiny_dir)).state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(OSError, match="safetensors"):
        modeling.load_model(str(pickled))


@pytest.mark.integration
def test_s3_prefix_is_synced_once_and_loads_the_same_model(tiny_dir, model_cache, s3_endpoint):
    import torch

    prefix = f"s3://{TEST_BUCKET}/base-models/tiny"
    Storage(prefix, s3_endpoint).upload_dir(tiny_dir)
    local_dir = modeling.materialize(prefix, s3_endpoint)
    assert Path(local_dir).parent == model_cache and (Path(local_dir) / "model.safetensors").exists()
    assert modeling.materialize(prefix, s3_endpoint) == local_dir  # second call: the synced copy

    from_s3, from_disk = modeling.load_model(prefix, endpoint_url=s3_endpoint), modeling.load_model(str(tiny_dir))
    assert all(torch.equal(a, b) for a, b in zip(weights(from_s3).values(), weights(from_disk).values()))
    config = modeling.load_config(prefix, endpoint_url=s3_endpoint).to_dict()
    assert config.pop("_name_or_path") == local_dir
    assert config == {k: v for k, v in from_disk.config.to_dict().items() if k != "_name_or_path"}
    tok = modeling.load_tokenizer(prefix, endpoint_url=s3_endpoint)
    # Same tokenizer identity wherever it was loaded from, so the dataset hash does not depend on the location.
    assert tokenizer_sha256(tok) == tokenizer_sha256(modeling.load_tokenizer(str(tiny_dir)))
    assert [p.name for p in model_cache.iterdir()] == [Path(local_dir).name]  # no staging dirs left


@pytest.mark.integration
def test_s3_prefix_without_a_model_is_refused(model_cache, s3_endpoint):
    prefix = f"s3://{TEST_BUCKET}/base-models/not-a-model"
    Storage(prefix, s3_endpoint).write_bytes(b"{}", "notes.json")
    with pytest.raises(FileNotFoundError, match="has no config.json"):
        modeling.materialize(prefix, s3_endpoint)
    assert list(model_cache.iterdir()) == []
