"""Load a Qwen model, config or tokenizer from a hub id, a local directory, or an s3:// prefix.

The same path serves `Qwen/Qwen2.5-1.5B` on EKS and the tiny local model here: s3:// prefixes
are synced to local disk first (a cache dir keyed by the objects' content, never by the URI alone:
a prefix rewritten by a rerun gets a new copy), then everything goes through `from_pretrained`. `trust_remote_code` stays off and only safetensors weights load.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from tuneproof.core.storage import Storage

if TYPE_CHECKING:  # transformers imports torch: loaded only where a function loads a model
    import torch
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

    from tuneproof.core.summaries_training import BaseModelFacts

Loaded = TypeVar("Loaded")

CACHE_ROOT = Path(os.environ.get("TUNEPROOF_MODEL_CACHE", Path(tempfile.gettempdir()) / "tuneproof-models"))


def materialize(source: str, endpoint_url: str | None = None) -> str:
    """A from_pretrained-able reference: local dirs and hub ids as they are, s3:// synced to disk.

    The sync writes into a temp dir and renames it into place, so a half-synced copy is never used.
    """
    if not source.startswith("s3://"):
        return source
    key = mirror_key(Storage(source, endpoint_url), endpoint_url)
    target = CACHE_ROOT / key
    if (target / "config.json").exists():
        return str(target)
    CACHE_ROOT.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=CACHE_ROOT, prefix=f".{key}-"))
    try:
        Storage(source, endpoint_url).download_dir(staging)
        if not (staging / "config.json").exists():
            raise FileNotFoundError(f"model source {source} has no config.json: not a Hugging Face model directory")
        try:
            staging.rename(target)
        except OSError:  # another worker on this node finished first; use its copy
            pass
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # gone after a rename; left over only after a failure
    return str(target)


def mirror_key(storage: Storage, endpoint_url: str | None) -> str:
    """The cache key of an S3 prefix: its URI plus every object's name, size and ETag (content-derived),
    so a changed object under the same URI is a cache miss instead of a silently stale model."""
    base = storage.path().rstrip("/")
    try:
        listing = storage.fs.find(base, detail=True)
    except FileNotFoundError:
        listing = {}
    digest = hashlib.sha256(f"{endpoint_url}|{storage.root}".encode())
    for path in sorted(listing):
        info = listing[path]
        digest.update(f"\0{path[len(base) :]}|{info.get('size')}|{info.get('ETag') or info.get('etag')}".encode())
    return digest.hexdigest()[:16]


class ModelUnreadable(OSError):
    """A local model directory that is not a loadable Hugging Face model (no config.json, corrupt or missing weights).

    An OSError, as transformers raises for the same directories, so callers that caught those still do."""


def _from_pretrained(from_pretrained: Callable[..., Loaded], ref: str, **kwargs: Any) -> Loaded:
    """from_pretrained(ref) (a class's from_pretrained); for a local directory, any failure becomes
    ModelUnreadable naming it.

    transformers reports a broken directory as OSError, ValueError or safetensors' own error type,
    often without the path: the job's one-line cause must say which directory to fix."""
    local = Path(ref).is_dir()
    if local and not (Path(ref) / "config.json").is_file():
        raise ModelUnreadable(f"model directory {ref} has no config.json: not a Hugging Face model directory")
    try:
        return from_pretrained(ref, **kwargs)
    except Exception as e:  # noqa: BLE001 - re-raised with the directory named; hub errors pass through
        if not local:
            raise
        raise ModelUnreadable(f"model directory {ref} is not a loadable model: {type(e).__name__}: {e}") from e


def _common(revision: str | None) -> dict[str, Any]:
    return {"revision": revision, "trust_remote_code": False}


def load_config(source: str, revision: str | None = None, endpoint_url: str | None = None) -> PretrainedConfig:
    from transformers import AutoConfig

    return _from_pretrained(AutoConfig.from_pretrained, materialize(source, endpoint_url), **_common(revision))


def load_tokenizer(
    source: str, revision: str | None = None, endpoint_url: str | None = None
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    return _from_pretrained(AutoTokenizer.from_pretrained, materialize(source, endpoint_url), **_common(revision))


SPECIAL_TOKEN = "one of the tokenizer's special tokens, which it reads as that control token and not as text"


def special_token_finder(tokenizer: Any) -> Callable[[str], re.Match[str] | None]:
    """Finds the tokenizer's special tokens (<|im_end|>, <|endoftext|>, ...) written out in a text.

    The tokenizer reads such text as the control token itself, not as its characters: an <|im_end|> in a
    response ends the turn there in training, one in a prompt opens a turn the template never wrote, and
    a reference holding one is an answer no generation gives (it stops at the token). Added tokens that
    are not special (Qwen's <tool_call>) are meant to appear in text and are not looked for."""
    decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
    specials = sorted({t.content for t in decoder.values() if t.special and t.content}, key=len, reverse=True)
    if not specials:
        return lambda text: None
    # One alternation: re factors out the tokens' common prefix ("<|"), so a text without it is one fast scan.
    return re.compile("|".join(map(re.escape, specials))).search


# Model types whose AutoTokenizer resolution, for a local directory naming one of these tokenizer classes
# and no custom code, is that class's own from_pretrained: the data stage loads it directly. AutoTokenizer
# reads the model config first, and transformers' config module imports torch (several CPU seconds of a
# data job that only tokenizes text).
DIRECT_TOKENIZERS = {"qwen2": ("Qwen2Tokenizer", "Qwen2TokenizerFast")}


def load_text_tokenizer(
    source: str, revision: str | None = None, endpoint_url: str | None = None
) -> PreTrainedTokenizerBase:
    """load_tokenizer's tokenizer, without importing torch where the model is a DIRECT_TOKENIZERS one."""
    ref = materialize(source, endpoint_url)
    name = direct_tokenizer_class(Path(ref))
    if name is None:
        return load_tokenizer(ref, revision)
    import transformers

    # transformers exports Qwen2Tokenizer at the top level, lazily, without importing torch; a release
    # that does not is left to AutoTokenizer.
    try:
        tokenizer_class = getattr(transformers, name.removesuffix("Fast"))
    except (AttributeError, ImportError):
        return load_tokenizer(ref, revision)
    return _from_pretrained(tokenizer_class.from_pretrained, ref, **_common(revision))


def direct_tokenizer_class(ref: Path) -> str | None:
    """The tokenizer class to load directly from local directory `ref`, or None for AutoTokenizer to decide
    (a hub id, a model type or class not in DIRECT_TOKENIZERS, custom code, missing or unreadable files)."""
    try:
        model_type = json.loads((ref / "config.json").read_text()).get("model_type")
        tokenizer = json.loads((ref / "tokenizer_config.json").read_text())
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(tokenizer, dict) or "auto_map" in tokenizer or not (ref / "tokenizer.json").is_file():
        return None
    name = tokenizer.get("tokenizer_class")
    return name if name in DIRECT_TOKENIZERS.get(model_type, ()) else None


def base_model_facts(source: str) -> BaseModelFacts | None:
    """BaseModelFacts from base.json in a local model directory (the tiny base's build record), or None:
    a hub id or s3:// prefix, or a directory without one, names no build."""
    from tuneproof.core.summaries_training import BaseModelFacts

    path = Path(source) / "base.json"
    if source.startswith("s3://") or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
        # The build record also keeps its training losses and time: the facts are the fields named here.
        return BaseModelFacts.model_validate({k: v for k, v in record.items() if k in BaseModelFacts.model_fields})
    except (OSError, ValueError, AttributeError) as e:
        raise ModelUnreadable(f"model directory {source}: base.json is not a base model's build record: {e}") from e


def load_model(
    source: str, revision: str | None = None, endpoint_url: str | None = None, dtype: torch.dtype | None = None
) -> PreTrainedModel:
    """AutoModelForCausalLM from safetensors only (use_safetensors=True refuses pickled .bin weights)."""
    from transformers import AutoModelForCausalLM

    return _from_pretrained(
        AutoModelForCausalLM.from_pretrained,
        materialize(source, endpoint_url),
        use_safetensors=True,
        dtype=dtype,
        **_common(revision),
    )
