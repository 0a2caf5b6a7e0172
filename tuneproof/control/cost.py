"""What a run, and a promoted model version, cost: resource-seconds per stage, money from a price table,
and goodput.

    run_cost(record, prices)                  -> RunCost: by stage, superseded attempts included
    version_costs(records, moves, prices)     -> [VersionCost]: per promoted version, its lineage's runs

A job's resources are what it asked Ray for, from the config it ran with: a Ray Train job (fine-tune,
connectivity, the resume test) one CPU per worker and, with train.use_gpu, one GPU per worker (Ray
Train's ScalingConfig defaults); any other job one CPU (its driver), and one GPU for the evaluation jobs
on a GPU cluster. Resource-seconds are those times the job's wall time (submitted to ended, from the
record). Money is resource-hours × the config's `cost.prices` (empty: seconds only).

A promoted version paid for its own run and for every run of the same model since the previous
promotion that did not become it: failed, refused, superseded attempts. Canary and comparison runs
(`side_runs`: ids `<decision>-r<N>`, `<comparison>-a<N>`/`-b<N>` whose decision or comparison exists)
are listed apart, not charged.
Goodput = the fine-tune steps of the promoted model (its export's step) ÷ every fine-tune step the
charged runs trained (each fine-tune job's steps beyond its start step); the resume test's and the
evaluations' time is in the cost, not in the steps. All pure over records and history moves, but
`side_runs`, which reads the storage.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from datetime import datetime

from pydantic import BaseModel, ConfigDict

from tuneproof.control.history import Move
from tuneproof.control.record import JobEntry, RunRecord, StageEntry
from tuneproof.core.storage import Storage

TRAIN_MODULES = ("training.finetune", "training.connectivity", "training.resume")
GPU_EVAL_MODULES = ("eval.evaluate_job", "eval.copy_check")
SIDE_RUN = re.compile(r"^(?P<owner>.+)-(?:r|a|b)\d+$")
"""Run ids the canary (`<decision>-r<N>`) and comparison (`<comparison>-a<N>`, `-b<N>`) flows give their runs."""
SIDE_OWNERS = (("images", "decision.json"), ("comparisons", "comparison.json"))


class Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StageCost(Model):
    stage: str
    superseded: bool = False
    """An earlier attempt a rerun replaced: paid for, not kept."""
    seconds: float
    """Wall time of its Ray jobs."""
    resource_seconds: dict[str, float]
    """Ray resource name -> resource-seconds (CPU, GPU)."""
    money: float | None = None
    """By the price table; None when it is empty."""
    steps: int = 0
    """Fine-tune steps its jobs trained."""


class RunCost(Model):
    run_id: str
    status: str
    """The run's status, with its failure class when it failed ('failed (modeling)')."""
    stages: list[StageCost]
    resource_seconds: dict[str, float]
    money: float | None = None
    steps: int


class VersionCost(Model):
    version: str
    run_id: str
    charged: list[RunCost]
    """The promoted run and every other run of the model since the previous promotion, oldest first."""
    apart: list[str] = []
    """Canary and comparison runs in the same window: listed, not charged."""
    resource_seconds: dict[str, float]
    money: float | None = None
    promoted_steps: int
    steps_paid: int
    goodput: float | None
    """promoted_steps / steps_paid (None when no step was paid for)."""


def job_resources(job: JobEntry, config: dict) -> dict[str, float]:
    """What the job asked Ray for, from the config it ran with (pure)."""
    module = job.entrypoint.rsplit(" ", 1)[-1]
    train = config.get("train") or {}
    use_gpu = bool(train.get("use_gpu"))
    if module in TRAIN_MODULES:
        workers = float(train.get("num_workers") or 1)
        return {"CPU": workers, **({"GPU": workers} if use_gpu else {})}
    return {"CPU": 1.0, **({"GPU": 1.0} if use_gpu and module in GPU_EVAL_MODULES else {})}


def job_seconds(job: JobEntry) -> float:
    return max(0.0, (datetime.fromisoformat(job.ended_at) - datetime.fromisoformat(job.submitted_at)).total_seconds())


def job_steps(job: JobEntry) -> int:
    """Fine-tune steps a job trained: its summary's steps beyond its start step (0 for other jobs)."""
    summary = job.result.summary or {}
    if "training.finetune" not in job.entrypoint or not isinstance(summary.get("steps"), int):
        return 0
    return max(0, summary["steps"] - int(summary.get("start_step") or 0))


def money(resource_seconds: dict[str, float], prices: dict[str, float]) -> float | None:
    """resource-hours × price per hour; None without a price table (pure)."""
    if not prices:
        return None
    return round(sum(s / 3600 * prices.get(r, 0.0) for r, s in resource_seconds.items()), 6)


def stage_cost(entry: StageEntry, config: dict, prices: dict[str, float], superseded: bool = False) -> StageCost:
    used: dict[str, float] = {}
    for job in entry.jobs:
        for resource, amount in job_resources(job, config).items():
            used[resource] = used.get(resource, 0.0) + amount * job_seconds(job)
    used = {r: round(s, 3) for r, s in used.items()}
    return StageCost(
        stage=entry.stage,
        superseded=superseded,
        seconds=round(sum(job_seconds(j) for j in entry.jobs), 3),
        resource_seconds=used,
        money=money(used, prices),
        steps=sum(job_steps(j) for j in entry.jobs),
    )


def run_cost(record: RunRecord, prices: dict[str, float]) -> RunCost:
    """Every stage the run paid for: its current entries and the superseded attempts (pure)."""
    configs = {inv.number: inv.config or record.config for inv in record.invocations}
    stages = [
        stage_cost(e, configs.get(e.invocation, record.config), prices, superseded=True) for e in record.superseded
    ]
    stages += [stage_cost(e, configs.get(e.invocation, record.config), prices) for e in record.stages.values()]
    total = add(s.resource_seconds for s in stages)
    failure = f" ({record.failure_class.value})" if record.failure_class else ""
    return RunCost(
        run_id=record.run_id,
        status=record.status + failure,
        stages=stages,
        resource_seconds=total,
        money=money(total, prices),
        steps=sum(s.steps for s in stages),
    )


def add(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for resource, seconds in part.items():
            total[resource] = round(total.get(resource, 0.0) + seconds, 3)
    return total


def version_costs(
    records: list[RunRecord], moves: list[Move], prices: dict[str, float], apart: frozenset[str] = frozenset()
) -> list[VersionCost]:
    """One row per promoted version (promotions in the history, oldest first), charging it the model's runs
    created after the previous promotion up to its own, except the `apart` ones (side_runs) (pure)."""
    promotions = [m for m in moves if m.kind != "rollback"]
    by_id = {r.run_id: r for r in records}
    rows, since = [], None
    for move in promotions:
        window = [r for r in records if _in_window(r, since, move) or r.run_id == move.run_id]
        window.sort(key=lambda r: r.created_at)
        rows.append(_version_cost(move, by_id.get(move.run_id), window, prices, apart - {move.run_id}))
        since = move.at
    return rows


def _in_window(record: RunRecord, since: str | None, move: Move) -> bool:
    created = datetime.fromisoformat(record.created_at)
    after = since is None or created > datetime.fromisoformat(since)
    return after and created <= datetime.fromisoformat(move.at)


def _version_cost(
    move: Move, promoted: RunRecord | None, window: list[RunRecord], prices: dict, apart: frozenset[str]
) -> VersionCost:
    charged = [run_cost(r, prices) for r in window if r.run_id not in apart]
    total = add(c.resource_seconds for c in charged)
    lineage = _export_step(promoted)
    paid = sum(c.steps for c in charged)
    return VersionCost(
        version=move.to_version,
        run_id=move.run_id,
        charged=charged,
        apart=[r.run_id for r in window if r.run_id in apart],
        resource_seconds=total,
        money=money(total, prices),
        promoted_steps=lineage,
        steps_paid=paid,
        goodput=round(lineage / paid, 4) if paid else None,
    )


def _export_step(record: RunRecord | None) -> int:
    """The promoted model's step: the current fine-tune's summary's final step."""
    entry = record.stages.get("finetune") if record else None
    summary = (entry.summary or {}) if entry else {}
    return int(summary.get("steps") or 0)


def records_of(records: list[RunRecord], model: str) -> list[RunRecord]:
    """The runs that trained `model` (config.model.name)."""
    return [r for r in records if (r.config.get("model") or {}).get("name") == model]


def side_runs(storage: Storage, run_ids: Iterable[str]) -> frozenset[str]:
    """The run ids a canary or a comparison ran: named after it, and its decision or comparison exists."""
    side = set()
    for run_id in run_ids:
        match = SIDE_RUN.match(run_id)
        if match and any(storage.exists(kind, match["owner"], doc) for kind, doc in SIDE_OWNERS):
            side.add(run_id)
    return frozenset(side)


def seconds_line(resource_seconds: dict[str, float], amount: float | None) -> str:
    """'CPU 123.4 s, GPU 0 s (0.0137)' for a terminal or a card (pure)."""
    parts = ", ".join(f"{r} {s:.1f} s" for r, s in sorted(resource_seconds.items())) or "no Ray job time"
    return parts + (f" (cost {amount:.4f})" if amount is not None else "")


def record_prices(record: RunRecord) -> dict[str, float]:
    """The price table the run was configured with (empty in records written before it existed)."""
    return dict((record.config.get("cost") or {}).get("prices") or {})


def diff_numbers(record: RunRecord) -> dict[str, float | None]:
    """The run's cost as `runs diff` numbers: wall seconds per stage, resource-seconds, money (pure)."""
    run = run_cost(record, record_prices(record))
    numbers: dict[str, float | None] = {f"cost.{s.stage}.seconds": s.seconds for s in run.stages if not s.superseded}
    numbers.update({f"cost.{r}_seconds": s for r, s in run.resource_seconds.items()})
    numbers["cost.money"] = run.money
    return numbers
