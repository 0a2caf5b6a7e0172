"""The `eval` and `promote` sections of the config: metrics, gates, regression suites, approval.

EvalConfig (with Gate and SuiteConfig) is read by the evaluate job (eval/evaluate_job.py) and the gates
(eval/gates.py); PromoteConfig by the promotion in the flow. Runs on both sides (Prefect and inside Ray jobs): it imports only pydantic and the core, which the published
Ray image has.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import AfterValidator, Field, field_validator, model_validator

from tuneproof.core.config_base import MAX_BATCH, MAX_EXAMPLES, MAX_SEQ_LEN, MAX_TIMEOUT_S, Strict
from tuneproof.core.names import check_slug

COPY_CHECK_EXAMPLES = 32
"""Saved answers that promotion's copy check (eval/copy_check.py) asks the registry's copy again before the
pointer moves: enough for a corrupted or wrong model to score differently, few enough to cost seconds."""


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


def _each_once(names: list[str]) -> list[str]:
    # A metric listed twice is scored once (metrics load by name): the record would say what did not happen.
    twice = sorted({name for name in names if names.count(name) > 1})
    if twice:
        raise ValueError(f"list each metric once (more than once: {', '.join(twice)})")
    return names


MetricNames = Annotated[list[str], AfterValidator(_each_once)]


class SuiteConfig(Strict):
    """A "must not regress" suite: JSONL items {"input", "output"} (an "id" optional), each asked as one user
    turn with no system prompt. Candidate, base and incumbent answer every item; each metric gets a
    non-inferiority gate against the base and against the incumbent with this suite's margin."""

    source: str
    """The JSONL file: a path (relative to the project root) or s3:// URI. Hashed, scored and checked
    against the training split for overlap."""
    metrics: MetricNames = ["exact_match"]
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
    metrics: MetricNames = ["exact_match"]
    """Metric names resolved first under eval/metrics/, then by evaluate.load only when hub_metrics is true."""
    hub_metrics: bool = False
    """Allow metrics that are not under eval/metrics/ to load from the Hugging Face hub (needs network on the cluster)."""
    max_new_tokens: int = Field(16, ge=1, le=MAX_SEQ_LEN)
    batch_size: int = Field(64, ge=1, le=MAX_BATCH)
    max_examples: int = Field(300, ge=1, le=MAX_EXAMPLES)
    """Eval examples scored, 1..10,000,000."""
    predictions_cap: int = Field(200, ge=COPY_CHECK_EXAMPLES, le=MAX_EXAMPLES)
    """Eval items whose prompt, reference and every model's answer are saved (predictions.jsonl), at least
    COPY_CHECK_EXAMPLES: promotion re-scores the first of them from the registry's copy, and 0 skipped that check."""
    gates: dict[str, Gate] = {"exact_match": Gate(min=0.8, min_improvement=0.5, max_regression=0.02)}
    """At least one gate: with none, every candidate would pass and promotion would judge nothing."""
    max_truncated_fraction: float = Field(0.02, ge=0.0, le=1.0)
    """Largest share of a split's references that may not fit in max_new_tokens with the stop token (checked before
    any model answers), of a model's answers that may come back empty, and of its answers that may stop at
    max_new_tokens without a stop token where no model on the split stopped within it; above it the evaluation is
    invalid (infrastructure), not a gate failure. Cut-off answers on a split where another model stopped are the
    model's own and scored as given. Holds the candidate and the incumbent on every split and the base on the
    suites, not the base on the task it has not learned (eval/selftest.py)."""
    max_irreproducible_fraction: float = Field(0.02, ge=0.0, le=1.0)
    """Largest share of the items a base model evaluated before on the same split (same content, same
    max_new_tokens) may answer differently now; above it greedy decoding did not repeat itself and the
    evaluation is not reproducible (infrastructure). Not 0: across batch sizes and devices greedy answers
    can flip on near-ties."""
    confidence: float = Field(0.95, ge=0.5, lt=1.0)
    """Confidence of each gate's two-sided interval, 0.5..<1 (Holm-adjusted across the gates): a gate passes
    when the interval's lower bound reaches its threshold, so a model exactly at the threshold passes
    approximately (1 - confidence) / 2 of the time (score intervals; exceeded at very small n: no gate passes on
    fewer than 5 items, nor a bootstrap on fewer than 20)."""
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
