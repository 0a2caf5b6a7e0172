"""A continued run (`tuneproof run --run-id X`, no --only) keeps what still stands and reruns the rest.

The planning is pure (`plan_continuation` over the record's entries and each stage's inputs now), so its
tests read as its specification; one integration test runs it through the real flow with stand-in stages.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from prefect import task

from flows import stage_tasks
from flows.pipeline import pipeline, refusal
from tasks.jobs import StageCall
from tests.reading import present, summary_dict
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.control.record import RunRecord, StageEntry, StageInputs
from tuneproof.control.stages import Need, Stage
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_training import FinetuneSummary

INFRA = FailureClass.infrastructure
ALL = table.names()


def inputs(key: str, **config: str) -> StageInputs:
    return StageInputs(key=key, config=config, working_dir_hash="wd")


def entry(stage: str, key: str, status: str = "succeeded", **fields) -> StageEntry:
    return StageEntry(stage=stage, status=status, started_at="t0", ended_at="t1", inputs=inputs(key), **fields)


def same_inputs() -> dict[str, StageInputs]:
    return {name: inputs(f"k-{name}") for name in ALL}


def finished() -> dict[str, StageEntry]:
    return {name: entry(name, f"k-{name}") for name in ALL}


def test_a_finished_run_with_unchanged_inputs_keeps_every_stage():
    plan = table.plan_continuation(finished(), same_inputs())
    assert plan.kept == ALL and plan.reran == {}


def test_a_changed_config_section_reruns_its_stage_and_everything_downstream():
    now = same_inputs()
    now["finetune"] = StageInputs(key="new", config={"train": "t2"}, working_dir_hash="wd")
    entries = finished()
    entries["finetune"] = entries["finetune"].model_copy(
        update={"inputs": StageInputs(key="k-finetune", config={"train": "t1"}, working_dir_hash="wd")}
    )
    plan = table.plan_continuation(entries, now)
    assert plan.kept == ["verify", "connectivity", "data"]
    assert plan.reran == {
        "finetune": "inputs changed: config train",
        "resume": "finetune reran",
        "evaluate": "finetune reran",
        "promote": "finetune, resume, evaluate reran",
    }


def test_changed_code_and_a_changed_needed_output_are_named():
    before = StageInputs(key="a", config={"eval": "e"}, working_dir_hash="wd1", needs={"finetune.export_path": "h1"})
    now = StageInputs(key="b", config={"eval": "e"}, working_dir_hash="wd2", needs={"finetune.export_path": "h2"})
    assert table.changed_inputs(before, now) == "code (working_dir wd1 -> wd2), finetune.export_path"


def test_an_interrupted_fine_tune_with_the_same_inputs_reruns_and_resumes_its_invocation():
    entries = finished()
    for name in ("resume", "evaluate", "promote"):
        del entries[name]  # the run stopped at the fine-tune
    entries["finetune"] = entry(
        "finetune", "k-finetune", "failed", failure_class=INFRA, cause="Ray job x STOPPED", invocation=2
    )
    plan = table.plan_continuation(entries, same_inputs())
    assert plan.kept == ["verify", "connectivity", "data"]
    assert plan.reran["finetune"] == "failed (infrastructure): Ray job x STOPPED"
    assert plan.reran["evaluate"] == "finetune reran"
    assert resumes(record_with(entries), inputs("k-finetune")) == 2


# ---- whether an interrupted stage resumes: decided as it starts, after what it needs has rerun

FINETUNE = table.by_name("finetune")


def resumes(rec: RunRecord, now: StageInputs, stage: Stage = FINETUNE) -> int | None:
    return table.resumes_invocation(stage, now, rec)


def interrupted(key: str = "k-finetune", **fields) -> StageEntry:
    return entry("finetune", key, "failed", failure_class=INFRA, cause="Ray job x STOPPED", **fields)


def rerun_with_only(*superseded: StageEntry) -> RunRecord:
    """A record as `--only data,finetune` leaves it when the fine-tune starts: data reran (in `stages`), the
    fine-tune's earlier attempts superseded, oldest first."""
    rec = record_with({"data": entry("data", "k-data", invocation=2)})
    rec.superseded = [entry("data", "k-data"), *superseded]
    return rec


def test_only_data_and_finetune_resumes_the_interrupted_fine_tune_when_data_kept_its_identity():
    rec = rerun_with_only(interrupted(invocation=1))
    assert resumes(rec, inputs("k-finetune")) == 1


def test_a_fine_tune_whose_inputs_changed_after_its_upstream_reran_starts_fresh():
    rec = rerun_with_only(interrupted(invocation=1))
    assert resumes(rec, inputs("k-finetune-new-dataset")) is None


def test_a_resumed_attempt_that_is_interrupted_again_still_resumes_the_first_one():
    rec = rerun_with_only(interrupted(invocation=1), interrupted(invocation=3, job_invocation=1))
    assert resumes(rec, inputs("k-finetune")) == 1


def test_only_the_latest_attempt_counts_and_only_when_it_was_interrupted():
    fresh_after = rerun_with_only(interrupted(invocation=1), entry("finetune", "k-finetune", invocation=2))
    assert resumes(fresh_after, inputs("k-finetune")) is None  # it finished since: a rerun trains fresh
    modeling = interrupted(invocation=1).model_copy(update={"failure_class": FailureClass.modeling})
    assert resumes(rerun_with_only(modeling), inputs("k-finetune")) is None  # nan loss: no checkpoint to trust
    keyless = interrupted(invocation=1).model_copy(update={"inputs": None})
    assert resumes(rerun_with_only(keyless), inputs("k-finetune")) is None  # an earlier release's entry
    assert resumes(rerun_with_only(), inputs("k-finetune")) is None  # never ran


def test_a_stage_that_is_not_resumable_never_resumes():
    rec = record_with({"data": entry("data", "k-data", "failed", failure_class=INFRA, cause="s3 down")})
    assert resumes(rec, inputs("k-data"), table.by_name("data")) is None


def test_the_needs_identity_not_the_rerun_decides_the_fine_tunes_key():
    """Data rerun to the same content hash: the fine-tune's key is the one it was interrupted with."""
    data = DataSummary(dataset_path="datasets/dates/abc", content_hash="abc", dataset_uri="/x")
    config = PipelineConfig().model_dump(mode="json")
    first = record_with({"data": StageEntry.succeeded("data", data, "t0")})
    before = table.stage_inputs(FINETUNE, config, "wd", first)
    rec = rerun_with_only(interrupted(before.key, invocation=1).model_copy(update={"inputs": before}))
    rec.stages["data"] = StageEntry.succeeded("data", data, "t1").model_copy(update={"invocation": 2})
    assert resumes(rec, table.stage_inputs(FINETUNE, config, "wd", rec)) == 1
    other = data.model_copy(update={"dataset_path": "datasets/dates/def", "content_hash": "def"})
    rec.stages["data"] = StageEntry.succeeded("data", other, "t1")
    assert resumes(rec, table.stage_inputs(FINETUNE, config, "wd", rec)) is None


def test_a_job_cut_short_keeps_the_key_it_had_before_it_ran_so_a_changed_setting_trains_fresh():
    """A stopped job reports no reads: keyed by the flow's few reads, a changed train.lr would have resumed."""
    from tuneproof.control.record import JobEntry, RuntimeEnvAdditions
    from tuneproof.core.results import StageResult

    result = StageResult(stage="finetune", status="failed", failure_class=INFRA, started_at="t0", ended_at="t1")
    stopped = JobEntry(
        submission_id="r-finetune", entrypoint="python -m training.finetune", job_status="STOPPED", attached=False,
        working_dir_hash="wd", runtime_env_additions=RuntimeEnvAdditions(),
        submitted_at="2026-12-01T00:00:00+00:00", ended_at="2026-12-01T00:01:00+00:00", result=result,
    )  # fmt: skip
    assert not table.reads_reported(StageEntry.failed("finetune", INFRA, "STOPPED", jobs=[stopped]))
    assert table.reads_reported(StageEntry.failed("promote", INFRA, "no job"))  # in-flow: the flow's reads are all
    config = PipelineConfig().model_dump(mode="json")
    rec = rerun_with_only()
    before = table.stage_inputs(FINETUNE, config, "wd", rec)  # before it ran: every section but the timeouts
    rec.superseded.append(interrupted(before.key, invocation=1).model_copy(update={"inputs": before}))
    assert resumes(rec, table.stage_inputs(FINETUNE, config, "wd", rec)) == 1
    changed = {**config, "train": {**config["train"], "lr": 0.5}}
    assert resumes(rec, table.stage_inputs(FINETUNE, changed, "wd", rec)) is None


def test_modeling_failures_and_failed_stages_rerun_with_their_cause():
    entries = finished()
    entries["finetune"] = entry("finetune", "k-finetune", "failed", failure_class=FailureClass.modeling, cause="nan")
    entries["data"] = entry("data", "k-data", "failed", failure_class=INFRA, cause="s3 down")
    plan = table.plan_continuation(entries, same_inputs())
    assert plan.reran["data"] == "failed (infrastructure): s3 down"
    assert plan.reran["finetune"] == "data reran"


def test_missing_results_and_results_without_a_key_rerun():
    entries = finished()
    del entries["verify"]
    entries["connectivity"] = entries["connectivity"].model_copy(update={"inputs": None})
    plan = table.plan_continuation(entries, same_inputs())
    assert plan.reran["verify"] == "no result yet"
    assert "no inputs key" in plan.reran["connectivity"]
    assert "verify" not in plan.kept and "data" in plan.kept  # data needs neither


def record_with(stages: dict[str, StageEntry]) -> RunRecord:
    cfg = PipelineConfig()
    rec = records.new_record("r", cfg, records.CodeIdentity(), None)
    rec.stages = stages
    return rec


def test_stage_inputs_hash_the_sections_the_code_and_the_needed_outputs_identity():
    data = DataSummary(dataset_path="datasets/dates/abc", content_hash="abc", dataset_uri="/x")
    tuned = FinetuneSummary(
        run_name="r", train_storage_uri="/t", checkpoints=[], start_step=0, steps=4, seconds=1.0, export_path="model",
        export_sha256="e1",
    )  # fmt: skip
    rec = record_with(
        {"data": StageEntry.succeeded("data", data, "t0"), "finetune": StageEntry.succeeded("finetune", tuned, "t0")}
    )
    config = PipelineConfig().model_dump(mode="json")
    evaluate = table.by_name("evaluate")
    never_ran = table.stage_inputs(evaluate, config, "wd", rec)
    assert "timeouts" not in never_ran.config and {"eval", "train", "model"} <= set(never_ran.config)
    reads = ["eval.max_examples", "model.name"]  # what it read when it ran, observed
    one = table.stage_inputs(evaluate, config, "wd", rec, reads=reads)
    assert one.needs["finetune.export_path"] == "e1"  # the export's content, not its path
    assert list(one.config) == reads
    rec.stages["evaluate"] = entry("evaluate", one.key).model_copy(update={"inputs": one})
    assert table.stage_inputs(evaluate, config, "wd", rec) == one  # deterministic, and its last reads by default
    unread = {**config, "eval": {**config["eval"], "max_new_tokens": 9}}
    assert table.stage_inputs(evaluate, unread, "wd", rec).key == one.key
    retrained = tuned.model_copy(update={"export_sha256": "e2"})
    rec.stages["finetune"] = StageEntry.succeeded("finetune", retrained, "t0")
    assert table.stage_inputs(evaluate, config, "wd", rec).key != one.key
    assert table.stage_inputs(evaluate, config, "wd2", rec).key != one.key
    changed = {**config, "eval": {**config["eval"], "max_examples": 7}}
    assert table.stage_inputs(evaluate, changed, "wd", rec).key != one.key
    timeouts = {**config, "timeouts": {**config["timeouts"], "evaluate": 1}}  # bounds a stage, changes no result
    assert table.stage_inputs(evaluate, timeouts, "wd", rec).key == table.stage_inputs(evaluate, config, "wd", rec).key
    del rec.stages["finetune"]
    assert table.stage_inputs(evaluate, config, "wd", rec).needs["finetune.export_path"] == "missing"


# ---------------------------------------------------------------- integration: through the real flow

CALLS: list[str] = []
STAND_IN_TASKS: dict[str, Callable[[StageCall], StageEntry]] = {}
FAILING: dict[str, str] = {}
"""Stand-in stages that fail (as a modeling failure) with this cause."""


def stand_in(name: str, needs: tuple[Need, ...], setting: str) -> Stage:
    """A stage that records its call, reads one setting and succeeds with a data-shaped summary (so `needs`
    resolve). It declares nothing: the setting it reads is observed."""

    @task(name=name)
    def run(call: StageCall) -> StageEntry:
        CALLS.append(name)
        section, field = setting.split(".")
        getattr(getattr(call.cfg, section), field)
        if name in FAILING:
            return StageEntry.failed(name, FailureClass.modeling, FAILING[name])
        summary = DataSummary(dataset_path=f"datasets/{name}/{call.invocation}", content_hash=name, dataset_uri="/x")
        return StageEntry.succeeded(name, summary, "t0")

    STAND_IN_TASKS[name] = run
    return Stage(
        name=name,
        summary=DataSummary,
        evidence=lambda s: s.dataset_path,
        fails_as=(INFRA,),
        timeout=table.IN_FLOW,
        needs=needs,
    )


@pytest.fixture
def stand_ins(monkeypatch):
    stages = (
        stand_in("a", (), "data.name"),
        stand_in("b", (Need("a", "dataset_path"),), "train.lr"),
        stand_in("c", (Need("b", "dataset_path"),), "eval.max_examples"),
    )
    monkeypatch.setattr(table, "STAGES", stages)
    monkeypatch.setattr(stage_tasks, "TASKS", dict(STAND_IN_TASKS))
    CALLS.clear()
    FAILING.clear()
    return stages


@pytest.mark.integration
def test_a_continued_run_keeps_unchanged_stages_and_reruns_a_changed_one_and_its_downstream(
    prefect_harness, stand_ins, tmp_path
):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    assert pipeline(config=cfg, run_id="cont", return_state=True).is_completed()
    assert CALLS == ["a", "b", "c"]

    CALLS.clear()  # nothing changed: nothing runs, every stage is kept
    assert pipeline(config=cfg, run_id="cont", return_state=True).is_completed()
    rec = records.load(Storage(str(tmp_path)), "cont")
    assert CALLS == [] and rec.invocations[-1].kept == ["a", "b", "c"] and rec.status == "succeeded"

    assert {name: list(present(rec.stages[name].inputs).config) for name in "abc"} == {
        "a": ["data.name"],
        "b": ["train.lr"],
        "c": ["eval.max_examples"],
    }  # what each stage read, observed

    CALLS.clear()  # a setting no stage read changes nothing
    unread = cfg.model_copy(update={"train": cfg.train.model_copy(update={"log_every": 7})})
    assert pipeline(config=unread, run_id="cont", return_state=True).is_completed()
    assert CALLS == [] and records.load(Storage(str(tmp_path)), "cont").invocations[-1].kept == ["a", "b", "c"]

    CALLS.clear()  # a changed setting that b read reruns b and c, keeps a
    changed = cfg.model_copy(update={"train": cfg.train.model_copy(update={"lr": 0.003})})
    assert pipeline(config=changed, run_id="cont", return_state=True).is_completed()
    rec = records.load(Storage(str(tmp_path)), "cont")
    assert CALLS == ["b", "c"]
    last = rec.invocations[-1]
    assert last.kept == ["a"] and last.reran == {"b": "inputs changed: config train.lr", "c": "b reran"}
    assert last.status == "succeeded" and last.running is None
    assert [e.stage for e in rec.superseded] == ["b", "c"]
    assert rec.stages["a"].invocation == 1 and rec.stages["c"].invocation == 4
    assert summary_dict(rec, "c")["dataset_path"] == "datasets/c/4"


@pytest.mark.integration
def test_a_run_until_a_stage_stops_there_and_its_continuation_runs_the_rest(prefect_harness, stand_ins, tmp_path):
    # train.log_every: set, in a section b reads, and read by no stage; only once c has had its turn is it ignored.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "train": {"log_every": 7}})
    assert pipeline(config=cfg, run_id="part", until="b", return_state=True).is_completed()
    rec = records.load(Storage(str(tmp_path)), "part")
    assert CALLS == ["a", "b"] and set(rec.stages) == {"a", "b"}
    assert rec.status == "succeeded" and rec.invocations[-1].until == "b"
    assert rec.unread_settings == []  # c, not run yet, might read it

    CALLS.clear()  # the same `until` again: everything it covers stands, nothing runs
    assert pipeline(config=cfg, run_id="part", until="b", return_state=True).is_completed()
    rec = records.load(Storage(str(tmp_path)), "part")
    assert CALLS == [] and rec.invocations[-1].kept == ["a", "b"] and rec.invocations[-1].reran == {}

    CALLS.clear()  # the continuation without `until` keeps a and b and runs only c
    assert pipeline(config=cfg, run_id="part", return_state=True).is_completed()
    rec = records.load(Storage(str(tmp_path)), "part")
    assert CALLS == ["c"]
    last = rec.invocations[-1]
    assert last.kept == ["a", "b"] and last.reran == {"c": "no result yet"} and last.until is None
    assert [rec.stages[n].invocation for n in ("a", "b", "c")] == [1, 1, 3]
    assert rec.unread_settings == ["train.log_every"]


@pytest.mark.integration
def test_a_subset_that_would_supersede_what_a_later_stage_needs_is_refused_before_anything_runs(
    prefect_harness, stand_ins, tmp_path
):
    """`--only data,evaluate`: data ran (and superseded the fine-tune), then evaluate was refused, "nothing ran"."""
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    assert pipeline(config=cfg, run_id="sub", return_state=True).is_completed()
    before = records.load(Storage(str(tmp_path)), "sub")
    CALLS.clear()
    state = pipeline(config=cfg, run_id="sub", only=["a", "c"], return_state=True)
    assert refusal(state) == (
        "nothing ran: stage c needs b.dataset_path from a succeeded b stage, and run sub's b is superseded by this "
        "rerun; run it too (e.g. --only a,b,c)"
    )
    assert CALLS == [] and records.load(Storage(str(tmp_path)), "sub") == before  # nothing superseded, nothing saved


@pytest.mark.integration
def test_a_flow_whose_run_was_taken_over_mid_stage_stops_and_leaves_its_successors_record(
    prefect_harness, stand_ins, tmp_path, monkeypatch
):
    """A flow presumed dead (renewals failing past the ttl) whose run another flow took over carried on: its next
    save overwrote the successor's record, its failed verify and its invocation gone, with `succeeded`."""
    from tuneproof.control import lease as leases
    from tuneproof.core.results import now_iso

    storage = Storage(str(tmp_path))

    @task(name="b")
    def taken_over_meanwhile(call: StageCall) -> StageEntry:
        CALLS.append("b")
        now = now_iso()
        successor = leases.LeaseInfo(
            run_id="lost", holder="elsewhere", pid=1, flow_run_id="flow-successor", command="successor", started=now,
            renewed=now,
        )  # fmt: skip
        storage.write_bytes(successor.model_dump_json().encode(), "runs", "lost", leases.LEASE)
        theirs = records.load(storage, "lost")
        theirs.end("failed", INFRA, "a: the successor's own verdict")
        records.save(storage, theirs)
        return StageEntry.succeeded("b", DataSummary(dataset_path="d", content_hash="b", dataset_uri="/x"), "t0")

    monkeypatch.setitem(stage_tasks.TASKS, "b", taken_over_meanwhile)
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    state = pipeline(config=cfg, run_id="lost", return_state=True)
    assert state.is_failed() and "lost the lease on run lost" in (state.message or "")
    assert "held by 'successor' (flow run flow-successor" in (state.message or "")
    assert CALLS == ["a", "b"]  # c was never submitted
    rec = records.load(storage, "lost")
    assert (rec.status, rec.cause) == ("failed", "a: the successor's own verdict")
    assert rec.stages["b"].status == "failed"  # as the successor closed it (interrupted), not this flow's success
    assert records.read_row(storage, "lost") == records.row_of(rec)
    assert present(leases.read(storage, "lost")).flow_run_id == "flow-successor"  # the loser released nothing


def test_needs_are_checked_against_what_the_plan_leaves_standing():
    data = DataSummary(dataset_path="datasets/d/abc", content_hash="abc", dataset_uri="/x")
    finished = record_with(
        {
            "data": StageEntry.succeeded("data", data, "t0"),
            "finetune": StageEntry.succeeded("finetune", finetuned("e1"), "t0"),
        }
    )
    table.check_needs(table.plan(["evaluate", "promote"]), finished)  # the fine-tune and the data stand
    table.check_needs(table.plan(["data", "finetune", "evaluate"]), finished)  # each need made earlier in the plan
    with pytest.raises(
        table.MissingStageOutput, match="finetune is superseded by this rerun; .*--only data,finetune,evaluate"
    ):
        table.check_needs(table.plan(["data", "evaluate"]), finished)
    with pytest.raises(
        table.MissingStageOutput, match="run r's data has not run; run it too .e.g. --only data,finetune"
    ):
        table.check_needs(table.plan(["finetune"]), record_with({}))
    unreadable = StageEntry.failed("data", FailureClass.data, "data source x is unreadable")
    with pytest.raises(table.MissingStageOutput, match="run r's data failed without it"):
        table.check_needs(table.plan(["finetune"]), record_with({"data": unreadable}))


@pytest.mark.integration
def test_a_current_failed_stage_keeps_the_run_failed_whatever_a_later_invocation_ran(
    prefect_harness, stand_ins, tmp_path, monkeypatch
):
    """`--until b` or `--only v` (v: a stage c does not depend on, as verify for evaluate) after c failed ended
    `succeeded`, exit 0, with the failed c still current."""
    from tuneproof.app.cli import run_exit_code

    monkeypatch.setattr(table, "STAGES", (stand_in("v", (), "cluster.backend"), *stand_ins))
    monkeypatch.setattr(stage_tasks, "TASKS", dict(STAND_IN_TASKS))
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    FAILING["c"] = "gate exact_match failed"
    assert pipeline(config=cfg, run_id="bad", return_state=True).is_failed()
    FAILING.clear()
    for only, until in ((None, "b"), (["v"], None)):
        CALLS.clear()
        state = pipeline(config=cfg, run_id="bad", only=only, until=until, return_state=True)
        rec = records.load(Storage(str(tmp_path)), "bad")
        assert state.is_failed() and rec.status == "failed" and rec.failure_class == FailureClass.modeling
        assert rec.cause == "c: gate exact_match failed (invocation 1's, still current)"
        assert run_exit_code(rec) == 6
    assert CALLS == ["v"]
    CALLS.clear()  # the continuation reruns c (and only c): the run succeeds once nothing failed stands
    assert pipeline(config=cfg, run_id="bad", return_state=True).is_completed()
    assert CALLS == ["c"] and records.load(Storage(str(tmp_path)), "bad").status == "succeeded"


def test_evaluate_depends_on_the_production_model_but_not_on_its_own_promotion(tmp_path):
    from tuneproof.control.registry import ProductionPointer

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    rec = record_with({"finetune": StageEntry.succeeded("finetune", finetuned("e1"), "t0")})
    evaluate = table.by_name("evaluate")
    assert evaluate.external is not None
    assert evaluate.external(cfg, storage, rec) == {"registry.production": "none"}
    other = ProductionPointer(
        name=cfg.model.name,
        version="v0002-other",
        path=f"models/{cfg.model.name}/v0002-other",
        run_id="other",
        promoted_at="t",
    )
    storage.write_json(other.to_json(), "models", cfg.model.name, "production.json")
    assert evaluate.external(cfg, storage, rec) == {"registry.production": "v0002-other"}
    # This run promoted its fine-tune over v0002; a rerun of evaluate superseded record.promotion before it ran.
    own = other.model_copy(
        update={
            "version": "v0003-r",
            "path": f"models/{cfg.model.name}/v0003-r",
            "run_id": "r",
            "previous_version": "v0002-other",
        }
    )
    storage.write_json(
        own.model_copy(update={"content_sha256": "e1"}).to_json(), "models", cfg.model.name, "production.json"
    )
    assert rec.promotion is None
    assert evaluate.external(cfg, storage, rec) == {"registry.production": "v0002-other"}  # its own promotion
    config = cfg.model_dump(mode="json")
    moved = table.stage_inputs(evaluate, config, "wd", rec, {"registry.production": "v3"})
    assert moved.key != table.stage_inputs(evaluate, config, "wd", rec, {"registry.production": "v2"}).key
    before = table.stage_inputs(evaluate, config, "wd", rec, {"registry.production": "v2"})
    assert table.changed_inputs(before, moved) == "registry.production"


def finetuned(export_sha256: str) -> FinetuneSummary:
    return FinetuneSummary(
        run_name="r", train_storage_uri="/t", checkpoints=[], start_step=0, steps=4, seconds=1.0,
        export_path="runs/r/model", export_sha256=export_sha256,
    )  # fmt: skip


def test_a_candidate_already_in_production_is_scored_against_the_version_it_replaced_never_itself():
    """Re-evaluating a run that promoted itself (a continuation after a gate changed, `--only evaluate,promote`)
    compared the candidate with itself: the incumbent was whatever production named, this run's own version."""
    from tuneproof.control.registry import ProductionPointer

    rec = record_with({"finetune": StageEntry.succeeded("finetune", finetuned("e1"), "t0")})
    own = ProductionPointer(
        name="m", version="v0003-r", path="models/m/v0003-r", run_id="r", promoted_at="t",
        previous_version="v0002-other", content_sha256="e1",
    )  # fmt: skip
    assert table.incumbent(own, rec) == table.Incumbent("v0002-other", "models/m/v0002-other")
    assert table.incumbent(own.model_copy(update={"previous_version": None}), rec) is None  # it was the first
    # Production is an earlier fine-tune of this same run: that model is the incumbent the new one must beat.
    earlier = own.model_copy(update={"content_sha256": "e0"})
    assert table.incumbent(earlier, rec) == table.Incumbent("v0003-r", "models/m/v0003-r")
    assert table.incumbent(None, rec) is None


def test_the_evaluate_job_is_given_the_incumbent_its_inputs_key_names(tmp_path, monkeypatch):
    from tasks import jobs
    from tuneproof.control.registry import ProductionPointer
    from tuneproof.core.summaries_eval import EvaluateSummary

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    rec = record_with({"finetune": StageEntry.succeeded("finetune", finetuned("e1"), "t0")})
    own = ProductionPointer(
        name=cfg.model.name, version="v0003-r", path=f"models/{cfg.model.name}/v0003-r", run_id="r",
        promoted_at="t", previous_version="v0002-other", content_sha256="e1",
    )  # fmt: skip
    Storage(str(tmp_path)).write_json(own.to_json(), "models", cfg.model.name, "production.json")
    submitted = []
    monkeypatch.setattr(jobs, "run_single_job", lambda call, spec: submitted.append(spec.params))
    inputs = {"dataset_path": "datasets/d/abc", "export_path": "runs/r/model", "suites": []}
    call = StageCall(
        stage="evaluate", cfg=cfg, run_id="r", invocation=2, timeout_s=60, summary=EvaluateSummary, inputs=inputs,
        record=rec,
    )  # fmt: skip
    jobs.evaluate.fn(call)
    assert submitted[0]["incumbent"] == {"version": "v0002-other", "path": f"models/{cfg.model.name}/v0002-other"}
    evaluate = table.by_name("evaluate")
    assert evaluate.external is not None
    assert evaluate.external(cfg, Storage(str(tmp_path)), rec) == {"registry.production": "v0002-other"}


def test_a_source_file_edited_in_place_changes_the_data_stages_key(tmp_path):
    """The data stage's settings name its files by path: an edited file kept its dataset, and every model after it."""
    source, suite = tmp_path / "train.jsonl", tmp_path / "suite.jsonl"
    source.write_text('{"q": "a", "a": "b"}\n')
    suite.write_text('{"input": "x", "output": "y"}\n')
    cfg = PipelineConfig.model_validate(
        {
            "storage": {"root": str(tmp_path)},
            "data": {"source": str(source), "eval_source": "hf://org/held-out:test"},
            "eval": {"suites": {"add": {"source": str(suite)}}},
        }
    )
    data, storage, rec = table.by_name("data"), Storage(str(tmp_path)), record_with({})
    assert data.external is not None
    contents = data.external(cfg, storage, rec)
    assert set(contents) == {"data.source content", "data.eval_source content", "eval.suites.add.source content"}
    assert contents["data.eval_source content"] == "hf://org/held-out:test"  # a hub dataset: its URI alone
    config = cfg.model_dump(mode="json")
    before = table.stage_inputs(data, config, "wd", rec, contents)
    source.write_text('{"q": "a", "a": "b"}\n')  # written again, the same bytes: the same key
    assert table.stage_inputs(data, config, "wd", rec, data.external(cfg, storage, rec)) == before
    source.write_text('{"q": "NEW", "a": "ROWS"}\n')
    edited = table.stage_inputs(data, config, "wd", rec, data.external(cfg, storage, rec))
    assert table.changed_inputs(before, edited) == "data.source content"
    suite.write_text('{"input": "x", "output": "z"}\n')
    assert "eval.suites.add.source content" in table.changed_inputs(
        edited, table.stage_inputs(data, config, "wd", rec, data.external(cfg, storage, rec))
    )
    source.unlink()  # a path on the cluster's nodes alone: the data job, which reads it there, is the judge
    assert data.external(cfg, storage, rec)["data.source content"] == "unreadable here (FileNotFoundError)"


def test_runs_show_says_which_stages_were_kept_and_why_others_reran():
    from tuneproof.app.terminal import invocation_line
    from tuneproof.control.record import Invocation

    crashed = Invocation(number=1, at="t0", config_hash="c", status="crashed", cause="its writer died: pid 7 is gone")
    assert invocation_line(crashed) == "1 at t0, crashed (its writer died: pid 7 is gone)"
    continued = Invocation(
        number=2,
        at="t1",
        config_hash="c",
        status="succeeded",
        lease_takeover="took over the lease of pid 7: its pid 7 is gone",
        kept=["verify", "data"],
        reran={"finetune": "failed (infrastructure): interrupted", "evaluate": "finetune reran"},
    )
    assert invocation_line(continued) == (
        "2 at t1, succeeded; took over the lease of pid 7: its pid 7 is gone; kept verify, data; "
        "reran finetune (failed (infrastructure): interrupted), evaluate (finetune reran)"
    )


# ---------------------------------------------------------------- integration: the real pipeline's reads


@pytest.mark.integration
def test_every_stage_stores_the_settings_its_jobs_read_with_their_values(finished_run):
    """The record's inputs of each stage are the settings observed in its jobs (and the flow), hashed as the
    config held them: nothing declared by hand."""
    from tuneproof.core import config_reads

    rec = finished_run.record
    for name, stage_entry in rec.stages.items():
        stored = stage_entry.inputs.config
        job_reads = config_reads.outermost({p for job in stage_entry.jobs for p in job.result.config_reads})
        covered = {p for p in job_reads if any(p == s or p.startswith(s + ".") for s in stored)}
        assert covered == job_reads, f"{name}: its jobs read {sorted(job_reads - covered)}, not in its inputs"
        assert stored == config_reads.reads_hashes(rec.config, list(stored)), name
        assert not any(p.split(".")[0] == "timeouts" for p in stored), name
    # The settings each job reads that a hand list once left out or could drift from:
    reads = {name: set(e.inputs.config) for name, e in rec.stages.items()}
    assert {"train.num_workers", "train.use_gpu", "train.sharding", "connectivity.iters"} <= reads["connectivity"]
    assert {"train.num_workers", "train.use_gpu", "cluster.backend"} <= reads["verify"]
    assert {"train.lr", "train.max_steps", "train.seed"} <= reads["finetune"]
    assert {"eval.max_new_tokens", "eval.gates"} <= reads["evaluate"]
    # Of eval's settings the data stage reads only its suites (checked against the training split), so a gate
    # change never re-prepares the data.
    assert "data.source" in reads["data"] and {p for p in reads["data"] if p.startswith("eval.")} == {"eval.suites"}


@pytest.mark.integration
def test_continuing_with_another_world_size_reruns_connectivity_and_keeps_the_data(finished_run):
    rec = finished_run.record
    config = {**rec.config, "train": {**rec.config["train"], "num_workers": 4}}
    wd = rec.stages["connectivity"].inputs.working_dir_hash
    now = {stage.name: table.stage_inputs(stage, config, wd, rec, _external(rec, stage.name)) for stage in table.STAGES}
    plan = table.plan_continuation(rec.stages, now)
    assert "data" in plan.kept
    # verify reads it too: whether the nodes can place that many workers is part of its verdict.
    assert plan.reran["verify"] == "inputs changed: config train.num_workers"
    assert plan.reran["connectivity"] == "inputs changed: config train.num_workers"
    assert plan.reran["finetune"] == "inputs changed: config train.num_workers"


def _external(rec: RunRecord, name: str) -> dict[str, str]:
    """The external inputs the stage ran with (evaluate's production version, data's source contents, the
    flow-side code of an in-flow verdict), as its entry stored them: its inputs' needs that are no need of its."""
    needs = {str(need) for need in table.by_name(name).needs}
    return {k: v for k, v in present(rec.stages[name].inputs).needs.items() if k not in needs}
