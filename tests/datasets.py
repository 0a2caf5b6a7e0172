"""Prepared datasets for tests: shards and a complete manifest, written the way the data stage writes them."""

from __future__ import annotations

from training.data_files import Example, examples_table, write_splits
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DatasetManifest, SourceIdentity


def write_prepared(
    storage: Storage,
    path: str,
    name: str,
    splits: dict[str, list[Example]],
    shard_rows: int = 4096,
    chat_template_sha256: str | None = None,
) -> DatasetManifest:
    """Parquet shards per split, then manifest.json last; the source identity is a stand-in, the chat
    template hash that of the template the rows were rendered with, where the test knows it."""
    meta = write_splits(storage, path, {split: examples_table(rows) for split, rows in splits.items()}, shard_rows)
    total = sum(len(examples) for examples in splits.values())
    manifest = DatasetManifest(
        name=name,
        content_hash=path.rsplit("/", 1)[-1],
        created_at=now_iso(),
        seed=0,
        source=SourceIdentity(uri="generated-by-test", sha256="0" * 64, bytes=0),
        tokenizer_sha256="0" * 64,
        settings={},
        chat_template_sha256=chat_template_sha256,
        splits=meta,
        total_rows=total,
        dropped_fraction=0.0,
    )
    storage.write_json(manifest.to_json(), path, "manifest.json")
    return manifest
