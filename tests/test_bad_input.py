"""Bad input, table-driven: every input a user can give, broken on purpose, gets an exit code and a message
that names the problem; none ends in a traceback, and none reaches the CLI's last-resort guard.

    .venv/bin/python -m pytest -q tests/test_bad_input.py

Each row: an id, how to build the input under a temp dir (returns the CLI arguments), the exit code, and a
phrase the output must contain. Readers that are not commands (data rows, model directories, storage paths)
have a second table: the input, the exception (or drop reason) and the phrase. Unit tier: no Ray, no Prefect
server; one case uses the moto S3 server for an object key only a store can hold.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

import tasks.promote  # noqa: F401 - Prefect imported once, here: a case's timeout then times the case alone
from tuneproof.app import cli
from tuneproof.app.cli import app, guarded
from tuneproof.control import record as records
from tuneproof.control.record import CodeIdentity
from tuneproof.control.registry import ModelCard, ProductionPointer
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.results import FailureClass
from tuneproof.core.storage import Storage, UnsafePath

TRACEBACK = "Traceback (most recent call last)"
K8S_FIXTURES = Path(__file__).parent / "fixtures" / "k8s" / "cluster"
EKS = str(PROJECT_ROOT / "configs" / "eks.yaml")
GOOD_RUN = "20261130-103832-a31ad3"
MODEL = "dates-qwen2-tiny"
DEEP_JSON = "[" * 100_000 + "]" * 100_000
# Not UTF-8, and no leading \xff\xfe: that is UTF-16's byte-order mark, which the saved-file readers honour.
NOT_UTF8 = b"bad \xc3\x28 bytes \xff\xfe\x00\n"
LONG = "a" * 65
HUGE_INT = "9" * 5000
"""Past Python's 4,300 digits for an integer read from text."""
YAML_BOMB = 'a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol"]\n' + "".join(
    f"{b}: &{b} [{', '.join([f'*{a}'] * 9)}]\n" for a, b in zip("abcdefgh", "bcdefghi", strict=True)
)
RAYCLUSTER = (PROJECT_ROOT / "deployments" / "raycluster.yaml").read_text()


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Path], list[str]]
    """Writes the input under the temp dir; returns the CLI arguments."""
    code: int
    phrase: str
    env: tuple[tuple[str, str], ...] = ()
    """Environment variables set for the command."""


def root_args(tmp: Path) -> list[str]:
    return ["--set", f"storage.root={tmp / 'store'}"]


def write(path: Path, data: str | bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


# ---- config files and --set values -----------------------------------------------------------------


def config_file(text: str | bytes) -> Callable[[Path], list[str]]:
    return lambda tmp: ["runs", "list", "--config", str(write(tmp / "bad.yaml", text))]


def with_set(*items: str, command: tuple[str, ...] = ("runs", "list")) -> Callable[[Path], list[str]]:
    return lambda tmp: [*command, *[a for item in items for a in ("--set", item)]]


CONFIG_CASES = [
    Case("config-is-a-directory", lambda tmp: ["run", "--config", str(tmp)], 3, "is a directory"),
    Case("config-missing", lambda tmp: ["run", "--config", str(tmp / "nope.yaml")], 3, "file not found"),
    Case("config-not-utf8", config_file(NOT_UTF8), 3, "not UTF-8"),
    Case("config-not-yaml", config_file("train: [1, 2\n"), 3, "not valid YAML"),
    Case("config-a-list", config_file("- a\n- b\n"), 3, "top level must be a mapping"),
    Case("config-unknown-key", config_file("train:\n  max_stepz: 3\n"), 3, "train.max_stepz: unknown key"),
    Case("config-empty-gates", config_file("eval:\n  gates: {}\n"), 3, "eval.gates is empty"),
    Case("config-nan-gate", config_file("eval:\n  gates:\n    exact_match: {min: .nan}\n"), 3, "finite number"),
    Case("config-gs-root", config_file("storage:\n  root: gs://bucket/x\n"), 3, "scheme 'gs://'"),
    Case("config-escaping-data-name", config_file("data:\n  name: ../../x\n"), 3, "dataset name '../../x'"),
    Case("config-yaml-alias-bomb", config_file(YAML_BOMB), 3, "i: unknown key (got [[[...]"),
    Case("config-deep-yaml", config_file("a: " + "[" * 1000 + "]" * 1000 + "\n"), 3, "nested too deeply"),
    Case("set-no-equals", with_set("train.max_steps"), 3, "expected dotted.key=value"),
    Case("set-empty-segment", with_set(".max_steps=3"), 3, "empty key segment"),
    Case("set-max-steps-absurd", with_set("train.max_steps=100000000"), 3, "less than or equal to 10000000"),
    Case("set-batch-absurd", with_set("train.micro_batch_size=1000000"), 3, "less than or equal to 65536"),
    Case("set-seq-len-absurd", with_set("data.max_seq_len=99999999"), 3, "less than or equal to 1048576"),
    Case("set-workers-absurd", with_set("train.num_workers=100000"), 3, "less than or equal to 4096"),
    Case("set-eval-examples-absurd", with_set("eval.max_examples=10000000000"), 3, "eval.max_examples"),
    Case("set-timeout-absurd", with_set("timeouts.finetune=99999999"), 3, "less than or equal to 604800"),
    Case("set-sizes-absurd", with_set("connectivity.sizes_bytes=[99999999999999]"), 3, "16 GiB"),
    Case("set-lr-inf", with_set("train.lr=.inf"), 3, "train.lr: Input should be a finite number"),
    Case("set-lr-overflow", with_set("train.lr=1.0e999"), 3, "finite number"),
    Case("set-rtol-nan", with_set("resume.loss_rtol=.nan"), 3, "resume.loss_rtol"),
    Case("set-regression-nan", with_set("eval.gates.exact_match.max_regression=.nan"), 3, "finite number"),
    Case("set-gates-empty", with_set("eval.gates={}"), 3, "eval.gates is empty"),
    Case("set-gate-no-threshold", with_set("eval.gates={exact_match: {}}"), 3, "a gate needs at least one"),
    Case("set-gate-unreachable", with_set("eval.gates.exact_match.min=1.01"), 3, "every model would fail it"),
    Case("set-gate-at-the-end", with_set("eval.gates.exact_match.min=1"), 3, "never reaches an end"),
    Case(
        "set-gate-wrong-way",
        with_set("eval.gates={exact_match: {min: 0.8}, eval_loss: {max_regression: 0.05}}"),
        3,
        "eval.gates.eval_loss.higher_is_better: true, but a lower eval_loss is better",
    ),
    Case("set-predictions-none", with_set("eval.predictions_cap=0"), 3, "eval.predictions_cap"),
    Case("set-model-source-no-bucket", with_set("model.source=s3://"), 3, "names no valid S3 bucket"),
    Case("set-model-source-gs", with_set("model.source=gs://b/m"), 3, "not a form the jobs can load"),
    Case(
        "set-model-source-not-hub-id", with_set("model.source=nosuchdir/"), 3, "neither a directory here nor a hub id"
    ),
    Case(
        "set-metric-twice",
        with_set("eval.metrics=[exact_match, rouge_l, exact_match]"),
        3,
        "more than once: exact_match",
    ),
    Case(
        "set-suite-metric-twice",
        with_set("eval.suites={s: {source: data/skills/suites/add.jsonl, metrics: [rouge_l, rouge_l]}}"),
        3,
        "eval.suites.s.metrics: list each metric once",
    ),
    Case("set-response-is-the-prompt", with_set("data.fields.prompt=output"), 3, "every answer would be in its own"),
    Case(
        "set-template-shows-the-response",
        with_set("data.template={prompt: '{input} = {output}'}", "data.shape=template"),
        3,
        "prompt names {output}, the response column",
    ),
    Case("set-string-got-mapping", with_set("data.source={a}"), 3, "got a YAML mapping; quote it"),
    Case("set-string-got-list", with_set("data.source=[a]"), 3, "got a YAML list; quote it"),
    Case("set-markup-in-value", with_set("data.name=a[/b]"), 3, "dataset name 'a[/b]'"),
    Case("set-data-name-escapes", with_set("data.name=../../x"), 3, "must not contain '..'"),
    Case("set-data-name-leading-dash", with_set("data.name=-rf"), 3, "starting with a letter or digit"),
    Case("set-data-name-too-long", with_set(f"data.name={LONG}"), 3, "at most 64"),
    Case("set-model-name-slash", with_set("model.name=team/prod"), 3, "model name 'team/prod'"),
    Case("set-model-name-empty", with_set("model.name="), 3, "must not be empty"),
    Case("set-run-with-bad-config", with_set("train.max_steps=0", command=("run",)), 3, "train.max_steps"),
    Case(
        "set-price-negative",
        with_set("cost.prices={CPU: -1}"),
        3,
        "cost.prices.CPU: Input should be greater than or equal to 0 (got -1)",
    ),
    # Accepted: the cost read "inf".
    Case("set-price-absurd", with_set("cost.prices={CPU: 1e308}"), 3, "cost.prices.CPU: Input should be less than"),
    # Accepted: the data stage asked for ~27 billion replayed rows (task_rows * share / (1 - share)).
    Case(
        "set-replay-share-near-one",
        with_set("data.replay={source: data/skills/replay.jsonl, share: 0.9999999}"),
        3,
        "data.replay.share: Input should be less than or equal to 0.9",
    ),
    # A RecursionError traceback: the file's depth check never saw overrides.
    Case("set-nested-deep", with_set("runtime_env.pip=" + "[" * 2000 + "]" * 2000), 3, "nested too deeply"),
    # Accepted as all defaults: a profile cut short (or `[]`, `false`) ran the local profile's defaults.
    Case("config-empty", config_file("# only a comment\n"), 3, "holds no settings (empty, or only comments)"),
    Case("config-false", config_file("false\n"), 3, "top level must be a mapping (got bool)"),
    # Accepted as YAML 1.1 reads them: seed 0042 was 34, max_steps 01000 was 512, a timeout of 1:30 was 90 s.
    Case("config-octal-seed", config_file("train:\n  seed: 0042\n"), 3, "'seed' at line 2: 0042 has a leading 0"),
    Case("set-octal-max-steps", with_set("train.max_steps=01000"), 3, "YAML 1.1 reads it as octal (512)"),
    Case(
        "set-base-60-timeout", with_set("timeouts.finetune=1:30"), 3, "timeouts.finetune: Input should be a valid int"
    ),
    # "error: ValueError: Exceeds the limit (4300 digits) ... (please report)", exit 4.
    Case(
        "config-int-too-long",
        config_file(f"train:\n  max_steps: {HUGE_INT}\n"),
        3,
        "'max_steps' at line 2: an integer of over 4,300 digits",
    ),
    Case("set-int-too-long", with_set(f"train.max_steps={HUGE_INT}"), 3, "': line 1: an integer of over 4,300 digits"),
    # The whole value, once in the message: a 120 KB line. Now cut as every other value (reprlib: 57 ... 58).
    Case("set-data-name-huge", with_set("data.name=" + "x" * 120_000), 3, "dataset name '" + "x" * 57 + "...x"),
    # Accepted: the data stage failed it late, as contamination of every eval item.
    Case(
        "set-eval-source-is-source",
        with_set("data.eval_source=./data/dates/dates.jsonl"),
        3,
        "data.eval_source './data/dates/dates.jsonl' names the file data.source does",
    ),
]


def root_file(tmp: Path) -> list[str]:
    return ["--set", f"storage.root={write(tmp / 'a-file', 'not a folder')}"]


# ---- storage URIs --------------------------------------------------------------------------------------

STORAGE_URI_CASES = [
    Case("root-s3-one-slash", with_set("storage.root=s3:/bucket"), 3, "looks like a mistyped URI"),
    Case("root-s3-no-slash", with_set("storage.root=s3:bucket"), 3, "looks like a mistyped URI"),
    Case("root-s3-no-bucket", with_set("storage.root=s3://"), 3, "names no bucket"),
    Case("root-http", with_set("storage.root=http://example.com/x"), 3, "scheme 'http://'"),
    Case("root-bad-bucket", with_set("storage.root=s3://Bad_Bucket/x"), 3, "not a valid S3 bucket name"),
    Case("root-empty", with_set("storage.root="), 3, "storage.root: must not be empty"),
    Case("root-a-file-runs", lambda tmp: ["runs", "list", *root_file(tmp)], 4, "is not a directory"),
    Case("root-a-file-models", lambda tmp: ["models", "list", *root_file(tmp)], 4, "is not a directory"),
    Case("root-a-file-show", lambda tmp: ["models", "show", MODEL, *root_file(tmp)], 4, "is not a directory"),
    # A file no reader can read passed every config check and failed the data stage late, as infrastructure.
    Case("suite-source-gs", with_set("eval.suites={s: {source: 'gs://b/x.jsonl'}}"), 3, "eval.suites.s.source: scheme"),
    Case("suite-source-s3-no-bucket", with_set("eval.suites={s: {source: 's3://'}}"), 3, "s.source: names no bucket"),
    Case("data-source-gs", with_set("data.source=gs://b/x.jsonl"), 3, "data.source: scheme 'gs://' is not supported"),
    Case("eval-source-http", with_set("data.eval_source=http://x/y.jsonl"), 3, "data.eval_source: scheme 'http://'"),
    Case(
        "replay-source-s3-no-bucket",
        with_set("data.replay={source: 's3://', share: 0.3}"),
        3,
        "data.replay.source: names no bucket",
    ),
]

# A NUL in a path: "error: ValueError: embedded null byte (please report)", exit 4, or accepted (exit 0).
NUL_CASES = [
    Case("root-nul", with_set('storage.root="x\\0y"'), 3, "storage.root: storage root 'x\\x00y' holds a control"),
    Case("data-source-nul", with_set('data.source="a\\0b.jsonl"'), 3, "data.source: holds a control character"),
    Case("eval-source-nul", with_set('data.eval_source="e\\0.jsonl"'), 3, "data.eval_source: holds a control"),
    Case(
        "replay-source-nul",
        with_set('data.replay={source: "r\\0.jsonl", share: 0.3}'),
        3,
        "data.replay.source: holds a control",
    ),
    Case("model-source-nul", with_set('model.source="./a\\0b"'), 3, "model.source: './a\\x00b' holds a control"),
    Case(
        "suite-source-nul",
        with_set('eval.suites={s: {source: "data/\\0.jsonl"}}'),
        3,
        "eval.suites.s.source: holds a control character",
    ),
    Case("token-file-nul", with_set('cluster.auth_token_file="t\\0"'), 3, "cluster.auth_token_file: holds a control"),
    Case("data-source-newline", with_set('data.source="a\\nb.jsonl"'), 3, "('\\n' at character 2)"),
]

# ---- identifiers on the command line ---------------------------------------------------------------------

ID_CASES = [
    Case("show-dotdot", lambda tmp: ["runs", "show", "../x"], 2, "run id '../x'"),
    Case("show-slash", lambda tmp: ["runs", "show", "a/b"], 2, "run id 'a/b'"),
    Case("show-empty", lambda tmp: ["runs", "show", ""], 2, "must not be empty"),
    Case("show-space", lambda tmp: ["runs", "show", "a b"], 2, "run id 'a b'"),
    Case("show-hidden", lambda tmp: ["runs", "show", ".hidden"], 2, "starting with a letter or digit"),
    Case("show-too-long", lambda tmp: ["runs", "show", LONG], 2, "at most 64"),
    Case("diff-second-bad", lambda tmp: ["runs", "diff", GOOD_RUN, "x/../y"], 2, "run id 'x/../y'"),
    Case("run-run-id-slash", lambda tmp: ["run", "--run-id", "a/b"], 2, "run id 'a/b'"),
    Case("promote-dotdot", lambda tmp: ["promote", "../x", "--force", "--reason", "r"], 2, "run id '../x'"),
    Case("models-show-escape", lambda tmp: ["models", "show", "../../etc"], 2, "model name '../../etc'"),
    Case("show-unknown-run", lambda tmp: ["runs", "show", "nosuchrun", *root_args(tmp)], 1, "no run record"),
    Case(
        "promote-unknown-run",
        lambda tmp: ["promote", "nosuch", "--force", "--reason", "r", *root_args(tmp)],
        3,
        "promote refused: no run record for run 'nosuch'",
    ),
    Case(
        "promote-unreadable-record",
        lambda tmp: ["promote", "bad", "--force", "--reason", "r", *record_file("{")(tmp)[3:]],
        3,
        "not a readable run record",
    ),
    Case("models-show-unknown", lambda tmp: ["models", "show", "nosuch", *root_args(tmp)], 1, "no model 'nosuch'"),
    # It exited 1 with nothing printed.
    Case(
        "models-history-unknown", lambda tmp: ["models", "history", "nosuch", *root_args(tmp)], 1, "no production moves"
    ),
]

# ---- run records and registry files in storage -----------------------------------------------------------


def good_record(tmp: Path, run_id: str = GOOD_RUN) -> Storage:
    storage = Storage(str(tmp / "store"))
    records.save(storage, records.new_record(run_id, PipelineConfig(), CodeIdentity(), None))
    return storage


def record_file(data: str | bytes, command: str = "show") -> Callable[[Path], list[str]]:
    """A good run next to a run 'bad' whose record.json holds `data`."""

    def build(tmp: Path) -> list[str]:
        good_record(tmp)
        write(tmp / "store" / "runs" / "bad" / "record.json", data)
        return ["runs", *command.split(), *(["bad"] if command == "show" else []), *root_args(tmp)]

    return build


def record_dir(tmp: Path) -> list[str]:
    good_record(tmp)
    (tmp / "store" / "runs" / "bad" / "record.json").mkdir(parents=True)
    return ["runs", "list", *root_args(tmp)]


def lease_dir(tmp: Path) -> list[str]:
    good_record(tmp)
    (tmp / "store" / "runs" / GOOD_RUN / "lease.json").mkdir()
    write(tmp / "store" / "runs" / "notes.txt", "a stray file")
    return ["runs", "list", *root_args(tmp)]


def bad_summary(tmp: Path) -> list[str]:
    storage = good_record(tmp)
    doc = storage.read_json("runs", GOOD_RUN, "record.json")
    doc["stages"] = {
        "finetune": {
            "stage": "finetune",
            "status": "succeeded",
            "summary": {"steps": "many"},
            "started_at": "x",
            "ended_at": "y",
        }
    }
    storage.write_json(doc, "runs", GOOD_RUN, "record.json")
    return ["runs", "show", GOOD_RUN, *root_args(tmp)]


def diff_truncated(tmp: Path) -> list[str]:
    record_file('{"schema_version": 2, "run_id": "ba')(tmp)
    return ["runs", "diff", GOOD_RUN, "bad", *root_args(tmp)]


def pointer_to(version: str) -> str:
    """models/<MODEL>/production.json as a promotion writes it, naming `version`."""
    return ProductionPointer(
        name=MODEL, version=version, path=f"models/{MODEL}/{version}", run_id=version[6:], promoted_at="2026-12-01"
    ).model_dump_json()


def card_of(version: str) -> str:
    """A version's card.json as a promotion writes it (the least one)."""
    return ModelCard(name=MODEL, version=version, run_id=version[6:], source_path="runs/x/model").model_dump_json()


def registry(tmp: Path, pointer: str | bytes | None = None, card: str | bytes | None = None) -> Path:
    models = tmp / "store" / "models"
    version = models / MODEL / f"v0001-{GOOD_RUN}"
    write(version / "card.json", card if card is not None else card_of(f"v0001-{GOOD_RUN}"))
    if pointer is not None:
        write(models / MODEL / "production.json", pointer)
    return models


def rollback_cmd(pointer: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        registry(tmp, pointer)
        return ["rollback", MODEL, "--reason", "bad-input test", *root_args(tmp)]

    return build


def models_cmd(command: str, pointer=None, card=None, stray: bool = False) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        models = registry(tmp, pointer, card)
        if stray:
            write(models / "README.txt", "not a model")
        return ["models", command, *([MODEL] if command == "show" else []), *root_args(tmp)]

    return build


def pointer_dir(tmp: Path) -> list[str]:
    (registry(tmp) / MODEL / "production.json").mkdir()
    return ["models", "list", *root_args(tmp)]


def pointer_with(**changes: str) -> str:
    """A promotion's pointer to this model's v0001, with `changes` made by hand."""
    return json.dumps({**json.loads(pointer_to(f"v0001-{GOOD_RUN}")), **changes})


def rollback_to_foreign_card(tmp: Path) -> list[str]:
    """Production v0002; v0001's folder holds another model's card (a copied folder)."""
    foreign = ModelCard(name="other", version="v0001-o1", run_id="o1", source_path="runs/o1/model")
    models = registry(tmp, pointer_to("v0002-later"), foreign.model_dump_json())
    write(models / MODEL / "v0002-later" / "card.json", card_of("v0002-later"))
    return ["rollback", MODEL, "--reason", "bad-input test", *root_args(tmp)]


def record_config(edit: Callable[[dict], object], command: str = "show") -> Callable[[Path], list[str]]:
    """Run 'bad', with a fine-tune job of an hour, whose record.json's recorded config was edited by `edit`
    (the record keeps it as raw JSON); `runs show bad` or `runs diff <good> bad`."""

    def build(tmp: Path) -> list[str]:
        from tuneproof.control.record import JobEntry, RuntimeEnvAdditions, StageEntry
        from tuneproof.core.results import StageResult

        storage = good_record(tmp)
        rec = records.new_record("bad", PipelineConfig(), CodeIdentity(), None)
        job = JobEntry(
            submission_id="bad-finetune",
            entrypoint="python -m training.finetune",
            job_status="SUCCEEDED",
            attached=False,
            working_dir_hash="w",
            runtime_env_additions=RuntimeEnvAdditions(),
            submitted_at="2026-12-01T00:00:00+00:00",
            ended_at="2026-12-01T01:00:00+00:00",
            result=StageResult(stage="finetune", status="succeeded", started_at="a", ended_at="b"),
        )
        rec.stages["finetune"] = StageEntry(
            stage="finetune", status="succeeded", started_at="a", ended_at="b", jobs=[job]
        )
        records.save(storage, rec)
        doc = storage.read_json("runs", "bad", "record.json")
        edit(doc["config"])
        storage.write_json(doc, "runs", "bad", "record.json")
        shown = ["show", "bad"] if command == "show" else ["diff", GOOD_RUN, "bad"]
        return ["runs", *shown, *root_args(tmp)]

    return build


def move_doc(**changes: object) -> str:
    """A production-history entry #1 (promoting v0001), with `changes` made by hand."""
    move = {
        "seq": 1,
        "kind": "promote",
        "from_version": None,
        "to_version": f"v0001-{GOOD_RUN}",
        "run_id": GOOD_RUN,
        "by": "ana",
        "at": "2026-12-01T10:00:00+00:00",
        "reason": "gates passed",
    }
    return json.dumps({**move, **changes})


def rollback_over_bad_history(tmp: Path) -> list[str]:
    models = registry(tmp, pointer_to("v0002-later"))
    write(models / MODEL / "v0002-later" / "card.json", card_of("v0002-later"))
    write(models / MODEL / "history" / "000001.json", move_doc(at="yesterday"))
    return ["rollback", MODEL, "--reason", "bad-input test", *root_args(tmp)]


STORAGE_FILE_CASES = [
    Case("record-truncated-listed", record_file('{"schema_version": 2, "run_id": "ba', "list"), 0, "unreadable"),
    Case("record-truncated-show", record_file('{"schema_version": 2, "run_id": "ba'), 1, "not a readable run record"),
    Case("record-not-utf8", record_file(NOT_UTF8), 1, "not a readable run record"),
    Case("record-a-list", record_file("[1, 2]"), 1, "expected a JSON object, got list"),
    Case("record-future-schema", record_file('{"schema_version": 99}'), 1, "schema_version 99"),
    Case("record-wrong-field-type", record_file('{"schema_version": 2, "run_id": 5}'), 1, "run_id"),
    Case("record-absurdly-nested", record_file(DEEP_JSON), 1, "RecursionError"),
    Case("record-is-a-directory", record_dir, 0, "unreadable"),
    Case("lease-is-a-directory", lease_dir, 0, GOOD_RUN),
    Case("record-summary-wrong-shape", bad_summary, 1, "stage summary in record.json is not readable"),
    Case("diff-truncated-record", diff_truncated, 1, "not a readable run record"),
    Case("models-stray-file", models_cmd("list", stray=True), 0, MODEL),
    Case("pointer-corrupt-list", models_cmd("list", pointer="{not json"), 0, "unreadable"),
    Case("pointer-corrupt-show", models_cmd("show", pointer="{not json"), 1, "not a JSON production pointer"),
    Case("pointer-wrong-shape", models_cmd("show", pointer="[1]"), 1, "not a production pointer (Input should be"),
    Case("pointer-no-run", models_cmd("show", pointer='{"version": "v1"}'), 1, "name: Field required (4 problem(s))"),
    Case("rollback-pointer-corrupt", rollback_cmd("{not json"), 3, "not a JSON production pointer"),
    Case("pointer-not-utf8", models_cmd("show", pointer=NOT_UTF8), 1, "not a JSON production pointer"),
    Case("pointer-is-a-directory", pointer_dir, 0, "cannot be read as the production pointer"),
    Case("record-truncated-json-list", record_file("{", "list --json"), 0, '"status": "unreadable"'),
    Case("card-corrupt", models_cmd("show", card="{"), 0, "card.json is unreadable: not a model card (Invalid JSON"),
    Case("card-no-version", models_cmd("show", card='{"name": "m"}'), 0, "not a model card (run_id: Field required"),
    # Accepted: evaluate would have scored another model as this one's incumbent (the pointer's path).
    Case(
        "pointer-names-another-model",
        models_cmd("show", pointer=pointer_with(name="other")),
        1,
        "not a usable production pointer (name is 'other', expected 'dates-qwen2-tiny')",
    ),
    Case(
        "pointer-path-of-another-model",
        models_cmd("show", pointer=pointer_with(path="models/other/v0001-o1")),
        1,
        "path is 'models/other/v0001-o1', expected 'models/dates-qwen2-tiny/v0001-",
    ),
    Case(
        "pointer-version-escapes",
        models_cmd("list", pointer=pointer_with(version="../other/v0001-o1", path="models/other/v0001-o1")),
        0,
        "version is '../other/v0001-o1', expected v<NNNN>-<run id>",
    ),
    # Rolled back (exit 0): the pointer named this model and served another's files.
    Case("rollback-foreign-card", rollback_to_foreign_card, 3, "is the card of other v0001-o1, expected"),
    # A traceback in disguise ("error: AttributeError ... (please report)"), a negative cost or an infinite one.
    Case(
        "record-train-a-number",
        record_config(lambda c: c.update(train=5)),
        1,
        "its recorded config in record.json is not readable: config.train: Input should be",
    ),
    Case(
        "record-workers-a-word",
        record_config(lambda c: c["train"].update(num_workers="lots"), "diff"),
        1,
        "config.train.num_workers: Input should be a valid integer",
    ),
    Case(
        "record-price-negative",
        record_config(lambda c: c.update(cost={"prices": {"CPU": -5}})),
        1,
        "config.cost.prices.CPU: Input should be greater than or equal to 0",
    ),
    Case(
        "record-price-absurd",
        record_config(lambda c: c.update(cost={"prices": {"CPU": 1e308}}), "diff"),
        1,
        "config.cost.prices.CPU: Input should be less than or equal to 1000000",
    ),
]

# ---- saved kubectl / ray JSON for verify --from-files --------------------------------------------------------


def saved(name: str, data: str | bytes | None, directory: bool = False) -> Callable[[Path], list[str]]:
    """The good fixture set with one file replaced (None: removed; directory: a folder in its place)."""

    def build(tmp: Path) -> list[str]:
        target = tmp / "saved"
        shutil.copytree(K8S_FIXTURES, target)
        (target / name).unlink()
        if directory:
            (target / name).mkdir()
        elif data is not None:
            write(target / name, data)
        return ["verify", "--from-files", str(target), "--config", EKS]

    return build


VERIFY_CASES = [
    Case("pods-truncated", saved("pods.json", '{"items": [{"metadata": '), 4, "pods.json: not JSON"),
    Case("pods-not-utf8", saved("pods.json", NOT_UTF8), 4, "pods.json: not UTF-8"),
    # UTF-16 by its mark, with a lone surrogate: it must not be called "not UTF-8" alone.
    Case(
        "pods-broken-utf16", saved("pods.json", b"\xff\xfe{\x00\x00\xd8}\x00"), 4, "pods.json: not UTF-8 or UTF-16 text"
    ),
    Case("pods-a-string", saved("pods.json", '"hello"'), 4, "expected Kubernetes objects"),
    Case("pods-list-of-numbers", saved("pods.json", '{"kind": "List", "items": [1, 2]}'), 4, "got int"),
    Case("raycluster-missing", saved("raycluster.json", None), 4, "raycluster.json: missing"),
    Case("raycluster-a-directory", saved("raycluster.json", None, directory=True), 4, "cannot be read"),
    Case("nodes-odd-fields", saved("nodes.json", '{"items": [{"status": "x", "metadata": 5}]}'), 4, "nodes"),
    Case(
        "ray-nodes-gpu-not-a-number",
        saved("ray-nodes.json", '[{"node_ip": "10.0.1.11", "state": "ALIVE", "resources_total": {"GPU": "lots"}}]'),
        4,
        "saved objects have an unexpected shape",
    ),
    Case("ray-nodes-nested", saved("ray-nodes.json", DEEP_JSON), 4, "ray-nodes.json: not JSON"),
    # JSON reads 1e400 as inf: it ended in "error: OverflowError: cannot convert float infinity to integer".
    Case(
        "ray-nodes-cpu-infinite",
        saved("ray-nodes.json", '[{"node_ip": "10.0.1.11", "state": "ALIVE", "resources_total": {"CPU": 1e400}}]'),
        4,
        "resources_total.CPU is inf, not a count",
    ),
    Case("from-files-not-a-dir", lambda tmp: ["verify", "--from-files", str(tmp / "nope"), "-c", EKS], 4, "missing"),
    # Exit 4 with json's "Exceeds the limit (4300 digits) ...", naming no file.
    Case(
        "pods-int-too-long", saved("pods.json", f'{{"items": [], "n": {HUGE_INT}}}'), 4, "pods.json: holds an integer"
    ),
]

# ---- manifests for lint ----------------------------------------------------------------------------------------


def manifest(text: str | bytes, name: str = "bad.yaml") -> Callable[[Path], list[str]]:
    return lambda tmp: ["lint", str(write(tmp / "m" / name, text)), "--config", EKS]


LINT_CASES = [
    Case("manifest-not-utf8", manifest(NOT_UTF8), 1, "not UTF-8"),
    Case("manifest-not-yaml", manifest("kind: [Pod\n"), 1, "unparseable"),
    Case("manifest-json-truncated", manifest('{"kind": ', "bad.json"), 1, "unparseable"),
    Case("manifest-a-scalar", manifest("42\n"), 1, "a Kubernetes object"),
    Case("manifest-kind-a-number", manifest("apiVersion: v1\nkind: 5\n"), 1, "a Kubernetes object"),
    Case("manifest-list-items-not-list", manifest("apiVersion: v1\nkind: List\nitems: 5\n"), 1, "a list of Kubernetes"),
    Case("manifest-metadata-a-string", manifest("apiVersion: v1\nkind: Namespace\nmetadata: x\n"), 1, "metadata"),
    Case("manifest-deep-json", manifest(DEEP_JSON, "deep.json"), 1, "unparseable"),
    # "error: ValueError: Exceeds the limit (4300 digits) ... (please report)", exit 4.
    Case(
        "manifest-int-too-long",
        manifest(f"apiVersion: v1\nkind: Namespace\nmetadata: {{name: a}}\nspec: {{n: {HUGE_INT}}}\n"),
        1,
        "'n' at line 4: an integer of over 4,300 digits",
    ),
    Case(
        "manifest-int-too-long-json",
        manifest(
            f'{{"apiVersion": "v1", "kind": "Namespace", "metadata": {{"name": "a"}}, "n": {HUGE_INT}}}', "a.json"
        ),
        1,
        "unparseable",
    ),
    Case(
        "manifest-unknown-kind-odd-shape",
        manifest("apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\nspec: 5\n"),
        0,
        "not schema-checked",
    ),
    Case(
        "raycluster-num-gpus-overflows",
        lambda tmp: [
            "lint",
            str(write(tmp / "m" / "rc.yaml", RAYCLUSTER.replace('num-gpus: "4"', 'num-gpus: "1e400"'))),
        ],
        1,
        "rayStartParams.num-gpus is '1e400', expected '4'",
    ),
    Case("lint-missing-path", lambda tmp: ["lint", str(tmp / "nope.yaml"), "-c", EKS], 1, "no such file or folder"),
    Case(
        "lint-folder-without-manifests",
        lambda tmp: ["lint", str(write(tmp / "m" / "notes.md", "# no manifests here\n").parent), "-c", EKS],
        1,
        "no manifests in folder",
    ),
]

# ---- NCCL logs for transport -------------------------------------------------------------------------------------

TRANSPORT_CASES = [
    Case("log-not-utf8", lambda tmp: ["transport", str(write(tmp / "n.log", NOT_UTF8))], 0, "inconclusive"),
    Case(
        "log-empty-expect-efa",
        lambda tmp: ["transport", str(write(tmp / "n.log", "")), "--expect", "efa"],
        1,
        "inconclusive",
    ),
    Case("log-a-directory", lambda tmp: ["transport", str(tmp)], 2, "cannot read"),
    Case("log-missing", lambda tmp: ["transport", str(tmp / "nope.log")], 2, "No such file"),
    Case("log-bad-expect", lambda tmp: ["transport", str(write(tmp / "n.log", "")), "--expect", "ib"], 2, "'ib'"),
]

# ---- a record read from the directory it sits in --------------------------------------------------------------


def copied_run(*command: str) -> Callable[[Path], list[str]]:
    """A good run's directory copied under the name 'copy' (its record still names the original)."""

    def build(tmp: Path) -> list[str]:
        good_record(tmp)
        shutil.copytree(tmp / "store" / "runs" / GOOD_RUN, tmp / "store" / "runs" / "copy")
        return [*command, *root_args(tmp)]

    return build


def lease(body: dict | str) -> Callable[[Path], list[str]]:
    """A run left `running` whose lease.json holds `body` (a dict is completed into a lease of this host)."""

    def build(tmp: Path) -> list[str]:
        good_record(tmp)
        if isinstance(body, dict):
            doc = {"run_id": GOOD_RUN, "holder": "h", "pid": 1, "command": "c", "started": "2026-12-01T00:00:00+00:00"}
            text = json.dumps({**doc, "renewed": doc["started"], **body})
        else:
            text = body
        write(tmp / "store" / "runs" / GOOD_RUN / "lease.json", text)
        return ["runs", "list", *root_args(tmp)]

    return build


def v1_record(command: str) -> Callable[[Path], list[str]]:
    """A first-release record (no schema_version) whose stage entry is a number, beside a good run."""
    return record_file(json.dumps({"run_id": "bad", "stages": {"finetune": 5}}), command)


PROVENANCE_CASES = [
    Case("promote-copied-run", copied_run("promote", "copy", "--force", "--reason", "r"), 3, "is the record of run"),
    Case("show-copied-run", copied_run("runs", "show", "copy"), 1, f"is the record of run '{GOOD_RUN}', not of 'copy'"),
    Case("list-copied-run", copied_run("runs", "list"), 0, "a copied run directory?"),
    Case("lease-naive-time", lease({"renewed": "2026-12-01T00:00:00"}), 0, "is not a readable lease"),
    Case("lease-absurd-pid", lease({"pid": 10**30}), 0, "is not a readable lease"),
    Case("lease-negative-pid", lease({"pid": -1}), 0, "is not a readable lease"),
    Case("lease-nan-ttl", lease('{"ttl_s": NaN}'), 0, "is not a readable lease"),
    Case("lease-infinite-ttl", lease({"ttl_s": 1e400}), 0, "is not a readable lease"),
    Case("record-v1-odd-stage-listed", v1_record("list"), 0, "unexpected shape"),
    Case("record-v1-odd-stage-show", v1_record("show"), 1, "unexpected shape"),
]

# ---- saved kubectl JSON: the named cluster, all of it -------------------------------------------------------------


def fixture_json(name: str) -> dict:
    return json.loads((K8S_FIXTURES / name).read_text())


def clusters(named_state: str | None, other_first: bool = True) -> str:
    """raycluster.json as a List: a healthy cluster 'other', then the named one (in `named_state`; None: absent)."""
    named = fixture_json("raycluster.json")
    other = json.loads(json.dumps(named))
    other["metadata"]["name"] = "other"
    items = [other]
    if named_state is not None:
        named["status"] = {"state": named_state}
        items.append(named)
    return json.dumps({"kind": "List", "items": items if other_first else items[::-1]})


def pods(edit: Callable[[list[dict]], list[dict]]) -> str:
    doc = fixture_json("pods.json")
    doc["items"] = edit(doc["items"])
    return json.dumps(doc)


def worker_of_another_cluster(items: list[dict]) -> list[dict]:
    stranger = json.loads(json.dumps(items[2]))
    stranger["metadata"]["labels"]["ray.io/cluster"] = "other"
    return [items[0], items[1], stranger]


CLUSTER_CASES = [
    Case("clusters-named-one-failed", saved("raycluster.json", clusters("failed")), 4, "status.state is 'failed'"),
    Case("clusters-named-one-absent", saved("raycluster.json", clusters(None)), 4, "'tuneproof/other', expected"),
    Case(
        "raycluster-listed-twice",
        saved("raycluster.json", json.dumps({"kind": "List", "items": [fixture_json("raycluster.json")] * 2})),
        4,
        "RayCluster tuneproof/tuneproof: entries in the saved objects is 2",
    ),
    Case(
        "pod-duplicate-hides-missing-worker",
        saved("pods.json", pods(lambda items: [items[0], items[1], items[1]])),
        4,
        "entries in the saved objects is 2, expected 1",
    ),
    Case(
        "pod-of-another-cluster",
        saved("pods.json", pods(worker_of_another_cluster)),
        4,
        "workerGroupSpecs[gpu] running pods is 1, expected 2",
    ),
]

# ---- special files: FIFOs, devices, files too large -------------------------------------------------------------


def fifo(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(path)
    return path


def record_fifo(command: str) -> Callable[[Path], list[str]]:
    def build(tmp: Path) -> list[str]:
        good_record(tmp)
        fifo(tmp / "store" / "runs" / "bad" / "record.json")
        return ["runs", *command.split(), *(["bad"] if command == "show" else []), *root_args(tmp)]

    return build


def saved_fifo(tmp: Path) -> list[str]:
    args = saved("pods.json", None)(tmp)
    fifo(tmp / "saved" / "pods.json")
    return args


def saved_device(tmp: Path) -> list[str]:
    args = saved("pods.json", None)(tmp)
    (tmp / "saved" / "pods.json").symlink_to("/dev/zero")
    return args


def lease_fifo(tmp: Path) -> list[str]:
    good_record(tmp)
    fifo(tmp / "store" / "runs" / GOOD_RUN / "lease.json")
    return ["runs", "list", *root_args(tmp)]


def registry_special(name: str, make: Callable[[Path], object], command: str = "list") -> Callable[[Path], list[str]]:
    """The registry with one file (production.json, or the version's card.json) replaced by `make`'s (a FIFO, a
    file too large); `command` is `models list|show` or `rollback` (from a production version to this one)."""

    def build(tmp: Path) -> list[str]:
        models = registry(tmp)
        if command == "rollback":
            write(models / MODEL / "v0002-later" / "card.json", card_of("v0002-later"))
            write(models / MODEL / "production.json", pointer_to("v0002-later"))
        target = models / MODEL / (name if name == "production.json" else f"v0001-{GOOD_RUN}/{name}")
        target.unlink(missing_ok=True)
        make(target)
        if command == "rollback":
            return ["rollback", MODEL, "--reason", "bad-input test", *root_args(tmp)]
        return ["models", command, *([MODEL] if command == "show" else []), *root_args(tmp)]

    return build


def too_large(limit: int) -> Callable[[Path], Path]:
    return lambda path: write(path, b" " * (limit + 1))


DECISION_ID = "20261201-000000-abc123"


def images_special(name: str, make: Callable[[Path], object], command: str = "list") -> Callable[[Path], list[str]]:
    """images/current.json, or a decision's decision.json, replaced by `make`'s; `images list` or `images show`."""

    def build(tmp: Path) -> list[str]:
        images = tmp / "store" / "images"
        make(images / (name if name == "current.json" else f"{DECISION_ID}/{name}"))
        shown = [DECISION_ID, "--json"] if command == "show" else []
        return ["images", command, *shown, *root_args(tmp)]

    return build


def history_entry(make: Callable[[Path], object]) -> Callable[[Path], list[str]]:
    """The model's first production-history entry (models/<name>/history/000001.json) made by `make` (a FIFO, a
    device, a move whose who and why hold escape sequences); `models history NAME`."""

    def build(tmp: Path) -> list[str]:
        make(registry(tmp) / MODEL / "history" / "000001.json")
        return ["models", "history", MODEL, *root_args(tmp)]

    return build


def device(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.symlink_to("/dev/zero")
    return path


HOSTILE_MOVE = {
    "seq": 1,
    "kind": "rollback",
    "from_version": "v0002-later",
    "to_version": f"v0001-{GOOD_RUN}",
    "run_id": GOOD_RUN,
    "by": "\x1b[2J\x1b[31mmallory",
    "at": "2026-12-01T10:00:00+00:00",
    "reason": "ALL GATES PASSED\x1b[0m\u202e\r\n",
}


SPECIAL_FILE_CASES = [
    Case("config-fifo", lambda tmp: ["run", "--config", str(fifo(tmp / "c.yaml"))], 3, "is a FIFO (named pipe)"),
    Case("config-device", lambda tmp: ["runs", "list", "--config", "/dev/zero"], 3, "is a character device"),
    Case("config-too-large", config_file("# " + "x" * (1 << 20) + "\n"), 3, "is larger than 1,048,576 bytes"),
    Case("record-fifo-listed", record_fifo("list"), 0, "unreadable"),
    Case("record-fifo-show", record_fifo("show"), 1, "not a regular file"),
    Case("lease-fifo", lease_fifo, 0, "is not a readable lease"),
    Case("saved-pods-fifo", saved_fifo, 4, "pods.json: cannot be read: is a FIFO"),
    Case("saved-pods-device", saved_device, 4, "pods.json: cannot be read: is a character device"),
    Case("manifest-fifo", lambda tmp: ["lint", str(fifo(tmp / "m.yaml")), "-c", EKS], 1, "is a FIFO (named pipe)"),
    Case("log-fifo", lambda tmp: ["transport", str(fifo(tmp / "n.log"))], 2, "is a FIFO (named pipe)"),
    Case("log-device", lambda tmp: ["transport", "/dev/zero"], 2, "is a character device"),
    Case(
        "pointer-fifo",
        registry_special("production.json", fifo),
        0,
        "production.json: cannot be read as the production pointer: is a FIFO (named pipe)",
    ),
    Case(
        "pointer-too-large",
        registry_special("production.json", too_large(1 << 20), "show"),
        1,
        "cannot be read as the production pointer: is larger than 1,048,576 bytes",
    ),
    Case("card-fifo", registry_special("card.json", fifo, "show"), 0, "is a FIFO (named pipe), not a regular file"),
    Case(
        "card-too-large", registry_special("card.json", too_large(16 << 20), "show"), 0, "larger than 16,777,216 bytes"
    ),
    Case("rollback-card-fifo", registry_special("card.json", fifo, "rollback"), 3, "is a FIFO (named pipe)"),
    Case(
        "history-entry-fifo",
        history_entry(fifo),
        1,
        "000001.json: cannot be read as a production-history entry: is a FIFO (named pipe)",
    ),
    Case("history-entry-device", history_entry(device), 1, "production-history entry: is a character device"),
    Case(
        "image-pointer-fifo",
        images_special("current.json", fifo),
        0,
        "current.json: cannot be read as the current-image pointer: is a FIFO (named pipe)",
    ),
    Case(
        "image-pointer-too-large",
        images_special("current.json", too_large(1 << 20)),
        0,
        "cannot be read as the current-image pointer: is larger than 1,048,576 bytes",
    ),
    Case(
        "image-decision-fifo",
        images_special("decision.json", fifo, "show"),
        1,
        "decision.json: cannot be read as an image decision: is a FIFO (named pipe)",
    ),
    Case(
        "image-decision-too-large",
        images_special("decision.json", too_large(16 << 20)),
        0,
        "cannot be read as an image decision: is larger than 16,777,216 bytes",
    ),
]

# ---- duplicate YAML keys ------------------------------------------------------------------------------------------

WEAKENED_GATE = "eval:\n  gates:\n    exact_match: {min: 0.9}\n    exact_match: {min: 0.0}\n"

DUPLICATE_KEY_CASES = [
    Case(
        "config-duplicate-key", config_file(WEAKENED_GATE), 3, "duplicate key 'exact_match' at line 4 (first at line 3)"
    ),
    Case(
        "set-duplicate-key", with_set("eval.gates={exact_match: {min: 1}, exact_match: {min: 0}}"), 3, "duplicate key"
    ),
    Case(
        "manifest-duplicate-key",
        manifest("apiVersion: v1\nkind: Namespace\nmetadata: {name: a}\nkind: Pod\n"),
        1,
        "duplicate key 'kind' at line 4 (first at line 2)",
    ),
]

# ---- values validated for what they mean -------------------------------------------------------------------------

MEANING_CASES = [
    Case("set-seed-negative", with_set("train.seed=-1"), 3, "train.seed"),
    Case("set-data-seed-huge", with_set("data.seed=99999999999"), 3, "data.seed"),
    Case("set-image-digest-short", with_set("cluster.expect.image=repo@sha256:abc"), 3, "64 lowercase hex digits"),
    Case("root-file-scheme-empty", with_set("storage.root=file://"), 3, "file:// names no directory"),
]

# ---- environment variables -----------------------------------------------------------------------------------------

BAD_URL = (("PREFECT_API_URL", "htp:/127.0.0.1:4200/api"),)

ENV_CASES = [
    Case("env-prefect-url-mistyped", lambda tmp: ["run", *root_args(tmp)], 3, "PREFECT_API_URL=", BAD_URL),
    Case(
        "env-prefect-url-bad-port",
        lambda tmp: ["verify"],
        3,
        "PREFECT_API_URL",
        (("PREFECT_API_URL", "http://127.0.0.1:99999/api"),),
    ),
    Case(
        "env-prefect-log-level",
        lambda tmp: ["run", *root_args(tmp)],
        3,
        "PREFECT_LOGGING_LEVEL='LOUD' is not a log level",
        (("PREFECT_LOGGING_LEVEL", "LOUD"),),
    ),
    Case("env-verbose-odd", lambda tmp: ["run"], 3, "TUNEPROOF_VERBOSE='yes'", (("TUNEPROOF_VERBOSE", "yes"),)),
    Case(
        "env-transport-needs-no-prefect",
        lambda tmp: ["transport", str(write(tmp / "n.log", ""))],
        0,
        "inconclusive",
        BAD_URL,
    ),
    Case("env-runs-list-needs-no-prefect", lambda tmp: ["runs", "list", *root_args(tmp)], 0, "run", BAD_URL),
]

# ---- names: control characters, look-alikes ----------------------------------------------------------------------

NAME_CASES = [
    Case("show-id-newline", lambda tmp: ["runs", "show", "abc\n"], 2, "holds a control character"),
    Case("run-id-escape", lambda tmp: ["run", "--run-id", "a\x1b[2J"], 2, "holds a control character"),
    Case("only-lookalike", lambda tmp: ["run", "--only", "v\u0435rify"], 3, "'v\\u0435rify'; did you mean 'verify'?"),
    Case("until-lookalike", lambda tmp: ["run", "--until", "fin\u0435tune"], 3, "did you mean 'finetune'?"),
    Case("only-empty", lambda tmp: ["run", "--only", "", *root_args(tmp)], 3, "--only: names no stage (got '')"),
    Case("only-commas", lambda tmp: ["run", "--only", " , ", *root_args(tmp)], 3, "--only: names no stage (got ' , ')"),
    Case(
        "compare-stages-empty", lambda tmp: ["compare", "--stages", "", *root_args(tmp)], 3, "--stages: names no stage"
    ),
    Case(
        "compare-unread-difference",
        lambda tmp: data_ran(tmp, "train.lr=0.001", "train.lr=0.002"),
        3,
        "differ only in train.lr, which the stages data did not read when they last ran (they read data.source)",
    ),
    # Only the threshold was named: fixing it met the repeats refusal next.
    Case(
        "compare-every-problem",
        lambda tmp: [
            *("compare", "--stages", "verify", "--a", "train.lr=0.001", "--b", "train.lr=0.002"),
            *("--repeats", "0", "--threshold", "-1", *root_args(tmp)),
        ],
        3,
        "(got -1.0)\n  repeats must be at least 2 for an interval (got 0)",
    ),
]


def data_ran(tmp: Path, a: str, b: str) -> list[str]:
    """A run whose data stage read only data.source (its reads observed), then `compare` of data under A and B."""
    from tuneproof.control.record import StageEntry, StageInputs

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp / "store")}})
    rec = records.new_record("seen", cfg, CodeIdentity(git_sha="abc", dirty=False), None)
    inputs = StageInputs(key="k", config={"data.source": "h"}, working_dir_hash="wd")
    rec.stages["data"] = StageEntry(stage="data", status="succeeded", started_at="t", ended_at="t", inputs=inputs)
    records.save(Storage(str(tmp / "store")), rec)
    return ["compare", "--stages", "data", "--a", a, "--b", b, *root_args(tmp)]


# ---- logs and pointers: read what they hold -------------------------------------------------------------------------

EFA_LINE = (  # the plugin's choice, and a channel that ran over it: the choice alone is no traffic
    "NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct\n"
    "NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA\n"
)


def dangling_pointer(tmp: Path) -> list[str]:
    registry(tmp, pointer=pointer_to("v0009-gone"))
    return ["models", "list", *root_args(tmp)]


READ_CASES = [
    Case(
        "log-gzip",
        lambda tmp: ["transport", str(write(tmp / "n.log.gz", gzip.compress(EFA_LINE.encode())))],
        0,
        '"efa"',
    ),
    Case("log-utf16", lambda tmp: ["transport", str(write(tmp / "n.log", EFA_LINE.encode("utf-16")))], 0, '"efa"'),
    Case(
        "log-utf16-no-bom",
        lambda tmp: ["transport", str(write(tmp / "n.log", EFA_LINE.encode("utf-16-le")))],
        0,
        '"efa"',
    ),
    Case(
        "log-gzip-corrupt",
        lambda tmp: ["transport", str(write(tmp / "n.gz", b"\x1f\x8bnot gzip"))],
        2,
        "not readable gzip",
    ),
    Case("pointer-dangling", dangling_pointer, 0, "broken (v0009-gone)"),
    Case(
        "history-entry-escapes",
        history_entry(lambda path: write(path, json.dumps(HOSTILE_MOVE))),
        0,
        "by \\x1b[2J\\x1b[31mmallory: ALL GATES PASSED\\x1b[0m\\u202e\\x0d\\x0a",
    ),
    # Listed as is, then `--at` ended in "error: ValueError ... (please report)".
    Case(
        "history-entry-at-not-a-time",
        history_entry(lambda path: write(path, move_doc(at="yesterday"))),
        1,
        "000001.json: not a production-history entry (at: time 'yesterday' is not ISO 8601",
    ),
    Case(
        "history-entry-seq-not-its-file",
        history_entry(lambda path: write(path, move_doc(seq=10**30))),
        1,
        "not a production-history entry (seq is 1000000000000000000000000000000, expected 1)",
    ),
    Case("rollback-history-unreadable", rollback_over_bad_history, 3, "the production history cannot be read"),
]

CLI_CASES = (
    CONFIG_CASES
    + STORAGE_URI_CASES
    + NUL_CASES
    + ID_CASES
    + STORAGE_FILE_CASES
    + VERIFY_CASES
    + LINT_CASES
    + TRANSPORT_CASES
    + PROVENANCE_CASES
    + CLUSTER_CASES
    + SPECIAL_FILE_CASES
    + DUPLICATE_KEY_CASES
    + MEANING_CASES
    + ENV_CASES
    + NAME_CASES
    + READ_CASES
    # Bad input on the model side: model.source, the production pointer's run, a forced promotion's record.
    + [
        Case(
            "set-model-source-bare-not-a-hub-id",
            with_set("model.source=not a model"),
            3,
            "model.source: 'not a model' is neither a directory here nor a hub id",
        ),
        # It ended in "error: UnsafePath ... (please report)", exit 4.
        Case(
            "rollback-pointer-run-escapes",
            rollback_cmd(pointer_with(run_id="../../x")),
            3,
            f"not a usable production pointer (run_id is '../../x', expected '{GOOD_RUN}', the run of v0001-{GOOD_RUN})",
        ),
        # Shown, exit 0: a rollback from it would have noted that other run's record as rolled back.
        Case(
            "pointer-run-of-another-version",
            models_cmd("show", pointer=pointer_with(run_id="20261207-093835-d61c65")),
            1,
            "not a usable production pointer (run_id is '20261207-093835-d61c65', expected",
        ),
        # Rolled back (exit 0) to a pointer naming the card's run, not the version's.
        Case(
            "rollback-card-of-another-run",
            lambda tmp: rollback_to_card(
                tmp, ModelCard(name=MODEL, version=f"v0001-{GOOD_RUN}", run_id="r9", source_path="m")
            ),
            3,
            f"not a model card (run_id is 'r9', not the run of its version 'v0001-{GOOD_RUN}')",
        ),
        # It ended in "error: ValidationError: 1 validation error for FinetuneSummary ... (please report)", exit 4.
        Case(
            "promote-summary-unreadable",
            lambda tmp: ["promote", GOOD_RUN, "--force", "--reason", "r", *bad_summary(tmp)[3:]],
            3,
            f"promote refused: run {GOOD_RUN}: a stage summary in record.json is not readable: finetune.",
        ),
    ]
)


def rollback_to_card(tmp: Path, card: ModelCard) -> list[str]:
    """Production v0002; v0001's folder holds `card`."""
    models = registry(tmp, pointer_to("v0002-later"), card.model_dump_json())
    write(models / MODEL / "v0002-later" / "card.json", card_of("v0002-later"))
    return ["rollback", MODEL, "--reason", "bad-input test", *root_args(tmp)]


CASE_TIMEOUT_S = 60
"""A case that blocks (a FIFO opened for reading, a device read to the end) fails here instead of hanging."""


def tree(root: Path) -> dict[str, str]:
    """Every path under root with its type and, for a regular file, its content hash (a FIFO is never opened)."""
    out = {}
    for path in sorted(root.rglob("*")):
        mode = path.lstat().st_mode
        kind = hashlib.sha256(path.read_bytes()).hexdigest() if stat.S_ISREG(mode) else oct(stat.S_IFMT(mode))
        out[str(path.relative_to(root))] = kind
    return out


@pytest.mark.timeout(CASE_TIMEOUT_S)
@pytest.mark.parametrize("case", CLI_CASES, ids=[c.id for c in CLI_CASES])
def test_cli_bad_input(case: Case, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # relative defaults (the local storage root) land in the temp dir
    for console in (cli.console, cli.err):
        monkeypatch.setattr(console, "width", 10_000)  # one message, one line: phrases are not cut by wrapping
    args = case.build(tmp_path)
    before = tree(tmp_path)
    result = CliRunner().invoke(app, args, env=dict(case.env))
    # Only SystemExit may leave a command: anything else would have reached the guard in cli.main.
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    assert TRACEBACK not in result.output
    assert "please report" not in result.output
    assert case.phrase in result.output, result.output
    assert result.exit_code == case.code, result.output
    assert tree(tmp_path) == before  # a refusal (or a read) leaves nothing behind and changes nothing


def test_the_guard_is_one_line_and_exit_4(capsys):
    def broken() -> None:
        raise RuntimeError("an unforeseen input")

    assert guarded(broken) == 4
    err = capsys.readouterr().err
    assert err.strip() == "error: RuntimeError: an unforeseen input (please report)"
    assert TRACEBACK not in err


# ---- readers that are not commands: data rows, model directories, storage paths ----------------------------


def data_drops(text: bytes) -> dict[str, int]:
    from training.data_sources import Source, conversations, parse_rows
    from tuneproof.core import datahash
    from tuneproof.core.config_data import DataConfig

    drops = datahash.Drops()
    good = b'{"input": "1 Jan 2020", "output": "2020-01-01"}\n'
    parsed = parse_rows(Source("mem://rows.jsonl", good + text, "jsonl"), drops, "train")
    convs, total = conversations(parsed, DataConfig(), "columns", drops, "train")
    assert len(convs) == 1 and total == 2  # the good row survives the bad one
    return drops.counts


DATA_CASES = [
    ("row-truncated-json", b'{"input": "1 Jan', "undecodable"),
    ("row-not-utf8", b'{"input": "\xff\xfe", "output": "x"}', "undecodable"),
    ("row-a-list", b"[1, 2]", "wrong_type"),
    ("row-missing-field", b'{"input": "1 Jan 2020"}', "missing_field"),
    ("row-field-a-number", b'{"input": 5, "output": "2020-01-01"}', "wrong_type"),
    ("row-empty-response", b'{"input": "1 Jan 2020", "output": ""}', "empty"),
    ("row-nested-deep", b"[" * 100_000 + b"]" * 100_000, "undecodable"),
    ("row-lone-surrogate", b'{"input": "1 Jan \\ud800", "output": "2020-01-01"}', "undecodable"),
    # json keeps the last value: this trained on "x" without a word.
    ("row-repeated-key", b'{"input": "1 Jan 2020", "output": "2020-01-01", "input": "x"}', "undecodable"),
    ("row-turn-repeated-key", b'{"input": {"a": 1, "a": 2}, "output": "2020-01-01"}', "undecodable"),
]


@pytest.mark.parametrize(("text", "reason"), [c[1:] for c in DATA_CASES], ids=[c[0] for c in DATA_CASES])
def test_bad_data_rows_are_dropped_by_reason(text: bytes, reason: str):
    assert data_drops(text) == {reason: 1}


TINY_CONFIG: dict[str, Any] = {
    "model_type": "qwen2",
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "vocab_size": 32,
}


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> Path:
    """A valid one-layer Qwen2 directory, written directly: a tokenizer is not needed to load weights."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    model_dir = tmp_path_factory.mktemp("tiny") / "model"
    Qwen2ForCausalLM(Qwen2Config(**TINY_CONFIG)).save_pretrained(model_dir)
    return model_dir


def broken_model(tiny: Path, tmp: Path, damage: str) -> Path:
    model = tmp / "model"
    shutil.copytree(tiny, model)
    if damage == "no-config":
        (model / "config.json").unlink()
    elif damage == "truncated-weights":
        weights = model / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:100])
    elif damage == "no-weights":
        (model / "model.safetensors").unlink()
    elif damage == "config-not-json":
        (model / "config.json").write_text("{")
    return model


def test_the_tiny_model_directory_loads(tiny_dir):
    from training.modeling import load_model

    assert load_model(str(tiny_dir)).config.num_hidden_layers == 1  # so each damage below is what breaks it


MODEL_CASES = [
    ("no-config", "has no config.json"),
    ("config-not-json", "config.json"),
    ("truncated-weights", "not a loadable model"),
    ("no-weights", "not a loadable model"),
]


@pytest.mark.parametrize(("damage", "phrase"), MODEL_CASES, ids=[c[0] for c in MODEL_CASES])
def test_broken_model_directory_names_itself(tiny_dir, tmp_path, damage: str, phrase: str):
    from training.modeling import ModelUnreadable, load_model

    model = broken_model(tiny_dir, tmp_path, damage)
    with pytest.raises(ModelUnreadable) as e:
        load_model(str(model))
    assert str(model) in str(e.value) and phrase in str(e.value)


STORAGE_PATH_CASES = [
    ("part-dotdot", ("..", "x"), "'..' segment"),
    ("part-dotdot-inside", ("runs/../../etc",), "'..' segment"),
    ("part-absolute", ("/etc/passwd",), "is absolute"),
]


@pytest.mark.parametrize(
    ("parts", "phrase"), [c[1:] for c in STORAGE_PATH_CASES], ids=[c[0] for c in STORAGE_PATH_CASES]
)
def test_storage_refuses_parts_that_leave_the_root(tmp_path, parts: tuple[str, ...], phrase: str):
    storage = Storage(str(tmp_path))
    with pytest.raises(UnsafePath, match=phrase):
        storage.write_bytes(b"x", *parts)
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("root", ["gs://bucket/x", "s3:/bucket", "s3://", "ftp://host/x"])
def test_storage_refuses_a_root_that_is_not_local_or_s3(root: str):
    with pytest.raises(ValueError, match="storage root"):
        Storage(root)


def s3_holding(s3_endpoint: str, prefix: str, objects: dict[str, bytes]) -> Storage:
    """Storage over s3://<test bucket>/<prefix> holding `objects` (keys under the prefix), put with a plain
    boto3 client as another writer would leave them: our own writes would refuse some of them."""
    import boto3

    from tests.conftest import TEST_BUCKET

    client = boto3.client("s3", endpoint_url=s3_endpoint)
    for key, body in objects.items():
        client.put_object(Bucket=TEST_BUCKET, Key=f"{prefix}/{key}", Body=body)
    return Storage(f"s3://{TEST_BUCKET}/{prefix}", s3_endpoint)


@pytest.mark.integration
def test_s3_mirror_refuses_a_key_with_dotdot(s3_endpoint, tmp_path):
    storage = s3_holding(s3_endpoint, "bad-input", {"model/ok.json": b"{}", "model/../../escape.txt": b"x"})
    mirror = tmp_path / "mirror" / "inner"
    with pytest.raises(UnsafePath, match="'..' segment"):
        storage.download_dir(mirror, "model")
    assert not (tmp_path / "escape.txt").exists() and not (tmp_path / "mirror" / "escape.txt").exists()


@pytest.mark.integration
def test_s3_objects_too_large_for_a_lease_or_a_pointer_are_refused_by_name(s3_endpoint):
    """On S3 the size is checked on the response (its ContentLength, then what arrives), never read whole."""
    from tuneproof.control import images, lease, registry

    big = b" " * ((1 << 20) + 1)
    keys = ("runs/r/lease.json", f"models/{MODEL}/production.json", "images/current.json")
    storage = s3_holding(s3_endpoint, "oversized", dict.fromkeys(keys, big))
    assert lease.stale(storage, "r") == (None, f"{storage.uri('runs', 'r', 'lease.json')} is not a readable lease")
    with pytest.raises(registry.RegistryUnreadable, match="production.json: .* is larger than 1,048,576 bytes"):
        registry.read_pointer(storage, MODEL)
    with pytest.raises(images.ImagesUnreadable, match="current.json: .* is larger than 1,048,576 bytes"):
        images.read_current(storage)


@pytest.mark.integration
def test_s3_mirror_skips_directory_marker_objects(s3_endpoint, tmp_path):
    """pyarrow's create_dir (Ray Train's checkpoint directories) writes empty 'dir/' keys: they are not files."""
    storage = s3_holding(
        s3_endpoint,
        "markers",
        {"checkpoint_000010/": b"", "checkpoint_000010/sub/": b"", "checkpoint_000010/sub/a.bin": b"a"},
    )
    mirror = storage.download_dir(tmp_path / "mirror", "checkpoint_000010")
    assert sorted(p.relative_to(mirror).as_posix() for p in mirror.rglob("*") if p.is_file()) == ["sub/a.bin"]


def test_the_suite_is_big_enough():
    total = len(CLI_CASES) + len(DATA_CASES) + len(MODEL_CASES) + len(STORAGE_PATH_CASES) + 4  # + the 4 Storage roots
    assert total >= 60, total


def test_stage_names_are_slugs():
    from tuneproof.control import stages as table
    from tuneproof.core.names import check_slug

    for name in table.names():
        check_slug("stage name", name)


@pytest.mark.parametrize("run_id", ["a/b", "../x", "", "-x"])
def test_the_flow_refuses_a_bad_run_id_before_anything_runs(run_id: str, tmp_path):
    from flows.pipeline import pipeline

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path / "store")}})
    state = pipeline.fn(cfg, run_id=run_id)
    assert (
        state.is_failed() and f"run id {run_id!r}" in (state.message or "") and "nothing ran" in (state.message or "")
    )
    assert not (tmp_path / "store").exists()  # no record, no lease, no job


@pytest.mark.parametrize(
    ("setting", "phrase"),
    [
        (
            {"eval": {"metrics": ["exact_mach"], "gates": {"exact_mach": {"min": 0.5}}}},
            "eval.metrics: metric 'exact_mach'",
        ),
        ({"eval": {"gates": {"exact_match": {"min": 1.01}}}}, "eval.gates.exact_match.min: 1.01 cannot be met"),
        ({"model": {"source": "nosuchdir/"}}, "model.source: 'nosuchdir/' is neither a directory here nor a hub id"),
        # Locally the jobs read this machine's files: a typo was found by the data stage, after verify and connectivity.
        (
            {"data": {"source": "data/datez.jsonl"}},
            f"data.source: no such file (got '{PROJECT_ROOT}/data/datez.jsonl')",
        ),
        (
            {"data": {"eval_source": "data/dates"}},
            f"data.eval_source: a directory, not a file (got '{PROJECT_ROOT}/data/dates')",
        ),
        # Each took the lease, wrote a record and ran verify and connectivity before a job failed to load the model.
        ({"model": {"source": "./nosuchdir"}}, f"model.source: no such directory (got '{PROJECT_ROOT}/nosuchdir')"),
        ({"model": {"source": "/nonexistent/model"}}, "model.source: no such directory (got '/nonexistent/model')"),
        (
            {"model": {"source": "./data/dates/dates.jsonl"}},
            f"model.source: not a directory (got '{PROJECT_ROOT}/data/dates/dates.jsonl')",
        ),
        ({"model": {"source": "not a model"}}, "model.source: 'not a model' is neither a directory here nor a hub id"),
    ],
)
def test_the_flow_refuses_what_a_deployments_parameters_get_wrong_before_anything_runs(setting, phrase, tmp_path):
    # A run started from the Prefect UI has no CLI in front of it: an unknown metric failed evaluate after the
    # fine-tune, and a model source that is no hub id crashed the flow.
    from flows.pipeline import pipeline

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path / "store")}, **setting})
    state = pipeline.fn(cfg, run_id="deployed")
    assert state.is_failed() and (state.message or "").startswith("nothing ran: "), state.message
    assert phrase in (state.message or "")
    assert not (tmp_path / "store").exists()  # no record, no lease, no job


def test_a_fifo_given_as_a_data_or_suite_file_is_named_for_what_it_is(tmp_path):
    # It read "no such file", which sends a user looking for a file that is there; a FIFO would block the reader.
    from flows.pipeline import missing_local_files
    from tuneproof.core.metric_names import check_suites

    fifo = tmp_path / "rows.jsonl"
    os.mkfifo(fifo)
    cfg = PipelineConfig.model_validate(
        {"data": {"source": str(fifo)}, "eval": {"suites": {"s": {"source": str(fifo)}}}}
    )
    assert missing_local_files(cfg, {"data"}) == f"data.source: not a regular file (got '{fifo}')"
    assert check_suites(cfg.eval.suites) == [
        f"eval.suites.s.source: not a regular file (got '{fifo}'); give a JSONL file of items"
    ]


def test_a_local_model_source_is_checked_where_this_machine_holds_the_jobs_files_and_a_stage_loads_it(tmp_path):
    from flows.pipeline import missing_local_files
    from tuneproof.core.config import load_config

    gone = str(tmp_path / "gone")
    cfg = PipelineConfig.model_validate({"model": {"source": gone}})
    assert missing_local_files(cfg, {"verify", "connectivity"}) == (
        f"model.source: no such directory (got '{gone}'); give a local model directory or a hub id (org/name)"
    )
    assert missing_local_files(cfg, {"verify", "promote"}) is None  # neither loads the base model
    assert missing_local_files(load_config(EKS, [f"model.source={gone}"]), {"finetune"}) is None  # on the nodes alone
    hub = PipelineConfig.model_validate({"model": {"source": "Qwen/Qwen2.5-1.5B"}})
    assert missing_local_files(hub, {"finetune"}) is None  # not fetched to be checked
    too_long = PipelineConfig.model_validate({"model": {"source": "/" + "x" * 5000}})
    named = missing_local_files(too_long, {"finetune"}) or ""
    assert named.startswith("model.source: no such directory (File name too long) (got '/xxx") and len(named) < 400
    (tmp_path / "gone").mkdir()
    assert missing_local_files(cfg, {"finetune"}) is None


# ---- what storage holds reaches the terminal escaped; errors one line, tables whole, off a terminal ------------------

ESCAPES = "\x1b[2J\x1b[31mALL GATES PASSED\x1b[0m\u202e\r\n"


def hostile_record(tmp: Path) -> Storage:
    """A failed run whose cause (a record on shared storage) holds terminal escape sequences and a bidi override."""
    storage = good_record(tmp)
    rec = records.load(storage, GOOD_RUN)
    rec.status, rec.failure_class, rec.cause = "failed", FailureClass.infrastructure, f"lost a worker {ESCAPES}"
    records.save(storage, rec)
    return storage


@pytest.mark.parametrize("command", [("runs", "list"), ("runs", "show", GOOD_RUN)])
def test_escape_sequences_from_a_record_are_shown_escaped(command, tmp_path, monkeypatch):
    hostile_record(tmp_path)
    monkeypatch.setattr(cli.console, "width", 10_000)
    result = CliRunner().invoke(app, [*command, *root_args(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\u202e" not in result.output and "\r" not in result.output
    assert "\\x1b[2J\\x1b[31mALL GATES PASSED\\x1b[0m\\u202e\\x0d\\x0a" in result.output


def cli_process(args: list[str], tmp: Path, **env: str) -> subprocess.CompletedProcess:
    """The command line as a separate process writing to pipes (not a terminal), as in CI or `| less`."""
    return subprocess.run(
        [sys.executable, "-m", "tuneproof.app.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
        env={**os.environ, **env},
    )


@pytest.mark.timeout(240)
def test_columns_zero_or_narrow_still_prints_whole_rows_and_one_line_errors(tmp_path):
    good_record(tmp_path)
    for columns in ("0", "20", "x"):
        listed = cli_process(["runs", "list", *root_args(tmp_path)], tmp_path, COLUMNS=columns)
        assert listed.returncode == 0, listed.stderr
        assert any(GOOD_RUN in line and "running" in line for line in listed.stdout.splitlines()), listed.stdout
    missing = tmp_path / ("a-long-folder-name-" * 6) / "profile.yaml"
    refused = cli_process(["run", "--config", str(missing)], tmp_path, COLUMNS="20")
    assert refused.returncode == 3
    assert any(str(missing) in line for line in refused.stderr.splitlines()), refused.stderr


USAGE_ERRORS = [
    (["runs", "show", "bad id!" + "-x" * 20], "Error: Invalid value for 'run_id': run id 'bad id!" + "-x" * 20 + "'"),
    (["run", "--run-id", "a\x1b[2J"], "Error: Invalid value for '--run-id': run id 'a\\x1b[2J' holds a control"),
    (["runs", "list", "--no-such-option"], "Error: No such option: --no-such-option"),
]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("columns", ["0", "20"])
def test_usage_errors_are_one_line_whatever_the_width(columns, tmp_path):
    """Click's own usage errors (exit 2), piped and without the width the table above patches in: Rich's box
    broke an id at 80 columns (or 20) and printed nothing at all with COLUMNS=0."""
    for args, line in USAGE_ERRORS:
        done = cli_process(args, tmp_path, COLUMNS=columns)
        assert done.returncode == 2, done.stderr
        assert any(row.startswith(line) for row in done.stderr.splitlines()), done.stderr
        assert "\x1b" not in done.stderr and "╭" not in done.stderr
    helped = cli_process(["run", "--help"], tmp_path, COLUMNS=columns)
    assert helped.returncode == 0 and "--run-id" in helped.stdout and "--until" in helped.stdout, helped.stdout


def test_transport_does_not_import_prefect(tmp_path):
    log = write(tmp_path / "n.log", "")
    code = (
        "import sys; from tuneproof.app.cli import guarded, app; "
        f"sys.argv = ['tuneproof', 'transport', {str(log)!r}]; guarded(app); "
        "print('prefect' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip().endswith("False"), done.stdout + done.stderr
