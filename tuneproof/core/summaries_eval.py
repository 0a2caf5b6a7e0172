"""What the evaluate and promote stages prove, as typed data: scores, gate verdicts, suites, the promotion.

eval/evaluate_job.py builds EvaluateSummary (eval/gates.py its GateDecision), eval/copy_check.py
CopyCheckSummary, and the flow's promotion (tasks/promote.py) PromoteSummary; the record, the CLI and
`runs diff` read them. Built on tuneproof/core/summaries.py's Summary: strict, unknown fields are errors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from tuneproof.core.results import FailureClass, first_and_more
from tuneproof.core.summaries import Summary
from tuneproof.core.summaries_training import RankMemory

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
    None for a hub id (see hub_commit)."""
    hub_commit: str | None = None
    """For a model named by hub id (no local files to hash): the hub commit it was loaded at, which
    model.revision (a branch such as 'main' moves) resolved to; None for local files and in older records."""
    chat_template_sha256: str | None = None
    """The chat template of the tokenizer the model was prompted with (the self-test holds the candidate's
    and the base's to the data stage's; an incumbent's that differs is logged)."""
    generations: dict[str, Generations] = {}
    """Per split, "task" first, then each suite by name: its cut-off and empty answers; empty in records made
    before they were counted. Empty answers over eval.max_truncated_fraction make the evaluation invalid. Cut-off
    ones do only when no model, of any role, stopped within that fraction on the split: then the stop tokens end
    no answer there, a fault of the apparatus. Where one did, they are this model's own (a candidate that forgot
    a suite's skill rambles where the base, with the same tokenizer and stop tokens, stops), scored as answered
    and judged by the gates. A budget too small for the answers is caught before any model answers, on the
    references' token lengths (eval/selftest.py; the base is held to neither cap on the task it has not
    learned)."""


GateKind = Literal["min", "min_improvement", "max_regression", "max_regression_vs_base"]


GateOutcome = Literal["pass", "fail", "insufficient"]


GATE_WORDS: dict[GateKind, str] = {
    "min": "min",
    "min_improvement": "gain vs base",
    "max_regression": "vs incumbent",
    "max_regression_vs_base": "vs base",
}


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
        if self.interval is None and self.method:  # a point comparison: no interval, no n
            parts.append(f", {self.method}")
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

    def failure_class(self) -> FailureClass:
        """modeling when a gate failed (its whole interval on the wrong side); data when every refusal is
        insufficient evidence: the items cannot tell, which says nothing about the model, and more eval items
        (the line says how many) are the remedy."""
        refused = [v for v in self.verdicts if not v.passed]
        unsure = refused and all(v.outcome == "insufficient" for v in refused)
        return FailureClass.data if unsure else FailureClass.modeling


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
    """Each metric's module hash: a local module's folder, or the files a hub metric was imported from (None where
    its class has no source file, and for a hub metric in records before this was recorded)."""
    chat_template_sha256: str | None = None
    """The chat template the data stage rendered the eval prompts with (its manifest's); None for a dataset
    prepared before manifests recorded it."""
    base_reproduction: Reproduction | None = None
    """The base's answers against its earlier evaluation; None for a base with neither a content hash nor a hub
    commit."""
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


def _suite_row(
    suite: str, metric: str, metrics: Mapping[Role, Mapping[str, float | None] | None], gates: GateDecision
) -> SuiteRow:
    values = {role: (metrics.get(role) or {}).get(metric) for role in ROLES}
    verdicts = "; ".join(f"{GATE_WORDS[v.gate]}: {v.brief()}" for v in gates.verdicts if v.metric == metric)
    return SuiteRow(suite=suite, metric=metric, **values, verdict=verdicts or "not gated")


class Forced(Summary):
    """Who overrode the gates, why, and which checks that bypassed."""

    by: str
    reason: str
    at: str
    bypassed: list[str]


class ApprovalAnswer(Summary):
    """The approver's answer to the approval form (promote.require_approval): who decided, and why."""

    approve: bool
    by: str
    """The approver as they named themselves in the form (required, approving or refusing)."""
    comment: str = ""
    at: str


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
    approval: ApprovalAnswer | None = None
    """The approver's answer, when promote.require_approval paused for one (approved, or the refusal's)."""
    copy_check: CopyCheckSummary | None = None
    """The registry copy scored before the pointer moved (None when not run: no evaluation to compare with)."""
