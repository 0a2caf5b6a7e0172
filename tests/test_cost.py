"""What a run and a promoted version cost, and goodput: pure over records and the production history.

A promoted version is charged its own run and every run of the same model since the previous promotion
(failed, refused, superseded attempts); canary and comparison runs are listed apart. The integration
test is the demo's story: a failed run, then a promoted one, whose card charges both.
"""

from __future__ import annotations

import json
import shutil
from datetime import datetime
from pathlib import Path

import pytest
from pydantic import ValidationError

from tests.conftest import tuneproof
from tests.reading import present, production_pointer
from tuneproof.app.rundiff import diff_records
from tuneproof.control import cost, registry
from tuneproof.control import record as records
from tuneproof.control.history import Move
from tuneproof.control.record import CodeIdentity, JobEntry, RunRecord, RuntimeEnvAdditions, StageEntry, new_record
from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import FailureClass, StageResult
from tuneproof.core.rowlog import append_rows
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import CopyCheckSummary
from tuneproof.core.summaries_training import METRICS_LOG, FinetuneSummary, Restart

GPU_CFG = PipelineConfig.model_validate({"train": {"num_workers": 4, "use_gpu": True}})


def job(module: str, start: str, end: str, summary: dict | None = None) -> JobEntry:
    result = StageResult(stage="s", status="succeeded", summary=summary, started_at=start, ended_at=end)
    return JobEntry(
        submission_id=f"x-{module}",
        entrypoint=f"python -m {module}",
        job_status="SUCCEEDED",
        attached=False,
        working_dir_hash="w",
        runtime_env_additions=RuntimeEnvAdditions(),
        submitted_at=start,
        ended_at=end,
        result=result,
    )


def at(seconds: int) -> str:
    return f"2026-12-03T10:{seconds // 60:02d}:{seconds % 60:02d}+00:00"


def run(run_id: str, created: int, cfg: PipelineConfig = GPU_CFG, failed: bool = False, steps: int = 100) -> RunRecord:
    """A run created at `created` seconds whose data job took 10 s and fine-tune 60 s (`steps` steps)."""
    rec = new_record(run_id, cfg, CodeIdentity(), None)
    rec.created_at = at(created)
    data = StageEntry(
        stage="data",
        status="succeeded",
        started_at=at(created),
        ended_at=at(created + 10),
        jobs=[job("training.data_prep", at(created), at(created + 10))],
    )
    ft_summary = FinetuneSummary(
        run_name=run_id, train_storage_uri="t", checkpoints=[], start_step=0, steps=steps, seconds=60.0
    ).to_json()
    finetune = StageEntry(
        stage="finetune",
        status="failed" if failed else "succeeded",
        started_at=at(created + 10),
        ended_at=at(created + 70),
        summary=ft_summary,
        jobs=[job("training.finetune", at(created + 10), at(created + 70), ft_summary)],
    )
    rec.stages = {"data": data, "finetune": finetune}
    if failed:
        rec.status, rec.failure_class = "failed", FailureClass.modeling
    else:
        rec.status = "succeeded"
    return rec


def promotion(seq: int, run_id: str, when: int) -> Move:
    return Move(
        seq=seq,
        kind="promote",
        from_version=None,
        to_version=f"v000{seq}-{run_id}",
        run_id=run_id,
        by="a",
        at=at(when),
        reason="x",
    )


def test_a_run_is_charged_by_stage_with_workers_and_gpus():
    run_cost = cost.run_cost(run("r1", 0), {"CPU": 0.036, "GPU": 3.6})
    data, finetune = run_cost.stages
    assert (data.stage, data.seconds, data.resource_seconds) == ("data", 10.0, {"CPU": 10.0})
    assert finetune.resource_seconds == {"CPU": 240.0, "GPU": 240.0} and finetune.steps == 100  # 4 workers × 60 s
    assert run_cost.resource_seconds == {"CPU": 250.0, "GPU": 240.0}
    assert run_cost.money == pytest.approx(250 / 3600 * 0.036 + 240 / 3600 * 3.6)
    assert cost.run_cost(run("r1", 0), {}).money is None  # no price table: seconds only


def test_superseded_attempts_are_paid_for():
    rec = run("r1", 0)
    rec.superseded = [rec.stages["finetune"].model_copy()]
    stages = cost.run_cost(rec, {}).stages
    assert [(s.stage, s.superseded) for s in stages] == [("finetune", True), ("data", False), ("finetune", False)]
    assert cost.run_cost(rec, {}).steps == 200


def test_a_promoted_version_is_charged_the_failed_runs_since_the_previous_promotion():
    runs = [run("r1", 0), run("r2-failed", 200, failed=True), run("r3", 400), run("cmp-a1", 500), run("r4", 700)]
    moves = [promotion(1, "r1", 100), promotion(2, "r3", 600)]
    first, second = cost.version_costs(runs, moves, {"GPU": 3.6}, frozenset({"cmp-a1"}))
    assert [c.run_id for c in first.charged] == ["r1"] and first.goodput == 1.0
    assert [c.run_id for c in second.charged] == ["r2-failed", "r3"]  # r4 came after; cmp-a1 listed apart
    assert second.apart == ["cmp-a1"] and second.charged[0].status == "failed (modeling)"
    assert second.resource_seconds == {"CPU": 500.0, "GPU": 480.0} and second.money == pytest.approx(0.48)
    assert (second.promoted_steps, second.steps_paid, second.goodput) == (100, 200, 0.5)
    moves.append(promotion(3, "r4", 800))
    third = cost.version_costs(runs, moves, {}, frozenset({"cmp-a1"}))[-1]
    assert [c.run_id for c in third.charged] == ["r4"] and third.apart == [] and third.money is None


def stopped_job(sid: str, start: int, end: int, logged: int | None) -> JobEntry:
    """A fine-tune job stopped from outside (`ray job stop`): no result.json, so no summary (tasks/rayjob.py)."""
    entry = job("training.finetune", at(start), at(end)).model_copy(update={"job_status": "STOPPED"})
    result = StageResult(
        stage="finetune",
        status="failed",
        failure_class=FailureClass.infrastructure,
        cause=f"Ray job {sid} STOPPED: Job was intentionally stopped.",
        started_at=at(end),
        ended_at=at(end),
    )
    return entry.model_copy(update={"submission_id": sid, "result": result, "logged_steps": logged})


def resumed_finetune(start: int, restarts: list[Restart] | None = None) -> StageEntry:
    """Invocation 2's fine-tune: `<run>-finetune-a2`, under the same Ray Train run, resumed from checkpoint 20."""
    summary = FinetuneSummary(
        run_name="demo",
        train_storage_uri="t",
        checkpoints=[],
        start_step=20,
        restored_from="runs/demo/train/demo/checkpoint_000020",
        steps=400,
        seconds=60.0,
        restarts=restarts or [],
    ).to_json()
    ft = job("training.finetune", at(start), at(start + 60), summary).model_copy(
        update={"submission_id": "demo-finetune-a2"}
    )
    ft.result.stage = "finetune"
    return StageEntry(
        stage="finetune", status="succeeded", started_at="a", ended_at="b", summary=summary, jobs=[ft], invocation=2
    )


def interrupted_run(first: StageEntry) -> RunRecord:
    """`run`, its fine-tune interrupted at step 23 (last checkpoint 20), then `run --only data,finetune --run-id demo`."""
    rec = run("demo", 0)
    rec.superseded = [first]
    rec.stages["finetune"] = resumed_finetune(200)
    return rec


def stopped_at_23() -> StageEntry:
    stopped = stopped_job("demo-finetune", 10, 40, logged=23)
    return StageEntry(
        stage="finetune",
        status="failed",
        failure_class=FailureClass.infrastructure,
        cause=stopped.result.cause,
        started_at="a",
        ended_at="b",
        jobs=[stopped],
    )


def test_an_interrupted_fine_tune_pays_for_the_steps_its_metrics_log_shows():
    rec = interrupted_run(stopped_at_23())
    stages = cost.run_cost(rec, {}).stages
    assert [(s.stage, s.superseded, s.steps) for s in stages] == [
        ("finetune", True, 23),  # steps 1-23, by its metrics log: it left no summary
        ("data", False, 0),
        ("finetune", False, 380),  # 21-400, steps 21-23 trained again
    ]
    (version,) = cost.version_costs([rec], [promotion(1, "demo", 300)], {})
    assert (version.promoted_steps, version.steps_paid, version.goodput) == (400, 403, 0.9926)


def test_a_fine_tune_summary_this_release_cannot_read_is_paid_for_by_its_logged_steps():
    # One other run of the model whose job summary carried a field this release does not know raised a raw
    # ValidationError from every later promotion of the model, after the registry copy was made.
    rec = run("r0", 0)
    entry = rec.stages["finetune"]
    summary = {**(entry.jobs[0].result.summary or {}), "a_later_releases_field": 1}
    result = entry.jobs[0].result.model_copy(update={"summary": summary})
    entry.jobs[0] = entry.jobs[0].model_copy(update={"logged_steps": 40, "result": result})
    assert [s.steps for s in cost.run_cost(rec, {}).stages] == [0, 40]


def test_an_attempt_that_left_no_job_entry_is_paid_for_up_to_the_checkpoint_resumed_from():
    # The flow died with its job (close_interrupted's entry: failed, no jobs): the checkpoint at 20 that the
    # next job resumed from is the evidence that some attempt of this run trained steps 1-20.
    lost = StageEntry.failed("finetune", FailureClass.infrastructure, "interrupted: invocation 1 ended crashed")
    rec = interrupted_run(lost)
    assert [s.steps for s in cost.run_cost(rec, {}).stages] == [0, 0, 400]
    (version,) = cost.version_costs([rec], [promotion(1, "demo", 300)], {})
    assert (version.steps_paid, version.goodput) == (400, 1.0)
    # Records written before logged_steps existed: a stopped job without it counts the same way.
    old = stopped_at_23()
    old.jobs[0].logged_steps = None
    assert [s.steps for s in cost.run_cost(interrupted_run(old), {}).stages] == [0, 0, 400]


def test_steps_a_restart_trained_again_are_paid_for():
    rec = run("demo", 0)
    rec.stages["finetune"] = resumed_finetune(
        10, [Restart(attempt=1, at_step=123, restored_step=100, lost_steps=23), Restart(attempt=2, restored_step=200)]
    )
    assert cost.run_cost(rec, {}).steps == 20 + 380 + 23  # the checkpoint at 20, 21-400, 101-123 again


def test_goodput_above_one_is_refused():
    assert cost.goodput(400, 403) == 0.9926 and cost.goodput(0, 0) is None
    with pytest.raises(AssertionError, match="goodput 400/380 > 1: .* a job's steps are missing"):
        cost.goodput(400, 380)


def test_a_stopped_jobs_steps_are_counted_from_its_metrics_log_when_it_ends(tmp_path):
    from tasks.jobs import with_logged_steps

    storage = Storage(str(tmp_path))
    when = [datetime.fromisoformat(at(t)).timestamp() for t in (5, 15, 20, 45)]
    rows = [{"step": s, "loss": 1.0, "time": t} for s, t in zip((7, 1, 2, 3), when, strict=True)]  # 7: a job before
    append_rows(storage, rows, "runs", "demo", "stages", "finetune", METRICS_LOG)
    stopped = stopped_job("demo-finetune", 10, 40, logged=None)
    entry = StageEntry(stage="finetune", status="failed", started_at="a", ended_at="b", jobs=[stopped])
    (counted,) = with_logged_steps(storage, "demo", entry).jobs
    assert counted.logged_steps == 2  # the rows written between its submission (10 s) and its end (40 s)
    # Attached to at 30 s by a restarted flow: Ray's own start (10 s) bounds its rows, not the attach.
    attached = stopped.model_copy(
        update={"attached": True, "submitted_at": at(30), "ray_started_at": at(10), "ray_ended_at": at(40)}
    )
    (counted,) = with_logged_steps(storage, "demo", entry.model_copy(update={"jobs": [attached]})).jobs
    assert counted.logged_steps == 2
    finished = job("training.finetune", at(0), at(1), {"steps": 1})
    kept = with_logged_steps(storage, "demo", entry.model_copy(update={"jobs": [finished]})).jobs[0]
    assert kept.logged_steps is None  # a job with a summary: its summary says what it trained


def test_side_runs_are_the_ones_a_canary_or_comparison_names(tmp_path):
    storage = Storage(str(tmp_path))
    storage.write_json({}, "images", "d1", "decision.json")
    storage.write_json({}, "comparisons", "c1", "comparison.json")
    ids = ["d1-r1", "c1-a2", "c1-b1", "20261203-100000-a12345", "other-r1"]
    assert cost.side_runs(storage, ids) == {"d1-r1", "c1-a2", "c1-b1"}


def test_runs_diff_shows_cost_rows():
    a, b = run("a", 0), run("b", 0, cfg=PipelineConfig())
    metrics = {m["metric"]: m for m in diff_records(a, b)["metrics"]}
    assert metrics["cost.finetune.seconds"]["a"] == 60.0
    assert (metrics["cost.GPU_seconds"]["a"], metrics["cost.GPU_seconds"]["b"]) == (240.0, None)
    assert (metrics["cost.CPU_seconds"]["a"], metrics["cost.CPU_seconds"]["b"]) == (250.0, 130.0)  # 2 CPU workers


def test_runs_diff_names_the_resources_cost_money_leaves_out(tmp_path):
    # It showed cost.money for two GPU runs priced with a CPU-only table as if it were their whole cost.
    cpu_only = PipelineConfig.model_validate(
        {"train": {"num_workers": 4, "use_gpu": True}, "cost": {"prices": {"CPU": 3.6}}}
    )
    records.save(Storage(str(tmp_path)), run("a", 0, cfg=cpu_only))
    records.save(Storage(str(tmp_path)), run("b", 0))  # no price table: seconds only, nothing left out
    where = ["--set", f"storage.root={tmp_path}"]
    lines = [line.strip() for line in tuneproof("runs", "diff", "a", "b", *where).output.splitlines()]
    money = next(i for i, line in enumerate(lines) if line.startswith("cost.money:"))
    assert lines[money + 1] == "a: GPU unpriced (cost.prices has no price for it: cost.money leaves it out)"
    shown = json.loads(tuneproof("runs", "diff", "a", "b", "--json", *where).stdout)
    assert shown["cost_unpriced"] == {"a": ["GPU"], "b": []}


def test_a_job_is_timed_by_ray_and_an_attach_without_rays_times_is_named():
    # Timed from when the flow watched it, a job a restarted flow found ended cost about 0 s.
    rec = run("r1", 0)  # the fine-tune ran 10-70 s
    ft = rec.stages["finetune"].jobs[0]
    found = ft.model_copy(update={"attached": True, "submitted_at": at(300), "ended_at": at(301)})
    rec.stages["finetune"].jobs = [found.model_copy(update={"ray_started_at": at(10), "ray_ended_at": at(70)})]
    assert cost.run_cost(rec, {}).stages[1].seconds == 60.0 and cost.run_cost(rec, {}).timed_from_attach == []
    rec.stages["finetune"].jobs = [found]  # a record written before Ray's times were kept
    old = cost.run_cost(rec, {})
    assert (old.stages[1].seconds, old.timed_from_attach) == (1.0, ["x-training.finetune"])
    (version,) = cost.version_costs([rec], [promotion(1, "r1", 400)], {})
    assert cost.card_notes(version) == [
        "Ray job(s) x-training.finetune are timed from when the flow attached to them: their records have no Ray "
        "start and end, so the cost leaves out their time before that."
    ]
    assert not cost.timed_from_attach(ft)  # one the flow submitted: watched from its submission, timed right


def test_the_card_renders_cost_and_goodput():
    version = cost.version_costs(
        [run("r2-failed", 0, failed=True), run("r3", 100)], [promotion(1, "r3", 200)], {"CPU": 0.36}
    )[0]
    card = registry.render_model_card(
        registry.ModelCard(name="m", version="v0001-r3", run_id="r3", source_path="runs/r3/model", cost=version)
    )
    assert "## Cost" in card and "| r2-failed | failed (modeling) | 250.0 | 240.0 | 0.0250 | 100 |" in card
    assert "| r3 | promoted as this version |" in card
    assert "Goodput: 100 fine-tune steps in this model / 200 paid for = 0.50." in card
    assert "Prices per resource-hour (the run's cost.prices): CPU 0.36." in card


def test_the_card_states_the_cost_with_the_copy_check_and_models_show_shows_that_cost(tmp_path):
    from tasks.promote import move_pointer, with_copy_check
    from tests.test_promote_task import passed_record, with_export

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"prices": {"CPU": 3.6}}})
    storage = Storage(str(tmp_path))
    failed = run("r0-failed", 0, cfg=cfg, failed=True)
    failed.created_at = records.now_iso()
    records.save(storage, failed)
    with_export(storage, "r1")
    promoted = passed_record(cfg, "r1")
    finetune = promoted.stages["finetune"]
    finetune.jobs = [job("training.finetune", at(100), at(160), finetune.summary)]
    jobs: list[JobEntry] = []

    def copy_check(model_path: str) -> None:  # the Ray job eval.copy_check, as its JobEntry
        scores = {"exact_match": 1.0}
        checked = CopyCheckSummary(
            model_path=model_path, examples=32, evaluate_scores=scores, copy_scores=scores, passed=True
        )
        jobs.append(job("eval.copy_check", at(200), at(205), checked.to_json()))

    entry = move_pointer(cfg, promoted, "t", forced=None, check_copy=copy_check, jobs=jobs)
    assert entry.ok, entry.cause
    promoted.stages["promote"] = with_copy_check(entry, jobs)  # what the flow then stores
    promoted.status = "succeeded"
    records.save(storage, promoted)

    version = production_pointer(storage, cfg.model.name).version
    card = storage.read_json("models", cfg.model.name, version, registry.CARD_JSON)["cost"]
    (charged,) = [c for c in card["charged"] if c["run_id"] == "r1"]
    assert [(s["stage"], s["seconds"]) for s in charged["stages"]][-1] == ("promote", 5.0)  # the copy check
    assert charged["status"] == "promoted" and card["prices"] == {"CPU": 3.6}
    assert [c["run_id"] for c in card["charged"]] == ["r0-failed", "r1"]
    shown = tuneproof("models", "show", cfg.model.name, "--set", f"storage.root={tmp_path}")
    assert card["version"] == version and json.loads(shown.stdout)["cost"] == [card]
    # The card is the one computation: the same one over the records as they are stored now agrees with it.
    stored, _ = cost.records_of(records.list_records(storage)[0], cfg.model.name)
    again = cost.version_costs(stored, registry.read_history(storage, cfg.model.name), cfg.cost.prices)
    assert [v.to_json() for v in again] == [card]


@pytest.mark.integration
def test_after_a_failed_run_the_promoted_versions_cost_includes_it(clone_run):
    storage = clone_run.storage
    shutil.rmtree(Path(storage.root) / "models")  # no production model yet, as the demo found it
    prices = ["--set", 'cost.prices={"CPU": 0.05, "GPU": 2.5}']
    garbage = Path(storage.root).parent / "garbage.jsonl"
    garbage.write_text("not json\n" * 50)
    bad = ["--set", f"data.source={garbage}"]
    failed = tuneproof("run", "--run-id", "bad-source", "--only", "data", *clone_run.args, *prices, *bad)
    assert failed.exit_code != 0, failed.output
    promoted = tuneproof("run", "--run-id", "demo", "--only", "promote", *clone_run.args, *prices)
    assert promoted.exit_code == 0, promoted.output
    name = records.load(storage, "demo").config["model"]["name"]
    version = production_pointer(storage, name).version
    card = storage.read_json("models", name, version, registry.CARD_JSON)["cost"]
    assert {c["run_id"] for c in card["charged"]} == {"demo", "bad-source"}
    assert card["money"] > 0 and card["steps_paid"] >= card["promoted_steps"] > 0
    text = storage.read_text("models", name, version, registry.CARD_MD)
    assert "| bad-source | failed (data) |" in text and "Goodput:" in text
    (demo,) = [c for c in card["charged"] if c["run_id"] == "demo"]
    promote = [s for s in demo["stages"] if s["stage"] == "promote" and not s["superseded"]]
    assert promote and promote[0]["seconds"] > 0  # the copy check's Ray job
    shown = json.loads(tuneproof("models", "show", name, *clone_run.args).stdout)
    assert shown["cost"][-1] == card and card["version"] == version
    runs_show = tuneproof("runs", "show", "demo", *clone_run.args, *prices)
    assert runs_show.exit_code == 0 and "cost: CPU" in runs_show.output


def evaluation(start: int) -> StageEntry:
    """A continued run's re-evaluation at `start` seconds (10 s)."""
    return StageEntry(
        stage="evaluate",
        status="succeeded",
        started_at=at(start),
        ended_at=at(start + 10),
        jobs=[job("eval.evaluate_job", at(start), at(start + 10))],
    )


def test_each_stage_is_charged_once_to_the_version_promoted_after_it_ended():
    # Windows by the record's creation left a continued run's later stages on no card.
    prices = {"CPU": 3.6, "GPU": 3.6}
    failed, r1, b = run("A-failed", 0, failed=True), run("R1", 20), run("B", 80)
    b_then = b.model_copy(update={"stages": {"data": b.stages["data"]}})  # its fine-tune (90-150 s) still running
    moves = [promotion(1, "R1", 130)]
    first_card = cost.version_costs([failed.model_copy(deep=True), r1, b_then], moves, prices)[-1]  # at 130 s
    # At 300 s `tuneproof run --run-id A-failed` continues A: its fine-tune reruns, and fails again.
    failed.superseded.append(failed.stages["finetune"])
    failed.stages["finetune"] = StageEntry(
        stage="finetune",
        status="failed",
        started_at=at(300),
        ended_at=at(360),
        invocation=2,
        jobs=[job("training.finetune", at(300), at(360))],
    )
    c = run("C", 400)
    moves.append(promotion(2, "C", 500))
    first, second = cost.version_costs([failed, r1, b, c], moves, prices)
    assert [(r.run_id, [s.stage for s in r.stages]) for r in second.charged] == [
        ("A-failed", ["finetune"]),  # the rerun; its first attempt is on the first card
        ("B", ["finetune"]),  # ended after the first promotion, so the first card never saw it
        ("C", ["data", "finetune"]),
    ]
    # Computed again from the records as they are now, the first card charges what it charged at its promotion.
    assert [r.run_id for r in first.charged] == [r.run_id for r in first_card.charged] == ["A-failed", "R1", "B"]
    assert (first.resource_seconds, first.steps_paid) == (first_card.resource_seconds, first_card.steps_paid)
    paid = cost.add(cost.run_cost(r, prices).resource_seconds for r in (failed, r1, b, c))
    assert cost.add([first_card.resource_seconds, second.resource_seconds]) == paid
    assert first_card.steps_paid + second.steps_paid == sum(cost.run_cost(r, {}).steps for r in (failed, r1, b, c))


def test_a_run_promoted_after_another_version_is_charged_what_it_spent_since_and_not_its_steps_again():
    # It was charged whole to both versions: to the first by its creation, to its own by its id.
    r1, b = run("R1", 0), run("B", 10)  # B's fine-tune ends at 80 s, before R1's promotion
    b.stages["evaluate"] = evaluation(200)  # re-evaluated against R1's version, then promoted
    first, second = cost.version_costs([r1, b], [promotion(1, "R1", 100), promotion(2, "B", 300)], {})
    assert [r.run_id for r in first.charged] == ["R1", "B"] and first.steps_paid == 200
    assert [(r.run_id, r.status, [s.stage for s in r.stages]) for r in second.charged] == [
        ("B", "promoted", ["evaluate"])
    ]
    assert (second.promoted_steps, second.earlier_steps, second.steps_paid, second.goodput) == (100, 100, 0, None)
    assert cost.card_notes(second) == [
        "100 of the model's 100 fine-tune steps were trained before the previous promotion and are on that "
        "version's card: goodput counts the other 0."
    ]


FIXTURES = Path(__file__).parent / "fixtures" / "records"
FIRST_RELEASE = {"v1-demo": "20261201-041236-af7799", "v1-verify-failed": "20261201-041616-e52621"}


def first_release(root: Path) -> Storage:
    """Storage holding the two records the first release's demo wrote."""
    for fixture, run_id in FIRST_RELEASE.items():
        (root / "runs" / run_id).mkdir(parents=True)
        shutil.copy(FIXTURES / f"{fixture}.json", root / "runs" / run_id / "record.json")
    return Storage(str(root))


def test_a_first_release_resume_test_is_not_fine_tune_steps_paid_for(tmp_path):
    # Its resume test ran `python -m training.finetune` jobs: counted as 309 more steps of a 400-step run.
    demo = records.load(first_release(tmp_path), FIRST_RELEASE["v1-demo"])
    stages = {s.stage: s for s in cost.run_cost(demo, {}).stages}
    assert (stages["finetune"].steps, stages["resume"].steps, cost.run_cost(demo, {}).steps) == (400, 0, 400)
    assert stages["resume"].resource_seconds["CPU"] > 0  # its time is paid for all the same


def test_a_version_after_a_first_release_pointer_is_not_charged_that_versions_run(tmp_path):
    # That pointer records no move, so the window had no start: the demo run, already v0001, was charged again.
    from tasks.promote import move_pointer
    from tests.test_promote_task import EXPORT_FILES, passed_record, with_export

    storage = first_release(tmp_path)
    demo = records.load(storage, FIRST_RELEASE["v1-demo"])
    promoted = present(demo.promotion)
    name, v1 = "dates-qwen2-tiny", str(promoted.version)
    pointer = {"name": name, "version": v1, "path": f"models/{name}/{v1}", "run_id": demo.run_id}
    for file, data in EXPORT_FILES.items():  # the version it copied, and a pointer to it that records no move
        storage.write_bytes(data, "models", name, v1, file)
    storage.write_json({**pointer, "promoted_at": promoted.promoted_at}, "models", name, "production.json")
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "model": {"name": name}})
    with_export(storage, "r-new")
    rec = passed_record(cfg, "r-new")
    rec.stages["evaluate"].summary = {**(rec.stages["evaluate"].summary or {}), "incumbent_version": v1}
    finetune = rec.stages["finetune"]
    finetune.jobs = [job("training.finetune", at(100), at(160), finetune.summary)]
    assert move_pointer(cfg, rec, "t", forced=None).ok
    version = production_pointer(storage, name).version
    card = storage.read_json("models", name, version, registry.CARD_JSON)["cost"]
    charged = [(c["run_id"], c["status"]) for c in card["charged"]]
    assert charged == [(FIRST_RELEASE["v1-verify-failed"], "failed (infrastructure)"), ("r-new", "promoted")]
    assert (card["promoted_steps"], card["steps_paid"], card["goodput"]) == (400, 400, 1.0)


def test_a_record_that_cannot_be_read_is_named_on_the_cost_not_left_out_in_silence(tmp_path):
    from tasks.promote import move_pointer
    from tests.test_promote_task import passed_record, with_export

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "cost": {"prices": {"CPU": 3.6}}})
    storage = Storage(str(tmp_path))
    for run_id in ("r0-readable", "r0-truncated"):
        failed = run(run_id, 0, cfg=cfg, failed=True)
        failed.created_at = records.now_iso()
        records.save(storage, failed)
    torn = tmp_path / "runs" / "r0-truncated" / "record.json"
    torn.write_text(torn.read_text()[:300])  # a torn write, a full disk
    with_export(storage, "r1")
    promoted = passed_record(cfg, "r1")
    promoted.stages["finetune"].jobs = [job("training.finetune", at(100), at(160), promoted.stages["finetune"].summary)]
    assert move_pointer(cfg, promoted, "t", forced=None).ok
    version = production_pointer(storage, cfg.model.name).version
    card = cost.VersionCost.model_validate(
        storage.read_json("models", cfg.model.name, version, registry.CARD_JSON)["cost"]
    )
    assert [r.run_id for r in card.charged] == ["r0-readable", "r1"] and card.unreadable == ["r0-truncated"]
    note = "Cost excludes 1 run(s) whose records could not be read (so their model is unknown): r0-truncated."
    assert cost.card_notes(card) == [note]
    assert note in storage.read_text("models", cfg.model.name, version, "MODEL_CARD.md")  # where people read it


def test_a_resource_without_a_price_is_named_not_priced_at_zero():
    gpu_run = run("r1", 0)  # 250 CPU-seconds, 240 GPU-seconds
    priced = cost.run_cost(gpu_run, {"CPU": 3.6})
    assert (priced.money, priced.unpriced) == (0.25, ["GPU"])  # what was priced; GPU named
    assert cost.seconds_line(priced.resource_seconds, priced.money, priced.unpriced) == (
        "CPU 250.0 s, GPU 240.0 s (cost 0.2500, GPU unpriced)"
    )
    assert cost.run_cost(gpu_run, {}).unpriced == []  # no table at all: seconds only, money None
    (version,) = cost.version_costs([gpu_run], [promotion(1, "r1", 100)], {"CPU": 3.6})
    assert version.unpriced == ["GPU"]
    assert cost.card_notes(version) == ["GPU unpriced: cost.prices has no price for it, so the cost counts only CPU."]


def test_runs_show_prices_a_run_with_its_own_price_table_unless_told_otherwise(tmp_path):
    # It priced with the reader's config: one run had two costs, `runs show`'s and `runs diff`'s.
    own = PipelineConfig.model_validate(
        {"train": {"num_workers": 4, "use_gpu": True}, "cost": {"prices": {"CPU": 1.0, "GPU": 10.0}}}
    )
    records.save(Storage(str(tmp_path)), run("r1", 0, cfg=own))
    where = ["--set", f"storage.root={tmp_path}"]
    shown = " ".join(tuneproof("runs", "show", "r1", *where).output.split())
    assert "prices per resource-hour: CPU 1, GPU 10 (the run's own cost.prices)" in shown
    assert "cost: CPU 250.0 s, GPU 240.0 s (cost 0.7361)" in shown
    assert cost.diff_numbers(run("r1", 0, cfg=own))["cost.money"] == 0.736111  # `runs diff`'s: the same table
    cheaper = tuneproof("runs", "show", "r1", *where, "--set", 'cost.prices={"CPU": 0.05}').output
    cheaper = " ".join(cheaper.split())
    assert "prices per resource-hour: CPU 0.05 (--set cost.prices)" in cheaper
    assert "cost: CPU 250.0 s, GPU 240.0 s (cost 0.0035, GPU unpriced)" in cheaper


def test_a_record_whose_config_the_cost_cannot_read_is_named_not_charged_and_stops_nothing():
    # `model: "x"` raised AttributeError before the promotion's try, and stopped every later promotion of the model.
    good, no_model, bad_train, other = run("r1", 0), run("r2", 100), run("r3", 200), run("r4", 300)
    no_model.config["model"] = "x"
    bad_train.config["train"] = {"num_workers": "lots"}
    other.config["model"] = {"name": "another"}
    other.config["train"] = 5  # another model's record: not this cost's business
    assert cost.records_of([good, no_model, bad_train, other], GPU_CFG.model.name) == ([good], ["r2", "r3"])
    assert cost.config_problem(bad_train) is not None and cost.config_problem(good) is None


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ({"train": 5}, "config.train: Input should be a valid dictionary"),
        ({"train": {"num_workers": 1e308}}, "config.train.num_workers: "),
        ({"cost": {"prices": {"CPU": -5}}}, "config.cost.prices.CPU: Input should be greater than or equal to 0"),
        ({"cost": {"prices": ["CPU"]}}, "config.cost.prices: Input should be a valid dictionary"),
    ],
)
def test_a_hand_edited_recorded_config_is_a_validation_error_naming_the_field(config, says):
    # `runs show` and `runs diff` name it (exit 1); they printed an AttributeError, a negative or an infinite cost.
    rec = run("r1", 0)
    rec.config.update(config)
    with pytest.raises(ValidationError) as info:
        cost.record_prices(rec) if "cost" in config else cost.run_cost(rec, {})
    first = info.value.errors()[0]
    shown = f"{info.value.title}.{'.'.join(map(str, first['loc']))}: {first['msg']}"  # as cli_common shows it
    assert shown.startswith(says), shown
