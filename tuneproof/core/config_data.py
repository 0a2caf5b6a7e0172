"""The `data` section of the config: what the data stage reads and how it turns rows into examples.

DataConfig (with FieldMap, PromptTemplate and ReplayConfig) is PipelineConfig.data
(tuneproof/core/config.py); the data stage (training/data_prep.py and its modules) reads it, the
fine-tune and evaluate stages read max_seq_len and the shape facts. Runs on both sides (Prefect and inside Ray jobs): it imports only pydantic and the core, which the published
Ray image has.
"""

from __future__ import annotations

import posixpath
import string
from typing import Literal

from pydantic import Field, field_validator, model_validator

from tuneproof.core.config_base import MAX_EXAMPLES, MAX_SEED, MAX_SEQ_LEN, Strict
from tuneproof.core.names import check_slug, control_character_problem, short_repr, storage_root_problem
from tuneproof.core.shapes import template_columns


class FieldMap(Strict):
    """Which source columns hold the conversation parts."""

    prompt: str = "input"
    response: str = "output"
    system: str | None = None

    @model_validator(mode="after")
    def _response_not_in_the_prompt(self) -> FieldMap:
        # The answer would be in its own prompt: a model that copies it scores 1, a verdict about no skill.
        for part, column in (("prompt", self.prompt), ("system", self.system)):
            if column == self.response:
                raise ValueError(
                    f"fields.{part} and fields.response both name column {column!r}: every answer would be in its "
                    "own prompt, and a model that copies it would pass every gate"
                )
        return self


class PromptTemplate(Strict):
    """The prompt of data.shape template: named columns laid into a text, e.g. an instruction and an optional input."""

    prompt: str
    """A format string over column names, e.g. "{instruction}\n\n{input}". A line, or a paragraph (lines
    between blank lines), whose columns are all empty (or null) is left out, so an optional column leaves
    no stray header or blank line behind."""
    response: str = "output"
    """The column holding the response."""

    @field_validator("prompt")
    @classmethod
    def _named_columns(cls, v: str) -> str:
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(v) if name is not None]
        except ValueError as e:
            raise ValueError(
                f"prompt is not a valid format string ({e}); write columns as {{name}}, braces as {{{{ }}}}"
            ) from e
        bad = [n for n in names if not n.isidentifier()]
        if not names or bad:
            raise ValueError("prompt must name at least one column as {column} (plain names, no index or attribute)")
        return v

    @model_validator(mode="after")
    def _response_not_in_the_prompt(self) -> PromptTemplate:
        if self.response in template_columns(self.prompt):
            raise ValueError(
                f"prompt names {{{self.response}}}, the response column: every answer would be in its own prompt, "
                "and a model that copies it would pass every gate"
            )
        return self


MAX_REPLAY_SHARE = 0.9
"""At most 9 replayed rows per task row: past that the task is the minority of its own training split, and a share
just under 1 asked for task_rows * share / (1 - share) rows (0.9999999: ~27 billion for the demo, out of memory)."""


class ReplayConfig(Strict):
    """Rows of what the base already knows, mixed into the training split so a full fine-tune keeps it."""

    source: str
    """A file of the task's format, shape and fields (local or s3://): its rows join the training split only,
    never the eval split, and it is hashed into the dataset's identity."""
    share: float = Field(gt=0.0, le=MAX_REPLAY_SHARE)
    """Fraction of the training split's rows that are replayed rows, >0..0.9: the file's rows are repeated
    (whole, then a seeded sample) to reach it, and training shuffles them in with the task's. A share so small
    that it adds no row is refused by the data stage (it knows the task's row count)."""


class DataConfig(Strict):
    name: str = "dates"
    """Dataset name: the folder under datasets/ (a slug, see tuneproof.core.names)."""
    source: str = "data/dates/dates.jsonl"
    """JSONL, CSV or parquet file (local or s3://), or hf://<dataset>[:split] where a hub is reachable."""
    format: Literal["auto", "jsonl", "csv", "parquet", "hf"] = "auto"
    """The file format; what the rows hold is `shape`."""
    shape: Literal["auto", "columns", "template", "messages"] = "auto"
    """columns: fields.prompt -> fields.response. template: `template` over named columns. messages: a
    list of {role, content} turns in `messages_column`, rendered with the model's chat template. auto:
    messages when the first row's `messages_column` is a list, else template when `template` is set, else columns."""
    messages_column: str = "messages"
    loss_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """messages: which assistant turns the loss covers; evaluation always answers the last one."""
    template: PromptTemplate | None = None
    eval_source: str | None = None
    """Separate held-out file; None splits the source."""
    replay: ReplayConfig | None = None
    """Rows mixed into the training split against forgetting (the bundled demo replays the base's skills)."""
    fields: FieldMap = FieldMap()
    system_prompt: str | None = None
    """Used when fields.system is None; None sends no system turn (the tiny demo model learns the task
    in 400 steps without one, in about 1000 with a constant system prompt)."""
    max_seq_len: int = Field(64, ge=8, le=MAX_SEQ_LEN)
    """Tokens per example, 8..1,048,576."""
    overflow: Literal["drop", "truncate", "pack"] = "drop"
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    max_dropped_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Fail the stage as a data failure when more rows than this are malformed."""
    max_contamination: float = Field(0.0, ge=0.0, le=1.0)
    """Largest share of eval items that may repeat the training split (normalised exact match or a shared
    13-word n-gram); above it the data stage fails as a data failure naming the items. 0: none may."""
    shard_rows: int = Field(4096, ge=1, le=MAX_EXAMPLES)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        return check_slug("dataset name", v)

    @model_validator(mode="after")
    def _sources_are_readable_forms(self) -> DataConfig:
        """Each file is read through Storage (a local path or s3://bucket[/prefix]) unless it is a hub dataset: a
        gs://, http:// or bare s3:// source passed every check and failed the data stage, after verify and the
        network measurements, as an infrastructure "storage root" error."""
        replay = self.replay.source if self.replay else None
        named = (("data.source", self.source), ("data.eval_source", self.eval_source), ("data.replay.source", replay))
        problems = []
        for field, value in named:
            if value is None:
                continue
            if problem := control_character_problem(value):
                problems.append(f"{field}: {problem} (got {short_repr(value)})")
            elif self.format != "hf" and not value.startswith("hf://") and (problem := storage_root_problem(value)):
                problems.append(f"{field}: {problem}, or hf://<dataset>[:split] (got {short_repr(value)})")
        trained = (("data.source", self.source), ("data.replay.source", replay))
        problems += [
            f"data.eval_source {short_repr(self.eval_source)} names the file {field} does: the held-out rows would "
            "be trained on, and every eval item would repeat the training split; give a separate file, or drop "
            "data.eval_source to split data.source"
            for field, value in trained
            if value is not None and self.eval_source is not None and _same_file(value, self.eval_source)
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return self

    @model_validator(mode="after")
    def _template_matches_shape(self) -> DataConfig:
        if self.shape == "template" and self.template is None:
            raise ValueError("template: shape template needs template.prompt (and template.response), got none")
        if self.shape in ("columns", "messages") and self.template is not None:
            raise ValueError(
                f"template is set but shape is {self.shape!r}: set shape to template (or auto), or drop template"
            )
        return self


def _same_file(a: str, b: str) -> bool:
    """Whether two sources name one file as written (pure): `./data/x.jsonl` is `data/x.jsonl`. A relative and an
    absolute spelling are told apart only once resolved, by the data stage's overlap check."""
    return a == b or ("://" not in a + b and posixpath.normpath(a) == posixpath.normpath(b))
