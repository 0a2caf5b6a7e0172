"""The data stage's rows: sources read and parsed, checked into conversations, split into train and eval.

Used by the data stage (training/data_prep.py) inside its Ray job. A source is JSONL, CSV or parquet,
local or s3://, or hf://<name>[:split] where a hub is reachable; undecodable rows and rows the shape
(tuneproof/core/shapes.py) cannot read are counted in the stage's drops by reason. The split is seeded
by each conversation's content (datahash.split_indices), or eval_source is the eval split; data.replay's
rows then join the training split.
"""

from __future__ import annotations

import codecs
import csv
import io
import json
import posixpath
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

from training.contamination import words
from training.jobkit import log
from tuneproof.core import datahash, shapes
from tuneproof.core.config_data import MAX_REPLAY_SHARE, DataConfig
from tuneproof.core.files import DuplicateJSONKey, parse_json
from tuneproof.core.hashing import sha256_bytes
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import SourceIdentity

LONE_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
"""A JSON escape of a UTF-16 surrogate (half of a pair, or alone); only a line holding one is checked further."""
EXTENSIONS = {".jsonl": "jsonl", ".json": "jsonl", ".csv": "csv", ".parquet": "parquet", ".pq": "parquet"}


@dataclass
class Source:
    uri: str
    data: bytes
    format: str

    def identity(self) -> SourceIdentity:
        return SourceIdentity(uri=self.uri, sha256=sha256_bytes(self.data), bytes=len(self.data))

    @property
    def has_bom(self) -> bool:
        return self.data.startswith(codecs.BOM_UTF8)

    def text_bytes(self) -> bytes:
        """The bytes rows are parsed from: without a leading UTF-8 byte-order mark (Excel's "CSV UTF-8" and Notepad
        write one), which made the first JSON line undecodable and a CSV's first column `\ufeffinput`."""
        return self.data.removeprefix(codecs.BOM_UTF8)


@dataclass
class Conversation:
    where: str  # "source" or "eval_source"
    row: int  # row index in that file, for drop evidence
    parts: dict[str, str]  # columns and template shapes: prompt, response[, system]
    messages: shapes.Messages | None = None  # messages shape: the turns, through the last assistant one

    def split_key(self) -> str:
        return datahash.split_key(self.parts if self.messages is None else {"messages": self.messages})


RawRow = tuple[int, Any, Any]
"""(row index, record, None), or (row index, None, what could not be decoded or a Dropped), as each parser yields."""


@dataclass
class Dropped:
    """A row a parser read but must not pass on, for a reason other than undecodable bytes."""

    reason: str
    evidence: str


Parsed = tuple[list[tuple[int, Any]], int]  # ([(row index, record)], rows read)


@dataclass
class ParsedSources:
    source: Parsed
    eval_source: Parsed | None  # None: the eval split is cut from the source
    replay: Parsed | None  # data.replay's rows, for the training split only


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


def read_source(uri: str, fmt: str, endpoint_url: str | None) -> Source:
    """The source's bytes and format; an unreadable source is a data failure naming it."""
    if uri.startswith("hf://") or fmt == "hf":
        return read_hub_dataset(uri)
    fmt = fmt if fmt != "auto" else format_from_extension(uri)
    try:
        data = Storage(uri, endpoint_url).read_bytes()
    except (FileNotFoundError, IsADirectoryError, PermissionError) as e:
        raise StageFailure("data", f"data source {uri} is unreadable: {type(e).__name__}: {e}") from e
    if fmt in ("jsonl", "csv") and (packed := not_text(data)):
        raise StageFailure(
            "data",
            f"data source {uri} is {packed}, not the UTF-8 text a {fmt} file is: every row would be undecodable; "
            "save it as UTF-8 text (decompress it, or re-export it as UTF-8)",
        )
    log(f"read {len(data)} bytes from {uri} ({fmt})")
    return Source(uri, data, fmt)


MAGIC = {
    b"\x1f\x8b": "gzip-compressed",
    b"\x28\xb5\x2f\xfd": "zstd-compressed",
    b"PK\x03\x04": "a zip archive (an .xlsx workbook is one)",
    codecs.BOM_UTF16_LE: "UTF-16 text (little-endian, by its byte-order mark)",
    codecs.BOM_UTF16_BE: "UTF-16 text (big-endian, by its byte-order mark)",
}
"""How a text source's first bytes say it is no UTF-8 text; (a UTF-32 LE mark starts like UTF-16 LE's: read as that)."""


def not_text(data: bytes) -> str | None:
    """What `data` is when its first bytes say it is compressed, archived or UTF-16 (pure); None otherwise. Read
    as text, such a file was '100% of rows dropped: undecodable', naming neither the file nor the cause."""
    return next((what for magic, what in MAGIC.items() if data.startswith(magic)), None)


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
        if isinstance(problem, Dropped):
            drops.add(problem.reason, where, index, problem.evidence)
        elif problem is not None:
            drops.add("undecodable", where, index, problem)
        else:
            rows.append((index, record))
    return rows, total


def parse_jsonl(source: Source) -> Iterator[RawRow]:
    """Yields (row, record, None) or (row, None, raw bytes); blank lines are not rows. A file that is one JSON
    array of records (what many tools call JSON) is refused naming the fix, rather than read as rows that are
    each a fragment of it (all dropped, the stage failing on a count of malformed rows)."""
    data = source.text_bytes()
    if data.lstrip().startswith(b"[") and (records := _json_array(data)) is not None:
        raise StageFailure(
            "data",
            f"data source {source.uri} is one JSON array of {records} records, not JSON Lines (one record a line): "
            f"convert it, e.g. `jq -c '.[]' in.json > out.jsonl`",
        )
    lines = [line for line in data.split(b"\n") if line.strip()]
    for index, line in enumerate(lines):
        try:
            record = parse_json(line.decode("utf-8"))
            if LONE_SURROGATE_ESCAPE.search(line):
                # `"\ud800"` is valid JSON but no text: it failed the stage as infrastructure where the row was
                # encoded (UnicodeEncodeError). A pair (an emoji) decodes to one character and passes.
                json.dumps(record, ensure_ascii=False).encode("utf-8")
            yield index, record, None
        except DuplicateJSONKey as e:  # the row number names the line
            yield index, None, str(e)
        except (UnicodeError, ValueError, RecursionError):  # RecursionError: absurdly nested JSON
            yield index, None, line


def _json_array(data: bytes) -> int | None:
    """How many records `data` holds when it is one JSON array of objects, else None."""
    try:
        value = json.loads(data)
    except (UnicodeDecodeError, ValueError, RecursionError):
        return None
    return len(value) if isinstance(value, list) and value and all(isinstance(v, dict) for v in value) else None


def parse_csv(source: Source) -> Iterator[RawRow]:
    """Yields (row, record, None) or (row, None, raw values); a header row names the columns. A row with more
    values than the header is dropped as extra_fields: an unquoted comma in a value cut its text there."""
    # surrogateescape keeps going past bytes that are not UTF-8, so only the rows holding them are lost.
    text = source.text_bytes().decode("utf-8", errors="surrogateescape")
    # The csv module refuses a field over 128 KiB (csv.Error: the stage failed as infrastructure): a long
    # document is a row like any other, kept or dropped as too_long by its tokens. No field outgrows its file.
    csv.field_size_limit(max(csv.field_size_limit(), len(text)))
    lines = _Lines(text)
    reader = csv.DictReader(lines)
    refuse_duplicate_columns(source, reader.fieldnames or [])
    start = after = (lines.offset, reader.line_num + 1)  # where a record starts: (its first character, line)
    for index, record in enumerate(reader):
        start, after = after, (lines.offset, reader.line_num + 1)
        values = [v for v in record.values() if isinstance(v, str)]
        if any(not _is_utf8(v) for v in values):
            yield index, None, [v.encode("utf-8", errors="surrogateescape") for v in values]
        elif None in record:  # csv.DictReader keeps the values past the header's columns under the key None
            fields = [*values, *record[None]]
            header = len(reader.fieldnames or [])
            yield index, None, Dropped("extra_fields", f"{len(fields)} fields, the header has {header}: {fields}")
        else:
            yield index, record, None
    refuse_unclosed_quote(source, text, *start)


class _Lines:
    """A text's lines for the csv reader, counting where the next unread one starts: a record's first character."""

    def __init__(self, text: str) -> None:
        self.lines, self.offset = iter(io.StringIO(text, newline="")), 0

    def __iter__(self) -> _Lines:
        return self

    def __next__(self) -> str:
        line = next(self.lines)
        self.offset += len(line)
        return line


def refuse_unclosed_quote(source: Source, text: str, start: int, line: int) -> None:
    """A quote opened and never closed is a data failure naming its line: the csv module (not strict, which would
    refuse `"a" ,b` too) reads the rest of the file as one value of one row, so every row after it vanished
    without a drop, or trained as that value. Only the last record can hold it; it begins at `start`, on `line`."""
    tail = text[start:]
    blank = len(tail) - len(tail.lstrip("\r\n"))  # blank lines the reader skipped before the record
    tail, line = tail[blank:], line + tail[:blank].count("\n")
    try:
        for _ in csv.reader(io.StringIO(tail, newline=""), strict=True):
            pass
    except csv.Error as e:
        if "end of data" not in str(e):  # another strictness (`"a" ,b`): read leniently, like every other row
            return
        raise StageFailure(
            "data",
            f"data source {source.uri}: a quote opened in the row on line {line} is never closed, so the file from "
            f"there to its end ({tail.rstrip().count(chr(10)) + 1} lines) would be read as one row: close the quote, "
            'or double a quote that is part of the text ("")',
        ) from None


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def parse_parquet(source: Source) -> Iterator[RawRow]:
    try:
        table = pq.read_table(io.BytesIO(source.data))
    except (pa.ArrowException, OSError) as e:
        raise StageFailure("data", f"data source {source.uri} is not a readable parquet file: {e}") from e
    for index, record in enumerate(table.to_pylist()):
        yield index, record, None


def refuse_duplicate_columns(source: Source, columns: Sequence[str]) -> None:
    """A CSV column named twice is a data failure naming it: a row kept only the last one's value, so `input,output,input`
    trained on the third column's text under the first one's name. (pyarrow refuses such a parquet file itself.)"""
    twice = sorted({name for name in columns if name and columns.count(name) > 1})
    if twice:
        raise StageFailure(
            "data",
            f"data source {source.uri} names column(s) {', '.join(map(repr, twice))} more than once (columns: "
            f"{columns[:20]}): which one is meant is ambiguous; rename or remove the others",
        )


def split_conversations(
    data: DataConfig, shape: str, parsed: ParsedSources, drops: datahash.Drops
) -> tuple[list[Conversation], list[Conversation], int]:
    """(train conversations, eval conversations, rows read): the seeded split, or eval_source as the eval
    split, each of its conversations once; then data.replay's rows added to the training split."""
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
    eval_convs = each_once(eval_convs, drops)
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


def each_once(convs: list[Conversation], drops: datahash.Drops) -> list[Conversation]:
    """The eval split with each conversation once, a repeat dropped as repeated_eval_item naming the first.

    A gate's items are its independent evidence: an item twice counts twice in n, and the interval it
    states is narrower than the evidence (the bundled alpaca example's eval split held 4 repeats in 300). A
    repeat is a conversation whose turns read the same once normalised as the overlap check reads them
    ('Jan 5, 2024' and 'JAN. 5 2024 ' ask one question). A repeat in the training split stays: there it weighs
    the row, which a source may mean."""
    first: dict[tuple[tuple[str, tuple[str, ...]], ...], Conversation] = {}
    kept = []
    for conv in convs:
        original = first.setdefault(normalised_turns(conv), conv)
        if original is conv:
            kept.append(conv)
        else:
            said = f"the same conversation as {original.where} row {original.row}"
            if conv.split_key() != original.split_key():  # not byte for byte: say what makes it the same
                said += " once normalised (case, punctuation, spacing, width)"
            drops.add("repeated_eval_item", conv.where, conv.row, said)
    return kept


def normalised_turns(conv: Conversation) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """Each turn (or part) by name with its words as the overlap check reads them (contamination.words): a row
    that differs from another only in case, punctuation, spacing or character width asks and answers the same."""
    if conv.messages is None:
        return tuple((name, tuple(words(text))) for name, text in conv.parts.items())
    return tuple((turn.get("role", ""), tuple(words(turn.get("content", "")))) for turn in conv.messages)


def replayed(rows: list[Conversation], task_rows: int, share: float, seed: int) -> list[Conversation]:
    """`rows` repeated to be `share` of a training split beside `task_rows` task rows: whole copies of the file,
    then a seeded sample of it for the rest (training shuffles them in). Pure. A data failure when the share
    asks for no row (replay configured, nothing replayed) or for more than MAX_REPLAY_SHARE allows (at most
    9 per task row: the config refuses such a share, a caller past it gets this)."""
    want = round(task_rows * share / (1.0 - share)) if 0.0 < share < 1.0 else -1
    cap = round(task_rows * MAX_REPLAY_SHARE / (1.0 - MAX_REPLAY_SHARE))
    if want <= 0 or want > cap:
        asked = "no replayed row" if want == 0 else f"{want:,} replayed rows" if want > 0 else "a share outside 0..1"
        fix = "raise it" if want == 0 else f"lower it to at most {MAX_REPLAY_SHARE}"
        raise StageFailure(
            FailureClass.data,
            f"data.replay.share {share!r} asks for {asked} beside {task_rows:,} training rows, expected 1 to "
            f"{cap:,}: {fix}",
        )
    copies, rest = divmod(want, len(rows))
    sample = datahash.rank_for_split([c.split_key() for c in rows], seed)[:rest]
    return rows * copies + [rows[i] for i in sample]


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
