"""The fine-tune's summary: what the driver reads back after the Ray Train run ends.

Called by the driver (training/finetune.py) in its own process, never in a worker: the metrics rows
every attempt logged, the complete checkpoints of the run, the workers' outcome.json and the export's
manifest become the stage's FinetuneSummary. The record keeps at most CURVE_POINTS of each curve
(`curve_fields`); the metrics log, named by path and hash, keeps every row. `loss_trend` judges whether the
loss fell over the whole curve, which the driver fails as modeling when it did not.
"""

from __future__ import annotations

import math
import posixpath
from collections.abc import Sequence
from typing import Any

from training.checkpoint_listing import complete_checkpoints
from training.finetune_state import METRICS, TrainParams
from training.jobkit import JobContext
from training.lora import ADAPTER_DIR
from training.modeling import base_model_facts
from training.preemption import NOTICES
from tuneproof.core.markers import ExportUnverified, read_export_manifest
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.rowlog import read_rows, rows_sha256
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import (
    FinetuneSummary,
    FitEstimate,
    LossPoint,
    RankMemory,
    latest_rows,
    ledger_points,
    loss_curve,
    thin,
)


def summarize(
    ctx: JobContext, params: TrainParams, outcome: dict, seconds: float, fit: FitEstimate | None = None
) -> FinetuneSummary:
    from training.restarts import ATTEMPTS, FAILURES, restarts

    rows = read_metrics(ctx.storage, ctx.stage_parts(METRICS))
    run_parts = ctx.run_parts("train", params.run_name)
    checkpoints = sorted(complete_checkpoints(ctx.storage, *run_parts), key=lambda c: c.step)
    speeds = [r["tokens_per_s"] for r in latest_rows(rows)]
    mfus = [r["mfu"] for r in latest_rows(rows) if r.get("mfu") is not None]
    export = outcome.get("export_path")
    export_sha256 = export_content_hash(ctx.storage, export) if export else None
    restored = params.first_step_marker and outcome["restored_from"]
    return FinetuneSummary(
        run_name=params.run_name,
        train_storage_uri=ctx.storage.uri(*run_parts),
        checkpoints=checkpoints,
        latest_checkpoint=checkpoints[-1] if checkpoints else None,
        start_step=outcome["start_step"],
        restored_from=outcome["restored_from"],
        steps=outcome["steps"],
        **curve_fields(rows, posixpath.join(*ctx.stage_parts(METRICS))),
        tokens_per_s=sum(speeds) / len(speeds) if speeds else None,
        seconds=round(seconds, 3),
        export_path=export,
        export_uri=ctx.storage.uri(export) if export else None,
        export_sha256=export_sha256,
        invocation=params.invocation,
        mfu=sum(mfus) / len(mfus) if mfus else None,
        restored_step=outcome["start_step"] if restored else None,
        first_step_completed_at=outcome["first_step_completed_at"] if restored else None,
        method=ctx.config.train.method,
        trainable_params=outcome["trainable_params"],
        total_params=outcome["total_params"],
        sharding=ctx.config.train.sharding,
        mesh=outcome.get("mesh"),
        adapter_path=posixpath.join(export, ADAPTER_DIR) if export and ctx.config.train.method == "lora" else None,
        memory=[RankMemory.model_validate(m) for m in outcome.get("memory", [])],
        fit_estimate=fit,
        restarts=restarts(
            read_rows(ctx.storage, *ctx.stage_parts(ATTEMPTS)),
            read_rows(ctx.storage, *ctx.stage_parts(FAILURES)),
            rows,
            read_rows(ctx.storage, *ctx.stage_parts(NOTICES)),
        ),
        base_model=base_model_facts(ctx.config.model.source),
    )


def curve_fields(rows: list[dict[str, Any]], metrics_path: str) -> dict[str, Any]:
    """The summary's loss and ledger fields from every metrics row. The record keeps at most CURVE_POINTS of
    each (its size must not grow with the steps); the log itself, named by path and hash, keeps them all. Pure."""
    curve = loss_curve(rows)
    falling, trend = loss_trend(curve)
    return {
        "loss_falling": falling,
        "loss_trend": trend,
        "first_loss": curve[0][1] if curve else None,
        "final_loss": curve[-1][1] if curve else None,
        "loss_curve": thin(curve),
        "curve_steps": len(curve),
        "ledger": thin(ledger_points(rows)),
        "metrics_path": metrics_path,
        "metrics_sha256": rows_sha256(rows),
    }


LOSS_WINDOW = 0.1
"""The share of a run's steps, at its start and at its end, whose mean losses `loss_trend` compares: a tenth of
the run averages out the batch-to-batch noise of single steps and still is the start and the end of training."""
MIN_STEPS_JUDGED = 20
"""A run of fewer steps is not judged: its windows would be single steps, whose losses say more about the batch
each drew than about training (the few-step runs of tests and canaries). Twenty give windows of two steps."""


def loss_trend(curve: Sequence[LossPoint]) -> tuple[bool | None, str]:
    """Whether the loss fell over a run trained from step 1 (README's "loss finite and falling"): (whether the
    mean loss of the last LOSS_WINDOW of its steps is below that of the first, the two means), or (None, why
    it was not judged). A job that continued a run from a checkpoint is not judged: its steps are the run's
    middle or end, where a flat loss is no failure. Pure."""
    if not curve:
        return None, "not judged: no step trained"
    if curve[0][0] != 1:
        return None, f"not judged: this job continued the run from step {curve[0][0] - 1}"
    not_finite = [step for step, loss in curve if loss is None or not math.isfinite(loss)]
    if not_finite:
        return False, f"the loss is not finite at step {not_finite[0]}"
    if len(curve) < MIN_STEPS_JUDGED:
        return None, f"not judged: too few steps to judge ({len(curve)}, fewer than {MIN_STEPS_JUDGED})"
    n = max(1, int(len(curve) * LOSS_WINDOW))
    head, tail = mean_loss(curve[:n]), mean_loss(curve[-n:])
    line = (
        f"mean loss {tail:.4g} over steps {curve[-n][0]}-{curve[-1][0]}, "
        f"{head:.4g} over steps {curve[0][0]}-{curve[n - 1][0]}"
    )
    return tail < head, line


def mean_loss(points: Sequence[LossPoint]) -> float:
    losses = [loss for _, loss in points if loss is not None]
    return sum(losses) / len(losses)


def export_content_hash(storage: Storage, export: str) -> str:
    """The content hash in the export's manifest (just written by rank 0)."""
    try:
        return read_export_manifest(storage, export).content_sha256
    except ExportUnverified as e:
        raise StageFailure(FailureClass.infrastructure, str(e)) from None


def read_metrics(storage: Storage, parts: tuple[str, ...]) -> list[dict[str, Any]]:
    """Every row every attempt of this job logged, in order (a replayed step's row comes after the first)."""
    return read_rows(storage, *parts)
