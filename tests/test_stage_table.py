"""The stage table is the one place a stage is defined: a toy stage registered here runs through the
flow and through `--only`, and the table's own facts (order, needs, downstream) are consistent."""

from __future__ import annotations

import json
from functools import partial

import pytest
from prefect import task
from prefect.states import Completed, Failed
from typer.testing import CliRunner

from flows import stage_tasks
from flows.pipeline import pipeline, refusal, refused
from tasks.jobs import StageCall
from tests.reading import summary_of
from tuneproof.app.cli import app
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.control.record import CodeIdentity, StageEntry
from tuneproof.control.stages import Need, Stage
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_cluster import Timeouts
from tuneproof.core.results import FailureClass
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import Summary
from tuneproof.core.summaries_data import DataSummary


class ToySummary(Summary):
    """What the toy stage proves: that it received the dataset path the data stage recorded."""

    dataset_path: str
    letters: int


@task(name="toy")
def toy_task(call: StageCall) -> StageEntry:
    path = call.inputs["dataset_path"]
    return StageEntry.succeeded("toy", ToySummary(dataset_path=path, letters=len(path)), "t0")


TOY = Stage(
    name="toy",
    summary=ToySummary,
    evidence=lambda s: f"{s.letters} letters in {s.dataset_path}",
    fails_as=(FailureClass.infrastructure,),
    timeout=table.IN_FLOW,  # a task in the flow process: it submits no Ray job
    needs=(Need("data", "dataset_path"),),
    metrics=lambda s: {"toy.letters": float(s.letters)},
)


def test_a_stage_without_a_timeout_is_refused_when_it_is_registered():
    late = partial(Stage, name="late", summary=ToySummary, evidence=str, fails_as=(FailureClass.infrastructure,))
    with pytest.raises(ValueError, match="stage 'late' has no timeout: set timeout= to a config.timeouts field"):
        late()
    with pytest.raises(ValueError, match="stage 'late': timeout must name a config.timeouts field .* got 'trian'"):
        late(timeout="trian")
    assert late(timeout="finetune").timeout_s(PipelineConfig()) == 3600
    with pytest.raises(ValueError, match="stage 'late': timeout must be a positive number of seconds, got 0"):
        late(timeout=0)


def test_a_new_job_stage_takes_a_fixed_deadline_without_a_config_field():
    """ARCHITECTURE.md's recipe for a stage that is one Ray job: its job module, its summary model and this
    one entry (three files outside tests); a config.timeouts field only once a profile needs another."""
    toy_job = Stage(
        name="toy",
        summary=ToySummary,
        evidence=str,
        fails_as=(FailureClass.infrastructure,),
        job="training.toy",
        timeout=600,
    )
    assert toy_job.timeout_s(PipelineConfig()) == 600 and "toy" not in Timeouts.model_fields


@pytest.fixture
def with_toy(monkeypatch):
    monkeypatch.setattr(table, "STAGES", (*table.STAGES, TOY))
    monkeypatch.setitem(stage_tasks.TASKS, "toy", toy_task)
    return TOY


def seeded_run(root, run_id: str = "toy-run") -> tuple[PipelineConfig, Storage]:
    """A finished run whose data stage succeeded (its record only: the toy stage needs nothing else)."""
    cfg = PipelineConfig.model_validate({"storage": {"root": str(root)}})
    storage = Storage(str(root))
    rec = records.new_record(run_id, cfg, CodeIdentity(git_sha="abc", dirty=False), None)
    data = DataSummary(dataset_path="datasets/dates/abc123", content_hash="abc123", dataset_uri=f"{root}/x")
    rec.stages["data"] = StageEntry.succeeded("data", data, "t0")
    rec.status = "succeeded"  # a finished run: `--only` reruns against finished runs only
    records.save(storage, rec)
    return cfg, storage


def test_the_built_in_table_is_in_pipeline_order_with_needs_on_earlier_stages():
    assert table.names() == ["verify", "connectivity", "data", "finetune", "resume", "evaluate", "promote"]
    for position, stage in enumerate(table.STAGES):
        earlier = set(table.names()[:position])
        assert stage.upstream() <= earlier, f"{stage.name} needs a later stage"
        for need in stage.needs:
            assert need.output in table.by_name(need.stage).summary.model_fields, f"{stage.name}: {need}"
        assert stage.timeout in (*Timeouts.model_fields, table.IN_FLOW)
    assert table.downstream("finetune") == ["resume", "evaluate", "promote"]
    assert table.downstream("data") == ["finetune", "resume", "evaluate", "promote"]
    assert table.downstream("promote") == []


def test_plan_refuses_unknown_stages_and_knows_when_an_earlier_run_is_needed():
    with pytest.raises(table.UnknownStages, match="unknown stage.s. evalute; expected some of verify, "):
        table.plan(["evalute"])
    assert not table.needs_an_earlier_run(table.plan(["verify", "connectivity", "data"]))
    assert table.needs_an_earlier_run(table.plan(["evaluate"]))


def test_until_plans_the_stages_up_to_and_including_one_and_refuses_a_typo_or_only():
    assert table.names(table.plan(None, "finetune")) == ["verify", "connectivity", "data", "finetune"]
    assert table.names(table.plan(None, "verify")) == ["verify"]
    assert table.names(table.plan(None, "promote")) == table.names()
    with pytest.raises(table.UnknownStages, match="unknown stage 'fintune'; expected one of verify, "):
        table.plan(None, "fintune")
    with pytest.raises(table.UnknownStages, match="--only and --until do not combine .got --only data --until data"):
        table.plan(["data"], "data")


def test_run_until_a_stage_that_is_not_one_exits_3_naming_it(tmp_path):
    result = CliRunner().invoke(app, ["run", "--until", "fintune", "--set", f"storage.root={tmp_path}"])
    assert result.exit_code == 3, result.output
    assert (
        "--until: unknown stage 'fintune'; did you mean 'finetune'? (expected some of verify, connectivity, data"
        in result.output
    )
    both = CliRunner().invoke(app, ["run", "--only", "data", "--until", "data", "--set", f"storage.root={tmp_path}"])
    assert both.exit_code == 3 and "--only and --until do not combine" in both.output
    assert not Storage(str(tmp_path)).exists("runs")


@pytest.mark.integration
def test_a_toy_stage_runs_through_the_flow_with_its_inputs_evidence_and_metrics(prefect_harness, with_toy, tmp_path):
    from tuneproof.app.rundiff import diff_records

    cfg, storage = seeded_run(tmp_path)
    state = pipeline(config=cfg, run_id="toy-run", only=["toy"], return_state=True)
    assert state.is_completed(), state.message
    rec = records.load(storage, "toy-run")
    assert summary_of(rec, "toy", ToySummary) == ToySummary(dataset_path="datasets/dates/abc123", letters=21)
    assert table.evidence_line(rec.stages["toy"]) == "21 letters in datasets/dates/abc123"
    metrics = [m for m in diff_records(rec, rec)["metrics"] if not m["metric"].startswith("cost.")]
    assert metrics == [{"metric": "toy.letters", "a": 21.0, "b": 21.0, "delta": 0.0}]


@pytest.mark.integration
def test_a_toy_stage_runs_through_only_on_the_command_line(prefect_harness, with_toy, tmp_path):
    seeded_run(tmp_path)
    result = CliRunner().invoke(app, ["run", "--only", "toy", "--set", f"storage.root={tmp_path}"])
    assert result.exit_code == 0, result.output
    assert "reruns against the latest run, toy-run" in result.output  # toy needs data: the latest run's
    assert "21 letters in" in result.output
    shown = CliRunner().invoke(app, ["runs", "show", "toy-run", "--json", "--set", f"storage.root={tmp_path}"])
    assert json.loads(shown.output)["stages"]["toy"]["summary"]["letters"] == 21


@pytest.mark.integration
def test_a_toy_stage_without_its_input_is_a_usage_error(prefect_harness, with_toy, tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    state = pipeline(config=cfg, run_id="empty-run", only=["toy"], return_state=True)
    assert "stage toy needs data.dataset_path" in (refusal(state) or "")
    assert "(e.g. --only data,toy)" in (refusal(state) or "")
    assert not Storage(str(tmp_path)).exists("runs", "empty-run", records.RECORD)  # refused before it was written


@pytest.mark.integration
def test_a_flow_run_with_an_unknown_stage_fails_before_anything_is_submitted(prefect_harness, tmp_path):
    """`only` is checked by the flow itself (a deployment run has no CLI in front of it)."""
    cfg = PipelineConfig.model_validate(
        {"storage": {"root": str(tmp_path)}, "cluster": {"address": "http://127.0.0.1:9"}}
    )  # nothing answers there
    state = pipeline(config=cfg, run_id="typo", only=["verify", "evalute"], return_state=True)
    assert refusal(state) == (
        "nothing ran: unknown stage(s) evalute; expected some of verify, connectivity, data, "
        "finetune, resume, evaluate, promote"
    )
    assert not Storage(str(tmp_path)).exists("runs")


def test_a_refusal_is_known_by_its_type_not_by_its_words():
    """The CLI exits 3 on a refused request; a stage failure whose words happen to read alike stays a failure."""
    assert refusal(refused("run id 'x' is taken")) == "nothing ran: run id 'x' is taken"
    assert refusal(Failed(message="nothing ran: a stage's own words")) is None
    assert refusal(Failed(message="boom", data=RuntimeError("boom"))) is None
    assert refusal(Completed(message="nothing ran")) is None


def test_the_flow_parameter_offers_the_stage_names_as_choices():
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(pipeline.fn).model_dump()["properties"]
    array = next(option for option in schema["only"]["anyOf"] if option.get("type") == "array")
    assert array["items"]["enum"] == table.names()
    until = next(option for option in schema["until"]["anyOf"] if option.get("type") == "string")
    assert until["enum"] == table.names()
