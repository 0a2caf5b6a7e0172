"""What each stage proves, as typed data: one summary model per stage.

A job builds its stage's summary (training/verify.py builds a VerifySummary, and so on) and its
harness writes it into result.json; the task that submitted the job reads it back with the same
model, and every reader after that (the flow, the record, the CLI, artifacts, promotion) gets these
types instead of digging through dicts. The stage table (tuneproof/control/stages.py) names each stage's model.

Fields a failed stage may not have reached are optional; everything else is required, and unknown
fields are errors, so a job that writes the wrong thing fails loudly at the boundary.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

from tuneproof.core.findings import Finding
from tuneproof.core.results import first_and_more


class Summary(BaseModel):
    """Base of every stage summary: strict, and JSON-ready with `to_json()`."""

    model_config = ConfigDict(extra="forbid")

    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


# ---- shared pieces ---------------------------------------------------------------------------


@dataclass(frozen=True)
class CheckpointRef:
    """A complete checkpoint: its step and where it lives (a local path or s3:// URI)."""

    step: int
    uri: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ---- 1 verify --------------------------------------------------------------------------------


class NodeFacts(Summary):
    """What one Ray node runs, as its probe saw it (Ray's view of the node plus the probe's facts)."""

    node_id: str
    node_ip: str
    is_head: bool
    alive: bool = True
    gpus_advertised: float = 0.0
    """Ray's 'GPU' resource for the node."""
    probe_error: str | None = None
    """Why the probe did not return facts; the version fields are then empty."""
    hostname: str | None = None
    ray_version: str | None = None
    python_version: str | None = None
    torch_version: str | None = None
    transformers_version: str | None = None
    cuda_version: str | None = None
    nccl_version: str | None = None
    gpus_visible: int | None = None
    """GPUs torch sees on the node."""
    gpu_memory_bytes: list[int] = []
    """Total memory of each GPU torch sees on the node (what a fine-tune's fit estimate is compared with)."""
    environment_digest: str | None = None
    """sha256 over the node's installed distributions (name==version)."""


DigestOrMap = str | dict[str, str | None] | None
"""One digest when every node/pod agrees, else a map from node/pod to its digest."""


class ClusterFacts(Summary):
    """The cluster's identity for the run record: Ray version, nodes, environment and image digests."""

    ray_version: str | None = None
    nodes: list[NodeFacts] = []
    environment_digest: DigestOrMap = None
    image_digest: DigestOrMap = None
    """The digest every Ray pod runs (eks); None on the local profile."""


class StorageProbe(Summary):
    uri: str
    node_ip: str
    ok: bool
    error: str | None = None
    seconds: float | None = None
    conditional_writes: str | None = None
    """'honoured', or what the store got wrong (a stale If-Match accepted, ...); None when not probed."""


class VerifySummary(Summary):
    nodes: list[NodeFacts]
    findings: list[Finding]
    cluster: ClusterFacts
    storage_probe: StorageProbe | None = None
    kubernetes: dict[str, Any] | None = None
    """The Kubernetes half on eks: its findings and a summary of the RayCluster, pods and nodes."""
    forwarded_env: dict[str, bool] = {}
    """runtime_env.forward_env names, each with whether the job saw a value (never the value)."""


# ---- 2 connectivity --------------------------------------------------------------------------


class RankStatus(Summary):
    rank: int
    node_ip: str | None = None
    pid: int | None = None
    started: str | None = None
    joined: str | None = None
    finished: str | None = None


class AllreduceRow(Summary):
    size_bytes: int
    time_ms: float
    algbw_GBps: float
    busbw_GBps: float
    """algbw x 2(n-1)/n: the ring all-reduce's traffic per link (nccl-tests' definition)."""


class FsdpProbe(Summary):
    steps: int
    losses: list[float]


TransportKind = Literal["efa", "socket-fallback", "inconclusive", "gloo"]


class TransportVerdict(Summary):
    kind: TransportKind
    evidence: list[str]
    """The log lines that decided it."""


class ConnectivitySummary(Summary):
    backend: str
    world_size: int
    ranks: list[RankStatus]
    allreduce: list[AllreduceRow]
    fsdp: FsdpProbe
    transport: TransportVerdict


# ---- 3 data ----------------------------------------------------------------------------------


class SourceIdentity(Summary):
    uri: str
    sha256: str
    bytes: int


class Shard(Summary):
    path: str
    rows: int
    sha256: str


class SplitMeta(Summary):
    rows: int
    tokens: int
    shards: list[Shard]


class DropExample(Summary):
    source: str
    row: int
    value: str


class DropCount(Summary):
    count: int
    examples: list[DropExample]


class Contamination(Summary):
    """How much of the eval split repeats the training split (training/contamination.py)."""

    ngram: int
    """Words per n-gram; items shorter than this are compared whole."""
    eval_items: int
    exact_matches: int
    """Eval items whose normalised text (case, whitespace, punctuation) equals a training item's."""
    overlapping: int
    """Eval items that match exactly or share a word n-gram with a training item."""
    fraction: float
    """overlapping / eval_items; the data stage fails above data.max_contamination."""
    overlapping_ids: list[str] = []
    """The first overlapping items as '<source|eval_source>:<row>' (row index in that file)."""


class DatasetManifest(Summary):
    """datasets/<name>/<hash>/manifest.json, written last: the dataset counts only once it exists."""

    name: str
    content_hash: str
    created_at: str
    seed: int
    source: SourceIdentity
    eval_source: SourceIdentity | None = None
    replay: SourceIdentity | None = None
    """data.replay's file: rows of it were added to the training split (settings["replay"] says what share)."""
    tokenizer_sha256: str
    settings: dict[str, Any]
    shape: Literal["columns", "template", "messages"] = "columns"
    """How rows were read (data.shape, auto resolved); manifests from before shapes were columns."""
    template_sha256: str | None = None
    """The template shape's prompt template and response column, hashed; the content hash covers it."""
    loss_on: str | None = None
    """The messages shape: all_assistant or last_assistant."""
    chat_template_sha256: str | None = None
    """The chat template every split's prompts were rendered with (hashing.chat_template_sha256); evaluate
    refuses to score a model whose template differs. None in manifests made before it was recorded."""
    splits: dict[str, SplitMeta]
    dropped: dict[str, DropCount] = {}
    total_rows: int
    dropped_fraction: float
    contamination: Contamination | None = None
    """Overlap of the eval split with the training split; None in manifests made before it was measured."""


class SuiteFile(Summary):
    """One regression suite as the data stage checked it: its file's hash and its overlap with the training split."""

    name: str
    source: str
    sha256: str
    """sha256 of the file's bytes: the evaluate stage's verdicts on the suite name the same hash."""
    items: int
    contamination: Contamination


class DataSummary(Summary):
    dataset_path: str | None = None
    """Storage path datasets/<name>/<hash>; None when the stage failed before writing one."""
    dataset_uri: str | None = None
    content_hash: str | None = None
    cache_hit: bool = False
    manifest: DatasetManifest | None = None
    total_rows: int | None = None
    """Rows read; with `dropped`, the evidence of a data failure that left no manifest."""
    dropped: dict[str, DropCount] = {}
    dropped_fraction: float | None = None
    contamination: Contamination | None = None
    """The eval split's overlap with the training split, kept also when it failed the stage."""
    suites: list[SuiteFile] = []
    """eval.suites, each hashed and checked against the training split (data.max_contamination applies)."""


# ---- 4 finetune ------------------------------------------------------------------------------

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
    """A checkpoint newer than the one a fine-tune resumed from, left out because it failed its check."""

    name: str
    """Its directory name, checkpoint_<step>."""
    step: int
    reason: str
    """What the completion check found (no marker, a file missing, a size or sha256 that differs)."""
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
    """Checkpoints newer than the one this job resumed from that failed their completion check: left out of
    the restore and of Ray Train's checkpoint bookkeeping alike."""
    memory: list[RankMemory] = []
    """Peak memory of every rank of the run's last attempt, by rank."""
    fit_estimate: FitEstimate | None = None
    """What the configuration was estimated to need per GPU before the run, beside `memory`'s measurement."""
    base_model: BaseModelFacts | None = None
    """The base's identity when its directory carries base.json (the pre-trained tiny base); else None."""


# ---- 5 resume --------------------------------------------------------------------------------


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


# ---- 6 evaluate ------------------------------------------------------------------------------

Role = Literal["candidate", "base", "incumbent"]
ROLES: tuple[Role, ...] = ("candidate", "base", "incumbent")
"""The order the gate decision takes the models in."""


class Generations(Summary):
    """One model's answers on one split (the task's, or a suite): how many, and how many the evaluation could
    not score as the model's own answer."""

    answers: int
    cut_off: int
    """Answers that stopped at eval.max_new_tokens without a stop token."""
    empty: int
    """Answers that came back empty (after stripping)."""


class ModelScore(Summary):
    path: str
    metrics: dict[str, float | None]
    seconds: float
    content_sha256: str | None = None
    """What was scored: an export's manifest hash (checked on the loaded copy), a directory's file hash,
    None for a hub id (its revision is in the config)."""
    chat_template_sha256: str | None = None
    """The chat template of the tokenizer the model was prompted with (the self-test holds the candidate's
    and the base's to the data stage's; an incumbent's that differs is logged)."""
    generations: dict[str, Generations] = {}
    """Per split, "task" first, then each suite by name: its cut-off and empty answers. Over
    eval.max_truncated_fraction the evaluation is invalid (eval/selftest.py: every model but the base on the
    task); empty in records made before they were counted."""


GateKind = Literal["min", "min_improvement", "max_regression", "max_regression_vs_base"]
GateOutcome = Literal["pass", "fail", "insufficient"]


class Verdict(Summary):
    """One threshold of one gate, with its human line, e.g.
    'exact_match >= 0.8: 0.98 [0.957, 0.9908] (n=300, Wilson score, 98.33% interval: 95% with Holm over 3, p<0.0001) (pass)'.

    outcome 'insufficient' means the interval straddles the threshold: promotion is refused, but the
    model is not shown to be worse; items_needed says how many items would resolve it."""

    metric: str
    gate: GateKind
    value: float | None
    """What was compared: the candidate's value, its improvement over base, or its regression vs the incumbent."""
    threshold: float
    passed: bool
    line: str
    outcome: GateOutcome | None = None
    """pass / fail / insufficient; None only in records written before intervals."""
    n: int | None = None
    """Items the interval stands on (None: no per-item scores, a point comparison)."""
    method: str | None = None
    """How the interval was made: 'Newcombe paired score', 'Wilson score', 'paired bootstrap', 'point ...'."""
    interval: tuple[float, float] | None = None
    """Lower and upper bound of `value`: a two-sided interval at `level`."""
    level: float | None = None
    """The interval's confidence after Holm's adjustment (eval.confidence when the gate is alone)."""
    p_value: float | None = None
    """One-sided p-value of 'the threshold is not met' (before Holm; Holm decides through `level`)."""
    items_needed: int | None = None
    """With an insufficient outcome: items at the observed disagreement that would resolve it."""
    split_sha256: str | None = None
    """The eval split every score of this verdict came from."""

    def brief(self) -> str:
        """'pass [0.95, 0.99] n=300, Wilson score, p<0.0001, split 05433017fd51', 'FAIL ...', 'insufficient
        evidence [...] n=15, Newcombe paired score, p=0.22, split ... (189 items would resolve it)': what runs diff
        and the tables show of a verdict, with the method, p-value and split it stands on."""
        if self.value is None and self.passed and self.interval is None:
            return "n/a (no incumbent)"
        evidence = self._evidence()
        if self.outcome == "insufficient":
            needed = f"{self.items_needed:,} items would resolve it" if self.items_needed else "no item count would"
            return f"insufficient evidence{evidence} ({needed})"
        return ("pass" if self.passed else "FAIL") + evidence

    def _evidence(self) -> str:
        parts = []
        if self.interval is not None:
            parts.append(f" [{self.interval[0]:.4g}, {self.interval[1]:.4g}] n={self.n}")
            parts += [f", {self.method}"] if self.method else []
            parts += [f", {p_text(self.p_value)}"] if self.p_value is not None else []
        parts += [f", split {self.split_sha256[:12]}"] if self.split_sha256 else []
        return "".join(parts)

    def with_split(self) -> str:
        """The gate line and the split it was decided on: what the model card lists."""
        return f"{self.line} (split `{self.split_sha256[:12]}`)" if self.split_sha256 else self.line


def p_text(p: float) -> str:
    """'p=0.0031', 'p<0.0001', 'p>0.5': a p-value as gate lines print it."""
    if p >= 0.5:
        return "p>0.5" if p >= 1.0 else f"p={p:.2g}"
    return "p<0.0001" if p < 1e-4 else f"p={p:.2g}"


class GateDecision(Summary):
    passed: bool
    lines: list[str]
    verdicts: list[Verdict]

    def failure_cause(self) -> str:
        """'<first failing line> (+N more)': the one-line cause of a refused candidate; failed verdicts
        come before those with insufficient evidence, so the cause names a real failure when there is one."""
        refused = [v for v in self.verdicts if not v.passed]
        refused.sort(key=lambda v: v.outcome == "insufficient")
        return first_and_more([v.line for v in refused])


class Reproduction(Summary):
    """The self-test's check that the base's greedy answers repeat those of its latest earlier evaluation on
    the same split with the same max_new_tokens (eval/reproduce.py)."""

    reference_uri: str
    """evaluations/<split>/base-<content>-tokens<max_new_tokens>.json, now holding this evaluation's answers."""
    earlier_run: str | None = None
    """The run whose answers were compared; None when there was none (this evaluation is the first)."""
    items: int = 0
    """Items both evaluations answered."""
    differing: int = 0
    """Of those, the items answered differently (at most eval.max_irreproducible_fraction, or the
    evaluation is not reproducible)."""


class SuiteScore(Summary):
    """One regression suite (eval.suites): what was scored, each model's metrics on it and the suite's gates."""

    name: str
    source: str
    sha256: str
    """sha256 of the suite file's bytes; every verdict of `gates` names it as its split."""
    items: int
    metrics: dict[Role, dict[str, float] | None]
    """Per model (None: no incumbent), the suite's metrics."""
    gates: GateDecision


class SuiteRow(Summary):
    """One row of the suites x models table: a suite (or the task's own split) and one metric."""

    suite: str
    metric: str
    candidate: float | None
    base: float | None
    incumbent: float | None
    verdict: str
    """Its gates' verdicts in brief ('vs base: pass [..] n=80; vs incumbent: n/a (no incumbent)')."""


class EvaluateSummary(Summary):
    models: dict[Role, ModelScore | None]
    incumbent_version: str | None = None
    gates: GateDecision
    predictions_uri: str | None = None
    item_scores_uri: str | None = None
    """item_scores.json: every item's score per model and metric, the evidence each gate was decided on."""
    examples: int
    device: str | None = None
    eval_split_sha256: str | None = None
    """Hash over the eval split's shards (path and sha256 from the dataset manifest)."""
    metric_sha256: dict[str, str | None] = {}
    """Each metric's module hash (None for a hub metric)."""
    chat_template_sha256: str | None = None
    """The chat template the data stage rendered the eval prompts with (its manifest's); None for a dataset
    prepared before manifests recorded it."""
    base_reproduction: Reproduction | None = None
    """The base's answers against its earlier evaluation; None for a base without a content hash (a hub id)."""
    memory: list[RankMemory] = []
    """Peak memory of the evaluating process (one rank)."""
    suites: list[SuiteScore] = []
    """The regression suites scored beside the task's split, in config order."""

    def suite_rows(self, task: str = "task") -> list[SuiteRow]:
        """The suites x models table: the task's own split first (its gated metrics), then every suite's metrics."""
        rows = [
            _suite_row(task, metric, {r: (m.metrics if m else None) for r, m in self.models.items()}, self.gates)
            for metric in sorted({v.metric for v in self.gates.verdicts})
        ]
        for suite in self.suites:
            metrics = sorted({name for values in suite.metrics.values() if values for name in values})
            rows += [_suite_row(suite.name, metric, suite.metrics, suite.gates) for metric in metrics]
        return rows


GATE_WORDS: dict[GateKind, str] = {
    "min": "min",
    "min_improvement": "gain vs base",
    "max_regression": "vs incumbent",
    "max_regression_vs_base": "vs base",
}


def _suite_row(
    suite: str, metric: str, metrics: Mapping[Role, Mapping[str, float | None] | None], gates: GateDecision
) -> SuiteRow:
    values = {role: (metrics.get(role) or {}).get(metric) for role in ROLES}
    verdicts = "; ".join(f"{GATE_WORDS[v.gate]}: {v.brief()}" for v in gates.verdicts if v.metric == metric)
    return SuiteRow(suite=suite, metric=metric, **values, verdict=verdicts or "not gated")


# ---- 7 promote -------------------------------------------------------------------------------


class Forced(Summary):
    """Who overrode the gates, why, and which checks that bypassed."""

    by: str
    reason: str
    at: str
    bypassed: list[str]


class CopyCheckSummary(Summary):
    """The registry copy, loaded from the registry's own bytes, against the evaluate job's answers on a
    fixed slice of the eval split (eval/copy_check.py): the same scores, or the promotion stops."""

    model_path: str
    """The version's storage path, models/<name>/<version>."""
    content_sha256: str | None = None
    """The loaded copy's content hash (its files checked against its export manifest before loading)."""
    examples: int
    evaluate_scores: dict[str, float]
    """The configured metrics over the evaluate job's candidate answers on the slice."""
    copy_scores: dict[str, float]
    """The same metrics over the copy's answers on the slice."""
    differing: list[int] = []
    """Slice positions whose answer differs from the evaluate job's."""
    passed: bool


class PromoteSummary(Summary):
    promoted: bool
    reasons: list[str] = []
    """Why it was refused (empty when promoted)."""
    name: str | None = None
    version: str | None = None
    path: str | None = None
    run_id: str | None = None
    promoted_at: str | None = None
    previous_version: str | None = None
    content_sha256: str | None = None
    """The promoted model's content hash (its export manifest's), also in the production pointer."""
    forced: Forced | None = None
    copy_check: CopyCheckSummary | None = None
    """The registry copy scored before the pointer moved (None when not run: no evaluation to compare with)."""
