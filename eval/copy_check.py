"""The registry copy check: load a promoted version from the registry's own bytes and score it on a fixed
slice of the eval split, against the evaluate job's answers for the same items.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m eval.copy_check   (submitted by tasks/promote.py)

params (CopyCheckParams): model "models/<name>/<version>" (the copy, before the pointer names it) and
the slice: prompts, references and the answers the evaluate job gave to them (the first rows of its
predictions.jsonl). The copy's files are checked against its export manifest on the very files that
load (as evaluate does), its answers are generated with the evaluate job's settings, and the configured
metrics are computed over both sets of answers. Any difference in scores fails the job as an
infrastructure failure: what production would serve is not what was judged.

A job, not a check in the promote task: loading a model is the job side's business (and needs its
libraries and, on EKS, its GPUs); it reuses the evaluate job's loading, generation and scoring.
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict

from eval.generation import generate
from eval.loading import ModelSource, load_for_eval
from eval.metrics_loader import load_metric
from eval.selftest import score
from training import jobkit
from training.jobkit import JobContext, run_stage
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_eval import CopyCheckSummary

ROLE = "registry copy"


class CopyCheckParams(BaseModel):
    """What the promote task passes; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str
    """Storage path of the registry copy, models/<name>/<version>."""
    prompts: list[str]
    references: list[str]
    answers: list[str]
    """The evaluate job's candidate answers to `prompts`, in order."""


def copy_check_body(ctx: JobContext) -> CopyCheckSummary:
    """Load the copy, answer the slice, score both, compare."""
    params = CopyCheckParams.model_validate(ctx.params)
    cfg = ctx.config.eval
    metrics = {name: load_metric(name, cfg.hub_metrics) for name in cfg.metrics}
    source = ModelSource(ROLE, params.model, ctx.storage.uri(params.model), manifest=True)
    model, tokenizer, content = load_for_eval(ctx, source)
    answers = generate(model, tokenizer, params.prompts, cfg.max_new_tokens, cfg.batch_size)
    summary = CopyCheckSummary(
        model_path=params.model,
        content_sha256=content,
        examples=len(params.prompts),
        evaluate_scores=score(metrics, params.answers, params.references, "the evaluate job's answers"),
        copy_scores=score(metrics, answers, params.references, f"{ROLE} {params.model}"),
        differing=[i for i, (a, b) in enumerate(zip(answers, params.answers, strict=True)) if a != b],
        passed=False,
    )
    summary.passed = not score_differences(summary.evaluate_scores, summary.copy_scores)
    jobkit.log(f"copy check: evaluate {summary.evaluate_scores}, copy {summary.copy_scores}")
    if not summary.passed:
        raise StageFailure(FailureClass.infrastructure, copy_check_cause(summary), summary)
    return summary


def score_differences(judged: dict[str, float], copy: dict[str, float]) -> list[str]:
    """'metric: evaluate 0.97, copy 0.12' for each metric whose values differ (pure)."""
    return [
        f"{name}: evaluate {judged.get(name)}, copy {copy.get(name)}"
        for name in sorted({*judged, *copy})
        if name not in judged or name not in copy or not math.isclose(judged[name], copy[name], abs_tol=1e-9)
    ]


def copy_check_cause(summary: CopyCheckSummary) -> str:
    return (
        f"the registry copy {summary.model_path} scores differently from the evaluated export on "
        f"{summary.examples} eval items ({'; '.join(score_differences(summary.evaluate_scores, summary.copy_scores))}; "
        f"{len(summary.differing)} answer(s) differ): production would not serve what was judged"
    )


def main() -> None:
    run_stage(copy_check_body)


if __name__ == "__main__":
    main()
