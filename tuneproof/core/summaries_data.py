"""What the data stage proves, as typed data: DataSummary, the DataIdentity it begins with and the dataset
manifest it carries.

training/data_prep.py builds them (the manifest is also written as the dataset's manifest.json, and
training/data_files.py reads it back); the fine-tune, evaluate and resume stages, the record, the CLI and
promotion read them. Built on tuneproof/core/summaries.py's Summary: strict, unknown fields are errors.
"""

from __future__ import annotations

from typing import Any, Literal

from tuneproof.core.summaries import Summary


class SourceIdentity(Summary):
    uri: str
    sha256: str
    bytes: int


class Shard(Summary):
    path: str
    rows: int
    sha256: str


class SplitMeta(Summary):
    rows: int
    tokens: int
    shards: list[Shard]


class DropExample(Summary):
    source: str
    row: int
    value: str


class DropCount(Summary):
    count: int
    examples: list[DropExample]


class Contamination(Summary):
    """How much of the eval split repeats the training split (training/contamination.py)."""

    ngram: int
    """Words per n-gram; items shorter than this are compared whole."""
    eval_items: int
    exact_matches: int
    """Eval items whose normalised text (case, whitespace, punctuation) equals a training item's."""
    overlapping: int
    """Eval items that match exactly or share a word n-gram with a training item."""
    fraction: float
    """overlapping / eval_items; the data stage fails above data.max_contamination."""
    overlapping_ids: list[str] = []
    """The first overlapping items as '<source|eval_source>:<row>' (row index in that file)."""


class DatasetManifest(Summary):
    """datasets/<name>/<hash>/manifest.json, written last: the dataset counts only once it exists."""

    name: str
    content_hash: str
    created_at: str
    seed: int
    source: SourceIdentity
    eval_source: SourceIdentity | None = None
    replay: SourceIdentity | None = None
    """data.replay's file: rows of it were added to the training split (settings["replay"] says what share)."""
    tokenizer_sha256: str
    settings: dict[str, Any]
    shape: Literal["columns", "template", "messages"] = "columns"
    """How rows were read (data.shape, auto resolved); manifests from before shapes were columns."""
    template_sha256: str | None = None
    """The template shape's prompt template and response column, hashed; the content hash covers it."""
    loss_on: str | None = None
    """The messages shape: all_assistant or last_assistant."""
    chat_template_sha256: str | None = None
    """The chat template every split's prompts were rendered with (hashing.chat_template_sha256); evaluate
    refuses to score a model whose template differs. None in manifests made before it was recorded."""
    splits: dict[str, SplitMeta]
    dropped: dict[str, DropCount] = {}
    total_rows: int
    dropped_fraction: float
    contamination: Contamination | None = None
    """Overlap of the eval split with the training split; None in manifests made before it was measured."""


class SuiteFile(Summary):
    """One regression suite as the data stage checked it: its file's hash and its overlap with the training split."""

    name: str
    source: str
    sha256: str
    """sha256 of the file's bytes: the evaluate stage's verdicts on the suite name the same hash."""
    items: int
    contamination: Contamination


class DataIdentity(Summary):
    """Which dataset a run trained and evaluated on: the data stage's summary begins with it, and the run record
    keeps it at its top level (lifted from the latest succeeded data stage)."""

    dataset_path: str | None = None
    """Storage path datasets/<name>/<hash>; None when the stage failed before writing one."""
    dataset_uri: str | None = None
    content_hash: str | None = None
    cache_hit: bool | None = None
    """None only in records of the first release, which did not always say."""


class DataSummary(DataIdentity):
    cache_hit: bool = False
    """The stage always knows whether it reused a cached dataset."""
    manifest: DatasetManifest | None = None
    total_rows: int | None = None
    """Rows read; with `dropped`, the evidence of a data failure that left no manifest."""
    dropped: dict[str, DropCount] = {}
    dropped_fraction: float | None = None
    contamination: Contamination | None = None
    """The eval split's overlap with the training split, kept also when it failed the stage."""
    suites: list[SuiteFile] = []
    """eval.suites, each hashed and checked against the training split (data.max_contamination applies)."""
