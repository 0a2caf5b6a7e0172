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

The fine-tune and evaluate stages read the result back with `read_split`.
"""

from __future__ import annotations

import contextlib
import csv
import hashlib
import io
import json
import posixpath
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from eval.suites import read_suite
from training import parallel
from training.contamination import measure as measure_overlap
from training.contamination import shared_texts
from training.jobkit import JobContext, log, progress, run_stage
from training.modeling import load_text_tokenizer
from tuneproof.core import datahash, shapes
from tuneproof.core.config import DataConfig, PipelineConfig
from tuneproof.core.hashing import chat_template_sha256
from tuneproof.core.results import FailureClass, StageFailure, now_iso, one_line
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import (
    Contamination,
    DatasetManifest,
    DataSummary,
    Shard,
    SourceIdentity,
    SplitMeta,
    SuiteFile,
)

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
# Conversations per batched chat-template call: large enough that the call's set-up is noise, small
# enough that a conversation the template rejects sends only its own chunk down the one-by-one path.
RENDER_CHUNK = 1024
# Chat templates rendered in plain Python, by the sha256 of the exact template string: a template edited by
# one character is not one of these and goes through jinja. Even a known one is checked against jinja on
# every batch's sample (ChatRenderer); jinja is what defines the text.
CHATML_TEMPLATE_SHA256 = "2eefca287a0f008b170ce31bc2c4dabb398a64eb74716bf64db5d9a21da50da9"
"""Plain ChatML, no default system turn: the tiny Qwen2's (tuneproof/app/tiny_model.py CHAT_TEMPLATE)."""
POOL_MIN_ROWS = 20_000
"""Conversations from which encoding runs on Ray actors: below it, a job of a few thousand rows takes well
under a second here and starting and feeding actors would cost about what they save."""
POOL_CHUNK_ROWS = 4096
"""Conversations per actor task: thousands, so each task's batched template and tokenizer calls keep their
batching, and enough tasks that the workers finish close together."""
VERIFY_FIRST, VERIFY_SPREAD = 64, 16
"""Conversations of each plain-Python batch that jinja renders too: the first ones, and some spread through the rest."""
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class Source:
    uri: str
    data: bytes
    format: str

    def identity(self) -> SourceIdentity:
        return SourceIdentity(uri=self.uri, sha256=datahash.sha256_bytes(self.data), bytes=len(self.data))


@dataclass
class Conversation:
    where: str  # "source" or "eval_source"
    row: int  # row index in that file, for drop evidence
    parts: dict[str, str]  # columns and template shapes: prompt, response[, system]
    messages: shapes.Messages | None = None  # messages shape: the turns, through the last assistant one

    def split_key(self) -> str:
        return datahash.split_key(self.parts if self.messages is None else {"messages": self.messages})


Parsed = tuple[list[tuple[int, Any]], int]  # ([(row index, record)], rows read)


@dataclass
class ParsedSources:
    source: Parsed
    eval_source: Parsed | None  # None: the eval split is cut from the source
    replay: Parsed | None  # data.replay's rows, for the training split only


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]
    prompt: str
    reference: str
    segments: list[int] | None = None
    """Lengths of the examples packed into this row (pack_split); None for one example."""


@parallel.collector_paused()
def prepare_data(ctx: JobContext) -> DataSummary:
    """The stage: sources -> identity -> (cache hit | rows -> splits -> shards -> manifest)."""
    cfg, storage = ctx.config, ctx.storage
    endpoint = cfg.storage.endpoint_url
    source = read_source(cfg.data.source, cfg.data.format, endpoint)
    eval_source = read_source(cfg.data.eval_source, cfg.data.format, endpoint) if cfg.data.eval_source else None
    replay = read_source(cfg.data.replay.source, cfg.data.format, endpoint) if cfg.data.replay else None
    tokenizer = load_text_tokenizer(cfg.model.source, cfg.model.revision, endpoint)
    tokenizer_sha = tokenizer_sha256(tokenizer)
    drops = datahash.Drops()
    parsed = parse_rows(source, drops, "source")
    eval_parsed = parse_rows(eval_source, drops, "eval_source") if eval_source else None
    parsed_sources = ParsedSources(parsed, eval_parsed, parse_rows(replay, drops, "replay") if replay else None)
    shape = resolve_shape(cfg.data, parsed)
    source_id, eval_source_id = source.identity(), eval_source.identity() if eval_source else None
    replay_id = replay.identity() if replay else None
    settings = prep_settings(cfg.data, replay_id)
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
        suites = suite_overlaps(cfg, train)
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
        template_sha256=shapes.template_sha256(template_dict(cfg.data)) if shape == "template" else None,
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


def prep_settings(data: DataConfig, replay: SourceIdentity | None = None) -> dict[str, Any]:
    """Settings that change what is written (max_dropped_fraction only decides pass/fail); `replay` is the
    data.replay file's identity, which its share and bytes put into the dataset's."""
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
    if data.replay is not None and replay is not None:  # only when set: datasets without one keep their hash
        settings["replay"] = {"sha256": replay.sha256, "share": data.replay.share}
    return settings


def resolve_shape(data: DataConfig, parsed: Parsed) -> str:
    """data.shape, or for auto the shape of the first decodable row; logged, since auto decides it."""
    rows, _ = parsed
    shape = shapes.resolve_shape(
        data.shape, rows[0][1] if rows else None, data.messages_column, data.template is not None
    )
    log(f"rows read as shape {shape}" + (" (auto)" if data.shape == "auto" else ""))
    return shape


def template_dict(data: DataConfig) -> dict[str, str]:
    return data.template.model_dump() if data.template else {}


def shape_identity(data: DataConfig, shape: str) -> dict[str, Any] | None:
    return shapes.shape_identity(shape, template_dict(data), data.messages_column, data.loss_on)


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


# ---- reading sources -------------------------------------------------------------------------


def read_source(uri: str, fmt: str, endpoint_url: str | None) -> Source:
    """The source's bytes and format; an unreadable source is a data failure naming it."""
    if uri.startswith("hf://") or fmt == "hf":
        return read_hub_dataset(uri)
    fmt = fmt if fmt != "auto" else format_from_extension(uri)
    try:
        data = Storage(uri, endpoint_url).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise StageFailure("data", f"data source {uri} is unreadable: {type(e).__name__}: {e}") from e
    log(f"read {len(data)} bytes from {uri} ({fmt})")
    return Source(uri, data, fmt)


def format_from_extension(uri: str) -> str:
    ext = posixpath.splitext(uri)[1].lower()
    if ext not in EXTENSIONS:
        raise StageFailure(
            "data",
            f"cannot tell the format of {uri} from its extension {ext!r}; expected one of "
            f"{sorted(EXTENSIONS)} or set data.format to jsonl, csv or parquet",
        )
    return EXTENSIONS[ext]


def read_hub_dataset(uri: str) -> Source:
    """hf://<name>[:split] through datasets.load_dataset, re-serialised as parquet so it hashes and parses like a file."""
    name, _, split = uri.removeprefix("hf://").partition(":")
    try:
        import datasets

        ds = datasets.load_dataset(name, split=split or "train")
        buf = io.BytesIO()
        ds.to_parquet(buf)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, no such split: all mean "cannot read the source"
        raise StageFailure(
            "data",
            f"data source {uri} could not be loaded from the Hugging Face hub (is a hub reachable "
            f"from the cluster, and does dataset {name!r} have split {split or 'train'!r}?): {type(e).__name__}: {e}",
        ) from e
    return Source(uri, buf.getvalue(), "parquet")


def parse_rows(source: Source, drops: datahash.Drops, where: str) -> tuple[list[tuple[int, Any]], int]:
    """([(row index, record)], total rows); undecodable rows go straight to drops."""
    parse = {"jsonl": parse_jsonl, "csv": parse_csv, "parquet": parse_parquet}[source.format]
    rows, total = [], 0
    for index, record, problem in parse(source):
        total += 1
        if problem is not None:
            drops.add("undecodable", where, index, problem)
        else:
            rows.append((index, record))
    return rows, total


def parse_jsonl(source: Source):
    """Yields (row, record, None) or (row, None, raw bytes); blank lines are not rows."""
    lines = [line for line in source.data.split(b"\n") if line.strip()]
    for index, line in enumerate(lines):
        try:
            yield index, json.loads(line.decode("utf-8")), None
        except (UnicodeDecodeError, ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            yield index, None, line


def parse_csv(source: Source):
    """Yields (row, record, None) or (row, None, raw values); a header row names the columns."""
    # surrogateescape keeps going past bytes that are not UTF-8, so only the rows holding them are lost.
    text = source.data.decode("utf-8", errors="surrogateescape")
    for index, record in enumerate(csv.DictReader(io.StringIO(text, newline=""))):
        values = [v for v in record.values() if isinstance(v, str)]
        if any(not _is_utf8(v) for v in values):
            yield index, None, [v.encode("utf-8", errors="surrogateescape") for v in values]
        else:
            yield index, record, None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_parquet(source: Source):
    try:
        table = pq.read_table(io.BytesIO(source.data))
    except (pa.ArrowException, OSError) as e:
        raise StageFailure("data", f"data source {source.uri} is not a readable parquet file: {e}") from e
    for index, record in enumerate(table.to_pylist()):
        yield index, record, None


# ---- rows -> examples -> splits ----------------------------------------------------------------


def build_splits(
    cfg: PipelineConfig, shape: str, tokenizer, parsed: ParsedSources, drops: datahash.Drops
) -> tuple[dict[str, pa.Table], int, Contamination, list[SuiteFile]]:
    """({"train": table, "eval": table} of SCHEMA rows, total rows read, the eval split's overlap with the
    train split, each regression suite's); dropped rows go to drops. Fails before encoding when an overlap is
    over the limit."""
    data = cfg.data
    render = ChatRenderer(tokenizer)  # one per run: a mismatch found in the train split holds for the eval split
    train_convs, eval_convs, total = split_conversations(data, shape, parsed, drops)
    contamination = contamination_of(train_convs, eval_convs, template_literals(data))
    check_contamination(contamination, data.max_contamination)
    suites = suite_overlaps(cfg, train_convs)
    progress("data", 1, 3, rows=total)
    # Packing serves training only; evaluation needs one prompt per row.
    overflow: dict[str, str] = {"train": data.overflow, "eval": "drop" if data.overflow == "pack" else data.overflow}
    encoded = encode_splits(tokenizer, {"train": train_convs, "eval": eval_convs}, data, render, overflow)
    splits = {name: encoded[name].take(drops) for name in ("train", "eval")}
    if data.overflow == "pack":
        splits["train"] = examples_table(pack_split(table_examples(splits["train"]), data.max_seq_len))
    progress("data", 2, 3, rows=total, dropped=drops.total)
    return splits, total, contamination, suites


def split_conversations(
    data: DataConfig, shape: str, parsed: ParsedSources, drops: datahash.Drops
) -> tuple[list[Conversation], list[Conversation], int]:
    """(train conversations, eval conversations, rows read): the seeded split, or eval_source as the eval
    split; then data.replay's rows added to the training split."""
    convs, total = conversations(parsed.source, data, shape, drops, "source")
    if parsed.eval_source is None:
        keys = [c.split_key() for c in convs]
        train_idx, eval_idx = datahash.split_indices(keys, data.eval_fraction, data.seed)
        train, eval_convs = [convs[i] for i in train_idx], [convs[i] for i in eval_idx]
    else:
        eval_convs, eval_total = conversations(parsed.eval_source, data, shape, drops, "eval_source")
        train, total = (
            [convs[rank] for rank in datahash.rank_for_split([c.split_key() for c in convs], data.seed)],
            total + eval_total,
        )
    if parsed.replay is None or data.replay is None:
        return train, eval_convs, total
    replay_convs, replay_total = conversations(parsed.replay, data, shape, drops, "replay")
    if not replay_convs:
        raise StageFailure(
            FailureClass.data, f"data.replay.source {data.replay.source}: no usable rows (all {replay_total} dropped)"
        )
    extra = replayed(replay_convs, len(train), data.replay.share, data.seed)
    log(f"replay: {len(extra)} rows from {len(replay_convs)} of {data.replay.source} join {len(train)} training rows")
    return train + extra, eval_convs, total + replay_total


def replayed(rows: list[Conversation], task_rows: int, share: float, seed: int) -> list[Conversation]:
    """`rows` repeated to be `share` of a training split beside `task_rows` task rows: whole copies of the file,
    then a seeded sample of it for the rest (training shuffles them in). Pure."""
    want = round(task_rows * share / (1.0 - share))
    copies, rest = divmod(want, len(rows))
    sample = datahash.rank_for_split([c.split_key() for c in rows], seed)[:rest]
    return rows * copies + [rows[i] for i in sample]


def suite_overlaps(cfg: PipelineConfig, train: list[Conversation]) -> list[SuiteFile]:
    """Each regression suite (eval.suites) hashed and measured against the training split: a suite whose items
    the fine-tune trains on measures recall, not retention, so above data.max_contamination it is a data failure."""
    literals, shared = template_literals(cfg.data), shared_system_texts(train)
    files = []
    for name, suite_cfg in cfg.eval.suites.items():
        suite = read_suite(name, suite_cfg, cfg.storage.endpoint_url)
        found = measure_overlap((conversation_text(c, literals, shared) for c in train), suite.texts())
        files.append(
            SuiteFile(name=name, source=suite.source, sha256=suite.sha256, items=len(suite.ids), contamination=found)
        )
        check_contamination(found, cfg.data.max_contamination, f"suite {name} ({suite.source})")
    return files


def contamination_of(
    train: list[Conversation], eval_convs: list[Conversation], literals: tuple[str, ...] = ()
) -> Contamination:
    """Overlap of the eval conversations with the training ones, over every turn's text. Left out, since every
    row shares them and so they say nothing of a row: `literals`, the template's own text, and the system texts
    that training rows share (a data.fields.system column or system turns of one prompt for all)."""
    shared = shared_system_texts(train)
    return measure_overlap(
        (conversation_text(c, literals, shared) for c in train),
        ((f"{c.where}:{c.row}", conversation_text(c, literals, shared)) for c in eval_convs),
    )


def shared_system_texts(train: list[Conversation]) -> frozenset[str]:
    """System texts that two or more training rows carry: the dataset's boilerplate. One row's own system text
    is kept, since it may hold that row's content."""
    texts: list[str] = []
    for conv in train:
        if conv.messages is not None:
            texts += [turn.get("content", "") for turn in conv.messages if turn.get("role") == "system"]
        elif conv.parts.get("system"):
            texts.append(conv.parts["system"])
    return shared_texts(texts)


def conversation_text(conv: Conversation, literals: tuple[str, ...] = (), shared: frozenset[str] = frozenset()) -> str:
    """The row's text as the overlap measure sees it: every turn, less the template's literals and `shared`
    system texts."""
    if conv.messages is not None:
        kept = (t for t in conv.messages if not (t.get("role") == "system" and t.get("content") in shared))
        return " ".join(turn.get("content", "") for turn in kept)
    text = " \n ".join(v for k, v in conv.parts.items() if not (k == "system" and v in shared))
    for literal in literals:
        text = text.replace(literal, " \n ")
    return text


def template_literals(data: DataConfig) -> tuple[str, ...]:
    """The fixed text of the template shape's prompt and response (between its {column} fields), longest first."""
    if data.template is None:
        return ()
    pieces = re.split(r"\{[^{}]*\}", data.template.prompt + "\n" + data.template.response)
    return tuple(sorted({p.strip() for p in pieces if p.strip()}, key=len, reverse=True))


def check_contamination(found: Contamination | None, limit: float, what: str = "eval split") -> None:
    """A data failure naming the overlapping eval items when more than `limit` of them repeat training rows."""
    if found is None or found.fraction <= limit:
        return
    ids = ", ".join(found.overlapping_ids[:10]) + (" ..." if found.overlapping > 10 else "")
    raise StageFailure(
        FailureClass.data,
        f"{what} overlaps the training split: {found.overlapping} of {found.eval_items} eval items "
        f"({found.fraction:.1%}; {found.exact_matches} normalised exact matches, the rest a shared "
        f"{found.ngram}-word n-gram) > data.max_contamination {limit:g}: {ids}",
        DataSummary(contamination=found),
    )


def conversations(
    parsed: Parsed, data: DataConfig, shape: str, drops: datahash.Drops, where: str
) -> tuple[list[Conversation], int]:
    rows, total = parsed
    convs = []
    fields = data.fields.model_dump()  # once, not per row: a pydantic dump costs about what checking a row does
    for index, record in rows:
        checked = check_record(record, data, shape, where, index, fields)
        if isinstance(checked, str):
            drops.add(checked, where, index, record)
        else:
            convs.append(checked)
    return convs, total


def check_record(
    record: Any, data: DataConfig, shape: str, where: str, index: int, fields: dict[str, str | None]
) -> Conversation | str:
    """The row's conversation, read as the shape says, or the reason to drop the row (`fields`: data.fields dumped)."""
    if shape == "messages":
        reason, messages = shapes.check_messages(record, data.messages_column)
        return reason or Conversation(where, index, {}, messages)
    if shape == "template" and data.template is not None:
        reason, parts = shapes.check_template_row(
            record, data.template.prompt, data.template.response, data.fields.system
        )
    else:
        reason, parts = datahash.check_row(record, fields)
    return reason or Conversation(where, index, parts)


@dataclass
class Encoded:
    """One split encoded and fitted, its drops (or the StageFailure it raised) held until `take`."""

    tables: list[pa.Table]
    drops: datahash.Drops
    failure: tuple[str, str] | None = None
    """(failure class, cause) of the StageFailure that encoding the split raised, at its first failing row."""

    def take(self, drops: datahash.Drops) -> pa.Table:
        """The split's examples as one table, its drops added to `drops`; raises what encoding the split raised."""
        if self.failure is not None:
            raise StageFailure(*self.failure)
        drops.merge(self.drops)
        return pa.concat_tables(self.tables) if self.tables else SCHEMA.empty_table()


Chunk = tuple[str, int, int]  # (split, start, end): conversations [start, end) of that split
EncodedChunk = tuple[pa.Table | None, datahash.Drops, tuple[str, str] | None]
"""(examples as a SCHEMA table, drops, failure): Arrow buffers cross a pipe as they are, no Python object per token."""


def encode_splits(
    tokenizer, splits: dict[str, list[Conversation]], data: DataConfig, render: ChatRenderer, overflow: dict[str, str]
) -> dict[str, Encoded]:
    """Each split through encode_split and fit_rows (with the split's `overflow` policy).

    From POOL_MIN_ROWS conversations on, in chunks of POOL_CHUNK_ROWS on Ray actors, one per free CPU of
    the cluster (training/parallel.py), merged in the original order: a row's example and its
    drop depend on that row alone, and Drops.merge keeps each reason's first rows, so the merge is
    what one pass over each split gives. Encoding stops at the first chunk that fails, as one pass would.
    """
    rows = sum(len(convs) for convs in splits.values())
    pooled = rows >= POOL_MIN_ROWS
    step = POOL_CHUNK_ROWS if pooled else max([len(convs) for convs in splits.values()] + [1])
    chunks = [
        (name, start, min(start + step, len(convs)))
        for name, convs in splits.items()
        for start in range(0, len(convs), step)
    ]
    workers = parallel.ray_workers(len(chunks)) if pooled else 1
    if workers > 1:
        log(f"encoding {rows} conversations in {len(chunks)} chunks on {workers} Ray actors")
    encoded = {name: Encoded([], datahash.Drops()) for name in splits}
    work = parallel.map_in_order(encode_chunk, chunks, (tokenizer, data, render, splits, overflow), workers)
    with contextlib.closing(work) as results:
        for (name, _, _), (examples, drops, failure) in zip(chunks, results):
            if failure is not None:
                encoded[name].failure = failure
                break
            encoded[name].tables.append(examples)
            encoded[name].drops.merge(drops)
    return encoded


def encode_chunk(
    shared: tuple[Any, DataConfig, ChatRenderer, dict[str, list[Conversation]], dict[str, str]], chunk: Chunk
) -> EncodedChunk:
    """One chunk through encode_split and fit_rows, in a Ray actor or in this process."""
    tokenizer, data, render, splits, overflow = shared
    name, start, end = chunk
    drops = datahash.Drops()
    try:
        examples = fit_rows(
            *encode_split(tokenizer, splits[name][start:end], data, drops, render), data, drops, overflow[name]
        )
    except StageFailure as e:  # its own pickling does not survive the trip from an actor: sent as its two fields
        return None, drops, (e.failure_class.value, e.cause)
    return examples_table(examples), drops, None


def encode_split(
    tokenizer,
    convs: list[Conversation],
    data: DataConfig,
    drops: datahash.Drops,
    render: ChatRenderer | None = None,
) -> tuple[list[Example], list[Conversation]]:
    """(examples, the conversations they came from): a conversation the chat template rejects is dropped."""
    render = render or ChatRenderer(tokenizer)
    if not convs or convs[0].messages is None:
        return encode(tokenizer, convs, data.system_prompt, render), convs
    chats = [shapes.with_system(conv.messages or [], data.system_prompt) for conv in convs]
    rendered = render_conversations(render, chats, data.loss_on)
    wanted = [
        text if generation_prompt else text.rstrip() for r in rendered for (_, generation_prompt), text in r.items()
    ]
    unique = list(dict.fromkeys(wanted))
    ids = dict(zip(unique, token_ids(tokenizer, unique)))
    examples, kept = [], []
    for conv, texts in zip(convs, rendered):
        try:
            examples.append(encode_messages(tokenizer, conv.messages or [], data, texts, ids))
            kept.append(conv)
        except jinja2.TemplateError as e:
            drops.add("template_rejected", conv.where, conv.row, f"{type(e).__name__}: {e}")
    return examples, kept


def encode_messages(
    tokenizer,
    messages: shapes.Messages,
    data: DataConfig,
    rendered: dict[tuple[int, bool], str] | None = None,
    token_cache: dict[str, list[int]] | None = None,
) -> Example:
    """One conversation rendered with the tokenizer's chat template; labels on its assistant turns only.

    `rendered` ({(prefix length, add_generation_prompt): text}) and `token_cache` ({text: ids}) hold what
    encode_split already rendered and tokenized in batches; anything not in them is rendered or
    tokenized here, one call at a time, so the result never depends on what was batched.
    """
    messages = shapes.with_system(messages, data.system_prompt)
    rendered, token_cache = rendered or {}, token_cache or {}

    def render(turns: shapes.Messages, add_generation_prompt: bool) -> str:
        # shapes renders prefixes of this one conversation only, so a prefix's length names it.
        text = rendered.get((len(turns), add_generation_prompt))
        if text is None:
            text = tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=add_generation_prompt)
        return text

    def tokenize(text: str) -> list[int]:
        cached = token_cache.get(text)
        # A copy: two conversations with equal text must not share one list.
        return list(cached) if cached is not None else tokenizer(text, add_special_tokens=False)["input_ids"]

    try:
        ids, labels = shapes.assistant_labels(messages, render, tokenize, data.loss_on)
    except shapes.NotAPrefix as e:
        raise StageFailure(
            "data",
            f"{e}; the base model's chat template re-renders earlier turns as the conversation grows, "
            "so the messages shape cannot mask it: use data.loss_on last_assistant, or the columns shape",
        ) from e
    prompt, reference = shapes.eval_pair(messages, render)
    return Example(ids, labels, prompt, reference)


def render_conversations(
    render: ChatRenderer, chats: list[shapes.Messages], loss_on: str
) -> list[dict[tuple[int, bool], str]]:
    """Each conversation's renderings (shapes.renderings), from batched template calls (render_batch)
    instead of several calls per row.

    A conversation the batch cannot render gets no renderings: encode_messages then renders it row by
    row, which drops it with the template's own error exactly as before. An empty prefix (a
    conversation that opens with the assistant) is left to that path too.
    """
    rendered: list[dict[tuple[int, bool], str]] = [{} for _ in chats]
    failed: set[int] = set()
    for generation_prompt in (True, False):
        wanted = [
            (i, length)
            for i, chat in enumerate(chats)
            for length, flag in sorted(shapes.renderings(chat, loss_on))
            if flag is generation_prompt and length > 0
        ]
        for (i, length), text in zip(
            wanted, render_batch(render, [chats[i][:length] for i, length in wanted], generation_prompt)
        ):
            if text is None:
                failed.add(i)
            else:
                rendered[i][(length, generation_prompt)] = text
    for i in failed:
        rendered[i] = {}
    return rendered


def render_batch(render: ChatRenderer, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str | None]:
    """Many conversations' chat-template texts: in plain Python where `render` may (ChatRenderer.fast),
    otherwise apply_chat_template RENDER_CHUNK per call (the same strings as one call each, the call's
    own set-up paid once per chunk); where the template rejects one, that chunk is rendered one
    conversation at a time and None marks the rejected ones."""
    fast = render.fast(chats, add_generation_prompt)
    if fast is not None:
        return list(fast)
    texts: list[str | None] = []
    for start in range(0, len(chats), RENDER_CHUNK):
        chunk = chats[start : start + RENDER_CHUNK]
        try:
            texts.extend(render.jinja(chunk, add_generation_prompt))
        except jinja2.TemplateError:
            texts.extend(render_each(render.tokenizer, chunk, add_generation_prompt))
    return texts


class ChatRenderer:
    """The tokenizer's chat template over many conversations, for one run of the stage.

    Where the template is one tuneproof knows (CHATML_TEMPLATE_SHA256) it renders in plain Python,
    several times faster than jinja, but only after jinja renders a sample of the same batch (the
    first VERIFY_FIRST conversations and VERIFY_SPREAD spread through the rest) to the same text.
    One mismatch, or a sample jinja rejects, is logged and sends this batch and the rest of the run
    to jinja. The sample guards against a transformers release or environment that renders the
    template differently (the same difference shows on every row); that the Python rendering equals
    jinja's for any text, empty, unicode or template syntax included, is what the tests hold it to.
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        template = getattr(tokenizer, "chat_template", None)
        known = isinstance(template, str) and hashlib.sha256(template.encode()).hexdigest() == CHATML_TEMPLATE_SHA256
        self.python = render_chatml if known else None

    def jinja(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str]:
        return self.tokenizer.apply_chat_template(chats, tokenize=False, add_generation_prompt=add_generation_prompt)

    def texts(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str]:
        """What one batched apply_chat_template call returns (or raises) for `chats`."""
        fast = self.fast(chats, add_generation_prompt)
        return fast if fast is not None else self.jinja(chats, add_generation_prompt)

    def fast(self, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str] | None:
        """The plain-Python texts, verified on a sample; None where jinja must render this batch."""
        # Anything but string roles and contents (None, numbers, parts lists) is for jinja and
        # transformers' own message normalisation to render or reject.
        if self.python is None or not all(plain_turns(chat) for chat in chats):
            return None
        texts = [self.python(chat, add_generation_prompt) for chat in chats]
        sample = verify_sample(len(texts))
        try:
            expected = self.jinja([chats[i] for i in sample], add_generation_prompt) if sample else []
        except jinja2.TemplateError as e:
            log(f"chat template: jinja rejects a sampled conversation ({type(e).__name__}: {e}); rendering with jinja")
            self.python = None
            return None
        for i, text in zip(sample, expected):
            if texts[i] != text:
                log(
                    f"chat template: the plain-Python rendering of conversation {i} differs from jinja's "
                    f"({texts[i][:80]!r} vs {text[:80]!r}); rendering the rest of this run with jinja"
                )
                self.python = None
                return None
        return texts


def plain_turns(chat: shapes.Messages) -> bool:
    return all(type(turn.get("role")) is str and type(turn.get("content")) is str for turn in chat)


def render_chatml(chat: shapes.Messages, add_generation_prompt: bool) -> str:
    """CHATML_TEMPLATE_SHA256's template in plain Python."""
    text = "".join(f"<|im_start|>{turn['role']}\n{turn['content']}<|im_end|>\n" for turn in chat)
    return text + "<|im_start|>assistant\n" if add_generation_prompt else text


def verify_sample(n: int) -> list[int]:
    """The first VERIFY_FIRST of n indices and VERIFY_SPREAD evenly spread through the rest, the last included."""
    rest = range(VERIFY_FIRST, n)
    spread = {rest[(len(rest) - 1) * k // max(VERIFY_SPREAD - 1, 1)] for k in range(VERIFY_SPREAD)} if rest else set()
    return sorted(set(range(min(n, VERIFY_FIRST))) | spread)


def render_each(tokenizer, chats: list[shapes.Messages], add_generation_prompt: bool) -> list[str | None]:
    texts: list[str | None] = []
    for chat in chats:
        try:
            texts.append(
                tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=add_generation_prompt)
            )
        except jinja2.TemplateError:
            texts.append(None)
    return texts


def token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    """tokenizer(texts, add_special_tokens=False)["input_ids"], read from the fast tokenizer's Rust backend.

    The wrapper turns every encoding into a Python BatchEncoding row first, about a third of the
    tokenizing time on short rows. One wrapper call on the first text sets the backend up exactly as
    the wrapper does (no truncation or padding, its special-token handling); `encode_batch` then
    encodes the lot, in parallel, to the same ids.

    Each distinct text is encoded once (a corpus repeats many of its short answers), so equal texts
    get the same list: copy one before changing it.
    """
    if not texts:
        return []
    unique = list(dict.fromkeys(texts))
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:  # a slow (pure Python) tokenizer: the wrapper is all there is
        encoded = tokenizer(unique, add_special_tokens=False)["input_ids"]
    else:
        tokenizer(unique[:1], add_special_tokens=False)
        encoded = [encoding.ids for encoding in backend.encode_batch(unique, add_special_tokens=False)]
    ids = dict(zip(unique, encoded))
    return [ids[text] for text in texts]


def encode(
    tokenizer, convs: list[Conversation], system_prompt: str | None, render: ChatRenderer | None = None
) -> list[Example]:
    """Render each conversation with the chat template; labels are the response tokens only."""
    if not convs:
        return []
    render = render or ChatRenderer(tokenizer)
    chats = []
    for conv in convs:
        system = conv.parts.get("system") or system_prompt
        chats.append(
            ([{"role": "system", "content": system}] if system else [])
            + [{"role": "user", "content": conv.parts["prompt"]}]
        )
    # One batched call per rendering: the same strings as a call per row, the call's own set-up paid once.
    prompts = render.texts(chats, add_generation_prompt=True)
    fulls = render.texts(
        [chat + [{"role": "assistant", "content": conv.parts["response"]}] for chat, conv in zip(chats, convs)],
        add_generation_prompt=False,
    )
    completions = []
    for prompt, full in zip(prompts, fulls):
        if not full.startswith(prompt):
            raise StageFailure(
                "data",
                f"the chat template of the base model does not render the generation prompt "
                f"as a prefix of the full conversation (prompt {prompt[-60:]!r}, full {full[-80:]!r}); "
                "prompt tokens cannot be masked",
            )
        # What follows the end-of-turn token (a newline in ChatML) is not something to learn to generate.
        completions.append(full[len(prompt) :].rstrip())
    ids = token_ids(tokenizer, prompts + completions)
    prompt_ids, completion_ids = ids[: len(prompts)], ids[len(prompts) :]
    return [
        Example(p + c, [datahash.IGNORE_INDEX] * len(p) + c, prompt, conv.parts["response"])
        for p, c, prompt, conv in zip(prompt_ids, completion_ids, prompts, convs)
    ]


def fit_rows(
    examples: list[Example], convs: list[Conversation], data: DataConfig, drops: datahash.Drops, overflow: str
) -> list[Example]:
    """Apply the overflow policy row by row: too-long rows are dropped (counted) or truncated; under pack
    they are dropped too, since a row is packed whole (pack_split packs the rest)."""
    fitted = []
    for ex, conv in zip(examples, convs):
        result = datahash.fit(ex.input_ids, ex.labels, data.max_seq_len, overflow)
        if result is None:
            drops.add("too_long", conv.where, conv.row, f"{len(ex.input_ids)} tokens > {data.max_seq_len}")
        elif result[0] is ex.input_ids:
            fitted.append(ex)  # it fits as it is
        else:
            fitted.append(Example(result[0], result[1], ex.prompt, ex.reference))
    return fitted


def pack_split(examples: list[Example], max_seq_len: int) -> list[Example]:
    """The fitted examples packed together, in order, into rows of at most max_seq_len tokens, each row
    with the lengths of the examples in it (its segments)."""
    packed = datahash.pack(((ex.input_ids, ex.labels) for ex in examples), max_seq_len)
    rows, remaining = [], iter(examples)
    for ids, labels in packed:  # a row is the next few examples whole, in order: take lengths until it is full
        lengths: list[int] = []
        while sum(lengths) < len(ids):
            lengths.append(len(next(remaining).input_ids))
        rows.append(Example(ids, labels, "", "", lengths))
    return rows


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


# ---- writing and reading the dataset -----------------------------------------------------------


def tokenizer_sha256(tokenizer) -> str:
    """A hash over the files the tokenizer saves: what tokenizes, not where it was loaded from."""
    with tempfile.TemporaryDirectory(prefix="tuneproof-tok-") as tmp:
        tokenizer.save_pretrained(tmp)
        files = {
            p.relative_to(tmp).as_posix(): datahash.sha256_bytes(p.read_bytes())
            for p in Path(tmp).rglob("*")
            if p.is_file()
        }
    return datahash.files_sha256(files)


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
            shards.append(Shard(path=rel, rows=end - start, sha256=datahash.sha256_bytes(data)))
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
    seen = datahash.sha256_bytes(data)
    if seen != shard.sha256:
        raise StageFailure(
            FailureClass.infrastructure,
            f"dataset shard {uri} is corrupt: sha256 {seen[:16]}…, manifest expects {shard.sha256[:16]}…",
        )
    return pq.read_table(io.BytesIO(data), schema=SCHEMA)


def main() -> None:
    run_stage(prepare_data)


if __name__ == "__main__":
    main()
