"""What a run, and a promoted model version, cost: resource-seconds per stage, money from a price table,
and goodput.

    run_cost(record, prices)                  -> RunCost: by stage, superseded attempts included
    version_costs(records, moves, prices)     -> [VersionCost]: per promoted version, what its lineage paid

A job's resources are what it asked Ray for, from the config it ran with: a Ray Train job (fine-tune,
connectivity, the resume test) one CPU per worker and, with train.use_gpu, one GPU per worker (Ray
Train's ScalingConfig defaults); any other job one CPU (its driver), and one GPU for the evaluation jobs
on a GPU cluster. Resource-seconds are those times the job's wall time: its start to its end as Ray reports them,
however late the flow attached to it. A record without them (written before they were kept) has the flow's own
times, submission or attach to the end it saw, and names the jobs the flow attached to (`timed_from_attach`): their
time before the attach is not counted. Money is resource-hours × the config's `cost.prices` (empty: seconds only).

A promoted version paid for its own run and for every run of the same model since the previous
promotion that did not become it: failed, refused, superseded attempts. Canary and comparison runs
(`side_runs`: ids `<decision>-r<N>`, `<comparison>-a<N>`/`-b<N>` whose decision or comparison exists)
are listed apart, not charged.
Goodput = the fine-tune steps of the promoted model (its export's step) ÷ every fine-tune step the
charged runs trained, each from the evidence its job left (`paid_steps`): a summary's steps past its start
step plus the steps its restarts trained again; for a job that left no summary (stopped, lost, failed in Ray
Train), the rows its metrics log shows it wrote (`logged_steps`, recorded when it ended); and the steps below
a resumed job's start step that no earlier job accounts for, which the checkpoint it resumed from proves were
paid for. So goodput is never above 1 (`goodput` refuses it). The resume test's and the evaluations' time is
in the cost, not in the steps. All pure over records and history moves, but `side_runs`, which reads the storage.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from datetime import datetime

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tuneproof.control.history import Move
from tuneproof.control.record import JobEntry, RunRecord, StageEntry
from tuneproof.core.config_base import MAX_WORKERS
from tuneproof.core.config_cluster import Price
from tuneproof.core.results import Model
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

FINETUNE = "training.finetune"
TRAIN_MODULES = ("training.finetune", "training.connectivity", "training.resume")
GPU_EVAL_MODULES = ("eval.evaluate_job", "eval.copy_check")
SIDE_RUN = re.compile(r"^(?P<owner>.+)-(?:r|a|b)\d+$")
"""Run ids the canary (`<decision>-r<N>`) and comparison (`<comparison>-a<N>`, `-b<N>`) flows give their runs."""
SIDE_OWNERS = (("images", "decision.json"), ("comparisons", "comparison.json"))


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
    """Fine-tune steps its jobs paid for (`paid_steps`)."""


class RunCost(Model):
    run_id: str
    status: str
    """The run's status, with its failure class when it failed ('failed (modeling)')."""
    stages: list[StageCost]
    resource_seconds: dict[str, float]
    money: float | None = None
    unpriced: list[str] = []
    """Resources it used that the price table has no price for: `money` leaves them out."""
    timed_from_attach: list[str] = []
    """Jobs (submission ids) timed from when the flow attached to them (`job_seconds`): the cost is short by their
    time before that."""
    steps: int


class VersionCost(Model):
    version: str
    run_id: str
    charged: list[RunCost]
    """The promoted run and every other run of the model with a stage that ended since the previous promotion,
    oldest first, each with those stages only."""
    apart: list[str] = []
    """Canary and comparison runs in the same window: listed, not charged."""
    unreadable: list[str] = []
    """Runs whose records could not be read when the cost was computed (their model unknown): not in the cost,
    which is short by whatever of theirs was this model's."""
    resource_seconds: dict[str, float]
    money: float | None = None
    unpriced: list[str] = []
    """Resources the charged runs used that `prices` has no price for: `money` leaves them out."""
    prices: dict[str, float] = {}
    """The price table `money` was computed with (per resource-hour; empty: seconds only)."""
    promoted_steps: int
    earlier_steps: int = 0
    """Of promoted_steps, those its run paid for before the previous promotion: on an earlier version's card."""
    steps_paid: int
    goodput: float | None
    """(promoted_steps - earlier_steps) / steps_paid (None when no step was paid for); never above 1."""


class RecordedTrain(BaseModel):
    """What the cost reads of a recorded config.train: the record keeps the config as raw JSON, which a hand edit
    or another release may have left in any shape (`train: 5` ended `runs show` in an AttributeError)."""

    model_config = ConfigDict(extra="ignore")
    num_workers: int | None = Field(None, ge=1, le=MAX_WORKERS)
    use_gpu: bool | None = None


class RecordedModel(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str


class RecordedCost(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)
    prices: dict[str, Price] | None = None
    """As CostConfig bounds them: a negative price made a negative cost, 1e308 an infinite one."""


class RecordedConfig(BaseModel):
    """The sections of a run's recorded config (RunRecord.config, an invocation's) the cost reads, checked: a
    ValidationError names the field ('config.train.num_workers'), as a stage summary's does."""

    model_config = ConfigDict(extra="ignore", title="config")
    train: RecordedTrain | None = None
    model: RecordedModel | None = None
    cost: RecordedCost | None = None


def recorded(config: dict, *sections: str) -> RecordedConfig:
    """The named sections of a recorded config, checked (the others are not read): ValidationError naming the field."""
    return RecordedConfig.model_validate({key: config.get(key) for key in sections})


def job_resources(job: JobEntry, config: dict) -> dict[str, float]:
    """What the job asked Ray for, from the config it ran with (pure); ValidationError when its train section
    cannot be read (`recorded`)."""
    module = _module(job)
    train = recorded(config, "train").train or RecordedTrain()
    use_gpu = bool(train.use_gpu)
    if module in TRAIN_MODULES:
        workers = float(train.num_workers or 1)
        return {"CPU": workers, **({"GPU": workers} if use_gpu else {})}
    return {"CPU": 1.0, **({"GPU": 1.0} if use_gpu and module in GPU_EVAL_MODULES else {})}


def job_seconds(job: JobEntry) -> float:
    """The job's wall time by Ray's start and end; where the record has not both, by the flow's submission or
    attach to the end it saw, which for a job the flow attached to is short (`timed_from_attach`). Pure."""
    if job.ray_started_at and job.ray_ended_at:
        start, end = job.ray_started_at, job.ray_ended_at
    else:
        start, end = job.submitted_at, job.ended_at
    return max(0.0, (datetime.fromisoformat(end) - datetime.fromisoformat(start)).total_seconds())


def timed_from_attach(job: JobEntry) -> bool:
    """Whether the job's seconds leave out its time before the flow attached to it: the record has no Ray start and
    end for it (written before they were kept), and the flow did not submit it. Pure."""
    return job.attached and not (job.ray_started_at and job.ray_ended_at)


def paid_steps(entries: list[StageEntry]) -> list[int]:
    """The fine-tune steps each entry's jobs paid for, from the evidence each job left (pure):

    - a job with a summary: its steps past its start step, plus the steps its worker-group restarts trained
      again (each Restart's lost_steps);
    - a job without one (stopped, lost, failed inside Ray Train): the steps its metrics log rows show
      (JobEntry.logged_steps, counted when it ended);
    - a resumed job's start step above the steps this run's earlier jobs of its Ray Train run account for:
      the checkpoint it resumed from proves an attempt of this run trained them (one that left no job entry:
      a flow that died with its job), charged to the resuming job's entry.

    A Ray Train run's steps paid for are therefore never fewer than the last step it reached. Jobs go in
    submission order; a summary-less job belongs to the Ray Train run of a summary written in its folder.
    Only the finetune stage's jobs count: a first-release record's resume test ran training.finetune jobs,
    whose steps test a restore and are not the model's training."""
    jobs = sorted(
        (
            (i, job)
            for i, entry in enumerate(entries)
            if entry.stage == "finetune"
            for job in entry.jobs
            if _module(job) == FINETUNE
        ),
        key=lambda pair: datetime.fromisoformat(pair[1].submitted_at),
    )
    run_of_folder = {job.result.stage: s.run_name for _, job in jobs if (s := _summary(job)) is not None}
    known: dict[str, int] = {}
    """Ray Train run -> the steps this run's jobs are known to have trained in it."""
    paid = [0] * len(entries)
    for i, job in jobs:
        summary = _summary(job)
        if summary is None:
            key, trained = run_of_folder.get(job.result.stage, job.result.stage), job.logged_steps or 0
        else:
            key = summary.run_name
            unaccounted = max(0, summary.start_step - known.get(key, 0))
            replayed = sum(r.lost_steps or 0 for r in summary.restarts)
            trained = unaccounted + max(0, summary.steps - summary.start_step) + replayed
        known[key] = known.get(key, 0) + trained
        paid[i] += trained
    return paid


def logged_steps(rows: list[dict], submitted_at: str, ended_at: str) -> int:
    """The fine-tune steps a job trained by its metrics log (training/finetune.py's rows, one per step, a
    replayed step again): the rows written between its submission and its end. Pure."""
    start, end = (datetime.fromisoformat(t).timestamp() for t in (submitted_at, ended_at))
    return sum(1 for row in rows if isinstance(row.get("time"), (int, float)) and start <= row["time"] <= end)


def _module(job: JobEntry) -> str:
    return job.entrypoint.rsplit(" ", 1)[-1]


def _summary(job: JobEntry) -> FinetuneSummary | None:
    """The job's fine-tune summary; None where it left none, or one this release cannot read (another release's
    record, a hand edit), which then counts as a job without one: by its logged steps. Raising here made one
    such record of a model stop every later promotion of it, after the registry copy was made."""
    if job.result.summary is None:
        return None
    try:
        return FinetuneSummary.model_validate(job.result.summary)
    except ValidationError:
        return None


def goodput(promoted_steps: int, steps_paid: int) -> float | None:
    """promoted_steps / steps_paid (None when nothing was paid for). A promoted model cannot hold more steps
    than were paid for: a fraction above 1 means the evidence lost a job's steps, and is refused. Pure."""
    if steps_paid == 0:
        return None
    if promoted_steps > steps_paid:
        raise AssertionError(
            f"goodput {promoted_steps}/{steps_paid} > 1: the promoted model has more fine-tune steps than the "
            "charged runs paid for, so a job's steps are missing from the evidence"
        )
    return round(promoted_steps / steps_paid, 4)


def money(resource_seconds: dict[str, float], prices: dict[str, float]) -> float | None:
    """resource-hours × price per hour over the resources the table prices; None without a price table (pure).
    A resource it does not price is left out, not priced at 0 in silence: `unpriced` names it beside the
    number. The number stays what was priced (rather than None) so a CPU-only table still prices a CPU-only
    run exactly, and None keeps meaning one thing: no price table."""
    if not prices:
        return None
    return round(sum(s / 3600 * prices[r] for r, s in resource_seconds.items() if r in prices), 6)


def unpriced(resource_seconds: dict[str, float], prices: dict[str, float]) -> list[str]:
    """The resources with seconds that a price table has no price for (pure); none without a table, where
    nothing is priced and `money` is None."""
    if not prices:
        return []
    return sorted(r for r, s in resource_seconds.items() if s > 0 and r not in prices)


def stage_cost(
    entry: StageEntry, config: dict, prices: dict[str, float], superseded: bool = False, steps: int = 0
) -> StageCost:
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
        steps=steps,
    )


def run_cost(
    record: RunRecord, prices: dict[str, float], charged: Callable[[StageEntry], bool] | None = None
) -> RunCost:
    """Every stage the run paid for: the superseded attempts, then its current entries in the order they ran
    (pure). `charged`, when given, keeps only the entries it accepts (those a version is charged); their steps
    are counted over the whole run all the same, as a resumed job's start step is set against all its earlier jobs."""
    configs = {inv.number: inv.config or record.config for inv in record.invocations}
    kept = [(e, superseded, paid) for e, superseded, paid in _paid_entries(record) if charged is None or charged(e)]
    stages = [
        stage_cost(e, configs.get(e.invocation, record.config), prices, superseded, paid)
        for e, superseded, paid in kept
    ]
    total = add(s.resource_seconds for s in stages)
    failure = f" ({record.failure_class.value})" if record.failure_class else ""
    return RunCost(
        run_id=record.run_id,
        status=record.status + failure,
        stages=stages,
        resource_seconds=total,
        money=money(total, prices),
        unpriced=unpriced(total, prices),
        timed_from_attach=[job.submission_id for e, _, _ in kept for job in e.jobs if timed_from_attach(job)],
        steps=sum(s.steps for s in stages),
    )


def _paid_entries(record: RunRecord) -> list[tuple[StageEntry, bool, int]]:
    """(entry, superseded, the fine-tune steps it paid for): the superseded attempts, then the current entries in
    the order they ran (a stored record keeps its stages by name; stages run one after another, so their start
    times order them)."""
    current = sorted(record.stages.values(), key=lambda e: (e.started_at, e.stage))
    entries = [(e, True) for e in record.superseded] + [(e, False) for e in current]
    steps = paid_steps([e for e, _ in entries])
    return [(e, superseded, paid) for (e, superseded), paid in zip(entries, steps, strict=True)]


def add(parts: Iterable[dict[str, float]]) -> dict[str, float]:
    total: dict[str, float] = {}
    for part in parts:
        for resource, seconds in part.items():
            total[resource] = round(total.get(resource, 0.0) + seconds, 3)
    return total


def version_costs(
    records: list[RunRecord],
    moves: list[Move],
    prices: dict[str, float],
    apart: frozenset[str] = frozenset(),
    since: str | None = None,
) -> list[VersionCost]:
    """One row per promoted version (promotions in the history, oldest first), charging it the stage entries of
    the model's runs that `owner` gives it; the `apart` runs (side_runs) it lists instead (pure). `since` is when
    the version production served before the first move was promoted, where no move put it there (a pointer the
    first release wrote): what ended before then was that version's, on no row here."""
    promotions = [m for m in moves if m.kind != "rollback"]
    points = [datetime.fromisoformat(t) for t in ([since] if since else []) + [m.at for m in promotions]]
    by_id = {r.run_id: r for r in records}
    rows = []
    for index, move in enumerate(promotions, start=len(points) - len(promotions)):

        def charged(entry: StageEntry, index: int = index) -> bool:
            return owner(entry, points) == index

        window = [r for r in records if r.run_id == move.run_id or any(map(charged, _entries(r)))]
        window.sort(key=lambda r: r.created_at)
        promoted = by_id.get(move.run_id)
        earlier = _earlier_steps(promoted, points, index) if promoted else 0
        rows.append(_version_cost(move, promoted, window, charged, earlier, prices, apart - {move.run_id}))
    return rows


def owner(entry: StageEntry, promotions_at: list[datetime]) -> int | None:
    """Which promotion an entry is charged to: the first made once its last job had ended (pure); None for an
    entry without jobs (it cost nothing) or one that ended after the last promotion. By the entry's own jobs, not
    its record's creation, so a continued run's later stages go to a later version; and by their end, not their
    start, because a card is computed at its promotion from the entries stored by then and an entry is stored
    when it ends: a job still running at a promotion goes to the next one, which sees it."""
    if not entry.jobs:
        return None
    ended = max(datetime.fromisoformat(job.ended_at) for job in entry.jobs)
    return next((i for i, at in enumerate(promotions_at) if ended <= at), None)


def _entries(record: RunRecord) -> list[StageEntry]:
    return [*record.superseded, *record.stages.values()]


def _earlier_steps(promoted: RunRecord, promotions_at: list[datetime], index: int) -> int:
    """The fine-tune steps the promoted run paid for before promotion `index`'s window: on an earlier card (its
    run trained before another version was promoted) or on none (before the first release's)."""
    return sum(
        paid
        for entry, _, paid in _paid_entries(promoted)
        if (before := owner(entry, promotions_at)) is not None and before < index
    )


def _version_cost(
    move: Move,
    promoted: RunRecord | None,
    window: list[RunRecord],
    charged: Callable[[StageEntry], bool],
    earlier: int,
    prices: dict[str, float],
    apart: frozenset[str],
) -> VersionCost:
    runs = [_charged(r, move.run_id, prices, charged) for r in window if r.run_id not in apart]
    total = add(c.resource_seconds for c in runs)
    lineage = _export_step(promoted)
    paid = sum(c.steps for c in runs)
    return VersionCost(
        version=move.to_version,
        run_id=move.run_id,
        charged=runs,
        apart=[r.run_id for r in window if r.run_id in apart],
        resource_seconds=total,
        money=money(total, prices),
        unpriced=unpriced(total, prices),
        prices=prices,
        promoted_steps=lineage,
        earlier_steps=earlier,
        steps_paid=paid,
        goodput=goodput(max(0, lineage - earlier), paid),
    )


def _charged(
    record: RunRecord, promoted_run: str, prices: dict[str, float], charged: Callable[[StageEntry], bool]
) -> RunCost:
    """The run's cost in the window; the promoted run's status is 'promoted' (whether its flow was still running)."""
    run = run_cost(record, prices, charged)
    return run.model_copy(update={"status": "promoted"}) if record.run_id == promoted_run else run


def _export_step(record: RunRecord | None) -> int:
    """The promoted model's step: the current fine-tune's summary's final step."""
    entry = record.stages.get("finetune") if record else None
    summary = (entry.summary or {}) if entry else {}
    return int(summary.get("steps") or 0)


def records_of(records: list[RunRecord], model: str) -> tuple[list[RunRecord], list[str]]:
    """(the runs that trained `model` (config.model.name), the run ids the cost cannot read): a record whose model
    cannot be read (its model unknown), or one of `model` whose configs the cost cannot read (`config_problem`), is
    named, for VersionCost.unreadable, never charged on a guess nor allowed to stop the promotion (an
    AttributeError here stopped every later promotion of the model)."""
    runs, unreadable = [], []
    for record in records:
        try:
            named = recorded(record.config, "model").model
        except ValidationError:
            unreadable.append(record.run_id)
            continue
        if named is None or named.name != model:
            continue
        if config_problem(record) is None:
            runs.append(record)
        else:
            unreadable.append(record.run_id)
    return runs, unreadable


def config_problem(record: RunRecord) -> str | None:
    """Why the cost cannot read the record's configs (its own and each invocation's train section), or None."""
    for config in [record.config, *(inv.config for inv in record.invocations if inv.config)]:
        try:
            recorded(config, "train")
        except ValidationError as e:
            return str(e)
    return None


def side_runs(storage: Storage, run_ids: Iterable[str]) -> frozenset[str]:
    """The run ids a canary or a comparison ran: named after it, and its decision or comparison exists."""
    side = set()
    for run_id in run_ids:
        match = SIDE_RUN.match(run_id)
        if match and any(storage.exists(kind, match["owner"], doc) for kind, doc in SIDE_OWNERS):
            side.add(run_id)
    return frozenset(side)


def seconds_line(resource_seconds: dict[str, float], amount: float | None, missing: Iterable[str] = ()) -> str:
    """'CPU 250.0 s, GPU 240.0 s (cost 0.0035, GPU unpriced)' for a terminal or a card (pure): `missing` are the
    resources the price table does not price (`unpriced`), which the cost leaves out."""
    parts = ", ".join(f"{r} {s:.1f} s" for r, s in sorted(resource_seconds.items())) or "no Ray job time"
    priced = [f"cost {amount:.4f}"] if amount is not None else []
    priced += [f"{r} unpriced" for r in missing]
    return parts + (f" ({', '.join(priced)})" if priced else "")


def attach_note(submission_ids: list[str]) -> str | None:
    """The sentence naming the jobs timed only from when the flow attached to them (`timed_from_attach`), for a
    terminal or a card; None for none. Pure."""
    if not submission_ids:
        return None
    return (
        f"Ray job(s) {', '.join(submission_ids)} are timed from when the flow attached to them: their records have "
        "no Ray start and end, so the cost leaves out their time before that."
    )


def unpriced_note(a: list[str], b: list[str]) -> str | None:
    """`runs diff`'s line under cost.money: what each run's price table does not price (`RunCost.unpriced`), as
    `runs show`'s cost line and the card name it; None when neither run used such a resource. Pure."""
    sides = "; ".join(f"{run}: {', '.join(missing)} unpriced" for run, missing in (("a", a), ("b", b)) if missing)
    return f"{sides} (cost.prices has no price for it: cost.money leaves it out)" if sides else None


def card_notes(version: VersionCost) -> list[str]:
    """What the card's cost does not count, one sentence each, under its table (pure): runs whose records could
    not be read, resources without a price, jobs timed from an attach, and the model's steps an earlier card paid
    for."""
    notes = []
    if version.unreadable:
        notes.append(
            f"Cost excludes {len(version.unreadable)} run(s) whose records could not be read (so their model is "
            f"unknown): {', '.join(version.unreadable)}."
        )
    if version.unpriced:
        notes.append(
            f"{', '.join(version.unpriced)} unpriced: cost.prices has no price for it, so the cost counts only "
            f"{', '.join(sorted(version.prices))}."
        )
    if attached := attach_note([sid for run in version.charged for sid in run.timed_from_attach]):
        notes.append(attached)
    if version.earlier_steps:
        notes.append(
            f"{version.earlier_steps} of the model's {version.promoted_steps} fine-tune steps were trained before "
            "the previous promotion and are on that version's card: goodput counts the other "
            f"{max(0, version.promoted_steps - version.earlier_steps)}."
        )
    return notes


def record_prices(record: RunRecord) -> dict[str, float]:
    """The price table the run was configured with (empty in records written before it existed); ValidationError
    naming the field when it is not one (a hand edit: a negative, absurd or non-numeric price)."""
    cost = recorded(record.config, "cost").cost
    return dict(cost.prices or {}) if cost else {}


def recorded_cost(record: RunRecord) -> RunCost:
    """The run's cost by its own price table, as `runs diff` shows it (pure)."""
    return run_cost(record, record_prices(record))


def diff_numbers(record: RunRecord) -> dict[str, float | None]:
    """The run's cost as `runs diff` numbers: wall seconds per stage, resource-seconds, money (pure); what money
    leaves out is `recorded_cost(record).unpriced`."""
    run = recorded_cost(record)
    numbers: dict[str, float | None] = {f"cost.{s.stage}.seconds": s.seconds for s in run.stages if not s.superseded}
    numbers.update({f"cost.{r}_seconds": s for r, s in run.resource_seconds.items()})
    numbers["cost.money"] = run.money
    return numbers
