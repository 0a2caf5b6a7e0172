"""What the fine-tune and resume stages prove, as typed data, and the pure readers of a fine-tune's metrics rows.

training/finetune.py (through training/finetune_summary.py) builds FinetuneSummary; training/resume.py
builds ResumeJobSummary, tasks/resume.py ResumeSummary. `latest_rows`, `loss_curve`, `thin` and
`ledger_points` turn the metrics log's rows (METRICS_LOG) into the summary's curves. Built on
tuneproof/core/summaries.py's Summary: strict, unknown fields are errors.
"""

from __future__ import annotations

from typing import Any, Literal, TypeVar

from tuneproof.core.summaries import CheckpointRef, Summary

LossPoint = tuple[int, float | None]
"""(step, loss); None where the loss was not finite."""


LedgerPoint = tuple[int, str, str | None]
"""(step, digest of the sample ids every rank trained on at that step, the data-order ledger after it: the
running sha256 over every step's ids, cut to LEDGER_DIGITS; None when the run resumed from a checkpoint
written before the ledger existed)."""


METRICS_LOG = "metrics.jsonl"
"""A fine-tune job's metrics log in its stage folder (runs/<run>/stages/<job>/): a row per step it trained."""


LEDGER_DIGITS = 16


CURVE_POINTS = 100
"""The most loss-curve and ledger points a fine-tune summary keeps: the record must stay small (≤ 64 KB at
100,000 steps); every point stays in the job's metrics log, which the summary names by path and hash."""


def latest_rows(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per step, the last one written: a step replayed after a restart supersedes the earlier try. Pure."""
    by_step = {r["step"]: r for r in rows}
    return [by_step[s] for s in sorted(by_step)]


def loss_curve(rows: list[dict[str, Any]]) -> list[LossPoint]:
    """(step, loss) of every step of a fine-tune's metrics rows, in step order. Pure."""
    return [(r["step"], r["loss"]) for r in latest_rows(rows)]


P = TypeVar("P", bound=tuple)


def thin(points: list[P], limit: int = CURVE_POINTS) -> list[P]:
    """At most `limit` of `points`, evenly spaced, the first and the last always among them; all of them when
    there are no more than `limit`. For display: the whole series is in the metrics log. Pure."""
    if len(points) <= limit:
        return list(points)
    last = len(points) - 1
    picks = sorted({round(i * last / (limit - 1)) for i in range(limit)})
    return [points[i] for i in picks]


def ledger_points(rows: list[dict[str, Any]]) -> list[LedgerPoint]:
    """The ledger points of a fine-tune's metrics rows, one per step (a step replayed after a restart: its
    last row), the running ledger cut to LEDGER_DIGITS; rows without a ledger are left out. Pure."""
    by_step = {r["step"]: r for r in rows if r.get("samples")}
    return [
        (step, r["samples"], r["ledger"][:LEDGER_DIGITS] if r.get("ledger") else None)
        for step, r in sorted(by_step.items())
    ]


class BaseModelFacts(Summary):
    """What a base model directory's base.json says of how it was made (the tiny local base writes one)."""

    content_hash: str
    """sha256 over the build's recipe, model shape and input files: the same hash, the same base."""
    recipe: dict[str, Any]
    """How it was pre-trained (tuneproof/app/tiny_base.SkillsRecipe): steps, batch, lr, seed, data, ..."""
    skills_exact_match: dict[str, float] = {}
    """Its exact match on each bundled skill suite when it was built."""


class Restart(Summary):
    """One restart of the Ray Train worker group within a fine-tune job (train.max_failures allows it)."""

    attempt: int
    """The worker group's attempt that started after the failure: 1 is the first restart."""
    at_step: int | None = None
    """The last step the failed attempt completed and logged (None: it logged none)."""
    restored_step: int
    """The step of the complete checkpoint the new attempt resumed from (0: from the start)."""
    restored_from: str | None = None
    cause: str | None = None
    """What Ray Train reported for the failed attempt (one line), when it reported anything."""
    lost_steps: int | None = None
    """Steps the failed attempt trained past the checkpoint the new one resumed from, trained again
    (at_step - restored_step); None when it logged no step. Only logged steps count: with train.log_every
    above 1, steps since the last flush of metrics.jsonl are not seen."""
    notice_step: int | None = None
    """The step the failed attempt saved a checkpoint at on Ray's preemption notice
    (train.checkpoint_on_preemption; training.preemption); None: it acted on no notice."""


class SkippedCheckpoint(Summary):
    """A checkpoint newer than the one a fine-tune resumed from, left out because it failed its check; or the
    latest checkpoint of a run whose loss diverged, set aside so that no continuation resumes into it."""

    name: str
    """Its directory name, checkpoint_<step>."""
    step: int
    reason: str
    """What the completion check found (no marker, a file missing, a size or sha256 that differs), or the
    divergence after it."""
    set_aside_as: str | None = None
    """The directory it was moved to, kept as evidence (None: left where it was, to be saved over)."""
    dropped_from_ray: bool = False
    """It was listed in Ray Train's checkpoint manager snapshot and was taken out of it."""


class RankMemory(Summary):
    """The most memory one rank held while the stage ran: CUDA's allocator peaks on a GPU, the process's
    peak resident set on CPU (and beside a GPU: the host side of the same process)."""

    rank: int
    device: str
    """cuda:N or cpu."""
    max_allocated_bytes: int | None = None
    """torch.cuda.max_memory_allocated: the most bytes tensors held at once (GPU only)."""
    max_reserved_bytes: int | None = None
    """torch.cuda.max_memory_reserved: the most the caching allocator took from the GPU (GPU only)."""
    peak_rss_bytes: int
    """The process's peak resident set size (getrusage ru_maxrss)."""


class FitEstimate(Summary):
    """Bytes per GPU a fine-tune configuration needs, estimated before any Ray Train run starts
    (tuneproof.core.fit), with the capacity it was compared with."""

    params_bytes: int
    """fp32 master weights, this rank's shard."""
    grads_bytes: int
    """fp32 gradients of the trainable parameters, this rank's shard."""
    optimizer_bytes: int
    """AdamW's two fp32 moments of the trainable parameters, this rank's shard."""
    gathered_bytes: int
    """Unsharded compute copies FSDP2 gathers at once (the root group and two decoder layers; every layer
    under ddp)."""
    activation_bytes: int
    """What autograd saves for backward at train.micro_batch_size x data.max_seq_len (a probe forward)."""
    loss_bytes: int
    """The chunked loss's logits, their gradient and its softmax, one chunk at a time."""
    total_bytes: int
    shard_degree: int
    """Ranks one parameter is sharded over (world under full, the group under hybrid, 1 under ddp)."""
    capacity_bytes: int | None = None
    """The smallest GPU the verified cluster reports (None: unknown, or a CPU run)."""


class FinetuneSummary(Summary):
    run_name: str
    """Ray Train run name (RunConfig.name): the same name resumes."""
    train_storage_uri: str
    checkpoints: list[CheckpointRef]
    latest_checkpoint: CheckpointRef | None = None
    start_step: int
    restored_from: str | None = None
    steps: int
    first_loss: float | None = None
    final_loss: float | None = None
    loss_curve: list[LossPoint] = []
    """At most CURVE_POINTS (step, loss) points, evenly spaced, first and last included: for display. Every
    step's loss is in the metrics log (`metrics_path`)."""
    loss_falling: bool | None = None
    """Whether the loss fell (training.finetune_summary.loss_trend: the mean over the last tenth of the steps below
    that over the first); False fails the stage as modeling. None: not judged (too few steps, or a job that
    continued its run rather than training it from step 1), or a record written before it was judged."""
    loss_trend: str | None = None
    """The two mean losses compared, or why the loss was not judged."""
    curve_steps: int | None = None
    """How many steps the whole loss curve has (None in records written before the curve was thinned, whose
    `loss_curve` and `ledger` hold every step)."""
    metrics_path: str | None = None
    """Storage path of the job's metrics log (tuneproof.core.rowlog): every step's loss and ledger."""
    metrics_sha256: str | None = None
    """rowlog.rows_sha256 of that log's rows as this summary read them: a reader checks it got the same."""
    tokens_per_s: float | None = None
    seconds: float
    export_path: str | None = None
    export_uri: str | None = None
    export_sha256: str | None = None
    """content_sha256 of the export's manifest (tuneproof-export.json): what evaluate must score."""
    invocation: int | None = None
    """The run record's invocation whose job trained this (also in the export's manifest)."""
    mfu: float | None = None
    restored_step: int | None = None
    first_step_completed_at: float | None = None
    """Unix time the first step after a restore completed (resume test)."""
    method: Literal["full", "lora"] = "full"
    """train.method: every weight trained, or LoRA adapters on a frozen base."""
    trainable_params: int | None = None
    """Parameters the optimizer updated (the adapters under LoRA)."""
    total_params: int | None = None
    """Every parameter of the trained model (under LoRA: base + adapters), a tied weight once."""
    adapter_path: str | None = None
    """LoRA: storage path of the peft adapter (<export_path>/adapter); export_path is the merged model."""
    sharding: Literal["full", "hybrid", "ddp"] | None = None
    """train.sharding as it ran (None in records written before it was recorded)."""
    mesh: list[int] | None = None
    """The device mesh the weights were sharded on: [shard] under full, [replicate, shard] under hybrid
    and ddp ([workers, 1]); e.g. [2, 2] for 4 workers in shard groups of 2."""
    restarts: list[Restart] = []
    """Worker-group failures Ray Train recovered from in this job, with the step each one resumed at."""
    ledger: list[LedgerPoint] = []
    """The data-order ledger of the steps this job trained (training.train_data): which samples each step
    consumed, and the running hash that every checkpoint carries on; thinned like `loss_curve`."""

    @property
    def thinned(self) -> bool:
        """True when `loss_curve` and `ledger` hold only some steps (read the rest from `metrics_path`)."""
        return self.curve_steps is not None and self.curve_steps > len(self.loss_curve)

    skipped_checkpoints: list[SkippedCheckpoint] = []
    """Checkpoints newer than the one this job resumed from that failed their completion check, and the latest
    one when this job's loss diverged: left out of the restore and of Ray Train's checkpoint bookkeeping alike."""
    memory: list[RankMemory] = []
    """Peak memory of every rank of the run's last attempt, by rank."""
    fit_estimate: FitEstimate | None = None
    """What the configuration was estimated to need per GPU before the run, beside `memory`'s measurement."""
    base_model: BaseModelFacts | None = None
    """The base's identity when its directory carries base.json (the pre-trained tiny base); else None."""


class LossDiff(Summary):
    step: int
    reference: float | None
    replay: float | None
    abs_diff: float | None
    rel_diff: float | None


class LossComparison(Summary):
    steps_compared: int
    max_abs_diff: float | None = None
    max_rel_diff: float | None = None
    ok: bool
    mismatches: list[LossDiff] = []
    reason: str | None = None


class LedgerComparison(Summary):
    """The resume test's data-order check: the replay's ledger against the main run's, step for step."""

    steps_compared: int
    first_differing_step: int | None = None
    """The first step whose samples (or the running ledger before them) differ from the main run's."""
    ok: bool
    reason: str | None = None


class ResumeSummary(Summary):
    seed_checkpoint: CheckpointRef | None = None
    """The main-run checkpoint the test starts from."""
    tested_run_name: str | None = None
    """The fine-tune's Ray Train run whose checkpoint was tested: promotion needs it to be the promoted model's."""
    tested_invocation: int | None = None
    """The run record's invocation of that fine-tune."""
    attempt_run_name: str | None = None
    """The Ray Train run name of this attempt's interrupt and continue phases (one per attempt, retries included)."""
    interrupted: bool = False
    """The interrupt phase's workers were all killed right after its checkpoint at interrupted_at_step."""
    interrupted_at_step: int | None = None
    restored_step: int | None = None
    restored_from: str | None = None
    seconds_to_first_resumed_step: float | None = None
    """From the kill to the restarted run's first step: a new Ray Train run's start and the checkpoint's load."""
    loss_comparison: LossComparison | None = None
    max_loss_diff: float | None = None
    loss_rtol: float | None = None
    ledger_comparison: LedgerComparison | None = None
    """Which samples the interrupted and restarted runs trained on, against the main run, over every step both
    ran: a restart that skips, repeats or reorders samples fails here even when its losses look close."""
    problems: list[str] = []


class ResumeJobSummary(Summary):
    """What the resume test's job (training.resume) reports; the flow's task judges it into a ResumeSummary."""

    interrupt_job: str
    """The interrupt phase's stage folder under runs/<run>/stages/ (its metrics.jsonl holds the losses it logged)."""
    continue_job: str
    """The continue phase's stage folder."""
    interrupted_at_step: int | None = None
    """The checkpoint step after which every rank was killed; None when the phase never got there."""
    interrupted_at: float | None = None
    """When rank 0 recorded the kill (unix time)."""
    resumed: FinetuneSummary | None = None
    """The continue phase, a new Ray Train run under the same name: the step it restored, its losses."""
