"""The pipeline's one typed configuration.

Loaded from a YAML profile (configs/local.yaml is the default), overridden with
`--set dotted.key=value`, validated once. Every invalid field is reported at once with
its dotted name and the value seen; unknown keys are errors.

This module runs on both sides (Prefect and inside Ray jobs), so it imports only
pydantic and yaml, which the published Ray image has.
"""

from __future__ import annotations

import re
import reprlib
import string
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from tuneproof.core import config_reads
from tuneproof.core.credentials import credential_problems
from tuneproof.core.files import DuplicateKey, parse_yaml, read_regular
from tuneproof.core.hashing import sha256_json
from tuneproof.core.names import check_slug, check_storage_root

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DIGEST_REF = re.compile(r"@sha256:[0-9a-f]{64}$")
"""The end of an image pinned by digest: a shorter hex string names no image."""
ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
RESERVED_ENV = {"TUNEPROOF_JOB", "TUNEPROOF_FORWARD_ENV_FILE"}
"""Set by the pipeline for every job (tuneproof.core.envelope, tuneproof.core.forward_env)."""
DEFAULT_PROFILE = PROJECT_ROOT / "configs" / "local.yaml"
# Upper bounds: far above any real run, low enough that a typo (an extra digit, a pasted byte count)
# is refused at submission instead of hanging a cluster or allocating the impossible.
MAX_STEPS = 10_000_000
MAX_SEED = 2**32 - 1
"""numpy's seeds are 0..2**32-1; torch's accept less than Python's ints: a negative seed failed the fine-tune."""
MAX_BATCH = 65_536
MAX_SEQ_LEN = 1_048_576
MAX_WORKERS = 4_096
MAX_EXAMPLES = 10_000_000
MAX_TIMEOUT_S = 7 * 24 * 3600
MAX_ITERS = 100_000
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for the watcher that raises preemption notices (train.checkpoint_on_preemption)."""
MAX_LORA_RANK = 4_096
MAX_LORA_ALPHA = 65_536
MAX_MODULE_NAMES = 256


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, assignments re-validate."""

    # allow_inf_nan=False: a NaN or inf threshold, tolerance or rate makes every comparison it enters meaningless.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    # A section dumped whole is read whole (tuneproof.core.config_reads); single reads are noted by
    # _noting_getattribute, installed only while a stage is recorded.
    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        if config_reads.ACTIVE.recorder is not None:
            config_reads.ACTIVE.recorder.note_whole(self)
        return super().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        if config_reads.ACTIVE.recorder is not None:
            config_reads.ACTIVE.recorder.note_whole(self)
        return super().model_dump_json(**kwargs)


def _noting_getattribute(self: Strict, name: str) -> Any:
    value = object.__getattribute__(self, name)
    recorder = config_reads.ACTIVE.recorder
    if recorder is not None and name[0] != "_":
        recorder.note(self, name, value)
    return value


@contextmanager
def reads_recorded(cfg: BaseModel) -> Iterator[set[str]]:
    """The settings of `cfg` read inside the block (this process, any thread), as dotted paths.

    The attribute hook is installed on the config classes only for the block, so code that runs
    unrecorded (a Prefect process, an encoding actor's hot loop) pays nothing for it.
    """
    installed = "__getattribute__" not in Strict.__dict__
    with config_reads.recording(cfg) as reads:
        if installed:
            setattr(Strict, "__getattribute__", _noting_getattribute)  # noqa: B010 - a slot, set for the block
        try:
            yield reads
        finally:
            if installed:
                delattr(Strict, "__getattribute__")


class ClusterExpect(Strict):
    """What the cluster must be running; None means 'not checked'."""

    ray_version: str | None = "2.60.0"
    """Ray version every node must report (exact)."""
    torch_version: str | None = "2.13.0"
    """torch version without the local build tag (2.13.0 matches 2.13.0+cpu and 2.13.0+cu130)."""
    python_version: str | None = None
    """Python major.minor, e.g. '3.13' on the published image."""
    transformers_version: str | None = None
    cuda_version: str | None = None
    """CUDA version torch was built with, e.g. '13.0'; None skips the check."""
    nccl_version: str | None = None
    image: str | None = None
    """Pinned image reference, repository@sha256:... (eks)."""
    gpus_per_worker: int = Field(0, ge=0, le=64)
    """GPUs each training worker node must advertise to Ray (0 on CPU; at most 64)."""
    efa: bool = False
    """Worker nodes must have the EFA device (eks)."""

    @field_validator("image")
    @classmethod
    def _digest_pinned(cls, v: str | None) -> str | None:
        if v is not None and "@sha256:" not in v:
            raise ValueError(f"image must be pinned by digest (repo@sha256:...), got a tag: {v!r}")
        if v is not None and not DIGEST_REF.search(v):
            raise ValueError(f"image digest must be sha256: and 64 lowercase hex digits, got {v.rpartition('@')[2]!r}")
        return v


class KubernetesConfig(Strict):
    """Where the RayCluster lives (eks backend)."""

    namespace: str = "tuneproof"
    raycluster: str = "tuneproof"
    kubeconfig: str | None = None
    """Path to a kubeconfig; None means in-cluster config, then ~/.kube/config."""


class ClusterConfig(Strict):
    backend: Literal["local", "eks"] = "local"
    address: str = "http://127.0.0.1:8265"
    """Ray dashboard (job submission) address."""
    auth_token_file: str | None = ".tuneproof/local/ray_auth_token"
    """File holding the Ray auth token sent with job requests; None sends no token."""
    expect: ClusterExpect = ClusterExpect()
    kubernetes: KubernetesConfig = KubernetesConfig()

    @field_validator("address")
    @classmethod
    def _http(cls, v: str) -> str:
        if not v.startswith(("http://", "https://")):
            raise ValueError(f"address must be the dashboard's http(s) URL, got {v!r}")
        return v.rstrip("/")


class StorageConfig(Strict):
    root: str = ".tuneproof/storage"
    """Local directory or s3://bucket/prefix shared by every node."""
    endpoint_url: str | None = None
    """S3-compatible endpoint (e.g. a local test server); None for AWS S3."""
    shared: bool = True
    """The root is reachable from every node (S3, FSx); a node-local path is only valid on one node."""

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        return check_storage_root("storage root", v)


class ModelConfig(Strict):
    name: str = "dates-qwen2-tiny"
    """Registry name the model is promoted under (models/<name>/)."""
    source: str = ".tuneproof/base-models/tiny-qwen2"
    """Hugging Face hub id, local directory, or s3:// prefix of the base model."""
    revision: str | None = None

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        return check_slug("model name", v)


class FieldMap(Strict):
    """Which source columns hold the conversation parts."""

    prompt: str = "input"
    response: str = "output"
    system: str | None = None


class PromptTemplate(Strict):
    """The prompt of data.shape template: named columns laid into a text, e.g. an instruction and an optional input."""

    prompt: str
    """A format string over column names, e.g. "{instruction}\n\n{input}". A line, or a paragraph (lines
    between blank lines), whose columns are all empty (or null) is left out, so an optional column leaves
    no stray header or blank line behind."""
    response: str = "output"
    """The column holding the response."""

    @field_validator("prompt")
    @classmethod
    def _named_columns(cls, v: str) -> str:
        try:
            names = [name for _, name, _, _ in string.Formatter().parse(v) if name is not None]
        except ValueError as e:
            raise ValueError(
                f"prompt is not a valid format string ({e}); write columns as {{name}}, braces as {{{{ }}}}"
            ) from e
        bad = [n for n in names if not n.isidentifier()]
        if not names or bad:
            raise ValueError("prompt must name at least one column as {column} (plain names, no index or attribute)")
        return v


class ReplayConfig(Strict):
    """Rows of what the base already knows, mixed into the training split so a full fine-tune keeps it."""

    source: str
    """A file of the task's format, shape and fields (local or s3://): its rows join the training split only,
    never the eval split, and it is hashed into the dataset's identity."""
    share: float = Field(gt=0.0, lt=1.0)
    """Fraction of the training split's rows that are replayed rows, >0..<1: the file's rows are repeated
    (whole, then a seeded sample) to reach it, and training shuffles them in with the task's."""


class DataConfig(Strict):
    name: str = "dates"
    """Dataset name: the folder under datasets/ (a slug, see tuneproof.core.names)."""
    source: str = "data/dates/dates.jsonl"
    """JSONL, CSV or parquet file (local or s3://), or hf://<dataset>[:split] where a hub is reachable."""
    format: Literal["auto", "jsonl", "csv", "parquet", "hf"] = "auto"
    """The file format; what the rows hold is `shape`."""
    shape: Literal["auto", "columns", "template", "messages"] = "auto"
    """columns: fields.prompt -> fields.response. template: `template` over named columns. messages: a
    list of {role, content} turns in `messages_column`, rendered with the model's chat template. auto:
    messages when the first row's `messages_column` is a list, else template when `template` is set, else columns."""
    messages_column: str = "messages"
    loss_on: Literal["all_assistant", "last_assistant"] = "all_assistant"
    """messages: which assistant turns the loss covers; evaluation always answers the last one."""
    template: PromptTemplate | None = None
    eval_source: str | None = None
    """Separate held-out file; None splits the source."""
    replay: ReplayConfig | None = None
    """Rows mixed into the training split against forgetting (the bundled demo replays the base's skills)."""
    fields: FieldMap = FieldMap()
    system_prompt: str | None = None
    """Used when fields.system is None; None sends no system turn (the tiny demo model learns the task
    in 400 steps without one, in about 1000 with a constant system prompt)."""
    max_seq_len: int = Field(64, ge=8, le=MAX_SEQ_LEN)
    """Tokens per example, 8..1,048,576."""
    overflow: Literal["drop", "truncate", "pack"] = "drop"
    eval_fraction: float = Field(0.1, gt=0.0, lt=1.0)
    seed: int = Field(0, ge=0, le=MAX_SEED)
    max_dropped_fraction: float = Field(0.05, ge=0.0, le=1.0)
    """Fail the stage as a data failure when more rows than this are malformed."""
    max_contamination: float = Field(0.0, ge=0.0, le=1.0)
    """Largest share of eval items that may repeat the training split (normalised exact match or a shared
    13-word n-gram); above it the data stage fails as a data failure naming the items. 0: none may."""
    shard_rows: int = Field(4096, ge=1, le=MAX_EXAMPLES)

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        return check_slug("dataset name", v)

    @model_validator(mode="after")
    def _template_matches_shape(self) -> DataConfig:
        if self.shape == "template" and self.template is None:
            raise ValueError("template: shape template needs template.prompt (and template.response), got none")
        if self.shape in ("columns", "messages") and self.template is not None:
            raise ValueError(
                f"template is set but shape is {self.shape!r}: set shape to template (or auto), or drop template"
            )
        return self


PEFT_REQUIREMENT = "peft==0.21.2"
"""What a LoRA run's jobs add to their runtime_env: peft is not in the published Ray image (exact pin,
so every node resolves the same version and the record names it)."""
LORA_JOB_MODULES = ("training.finetune", "training.resume")
"""Jobs that build the LoRA model: the fine-tune and the resume test's fine-tune jobs. The others get no
peft (a pip runtime_env costs each job a virtualenv set-up; evaluation loads the merged export)."""
LORA_ADAPTER_DIR = "adapter"
"""Where a LoRA export keeps its peft adapter: a folder inside the merged model's (runs/<run>/model/adapter,
models/<name>/<version>/adapter)."""
QWEN2_LINEAR = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraSettings(Strict):
    """Low-rank adapters (peft LoRA) on the base model's linear layers; read when train.method is lora."""

    rank: int = Field(8, ge=1, le=MAX_LORA_RANK)
    """r: the rank of each adapter's A (r x in) and B (out x r) matrices, 1..4096."""
    alpha: int = Field(16, ge=1, le=MAX_LORA_ALPHA)
    """lora_alpha: the adapter's output is scaled by alpha / rank, 1..65,536."""
    dropout: float = Field(0.05, ge=0.0, lt=1.0)
    """lora_dropout on the adapter's input, finite, [0, 1) (its RNG state is checkpointed, so a resume
    replays it exactly)."""
    target_modules: list[str] = QWEN2_LINEAR
    """Names (last path component) of the linear layers that get adapters: every projection of a Qwen2
    block by default; attention only is q_proj, k_proj, v_proj, o_proj."""
    modules_to_save: list[str] = []
    """Modules trained in full beside the adapters (peft modules_to_save; a name matches every module path
    ending in it, so "norm" is every RMSNorm). A pretrained base needs none. A randomly initialised base
    (the tiny local model) needs ["embed_tokens"]: its frozen tied head (embeddings of norm ~0.16 after an
    RMSNorm) caps every logit near +-1.3, so the loss stalls near 5 whatever the adapters learn. With a tied
    head, naming embed_tokens (or lm_head) trains the one shared weight as both."""

    @field_validator("target_modules")
    @classmethod
    def _named(cls, v: list[str]) -> list[str]:
        if not v or any(not name.strip() for name in v) or len(set(v)) != len(v):
            raise ValueError(f"target_modules must be a non-empty list of distinct module names, got {v!r}")
        return _module_names(v)

    @field_validator("modules_to_save")
    @classmethod
    def _saved_named(cls, v: list[str]) -> list[str]:
        if len(set(v)) != len(v):
            raise ValueError("must list distinct module names")
        return _module_names(v)


MODULE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_.]{0,127}$")


def _module_names(v: list[str]) -> list[str]:
    """At most MAX_MODULE_NAMES names, each a module path component (letters, digits, _ and .)."""
    if len(v) > MAX_MODULE_NAMES:
        raise ValueError(f"{len(v)} module names; at most {MAX_MODULE_NAMES}")
    bad = [name for name in v if not MODULE_NAME.match(name)]
    if bad:
        raise ValueError(
            f"{reprlib.repr(bad)} are not module names (a letter or _, then letters, digits, _ or ., "
            "at most 128 characters)"
        )
    return v


class TrainConfig(Strict):
    method: Literal["full", "lora"] = "full"
    """full: every weight trains. lora: the base is frozen and only low-rank adapters (train.lora) train;
    checkpoints hold the adapters and their optimizer state, the export the adapter and a merged model."""
    lora: LoraSettings = LoraSettings()
    num_workers: int = Field(2, ge=1, le=MAX_WORKERS)
    """Ray Train workers, 1..4096."""
    use_gpu: bool = False
    max_steps: int = Field(400, ge=1, le=MAX_STEPS)
    """Optimizer steps, 1..10,000,000."""
    micro_batch_size: int = Field(32, ge=1, le=MAX_BATCH)
    """Sequences per worker per micro-step, 1..65,536."""
    grad_accum_steps: int = Field(1, ge=1, le=MAX_BATCH)
    lr: float = Field(2e-3, gt=0.0, le=10.0)
    """Peak learning rate, finite, in (0, 10]."""
    warmup_steps: int = Field(20, ge=0, le=MAX_STEPS)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    weight_decay: float = Field(0.0, ge=0.0)
    max_grad_norm: float = Field(1.0, gt=0.0)
    activation_checkpointing: bool = False
    compile: bool = False
    """torch.compile each decoder layer (training.step.compile_layers). Off by default: on CPU compiling
    costs more than it saves at these sizes; on GPU bench/gpu_check.py measures what it gains."""
    sharding: Literal["full", "hybrid", "ddp"] = "full"
    """How parameters, gradients and optimizer state spread over the workers. full: sharded over all
    of them (FSDP2, least memory). hybrid: sharded within a group of shard_group_size workers and
    replicated across groups (HSDP: all-gathers stay on a node's NVLink, only the gradient
    all-reduce crosses nodes). ddp: replicated on every worker, gradients all-reduced (most memory,
    fewest collectives). A checkpoint saved under one resumes under any other (DCP reshards)."""
    shard_group_size: int | None = Field(None, ge=1)
    """Workers per shard group under hybrid sharding; ignored otherwise. None: the workers on one
    node (Ray Train's local world size), which is the GPUs per node with one GPU per worker; on a
    single CPU machine that makes hybrid the same as full, so give it (e.g. 2 of 4 workers) there."""
    checkpoint_every: int = Field(100, ge=1, le=MAX_STEPS)
    num_to_keep: int = Field(3, ge=1, le=1000)
    max_failures: int = Field(0, ge=0, le=100)
    checkpoint_on_preemption: bool = False
    """On Ray's preemption notice (a node of the worker group drained with a deadline, as a spot reclaim
    is), save a checkpoint at once instead of losing the steps since the last one (training.preemption).
    The step loop asks Ray every 5th step (a barrier across the workers). Off locally: one machine is not
    preempted; on in the EKS profile, whose nodes may be spot."""
    seed: int = Field(0, ge=0, le=MAX_SEED)
    log_every: int = Field(10, ge=1, le=MAX_STEPS)
    divergence_loss: float = Field(50.0, gt=0.0)
    """A loss above this (or NaN/inf) stops training as a modeling failure."""
    continue_previous: bool = False
    """A fine-tune rerun (`--only finetune` on an existing run) trains a fresh Ray Train run named
    <run>-r<invocation> from the base model. true: continue the latest fine-tune's Ray Train run instead
    (resume its last checkpoint and train on to max_steps); refused when it is already at max_steps."""

    @model_validator(mode="after")
    def _shard_groups_tile_the_workers(self) -> TrainConfig:
        group, workers = self.shard_group_size, self.num_workers
        if self.sharding == "hybrid" and group is not None and workers % group:
            raise ValueError(
                f"hybrid sharding needs shard_group_size to divide num_workers, "
                f"got shard_group_size={group} and num_workers={workers}"
            )
        return self


class ConnectivityConfig(Strict):
    sizes_bytes: list[int] = [1 << 10, 1 << 14, 1 << 18, 1 << 20, 1 << 22]
    """All-reduce message sizes, each 4 bytes..16 GiB."""
    iters: int = Field(5, ge=1, le=MAX_ITERS)
    warmup_iters: int = Field(2, ge=0, le=MAX_ITERS)
    fsdp_steps: int = Field(3, ge=1, le=MAX_ITERS)
    expect_transport: Literal["any", "gloo", "efa"] = "any"
    """'efa' fails the stage on socket fallback or inconclusive NCCL logs."""

    @field_validator("sizes_bytes")
    @classmethod
    def _positive(cls, v: list[int]) -> list[int]:
        if not v or any(s < 4 or s > 1 << 34 for s in v):
            raise ValueError(f"sizes_bytes must be non-empty, each 4 bytes..16 GiB (17179869184), got {v!r}")
        return sorted(v)


class ResumeConfig(Strict):
    enabled: bool = True
    extra_steps: int = Field(4, ge=1, le=MAX_ITERS)
    """How far past the final checkpoint the interrupted continuation runs before it is stopped."""
    replay_steps: int = Field(5, ge=1, le=MAX_ITERS)
    loss_rtol: float = Field(0.0, ge=0.0, le=1.0)
    """Allowed relative loss difference on replay, finite, 0..1: 0 on CPU fp32; e.g. 0.02 on GPU bf16."""


class Gate(Strict):
    """Thresholds on one metric; eval/gates.py turns each set one into a pass/fail line."""

    min: float | None = None
    """Absolute threshold the candidate must reach (a maximum when higher_is_better is false)."""
    min_improvement: float | None = None
    """Candidate minus base must be at least this (base minus candidate when lower is better)."""
    max_regression: float | None = None
    """Incumbent minus candidate may be at most this; checked only when an incumbent exists."""
    max_regression_vs_base: float | None = None
    """Base minus candidate may be at most this: non-inferiority against the base (a regression suite's gate)."""
    higher_is_better: bool = True
    """False for losses and perplexity: every comparison flips."""

    @model_validator(mode="after")
    def _some_threshold(self) -> Gate:
        if all(v is None for v in (self.min, self.min_improvement, self.max_regression, self.max_regression_vs_base)):
            raise ValueError(
                "a gate needs at least one of min, min_improvement, max_regression, max_regression_vs_base (got none)"
            )
        return self


class SuiteConfig(Strict):
    """A "must not regress" suite: JSONL items {"input", "output"} (an "id" optional), each asked as one user
    turn with no system prompt. Candidate, base and incumbent answer every item; each metric gets a
    non-inferiority gate against the base and against the incumbent with this suite's margin."""

    source: str
    """The JSONL file: a path (relative to the project root) or s3:// URI. Hashed, scored and checked
    against the training split for overlap."""
    metrics: list[str] = ["exact_match"]
    """Item-scored metrics (local `evaluate` modules), as eval.metrics."""
    margin: float = Field(0.1, gt=0.0, lt=1.0)
    """How far the candidate may fall below the base and the incumbent on this suite, >0..<1: the gate passes
    when the interval's lower bound of candidate - other stays above -margin."""

    @field_validator("metrics")
    @classmethod
    def _some_metric(cls, v: list[str]) -> list[str]:
        if not v:
            raise ValueError("a suite needs at least one metric (got [])")
        return v

    def gates(self) -> dict[str, Gate]:
        """The suite's gates: each metric may regress by at most `margin` against base and incumbent."""
        return {m: Gate(max_regression_vs_base=self.margin, max_regression=self.margin) for m in self.metrics}


class EvalConfig(Strict):
    metrics: list[str] = ["exact_match"]
    """Metric names resolved first under eval/metrics/, then by evaluate.load only when hub_metrics is true."""
    hub_metrics: bool = False
    """Allow metrics that are not under eval/metrics/ to load from the Hugging Face hub (needs network on the cluster)."""
    max_new_tokens: int = Field(16, ge=1, le=MAX_SEQ_LEN)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    max_examples: int = Field(300, ge=1, le=MAX_EXAMPLES)
    """Eval examples scored, 1..10,000,000."""
    predictions_cap: int = Field(200, ge=0, le=MAX_EXAMPLES)
    gates: dict[str, Gate] = {"exact_match": Gate(min=0.8, min_improvement=0.5, max_regression=0.02)}
    """At least one gate: with none, every candidate would pass and promotion would judge nothing."""
    max_truncated_fraction: float = Field(0.02, ge=0.0, le=1.0)
    """Largest share of a model's answers on a split that may stop at max_new_tokens without a stop token, and
    (separately) that may come back empty; above it the answers cannot be scored as the model's, and the
    evaluation is invalid (infrastructure), not a gate failure. Holds the candidate and the incumbent on every
    split and the base on the suites, not the base on the task it has not learned (eval/selftest.py)."""
    max_irreproducible_fraction: float = Field(0.02, ge=0.0, le=1.0)
    """Largest share of the items a base model evaluated before on the same split (same content, same
    max_new_tokens) may answer differently now; above it greedy decoding did not repeat itself and the
    evaluation is not reproducible (infrastructure). Not 0: across batch sizes and devices greedy answers
    can flip on near-ties."""
    confidence: float = Field(0.95, ge=0.5, lt=1.0)
    """Confidence of each gate's two-sided interval, 0.5..<1 (Holm-adjusted across the gates): a gate passes
    when the interval's lower bound reaches its threshold, so a model exactly at the threshold passes at
    most (1 - confidence) / 2 of the time."""
    suites: dict[str, SuiteConfig] = {}
    """Regression suites by name (a slug), scored beside the task's own eval split: each is its own gate
    family (Holm within the suite), and any suite's failed or unresolved gate refuses the candidate."""

    @field_validator("gates")
    @classmethod
    def _some_gate(cls, v: dict[str, Gate]) -> dict[str, Gate]:
        if not v:
            raise ValueError("eval.gates is empty: promotion would judge nothing; configure at least one gate")
        return v

    @field_validator("suites")
    @classmethod
    def _suite_names(cls, v: dict[str, SuiteConfig]) -> dict[str, SuiteConfig]:
        for name in v:
            check_slug("suite name", name)
        return v


class PromoteConfig(Strict):
    require_approval: bool = False
    approval_timeout_s: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)


class CostConfig(Strict):
    """What compute costs, for the cost and goodput reports (tuneproof.control.cost)."""

    prices: dict[str, float] = {}
    """Price per resource-hour by Ray resource name ({"CPU": 0.04, "GPU": 2.5}); empty: seconds only."""

    @field_validator("prices")
    @classmethod
    def _non_negative(cls, v: dict[str, float]) -> dict[str, float]:
        bad = {k: p for k, p in v.items() if p < 0}
        if bad:
            raise ValueError(f"a price per resource-hour is 0 or more, got {bad}")
        return v


class Timeouts(Strict):
    """Seconds per stage, 1..604,800 (a week)."""

    verify: int = Field(300, ge=1, le=MAX_TIMEOUT_S)
    connectivity: int = Field(600, ge=1, le=MAX_TIMEOUT_S)
    data: int = Field(600, ge=1, le=MAX_TIMEOUT_S)
    finetune: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)
    resume: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    evaluate: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    promote: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    """Bounds the copy check's Ray job (the registry copy loaded and scored before the pointer moves)."""


class RuntimeEnvSettings(Strict):
    """What the user adds to every job's runtime_env. What a job was submitted with (these plus the method's
    packages, forwarded variables by name only) is the record's RuntimeEnvAdditions."""

    pip: list[str] = []
    env_vars: dict[str, str] = {}
    """Plain settings only: they are recorded, published and logged by Ray. Credentials are refused here."""
    forward_env: list[str] = []
    """Environment variables passed to every job by name: values from the submitting environment (local)
    or a Kubernetes Secret on the Ray pods (EKS), never in the config, the record or Ray's runtime_env."""

    @field_validator("forward_env")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        bad = [n for n in v if not ENV_NAME.match(n) or n in RESERVED_ENV]
        if bad:
            raise ValueError(
                f"forward_env takes environment variable names ([A-Za-z_][A-Za-z0-9_]*, not {sorted(RESERVED_ENV)}), "
                f"got {bad!r}"
            )
        return list(dict.fromkeys(v))

    @model_validator(mode="after")
    def _not_both(self) -> RuntimeEnvSettings:
        both = sorted(set(self.forward_env) & set(self.env_vars))
        if both:
            raise ValueError(f"forward_env and env_vars both set {both}: a variable is either forwarded or given")
        return self


class PipelineConfig(Strict):
    """Everything one pipeline run needs; the Prefect flow's parameter."""

    # A refused credential must not come back in an error's text (Prefect logs parameter errors).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    profile: str = "local"
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    connectivity: ConnectivityConfig = ConnectivityConfig()
    resume: ResumeConfig = ResumeConfig()
    eval: EvalConfig = EvalConfig()
    promote: PromoteConfig = PromoteConfig()
    timeouts: Timeouts = Timeouts()
    runtime_env: RuntimeEnvSettings = RuntimeEnvSettings()
    cost: CostConfig = CostConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        # The same check as validate()'s, for configs that arrive another way (a Prefect deployment's parameter).
        problems = credential_problems(data)
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @model_validator(mode="after")
    def _cross_field(self) -> PipelineConfig:
        if self.cluster.backend == "eks" and self.cluster.expect.image is None:
            raise ValueError("cluster.expect.image: the eks backend needs the image pinned by digest, got None")
        if self.cluster.backend == "eks" and not self.storage.root.startswith(("s3://", "/")):
            raise ValueError(
                f"storage.root: the eks backend needs s3:// or a shared mount's absolute path, got {self.storage.root!r}"
            )
        if self.cluster.backend == "eks" and self.train.num_workers > 1 and not self.storage.shared:
            raise ValueError(
                "storage.shared: more than one node needs shared storage (S3 or FSx), got a node-local root"
            )
        other_peft = [r for r in self.runtime_env.pip if _requirement_name(r) == "peft" and r != PEFT_REQUIREMENT]
        if self.train.method == "lora" and other_peft:
            raise ValueError(
                f"runtime_env.pip: train.method lora adds {PEFT_REQUIREMENT} (the version the fine-tune is tested "
                f"with), got another peft requirement {other_peft[0]!r}: remove it"
            )
        if self.train.checkpoint_on_preemption and self.runtime_env.env_vars.get(PREEMPTION_WATCHER) == "0":
            raise ValueError(
                f"train.checkpoint_on_preemption: runtime_env.env_vars turns Ray Train's preemption watcher off "
                f'({PREEMPTION_WATCHER}: "0"), so no notice would come: remove that variable, or leave '
                "checkpoint_on_preemption false"
            )
        if (
            self.resume.enabled
            and self.train.checkpoint_every + self.resume.extra_steps + self.resume.replay_steps > self.train.max_steps
        ):
            raise ValueError(
                "resume: the resume test needs a checkpoint followed by resume.extra_steps + resume.replay_steps "
                f"steps of the main run, got checkpoint_every={self.train.checkpoint_every} + "
                f"{self.resume.extra_steps} + {self.resume.replay_steps} > train.max_steps={self.train.max_steps}"
            )
        return self

    def job_pip(self, module: str | None = None) -> list[str]:
        """The pip requirements a job running `module` gets through its runtime_env (and its record entry
        shows): runtime_env.pip, plus peft for a LoRA run's fine-tune jobs. module None: what the run adds
        to any of its jobs (the record's run-level identity)."""
        needs_peft = self.train.method == "lora" and (module is None or module in LORA_JOB_MODULES)
        if needs_peft and PEFT_REQUIREMENT not in self.runtime_env.pip:
            return [*self.runtime_env.pip, PEFT_REQUIREMENT]
        return list(self.runtime_env.pip)

    def config_hash(self) -> str:
        return sha256_json(self.model_dump(mode="json"))

    def resolved(self, base: Path | None = None) -> PipelineConfig:
        """Copy with relative local paths made absolute against `base` (the project root)."""
        base = base or PROJECT_ROOT
        data = self.model_dump(mode="json")
        for dotted in ("storage.root", "model.source", "data.source", "data.eval_source", "cluster.auth_token_file"):
            section, key = dotted.split(".")
            value = data[section][key]
            if not value or not _is_relative_local_path(value):
                continue
            if dotted == "model.source" and not _names_a_local_model(value, base):
                continue  # a hub id ("Qwen/Qwen2.5-1.5B"): the jobs load it from the hub, not from base/Qwen/...
            data[section][key] = str((base / value).resolve())
        for nested in [*data["eval"]["suites"].values(), *([data["data"]["replay"]] if data["data"]["replay"] else [])]:
            if _is_relative_local_path(nested["source"]):
                nested["source"] = str((base / nested["source"]).resolve())
        return PipelineConfig.model_validate(data)


class ConfigError(ValueError):
    """Invalid configuration; `problems` holds one 'dotted.name: message (got value)' per error."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


def _requirement_name(requirement: str) -> str:
    """'peft==0.21.2' -> 'peft', 'PEFT[extra]>=1' -> 'peft'. Pure."""
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].strip().lower().replace("_", "-")
    return requirement.strip().lower().replace("_", "-")


def _is_relative_local_path(value: str) -> bool:
    return "://" not in value and not value.startswith("/") and (value.startswith(".") or "/" in value)


def _names_a_local_model(value: str, base: Path) -> bool:
    """model.source "org/name" is a hub id unless it starts with "." or is a directory under base: the
    rule from_pretrained applies (a directory first, else a repo id), decided here because the jobs
    receive the resolved value and cannot tell a path made absolute from one the user gave."""
    if value.startswith("."):
        return True
    try:
        return (base / value).is_dir()
    except OSError:  # a name no file system holds (too long): not a directory here, so not a local model
        return False


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a','b','c'], value parsed as a YAML scalar/collection)."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected dotted.key=value"])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError([f"--set {item!r}: empty key segment in {key!r}"])
    try:
        value = parse_yaml(raw) if raw != "" else ""
    except DuplicateKey as e:
        raise ConfigError([f"--set {item!r}: {e}"]) from None
    except yaml.YAMLError:
        value = raw
    return parts, value


def apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def validate(data: dict) -> PipelineConfig:
    """Validate a raw mapping, reporting every problem at once."""
    secrets = credential_problems(data)
    if secrets:
        raise ConfigError(secrets)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from None


def format_errors(e: ValidationError) -> list[str]:
    problems = []
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        value = err.get("input")
        if err["type"] == "string_type" and isinstance(value, (dict, list)):
            # `--set key={a}` or `key=[a]`: YAML read braces or brackets as a collection, not text.
            kind = "mapping" if isinstance(value, dict) else "list"
            msg = f"expected text, got a YAML {kind}; quote it (e.g. --set '{loc}=\"...\"')"
        if not loc:  # cross-field checks name their fields in the message itself
            problems.append(msg)
            continue
        got = _short_repr(value)
        # Validators that name the value themselves (slugs, storage roots) need no second copy of it.
        problems.append(f"{loc}: {msg}" if got in msg else f"{loc}: {msg} (got {got})")
    return problems


def _short_repr(value: Any) -> str:
    """repr cut to a line: a pasted file or an alias-expanded YAML value must not flood the terminal."""
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlevel = 120, 120, 2
    text = r.repr(value)
    return text if len(text) <= 200 else text[:199] + "…"


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), resolve: bool = True) -> PipelineConfig:
    """Read a YAML profile, apply --set overrides, validate, resolve relative paths."""
    path = Path(path) if path else DEFAULT_PROFILE
    try:
        data = parse_yaml(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8")) or {}
    except FileNotFoundError:
        raise ConfigError([f"--config: file not found (got {str(path)!r})"]) from None
    except IsADirectoryError:
        raise ConfigError([f"--config {path}: is a directory; give a YAML file such as configs/local.yaml"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"--config {path}: not UTF-8 text (byte {e.start}); save it as UTF-8 YAML"]) from None
    except OSError as e:
        raise ConfigError([f"--config {path}: cannot be read: {e.strerror or e}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"--config {path}: not valid YAML: {' '.join(str(e).split())}"]) from None
    except RecursionError:
        raise ConfigError([f"--config {path}: nested too deeply to be a config"]) from None
    if _nesting(data, MAX_CONFIG_DEPTH, {}) > MAX_CONFIG_DEPTH:
        # Checked, not left to the parser's RecursionError: that depends on the process's recursion limit.
        raise ConfigError([f"--config {path}: nested too deeply to be a config (over {MAX_CONFIG_DEPTH} levels)"])
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: top level must be a mapping (got {type(data).__name__})"])
    for item in overrides:
        parts, value = parse_override(item)
        apply_override(data, parts, value)
    cfg = validate(data)
    return cfg.resolved(_base_dir(path)) if resolve else cfg


MAX_CONFIG_BYTES = 1 << 20
"""A profile is a few kilobytes; a larger file is not one (and a device would never end)."""
MAX_CONFIG_DEPTH = 32
"""A profile is a handful of levels deep (eval.gates.<metric>.min); anything past this is not a config."""


def _nesting(value: Any, budget: int, memo: dict[int, int]) -> int:
    """Levels of mappings and lists in a parsed YAML value, counted only to budget + 1 (pure).

    The budget bounds the recursion; the memo visits a node that YAML aliases share only once, so an
    alias bomb costs its node count, not its expansion.
    """
    if not isinstance(value, (dict, list)):
        return 0
    if id(value) in memo:
        return memo[id(value)]
    if budget <= 0:
        return 1
    children = value.values() if isinstance(value, dict) else value
    height = 1 + max((_nesting(child, budget - 1, memo) for child in children), default=0)
    memo[id(value)] = height
    return height


def _base_dir(profile: Path) -> Path:
    """Relative paths in a profile under configs/ are relative to the project root."""
    profile = profile.resolve()
    return profile.parent.parent if profile.parent.name == "configs" else Path.cwd()
