"""Content hashes: the one definition of how tuneproof names bytes, JSON documents and sets of files.

A verdict is bound to what it judged by these hashes (a dataset, a checkpoint's shards, an exported
model), so every writer and every checker must compute them the same way. Pure.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

IGNORE_INDEX = -100
"""Label value that the loss skips (prompt tokens, padding): Hugging Face's and torch's convention."""


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_json(obj: Any) -> str:
    """The hash of a JSON document in canonical form (sorted keys, no whitespace)."""
    return sha256_bytes(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode())


def files_sha256(file_hashes: dict[str, str]) -> str:
    """One hash over a set of files given as {relative name: sha256 of its bytes}; the order does not matter."""
    return sha256_json(sorted(file_hashes.items()))


def chat_template_sha256(template: str | dict[str, str] | None) -> str | None:
    """The hash of a tokenizer's chat template (its `chat_template`: one jinja string, or named ones), which
    decides how a conversation is rendered into a prompt; None for a tokenizer without one."""
    if template is None:
        return None
    return sha256_bytes(template.encode()) if isinstance(template, str) else sha256_json(template)
