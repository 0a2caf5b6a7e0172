"""A controlled comparison: the same stages under settings A and B, interleaved over N repeats.

Each repeat of each arm is an ordinary pipeline run (a subflow with its own run id and record), so
every observation keeps its full identity and any two runs can be explained with `runs diff`. The
flow only orders the runs, reads their metrics from the stage table and writes one
comparisons/<id>/comparison.json, with a table and plots as Prefect artifacts.
"""

from __future__ import annotations

import time

from prefect import flow, get_run_logger
from prefect.states import Completed, Failed, State

from flows.pipeline import StageName, missing_forwarded_env, missing_local_files, pipeline, publish, refused
from tasks import compare_artifacts
from tuneproof.control import comparison as cmp
from tuneproof.control import images
from tuneproof.control import record as records
from tuneproof.control import stages as table
from tuneproof.control.comparison import ArmIdentity, Comparison, RunOutcome
from tuneproof.control.record import RunRecord
from tuneproof.core.config import ConfigError, PipelineConfig
from tuneproof.core.metric_names import check_eval_config
from tuneproof.core.names import slug_problem
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary


class ComparisonRefused(ValueError):
    """A comparison that could not be a fair one (nothing differs, a plan that needs an earlier run)."""


def check_request(config_a: PipelineConfig, config_b: PipelineConfig, stages: list[str], repeats: int) -> None:
    plan = table.plan(stages)
    if table.needs_an_earlier_run(plan):
        needed = sorted({need.stage for s in plan for need in s.needs} - set(table.names(plan)))
        raise ComparisonRefused(
            f"stages {','.join(stages)} need the output of {','.join(needed)}: add them to --stages "
            "(each repeat is a fresh run)"
        )
    if config_a.config_hash() == config_b.config_hash():
        raise ComparisonRefused("A and B are the same config: give each arm at least one --a/--b override that differs")
    if repeats < 2:
        raise ComparisonRefused(f"repeats must be at least 2 for an interval (got {repeats})")
    if repeats > images.MAX_REPEATS:  # the canary's bound: 10**9 was accepted, a comparison that would never end
        raise ComparisonRefused(
            f"repeats must be at most {images.MAX_REPEATS} (got {repeats}): each repeat runs the stages once per arm"
        )
    if config_a.storage != config_b.storage:
        raise ComparisonRefused("A and B must share the storage root: the comparison lives beside both arms' runs")


@flow(name="tuneproof-compare", log_prints=True)
def compare(
    config_a: PipelineConfig,
    config_b: PipelineConfig,
    stages: list[StageName],
    repeats: int = 3,
    threshold: float = 0.05,
    sets_a: list[str] | None = None,
    sets_b: list[str] | None = None,
    comparison_id: str | None = None,
) -> State:
    """Run `stages` under A and B as A1 B1 A2 B2 …; per metric: medians, spread, the ratio B/A with its
    Student t interval on log values (valid from 2 repeats an arm) and a verdict: better, worse, no
    detectable difference or insufficient repeats (with the repeats needed). A run that fails is recorded
    in the order and ends the comparison as failed."""
    try:
        check_request(config_a, config_b, stages, repeats)
    except (ComparisonRefused, table.UnknownStages) as e:
        return refused(e)
    if problem := images.threshold_problem(threshold):  # the canary's bound, and the stored Comparison's
        return refused(problem)
    # The id names a storage folder and, with a suffix, every run id of the comparison.
    if comparison_id is not None and (problem := slug_problem(comparison_id)):
        return refused(f"comparison id {comparison_id!r} {problem}")
    # A run the pipeline refuses would end the comparison with nothing measured, after its id was used up.
    try:
        cfg_a, cfg_b = checked_arm("A", config_a, stages), checked_arm("B", config_b, stages)
    except ComparisonRefused as e:
        return refused(e)
    comparison_id = comparison_id or records.make_run_id()
    storage = Storage.from_config(cfg_a.storage)
    result = Comparison(
        comparison_id=comparison_id,
        created_at=now_iso(),
        stages=list(stages),
        repeats=repeats,
        threshold=threshold,
        status="running",
        arms={
            "A": arm_identity("A", cfg_a, sets_a or []),
            "B": arm_identity("B", cfg_b, sets_b or []),
        },
    )
    if not cmp.create(storage, result):
        return refused(
            f"comparison {comparison_id} already exists under {storage.uri('comparisons')}; "
            "give another --id (or none for a new one)"
        )
    logger = get_run_logger()
    logger.info(f"comparison {comparison_id}: {', '.join(stages)} x {repeats} repeats, A then B each time")

    metrics: dict[str, list[dict[str, float | None]]] = {"A": [], "B": []}
    for arm, repeat in cmp.interleaved(repeats):
        run_id = f"{comparison_id}-{arm.lower()}{repeat}"
        started = time.monotonic()
        state = pipeline(config=cfg_a if arm == "A" else cfg_b, run_id=run_id, only=list(stages), return_state=True)
        rec = read_record(storage, run_id)
        outcome = RunOutcome(
            run_id=run_id,
            arm=arm,
            repeat=repeat,
            status=rec.status if rec else "failed",
            failure_class=rec.failure_class.value if rec and rec.failure_class else None,
            # A run refused before its record was written says why in its state alone.
            cause=rec.cause if rec else (state.message or "the run ended before writing a record"),
            seconds=round(time.monotonic() - started, 2),
        )
        result.order.append(outcome)
        result.arms[arm].runs.append(run_id)
        if rec is not None:
            fill_identity(result.arms[arm], rec)
            if outcome.status == "succeeded":  # a failed run's numbers measured something that did not work
                metrics[arm].append(table.diff_metrics(rec))
            if ft := rec.summary("finetune", FinetuneSummary):
                result.loss_curves[run_id] = [(p[0], p[1]) for p in ft.loss_curve]
        if outcome.status != "succeeded":
            result.status, result.cause = "failed", f"{run_id}: {outcome.cause}"
            break
        logger.info(f"{run_id} ({arm}{repeat}) succeeded in {outcome.seconds:.0f} s")
    result.metrics = cmp.compare_all(metrics["A"], metrics["B"], threshold)
    if result.status == "running":
        result.status = "succeeded"
    uri = cmp.save(storage, result)
    publish(compare_artifacts.publish, result)
    logger.info(f"comparison written to {uri}")
    if result.status == "failed":
        return Failed(message=f"comparison {comparison_id} failed: {result.cause}", data=result.to_json())
    return Completed(message=f"comparison {comparison_id} succeeded", data=result.to_json())


def checked_arm(label: str, config: PipelineConfig, stages: list[str]) -> PipelineConfig:
    """The arm's config resolved and passed through the checks the pipeline runs before its first stage;
    ComparisonRefused naming the arm otherwise."""
    try:
        cfg = config.resolved()
    except ConfigError as e:
        raise ComparisonRefused(f"arm {label}: {e}") from None
    planned = set(table.names(table.plan(stages)))
    if problems := check_eval_config(cfg.eval):
        raise ComparisonRefused(f"arm {label}: {ConfigError(problems)}")
    if missing := missing_forwarded_env(cfg) or missing_local_files(cfg, planned):
        raise ComparisonRefused(f"arm {label}: {missing}")
    return cfg


def arm_identity(label: str, cfg: PipelineConfig, sets: list[str]) -> ArmIdentity:
    return ArmIdentity(label=label, sets=list(sets), config_hash=cfg.config_hash(), config=cfg.model_dump(mode="json"))


def read_record(storage: Storage, run_id: str) -> RunRecord | None:
    try:
        return records.load(storage, run_id)
    except (FileNotFoundError, records.RecordUnreadable):
        return None


def fill_identity(arm: ArmIdentity, rec: RunRecord) -> None:
    """What the arm ran on, from its first run that said (code, cluster and data identity)."""
    arm.code = arm.code or rec.code.model_dump(mode="json")
    if arm.cluster is None and rec.cluster is not None:
        arm.cluster = rec.cluster.model_dump(mode="json")
    if arm.data is None and rec.data is not None:
        arm.data = rec.data.model_dump(mode="json")
