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

from tuneproof.app import cli, cli_runs
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
    saved = cli_runs.console
    cli_runs.console = wide
    try:
        return CliRunner().invoke(cli.app, list(args))
    finally:
        cli_runs.console = saved


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


def record_saved_without_its_row(storage: Storage, run_id: str, status: str) -> None:
    """The first half of records.save: the flow was killed before it wrote row.json."""
    rec = records.load(storage, run_id)
    rec.status, rec.failure_class, rec.cause = status, None, None  # type: ignore[assignment]
    storage.write_json(rec.to_json(), "runs", run_id, records.RECORD)


def test_a_row_a_save_behind_its_record_is_never_listed(tmp_path, v1_storage):
    # A flow killed between record.json and row.json left `runs list` saying the previous save's status: succeeded
    # for a run whose record was running again (its writer dead), running (shown crashed) for one that succeeded.
    storage = Storage(str(tmp_path / "store"))
    ahead, behind, edited, gone = saved_runs(storage, v1_storage, 4)
    record_saved_without_its_row(storage, ahead, "running")
    running = records.load(storage, behind)
    running.status = "running"
    records.save(storage, running)
    record_saved_without_its_row(storage, behind, "succeeded")
    row = storage.read_json("runs", edited, records.ROW)
    storage.write_json({**row, "status": "crashed"}, "runs", edited, records.ROW)  # a hand edit of the index
    storage.remove("runs", gone, records.RECORD)
    rows = {r.run_id: r for r in records.list_rows(storage)}
    assert (rows[ahead].status, rows[behind].status, rows[edited].status) == ("running", "succeeded", "succeeded")
    assert rows[gone].status == "unreadable"  # not the `failed` its row said
    assert f"{gone}/record.json is gone" in (rows[gone].cause or "")


def test_a_row_written_before_rows_were_stamped_is_checked_against_its_record(tmp_path, v1_storage):
    storage = Storage(str(tmp_path / "store"))
    (run_id,) = saved_runs(storage, v1_storage, 1)
    unstamped = {k: v for k, v in storage.read_json("runs", run_id, records.ROW).items() if k != "stamp"}
    storage.write_json({**unstamped, "status": "running"}, "runs", run_id, records.ROW)
    assert [(r.run_id, r.status) for r in records.list_rows(storage)] == [(run_id, "failed")]
    records.save(storage, records.load(storage, run_id))  # the next save stamps it
    assert "stamp" in storage.read_json("runs", run_id, records.ROW)


@pytest.mark.parametrize("bad", ["unknown", "2026-12-01T04:12:46"])
def test_a_job_time_that_is_not_an_iso_time_with_its_offset_makes_the_record_unreadable(v1_storage, bad):
    # `runs show` subtracted it for the run's cost: `error: ValueError: Invalid isoformat string` (exit 4, no file).
    run_id = V1_RUNS["v1-demo"]
    path = v1_storage / "runs" / run_id / "record.json"
    doc = json.loads(path.read_text())
    job = next(job for entry in doc["stages"].values() for job in entry.get("jobs", []))
    job["submitted_at"] = bad
    path.write_text(json.dumps(doc))
    with pytest.raises(records.RecordUnreadable, match="submitted_at") as refused:
        records.load(Storage(str(v1_storage)), run_id)
    assert str(path) in str(refused.value) and repr(bad) in str(refused.value)
    for command in (["show", run_id], ["diff", run_id, V1_RUNS["v1-verify-failed"]]):
        shown = tuneproof("runs", *command, "--set", f"storage.root={v1_storage}")
        assert shown.exit_code == 1 and "not a readable run record" in shown.output, shown.output


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
    record_saved_without_its_row(storage, ids[-1], "running")  # its ETag is not the one its row was stamped with
    assert records.list_rows(storage)[0].status == "running"


def test_a_100000_step_fine_tune_leaves_a_record_of_at_most_64_kb(tmp_path):
    """The record stays bounded at 100,000 steps: it keeps a thinned curve and ledger for display, and names
    the metrics log that holds every step by path and hash; what `runs show` prints is unchanged."""
    import random

    from training.finetune_summary import curve_fields
    from tuneproof.control.stages import finetune_evidence
    from tuneproof.core.config import PipelineConfig
    from tuneproof.core.results import StageResult
    from tuneproof.core.rowlog import append_rows, read_rows, rows_sha256
    from tuneproof.core.summaries import CheckpointRef
    from tuneproof.core.summaries_training import CURVE_POINTS, FinetuneSummary, loss_curve

    steps, rng = 100_000, random.Random(0)
    rows = [
        {"step": step, "loss": 3 / step**0.1 + rng.random() / 100, "tokens_per_s": 1234.5 + rng.random(),
         "samples": f"{step * 7919:016x}", "ledger": f"{step * 104729:064x}"}
        for step in range(1, steps + 1)
    ]  # fmt: skip
    storage = Storage(str(tmp_path))
    append_rows(storage, rows, "runs", "big", "stages", "finetune", "metrics.jsonl")
    uri = f"{tmp_path}/runs/big/train/big-finetune"
    summary = FinetuneSummary(
        run_name="big-finetune",
        train_storage_uri=uri,
        checkpoints=[CheckpointRef(s, f"{uri}/checkpoint_{s:06d}") for s in (99_800, 99_900, 100_000)],
        latest_checkpoint=CheckpointRef(100_000, f"{uri}/checkpoint_100000"),
        start_step=0,
        steps=steps,
        seconds=86_400.0,
        **curve_fields(rows, "runs/big/stages/finetune/metrics.jsonl"),
    )
    result = StageResult(
        stage="finetune", status="succeeded", summary=summary.to_json(), started_at="t0", ended_at="t1"
    )
    job = records.JobEntry(
        submission_id="big-finetune-1", entrypoint="python -m training.finetune", job_status="SUCCEEDED",
        attached=False, working_dir_hash="0" * 64, runtime_env_additions=records.RuntimeEnvAdditions(),
        submitted_at="2026-12-01T00:00:00+00:00", ended_at="2026-12-02T00:00:00+00:00", result=result,
    )  # fmt: skip
    rec = records.new_record("big", PipelineConfig(), records.CodeIdentity(git_sha="abc", dirty=False), None)
    rec.stages["finetune"] = records.StageEntry.from_jobs("finetune", result, [job], "t0")
    records.save(storage, rec)

    size = len((tmp_path / "runs" / "big" / "record.json").read_bytes())
    assert size <= 64 << 10, f"record.json is {size} bytes at {steps} steps, expected at most {64 << 10}"
    shown = records.load(storage, "big").summary("finetune", FinetuneSummary)
    assert shown is not None and shown.thinned and shown.curve_steps == steps
    assert len(shown.loss_curve) == CURVE_POINTS and len(shown.ledger) == CURVE_POINTS
    whole = loss_curve(rows)
    assert shown.loss_curve[0] == whole[0] and shown.loss_curve[-1] == whole[-1]
    assert finetune_evidence(shown) == f"full: loss {whole[0][1]:.3f} -> {whole[-1][1]:.3f} in 100000 steps"
    # Every step is where the record says, as it was when the summary was written.
    assert shown.metrics_path is not None
    logged = read_rows(storage, *shown.metrics_path.split("/"))
    assert loss_curve(logged) == whole and rows_sha256(logged) == shown.metrics_sha256


def test_the_run_state_machine_lives_on_the_record():
    """start and end set status, failure class and cause together and close the invocation; a stage the
    invocation left running becomes a failed (infrastructure) entry; a run never 'ends' running."""
    from tuneproof.control.record import CodeIdentity, Invocation, StageAttempt, StageInputs
    from tuneproof.core.config import PipelineConfig
    from tuneproof.core.results import FailureClass

    rec = records.new_record("r", PipelineConfig(), CodeIdentity(git_sha="abc", dirty=False), None)
    inputs = StageInputs(key="k", config={}, working_dir_hash="w")
    rec.invocations.append(Invocation(number=1, at="t0", config_hash="h", kept=[], reran={}))
    rec.invocations[-1].running = StageAttempt(stage="finetune", inputs=inputs, job_invocation=1, started_at="t1")
    rec.end("cancelled", None, "KeyboardInterrupt")
    assert (rec.status, rec.failure_class, rec.cause) == ("cancelled", None, "KeyboardInterrupt")
    assert (rec.invocations[-1].status, rec.invocations[-1].running) == ("cancelled", None)
    interrupted = rec.stages["finetune"]
    assert interrupted.failure_class == FailureClass.infrastructure and interrupted.inputs == inputs
    assert "invocation 1 ended cancelled while it ran (KeyboardInterrupt)" in (interrupted.cause or "")

    rec.invocations.append(Invocation(number=2, at="t2", config_hash="h", kept=[], reran={}))
    rec.start()
    assert (rec.status, rec.failure_class, rec.cause) == ("running", None, None)
    rec.end("failed", FailureClass.modeling, "evaluate: a gate failed")
    assert (rec.status, rec.failure_class, rec.invocations[-1].status) == ("failed", FailureClass.modeling, "failed")
    with pytest.raises(ValueError, match="not running"):
        rec.end("running")
