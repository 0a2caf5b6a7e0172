"""The data stage: read the real source, apply the chat template, tokenize, split, write it content-addressed.

Runs inside a Ray job, submitted by tasks/ as

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m training.data_prep

Reads config.data.source (JSONL, CSV or parquet, local or s3://; hf://<name>[:split] where a hub is
reachable), renders each row through the base model's chat template, masks the prompt out of the
labels and writes parquet shards to datasets/<name>/<content-hash>/{train,eval}/ with manifest.json
written last. Rows come in one of three shapes (config.data.shape, tuneproof/core/shapes.py):
columns (a prompt and a response column), template (a prompt laid out from named columns) or
messages (a list of role/content turns; the loss covers assistant turns only, evaluation answers the
last one). The hash covers the source bytes, the field mapping, the system prompt, the tokenizer
files, the prep settings and the shape (with its template), so a rerun with equal inputs is a cache
hit that rewrites nothing. Rows that cannot be used are counted by reason; too many of them fail the
stage as a data failure. From POOL_MIN_ROWS conversations on, the chat template, tokenizing and
fitting run in chunks on Ray actors, one per free CPU of the cluster (training/parallel.py), merged in
order: the same bytes, drops and errors as one process.

This file is the stage's story; its pieces live beside it: training/data_sources.py reads the sources
into conversations and splits them, training/data_overlap.py measures the eval split's and each suite's
overlap with training, training/data_encode.py renders, tokenizes, fits and packs, and
training/data_files.py writes and reads the shards and manifest. The fine-tune and evaluate stages read
the result back with `data_files.read_split`.
"""

from __future__ import annotations

import posixpath
import tempfile
from pathlib import Path
from typing import Any

import pyarrow as pa

from training import parallel
from training.data_encode import ChatRenderer, encode_splits, pack_split
from training.data_files import examples_table, read_manifest, table_examples, write_splits
from training.data_overlap import TrainingSplit, check_contamination, suite_overlaps, template_literals
from training.data_sources import (
    ParsedSources,
    parse_rows,
    read_source,
    resolve_shape,
    shape_identity,
    split_conversations,
    template_dict,
)
from training.jobkit import JobContext, log, progress, run_stage
from training.modeling import load_text_tokenizer
from tuneproof.core import datahash
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_data import DataConfig
from tuneproof.core.hashing import chat_template_sha256, files_sha256, sha256_bytes, sha256_json
from tuneproof.core.results import StageFailure, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import Contamination, DatasetManifest, DataSummary, SourceIdentity, SuiteFile


@parallel.collector_paused()
def prepare_data(ctx: JobContext) -> DataSummary:
    """The stage: sources -> identity -> (cache hit | rows -> splits -> shards -> manifest)."""
    cfg, storage = ctx.config, ctx.storage
    endpoint = cfg.storage.endpoint_url
    source = read_source(cfg.data.source, cfg.data.format, endpoint)
    eval_source = read_source(cfg.data.eval_source, cfg.data.format, endpoint) if cfg.data.eval_source else None
    replay = read_source(cfg.data.replay.source, cfg.data.format, endpoint) if cfg.data.replay else None
    tokenizer = load_text_tokenizer(cfg.model.source, cfg.model.revision, endpoint)
    if not getattr(tokenizer, "chat_template", None):  # it raised a bare ValueError from the first row's rendering
        raise StageFailure(
            "data",
            f"model.source {cfg.model.source}: its tokenizer has no chat template, so no row can be rendered as a "
            "conversation: use a model whose tokenizer ships one (chat_template.jinja, or chat_template in "
            "tokenizer_config.json), as instruct releases do",
        )
    tokenizer_sha = tokenizer_sha256(tokenizer)
    drops = datahash.Drops()
    parsed = parse_rows(source, drops, "source")
    eval_parsed = parse_rows(eval_source, drops, "eval_source") if eval_source else None
    parsed_sources = ParsedSources(parsed, eval_parsed, parse_rows(replay, drops, "replay") if replay else None)
    shape = resolve_shape(cfg.data, parsed)
    source_id, eval_source_id = source.identity(), eval_source.identity() if eval_source else None
    replay_id = replay.identity() if replay else None
    settings = prep_settings(cfg.data, replay_id, bom=any(s.has_bom for s in (source, eval_source, replay) if s))
    content_hash = datahash.content_hash(
        source_id.sha256,
        eval_source_id.sha256 if eval_source_id else None,
        cfg.data.fields.model_dump(),
        cfg.data.system_prompt,
        tokenizer_sha,
        settings,
        shape=shape_identity(cfg.data, shape),
    )
    dataset_path = posixpath.join("datasets", cfg.data.name, content_hash)
    if storage.exists(dataset_path, "manifest.json"):
        log(f"dataset {dataset_path} already prepared: cache hit, nothing rewritten")
        cached = read_manifest(storage, dataset_path)
        check_contamination(cached.contamination, cfg.data.max_contamination)
        # The suites are not part of the dataset's identity (a new suite must not retrain), so they are
        # checked against the training split again; only when there are any, since it re-reads every row.
        train = split_conversations(cfg.data, shape, parsed_sources, datahash.Drops())[0] if cfg.eval.suites else []
        suites = suite_overlaps(cfg, TrainingSplit(train, template_literals(cfg.data)), tokenizer)
        return stage_summary(storage, dataset_path, cached, cache_hit=True, suites=suites)

    splits, total_rows, contamination, suites = build_splits(cfg, shape, tokenizer, parsed_sources, drops)
    enforce_limits(splits, drops, total_rows, cfg.data.max_dropped_fraction)
    manifest = DatasetManifest(
        name=cfg.data.name,
        content_hash=content_hash,
        created_at=now_iso(),
        seed=cfg.data.seed,
        source=source_id,
        eval_source=eval_source_id,
        replay=replay_id,
        tokenizer_sha256=tokenizer_sha,
        settings=settings,
        shape=shape,
        template_sha256=sha256_json(template_dict(cfg.data)) if shape == "template" else None,
        loss_on=cfg.data.loss_on if shape == "messages" else None,
        chat_template_sha256=chat_template_sha256(getattr(tokenizer, "chat_template", None)),
        splits=write_splits(storage, dataset_path, splits, cfg.data.shard_rows),
        dropped=drops.to_json(),
        total_rows=total_rows,
        dropped_fraction=drops.total / total_rows,
        contamination=contamination,
    )
    storage.write_json(manifest.to_json(), dataset_path, "manifest.json")  # last: the dataset counts only from here on
    log(
        f"dataset {dataset_path} ({shape}): train {len(splits['train'])} rows, eval {len(splits['eval'])} rows, dropped {drops.total}"
    )
    return stage_summary(storage, dataset_path, manifest, cache_hit=False, suites=suites)


def prep_settings(data: DataConfig, replay: SourceIdentity | None = None, bom: bool = False) -> dict[str, Any]:
    """Settings that change what is written (max_dropped_fraction only decides pass/fail); `replay` is the
    data.replay file's identity, which its share and bytes put into the dataset's; `bom`: a source starts with
    a UTF-8 byte-order mark."""
    settings: dict[str, Any] = {
        "format": data.format,
        "max_seq_len": data.max_seq_len,
        "overflow": data.overflow,
        "eval_fraction": None if data.eval_source else data.eval_fraction,
        "seed": data.seed,
        "shard_rows": data.shard_rows,
    }
    if data.overflow == "pack":  # packed rows written before the segments column were one flat sequence:
        settings["pack_boundaries"] = "segments"  # a new hash, so such a dataset is never reused
    if bom:  # read without it since 2026-12-06 (its first row was dropped): a new hash, the old dataset never reused
        settings["utf8_bom"] = "stripped"
    if data.replay is not None and replay is not None:  # only when set: datasets without one keep their hash
        settings["replay"] = {"sha256": replay.sha256, "share": data.replay.share}
    return settings


def stage_summary(
    storage: Storage, dataset_path: str, manifest: DatasetManifest, cache_hit: bool, suites: list[SuiteFile]
) -> DataSummary:
    return DataSummary(
        dataset_path=dataset_path,
        dataset_uri=storage.uri(dataset_path),
        content_hash=manifest.content_hash,
        cache_hit=cache_hit,
        manifest=manifest,
        total_rows=manifest.total_rows,
        dropped=manifest.dropped,
        dropped_fraction=manifest.dropped_fraction,
        contamination=manifest.contamination,
        suites=suites,
    )


def build_splits(
    cfg: PipelineConfig, shape: str, tokenizer: Any, parsed: ParsedSources, drops: datahash.Drops
) -> tuple[dict[str, pa.Table], int, Contamination, list[SuiteFile]]:
    """({"train": table, "eval": table} of SCHEMA rows, total rows read, the eval split's overlap with the
    train split, each regression suite's); dropped rows go to drops. Fails before encoding when an overlap is
    over the limit."""
    data = cfg.data
    # In one process a mismatch this renderer finds sends the rest of the run to jinja; pooled on Ray actors, each
    # actor holds its own pickled copy, so a mismatch switches only that actor's later chunks and every chunk
    # checks its own sample (ChatRenderer.fast).
    render = ChatRenderer(tokenizer)
    train_convs, eval_convs, total = split_conversations(data, shape, parsed, drops)
    seen = TrainingSplit(train_convs, template_literals(data))  # hashed once for the eval split and every suite
    contamination = seen.overlap(eval_convs)
    check_contamination(contamination, data.max_contamination)
    suites = suite_overlaps(cfg, seen, tokenizer)
    progress("data", 1, 3, rows=total)
    # Packing serves training only; evaluation needs one prompt per row.
    overflow: dict[str, str] = {"train": data.overflow, "eval": "drop" if data.overflow == "pack" else data.overflow}
    encoded = encode_splits(tokenizer, {"train": train_convs, "eval": eval_convs}, data, render, overflow)
    splits = {name: encoded[name].take(drops) for name in ("train", "eval")}
    if data.overflow == "pack":
        splits["train"] = examples_table(pack_split(table_examples(splits["train"]), data.max_seq_len))
    progress("data", 2, 3, rows=total, dropped=drops.total)
    return splits, total, contamination, suites


def enforce_limits(splits: dict[str, pa.Table], drops: datahash.Drops, total_rows: int, limit: float) -> None:
    """Too many dropped rows, or an empty split, is a data failure; the summary keeps the counts."""
    evidence = DataSummary(
        total_rows=total_rows,
        dropped=drops.to_json(),
        dropped_fraction=drops.total / total_rows if total_rows else None,
    )
    cause = datahash.drop_failure(drops, total_rows, limit)
    if cause:
        raise StageFailure("data", cause, evidence)
    for name, examples in splits.items():
        if examples.num_rows == 0:
            raise StageFailure(
                "data",
                f"the {name} split is empty ({total_rows} rows read, {drops.total} dropped); "
                "expected at least one row: use a larger source or eval_fraction",
                evidence,
            )


def tokenizer_sha256(tokenizer: Any) -> str:
    """A hash over the files the tokenizer saves: what tokenizes, not where it was loaded from."""
    with tempfile.TemporaryDirectory(prefix="tuneproof-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {
            p.relative_to(tmp).as_posix(): sha256_bytes(p.read_bytes()) for p in Path(tmp).rglob("*") if p.is_file()
        }
    return files_sha256(files)


def main() -> None:
    run_stage(prepare_data)


if __name__ == "__main__":
    main()
