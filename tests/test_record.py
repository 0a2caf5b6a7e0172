"""The typed run record: it validates against the committed JSON Schema, records from the first release
still load and show, an unreadable record is a row (not a traceback), and tables never cut an id."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import pytest
from rich.console import Console
from typer.testing import CliRunner

from tuneproof.app import cli
from tuneproof.control import record as records
from tuneproof.control.stages import record_schema
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.storage import Storage

FIXTURES = Path(__file__).parent / "fixtures" / "records"
SCHEMA_FILE = PROJECT_ROOT / "schemas" / "run-record.schema.json"
V1_RUNS = {"v1-demo": "20261201-041236-af7799", "v1-verify-failed": "20261201-041616-e52621"}


@pytest.fixture
def v1_storage(tmp_path) -> Path:
    """A storage root holding the two records the first release wrote (saved from its demo)."""
    for fixture, run_id in V1_RUNS.items():
        target = tmp_path / "runs" / run_id
        target.mkdir(parents=True)
        shutil.copy(FIXTURES / f"{fixture}.json", target / "record.json")
    return tmp_path


def tuneproof(*args: str, width: int = 80):
    """The CLI as a user at an 80-column terminal sees it."""
    wide = Console(width=width, force_terminal=False, no_color=True)
    saved = cli.console
    cli.console = wide
    try:
        return CliRunner().invoke(cli.app, list(args))
    finally:
        cli.console = saved


def test_the_committed_schema_is_the_models_schema():
    """Regenerate with `make schema` when a model changes."""
    assert json.loads(SCHEMA_FILE.read_text()) == json.loads(json.dumps(record_schema()))


@pytest.mark.parametrize("fixture", sorted(V1_RUNS))
def test_a_first_release_record_loads_and_its_json_validates(fixture, v1_storage):
    shown = tuneproof("runs", "show", V1_RUNS[fixture], "--json", "--set", f"storage.root={v1_storage}")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text())).validate(doc)
    assert doc["schema_version"] == records.SCHEMA_VERSION and doc["run_id"] == V1_RUNS[fixture]


def test_a_first_release_record_still_shows_its_evidence(v1_storage):
    shown = tuneproof("runs", "show", V1_RUNS["v1-demo"], "--set", f"storage.root={v1_storage}")
    assert shown.exit_code == 0, shown.output
    text = shown.output
    for evidence in (
        "2 ranks, transport gloo",
        "loss 5.943 -> 0.020 in 400 steps",
        "restored step 304",
        "promotion: promoted v0001-20261201-041236-af7799",
        "run 20261201-041236-af7799 succeeded",
    ):
        assert evidence in " ".join(text.split()), evidence


def test_the_schema_catches_a_summary_of_the_wrong_shape(v1_storage):
    doc = records.load(Storage(str(v1_storage)), V1_RUNS["v1-demo"]).to_json()
    doc["stages"]["finetune"]["summary"]["steps"] = "many"
    with pytest.raises(jsonschema.ValidationError, match="'many' is not of type 'integer'"):
        jsonschema.Draft202012Validator(json.loads(SCHEMA_FILE.read_text())).validate(doc)


def test_a_truncated_record_is_a_row_marked_unreadable(v1_storage):
    broken = v1_storage / "runs" / "20261201-000000-broken" / "record.json"
    broken.parent.mkdir(parents=True)
    broken.write_text((FIXTURES / "v1-demo.json").read_text()[:500])
    listed = tuneproof("runs", "list", "--json", "--set", f"storage.root={v1_storage}")
    assert listed.exit_code == 0, listed.output
    rows = {r["run_id"]: r for r in json.loads(listed.output)}
    assert rows["20261201-000000-broken"]["status"] == "unreadable"
    assert "is not a readable run record" in rows["20261201-000000-broken"]["cause"]
    assert rows[V1_RUNS["v1-demo"]]["status"] == "succeeded"
    shown = tuneproof("runs", "show", "20261201-000000-broken", "--set", f"storage.root={v1_storage}")
    assert shown.exit_code == 1 and "not a readable run record" in shown.output and "Traceback" not in shown.output


def test_tables_show_whole_run_ids_versions_and_digests_at_80_columns(v1_storage):
    listed = tuneproof("runs", "list", "--set", f"storage.root={v1_storage}", width=80)
    assert all(len(line) <= 80 for line in listed.output.splitlines())
    for run_id in V1_RUNS.values():
        assert run_id in listed.output
    shown = tuneproof("runs", "show", V1_RUNS["v1-demo"], "--set", f"storage.root={v1_storage}", width=80)
    digest = json.loads((FIXTURES / "v1-demo.json").read_text())["cluster"]["environment_digest"]
    folded = "".join(shown.output.split())  # a long digest may fold across lines, never be cut
    assert digest in folded and "…" not in shown.output
    assert "v0001-20261201-041236-af7799" in shown.output


def saved_runs(storage: Storage, v1_storage: Path, count: int) -> list[str]:
    """`count` runs saved as the flow saves them (record.json + row.json), the newest one failed."""
    base = records.load(Storage(str(v1_storage)), V1_RUNS["v1-demo"])
    ids = []
    for i in range(count):
        run = base.model_copy(update={"run_id": f"20261202-00000{i}-run", "created_at": f"2026-12-02T00:00:0{i}+00:00"})
        if i == count - 1:
            run.status, run.cause = "failed", "a gate said no"
        records.save(storage, run)
        ids.append(run.run_id)
    return ids


def test_runs_list_reads_each_runs_small_row_not_its_record(tmp_path, v1_storage, monkeypatch):
    storage = Storage(str(tmp_path / "store"))
    ids = saved_runs(storage, v1_storage, 3)
    monkeypatch.setattr(records, "load", lambda *a: pytest.fail("a whole record was read to list runs"))
    rows = records.list_rows(storage)
    assert [r.run_id for r in rows] == ids[::-1]  # newest first
    assert (rows[0].status, rows[0].cause) == ("failed", "a gate said no")
    assert all(len(storage.read_bytes("runs", i, records.ROW)) < 400 for i in ids)


def test_a_run_without_a_readable_row_is_listed_from_its_record_or_as_unreadable(tmp_path, v1_storage):
    storage = Storage(str(tmp_path / "store"))
    ids = saved_runs(storage, v1_storage, 3)
    storage.write_bytes(b"{not json", "runs", ids[0], records.ROW)  # a torn row: the record decides
    storage.remove("runs", ids[1], records.ROW)  # a record written before rows were
    shutil.copytree(storage.path("runs", ids[2]), storage.path("runs", "20261203-000000-copy"))  # another run's row
    (tmp_path / "store" / "runs" / "strays").mkdir()  # no record: not a run
    rows = {r.run_id: r for r in records.list_rows(storage)}
    assert sorted(rows) == sorted([*ids, "20261203-000000-copy"])
    assert rows[ids[0]].status == rows[ids[1]].status == "succeeded"
    assert rows["20261203-000000-copy"].status == "unreadable"
    assert "a copied run directory?" in (rows["20261203-000000-copy"].cause or "")


@pytest.mark.integration
def test_runs_list_reads_rows_on_s3_too(s3_endpoint, v1_storage):
    import uuid

    from .conftest import TEST_BUCKET

    storage = Storage(f"s3://{TEST_BUCKET}/rows-{uuid.uuid4().hex[:8]}", s3_endpoint)
    ids = saved_runs(storage, v1_storage, 2)
    storage.write_bytes(b"[1, 2]", "runs", "20261203-000000-bad", records.RECORD)
    rows = records.list_rows(storage)
    assert [r.run_id for r in rows] == [*ids[::-1], "20261203-000000-bad"]
    assert rows[-1].status == "unreadable"
