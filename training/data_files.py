"""A prepared dataset's files: the row schema, parquet shards and manifest.json, written and read back.

Used inside Ray jobs: the data stage (training/data_prep.py) writes a dataset's splits with
`write_splits` and its manifest last; the fine-tune (training/train_data.py) and evaluate
(eval/evaluate_job.py) stages read it with `read_split` and `read_manifest`, every shard checked against
the sha256 the manifest lists. A missing manifest means the dataset is absent or half-written.
"""

from __future__ import annotations

import io
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from training.jobkit import progress
from tuneproof.core import datahash
from tuneproof.core.hashing import sha256_bytes
from tuneproof.core.results import FailureClass, StageFailure, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DatasetManifest, Shard, SplitMeta

SCHEMA = pa.schema(
    [
        ("input_ids", pa.list_(pa.int32())),
        ("labels", pa.list_(pa.int32())),
        ("prompt", pa.string()),  # the rendered chat prompt with the generation prompt, for evaluation
        ("reference", pa.string()),  # the response text
        # data.overflow pack: the lengths of the examples packed into the row, so training can keep them
        # apart (position ids, attention, labels); null for a row of one example.
        ("segments", pa.list_(pa.int32())),
    ]
)


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    prompt: str
    reference: str
    segments: list[int] | None = None
    """Lengths of the examples packed into this row (pack_split); None for one example."""


def write_splits(
    storage: Storage, dataset_path: str, splits: dict[str, pa.Table], shard_rows: int
) -> dict[str, SplitMeta]:
    """Each split's SCHEMA table as parquet shards of shard_rows rows, in order."""
    meta = {}
    for split, table in splits.items():
        shards = []
        for number, (start, end) in enumerate(datahash.shard_ranges(table.num_rows, shard_rows)):
            rel = f"{split}/part-{number:05d}.parquet"
            data = parquet_bytes(table.slice(start, end - start))
            storage.write_bytes(data, dataset_path, rel)
            shards.append(Shard(path=rel, rows=end - start, sha256=sha256_bytes(data)))
        tokens = pc.sum(pc.list_value_length(table.column("input_ids"))).as_py() or 0
        meta[split] = SplitMeta(rows=table.num_rows, tokens=tokens, shards=shards)
    progress("data", 3, 3)
    return meta


def examples_table(examples: list[Example]) -> pa.Table:
    return pa.table(
        {
            "input_ids": [e.input_ids for e in examples],
            "labels": [e.labels for e in examples],
            "prompt": [e.prompt for e in examples],
            "reference": [e.reference for e in examples],
            "segments": [e.segments for e in examples],
        },
        schema=SCHEMA,
    )


def table_examples(table: pa.Table) -> list[Example]:
    columns = [table.column(name).to_pylist() for name in SCHEMA.names]
    return [Example(*row) for row in zip(*columns)]


def parquet_bytes(table: pa.Table) -> bytes:
    """One shard's file. Its chunks are combined first: a shard is written from one contiguous array per
    column, whatever chunks of the split's table it came from (the bytes are those of a table built whole)."""
    buf = io.BytesIO()
    pq.write_table(table.combine_chunks(), buf)
    return buf.getvalue()


def read_manifest(storage: Storage, dataset_path: str) -> DatasetManifest:
    """The manifest of a complete dataset; a missing one means the dataset is absent or half-written."""
    if not storage.exists(dataset_path, "manifest.json"):
        raise StageFailure(
            FailureClass.infrastructure,
            f"dataset {storage.uri(dataset_path)} has no manifest.json: "
            "it is missing or was never completed; rerun the data stage",
        )
    try:
        return DatasetManifest.model_validate(storage.read_json(dataset_path, "manifest.json"))
    except ValueError as e:
        raise StageFailure(
            FailureClass.infrastructure,
            f"dataset {storage.uri(dataset_path)}: manifest.json is not "
            f"a dataset manifest ({one_line(str(e), 200)}); rerun the data stage",
        ) from None


def read_split(storage: Storage, dataset_path: str, split: str) -> pa.Table:
    """One split of a prepared dataset, every shard checked against the manifest's sha256."""
    manifest = read_manifest(storage, dataset_path)
    if split not in manifest.splits:
        raise StageFailure(
            FailureClass.infrastructure,
            f"dataset {storage.uri(dataset_path)} has no split {split!r}; expected one of {sorted(manifest.splits)}",
        )
    tables = [read_shard(storage, dataset_path, shard) for shard in manifest.splits[split].shards]
    return pa.concat_tables(tables) if tables else SCHEMA.empty_table()


def read_shard(storage: Storage, dataset_path: str, shard: Shard) -> pa.Table:
    uri = storage.uri(dataset_path, shard.path)
    try:
        data = storage.read_bytes(dataset_path, shard.path)
    except FileNotFoundError as e:
        raise StageFailure(FailureClass.infrastructure, f"dataset shard {uri} is missing; the manifest lists it") from e
    seen = sha256_bytes(data)
    if seen != shard.sha256:
        raise StageFailure(
            FailureClass.infrastructure,
            f"dataset shard {uri} is corrupt: sha256 {seen[:16]}…, manifest expects {shard.sha256[:16]}…",
        )
    return pq.read_table(io.BytesIO(data), schema=SCHEMA)
