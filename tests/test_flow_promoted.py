"""The real stage table through the real flow, with stand-in stages: a run that is production, continued.

    python -m pytest -q -m integration tests/test_flow_promoted.py

Every stage but evaluate is a stand-in task that reads a setting or two (observed, as the real jobs' reads are)
and succeeds with a summary of its shape; evaluate is the real task (tasks.jobs.evaluate), whose Ray job is
stood in for, so its choice of incumbent is the one under test; promote moves the production pointer as
tasks.promote does (a run that is production already keeps its version).
"""

from __future__ import annotations

import errno

import pytest
from prefect import task
from typer.testing import CliRunner

from flows import stage_tasks
from flows.pipeline import pipeline
from tasks import jobs
from tasks.jobs import StageCall
from tasks.rayjob import JobSpec
from tests.reading import present, production_pointer
from tuneproof.app.cli import app
from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.control.record import StageEntry
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary

pytestmark = pytest.mark.integration

CALLS: list[str] = []
INCUMBENTS: list[str | None] = []
"""The incumbent version each evaluate job was given."""
FAILING: dict[str, str] = {}
"""Stages that fail (as a modeling failure) with this cause."""


def read(call: StageCall, setting: str) -> None:
    """Read a setting as the stage's real job would: the flow observes it into the stage's inputs key."""
    section, field = setting.split(".")
    getattr(getattr(call.cfg, section), field)


def ended(call: StageCall, entry: StageEntry) -> StageEntry:
    CALLS.append(call.stage)
    return StageEntry.failed(call.stage, FailureClass.modeling, FAILING[call.stage]) if call.stage in FAILING else entry


@task(name="verify")
def verify(call: StageCall) -> StageEntry:
    read(call, "train.num_workers")
    return ended(call, StageEntry(stage=call.stage, status="succeeded", started_at="t0", ended_at="t1"))


@task(name="data")
def data(call: StageCall) -> StageEntry:
    read(call, "data.source")
    summary = DataSummary(dataset_path="datasets/d/abc", content_hash="abc", dataset_uri="/x")
    return ended(call, StageEntry.succeeded("data", summary, "t0"))


@task(name="finetune")
def finetune(call: StageCall) -> StageEntry:
    content = f"export-lr-{call.cfg.train.lr}"  # the same settings train the same weights
    summary = FinetuneSummary(
        run_name=call.run_id, train_storage_uri="/t", checkpoints=[], start_step=0, steps=4, seconds=1.0,
        export_path=f"runs/{call.run_id}/model", export_sha256=content,
    )  # fmt: skip
    return ended(call, StageEntry.succeeded("finetune", summary, "t0"))


def evaluate_job(call: StageCall, spec: JobSpec) -> StageEntry:
    """The evaluate task's Ray job: what it was given is kept; it reads what the real job reads most visibly."""
    read(call, "eval.max_examples")
    INCUMBENTS.append((spec.params["incumbent"] or {}).get("version"))
    return ended(call, StageEntry(stage=call.stage, status="succeeded", started_at="t0", ended_at="t1"))


@task(name="promote")
def promote(call: StageCall) -> StageEntry:
    """As tasks.promote.move_pointer: a pointer that already names this run's content is kept, else it moves."""
    read(call, "promote.require_approval")
    storage = Storage.from_config(call.cfg.storage)
    content = present(call.record.summary("finetune", FinetuneSummary)).export_sha256
    pointer, _ = registry.read_pointer(storage, call.cfg.model.name)
    if not registry.is_promotion_of(pointer, call.run_id, content):
        version = registry.next_version(registry.versions(storage, call.cfg.model.name), call.run_id)
        storage.write_json({}, "models", call.cfg.model.name, version, "card.json")
        pointer = registry.ProductionPointer(
            name=call.cfg.model.name, version=version, path=f"models/{call.cfg.model.name}/{version}",
            run_id=call.run_id, promoted_at="t", previous_version=pointer.version if pointer else None,
            content_sha256=content,
        )  # fmt: skip
        storage.write_json(pointer.to_json(), "models", call.cfg.model.name, "production.json")
    summary = PromoteSummary(promoted=True, **pointer.model_dump(exclude={"move"}))
    return ended(call, StageEntry.succeeded("promote", summary, "t0"))


@pytest.fixture
def stand_ins(prefect_harness, monkeypatch):
    tasks = {"verify": verify, "connectivity": verify, "data": data, "finetune": finetune, "resume": verify}
    monkeypatch.setattr(stage_tasks, "TASKS", {**tasks, "evaluate": jobs.evaluate, "promote": promote})
    monkeypatch.setattr(stage_tasks, "ARTIFACTS", {})
    monkeypatch.setattr("flows.pipeline.ARTIFACTS", {})
    monkeypatch.setattr(jobs, "run_single_job", evaluate_job)
    for kept in (CALLS, INCUMBENTS, FAILING):
        kept.clear()


def config(tmp_path, **eval_settings: int) -> PipelineConfig:
    source = tmp_path / "train.jsonl"
    source.write_text('{"q": "a", "a": "b"}\n')
    doc = {
        "storage": {"root": str(tmp_path / "store")},
        "data": {"source": str(source)},
        "model": {
            "source": str(tmp_path)
        },  # a directory: the stand-in stages load no model, the flow's check wants one
        "eval": eval_settings,
    }
    return PipelineConfig.model_validate(doc)


def test_a_run_that_promoted_itself_is_evaluated_again_against_the_version_it_replaced(stand_ins, tmp_path):
    """It was compared with itself (production was its own version), and every continuation after that, with
    nothing changed, evaluated it again ('inputs changed: registry.production')."""
    cfg, storage = config(tmp_path), Storage(str(tmp_path / "store"))
    assert pipeline(config=cfg, run_id="other", return_state=True).is_completed()
    lr = {"train": cfg.train.model_copy(update={"lr": 0.5})}
    assert pipeline(config=cfg.model_copy(update=lr), run_id="x", return_state=True).is_completed()
    assert production_pointer(storage, cfg.model.name).version == "v0002-x" and INCUMBENTS == [None, "v0001-other"]

    stricter = config(tmp_path, max_examples=7).model_copy(update=lr)
    CALLS.clear()
    assert pipeline(config=stricter, run_id="x", return_state=True).is_completed()
    assert CALLS == ["evaluate", "promote"] and INCUMBENTS[-1] == "v0001-other"
    assert production_pointer(storage, cfg.model.name).version == "v0002-x"  # kept, not promoted over itself

    CALLS.clear()  # nothing changed: nothing runs
    assert pipeline(config=stricter, run_id="x", return_state=True).is_completed()
    assert CALLS == [] and records.load(storage, "x").invocations[-1].reran == {}

    CALLS.clear()  # the README's `--only evaluate,promote` on a promoted run
    assert pipeline(config=stricter, run_id="x", only=["evaluate", "promote"], return_state=True).is_completed()
    assert CALLS == ["evaluate", "promote"] and INCUMBENTS[-1] == "v0001-other"


def test_a_failed_re_evaluation_of_a_run_in_production_never_says_it_was_not_promoted(stand_ins, tmp_path):
    """Production served the run while its record said `promoted: false`: the re-evaluation's failure stands
    beside the promotion, which only a rollback takes back."""
    from tuneproof.app.terminal import Screen, print_summary

    cfg, storage = config(tmp_path), Storage(str(tmp_path / "store"))
    assert pipeline(config=cfg, run_id="x", return_state=True).is_completed()
    FAILING["evaluate"] = "gate exact_match failed"
    state = pipeline(config=config(tmp_path, max_examples=7), run_id="x", return_state=True)
    rec = records.load(storage, "x")
    assert state.is_failed() and (rec.status, rec.failure_class) == ("failed", FailureClass.modeling)
    promotion = present(rec.promotion)
    assert production_pointer(storage, cfg.model.name).run_id == "x"
    assert promotion.promoted and promotion.version == "v0001-x"
    assert [e.stage for e in rec.superseded] == ["evaluate", "promote"]
    screen = Screen()
    with screen.capture() as shown:
        print_summary(rec, screen)
    assert (
        "promotion: promoted v0001-x earlier in this run and in production when the run last ended, though the "
        "evidence it was promoted on is superseded" in shown.get()
    )


def test_a_flow_that_crashes_before_it_could_write_its_record_exits_4_not_with_the_last_summary(
    stand_ins, tmp_path, monkeypatch
):
    """A continuation whose record write failed (ENOSPC, after the lease) printed the previous invocation's
    `run x succeeded` and exited 0."""
    cfg = config(tmp_path)
    assert pipeline(config=cfg, run_id="x", return_state=True).is_completed()
    write = Storage.write_bytes

    def full(self: Storage, data: bytes, *parts: str) -> None:
        if parts[-1:] == (records.RECORD,):
            raise OSError(errno.ENOSPC, "No space left on device")
        write(self, data, *parts)

    monkeypatch.setattr(Storage, "write_bytes", full)
    sets = [
        f"storage.root={cfg.storage.root}",
        f"data.source={cfg.data.source}",
        f"model.source={cfg.model.source}",
        "train.lr=0.5",
    ]
    result = CliRunner().invoke(app, ["run", "--run-id", "x", *[arg for s in sets for arg in ("--set", s)]])
    assert result.exit_code == 4, result.output
    assert "run x crashed and its record could not be updated" in result.output and "succeeded" not in result.output
