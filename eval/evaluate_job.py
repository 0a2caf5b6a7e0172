"""The evaluate stage: the candidate against its base and the production incumbent, then the gate decision.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m eval.evaluate_job   (submitted by tasks/ as a Ray job)

params (EvalParams): candidate "runs/<run>/model" (storage-relative HF export), dataset
"datasets/<name>/<hash>", incumbent {version, path}: the production model the submitting task read
from the registry when it built the job (None before the first promotion), and suites: the regression suites
as the data stage measured them (DataSummary.suites: each file's sha256 and its overlap with the training split).
Each model in turn, one in memory at a time: greedy answers to the eval split's prompts, the
configured `evaluate` metrics over them, eval loss and perplexity over input_ids/labels.
Per-example answers go to runs/<run>/stages/<job>/predictions.jsonl, and every item's score per model
and metric to item_scores.json beside it: the gates are decided on those per-item scores, paired by item
(eval/gates.py), so a verdict replays from that file. A failed gate fails the stage as a modeling failure
whose summary still carries every number and gate line; gates the items cannot resolve (insufficient
evidence), with none failed, fail it as a data failure: the eval items cannot tell, which is no verdict on
the model.

Beside the task's split, each regression suite of eval.suites (eval/suites.py) is asked of the same loaded
model, item by item, and decided with the same gates against base and incumbent, one Holm family per suite;
a suite's failed gate fails the stage as a modeling failure whose cause names the suite (unresolved gates alone, as
a data failure, like the task's: GateDecision.failure_class). A suite
whose file no longer hashes as the data stage measured it, or that the data stage never measured (added to
eval.suites since), fails the stage as a data failure before any model loads, naming the suite, both hashes and
the remedy (eval/suites.py `unmeasured`): its contamination check stands behind no other bytes.

Before any model verdict the evaluation tests itself, and a failed self-test ends the stage as
"evaluation invalid: ..." in the infrastructure class (exit 4: the measuring apparatus failed, not the
model), never as a gate failure: every metric that scores items one at a time, local or hub, must score the
references, put through the same post-processing, at its maximum (1) on every item, score an answer that shares
nothing with the reference (the empty answer; every character replaced) at most eval/selftest.py's WRONG_FLOOR on
every item (the gates read 0 as the worst), and give full credit to no wrong answer (the next item's reference on
every item; the reference with one character changed, cut short, its words reversed, followed by another item's
reference, or in swapped case where the metric does not declare case meaningless, on more than WRONG_CREDIT_SHARE
of them); a local metric must score each item alone, its value the mean of its items' (its gates are decided on
them; only a hub metric, maybe corpus-level, falls back to comparing points, and is then not self-tested); the candidate's and the base's tokenizer must encode the eval prompts to the ids the data stage
wrote (checked on the split's own prompts) and carry the chat template it rendered the eval prompts with (its
chat_template_sha256); every gated value the metric modules report must be a number (not
missing, NaN or infinite), each item's in [0, 1] and a fraction's (exact_match, accuracy, rouge_l) too, for
every model;
before any model answers, no more than eval.max_truncated_fraction of a split's references (the task's, each
suite's) may need more than eval.max_new_tokens tokens with the stop token (the budget, not a model, would cut
right answers off); after, a split on which a model is cut off at eval.max_new_tokens over that fraction is
invalid only when no model stopped within it there (the stop tokens end no answer; where one did, the others'
cut-off answers are their own, scored as answered and judged by the gates), and no more than that fraction of a
model's answers on a split may come back empty (eval/selftest.py: counted per model and split, kept in the
summary; the base is not held to either on the task it has not learned); and the base's answers must repeat
those of its latest earlier evaluation on the same split (eval/reproduce.py), else "evaluation not
reproducible: ...", also infrastructure.

Every verdict names what it judged: each model's content hash (candidate and incumbent checked
against their export manifest on the copy that is loaded; the base hashed when it is a directory, and named by the
hub commit it resolved to when it is a hub id), the eval split's hash (over its shards' sha256) and each metric
module's hash (a local module's folder; for a hub metric, the files evaluate.load imported it from). The answers are
greedy under the evaluation's own settings: a model's generation_config.json is ignored (eval/generation.py).
"""

from __future__ import annotations

import gc
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from eval.gates import Scores, decide
from eval.generation import eval_loss, generate_checked, pad_token_id, pick_device
from eval.loading import (
    ModelSource,
    check_template,
    check_tokenizer,
    hub_commit,
    load_for_eval,
    require_complete_export,
)
from eval.metrics_loader import load_metric, loaded_module_files
from eval.reproduce import HUB_COMMIT, base_reproduction
from eval.selftest import (
    TASK,
    check_references,
    count_lines,
    generation_problem,
    generations,
    invalid,
    item_scores,
    score,
    unfitting_references,
    unscored,
)
from eval.suites import Suite, chat_prompts, overall, read_suite, suite_score, unmeasured
from training import jobkit
from training.data_files import read_manifest
from training.jobkit import JobContext, run_stage
from training.modeling import load_tokenizer, special_token_finder
from training.train_data import read_split
from tuneproof.core import markers
from tuneproof.core.metric_names import resolve_metric
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_data import SuiteFile
from tuneproof.core.summaries_eval import ROLES, EvaluateSummary, GateDecision, Generations, ModelScore

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

STAGE = "evaluate"


class Incumbent(BaseModel):
    """The production model at the time the job was built: its registry version and storage path."""

    version: str
    path: str


class EvalParams(BaseModel):
    """What the submitting task passes; unknown keys are errors."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    candidate: str
    """Storage path of the candidate's Hugging Face export, runs/<run>/model."""
    dataset: str
    """Storage path of the prepared dataset, datasets/<name>/<hash>."""
    incumbent: Incumbent | None = None
    suites: list[SuiteFile] = []
    """Each regression suite as the data stage measured it (the data stage's DataSummary.suites); a configured
    suite missing here was never checked against the training split, and is refused (eval/suites.py unmeasured)."""


@dataclass(frozen=True)
class EvalSet:
    prompts: list[str]
    references: list[str]
    input_ids: list[list[int]]
    labels: list[list[int]]
    chat_template_sha256: str | None
    """The template the data stage rendered the prompts with (its manifest's); None for an older manifest."""


@dataclass
class ModelEval:
    answers: list[str]
    metrics: dict[str, float]
    items: dict[str, list[float]]
    """Each item's score, for the metrics whose value is the mean of its items' scores."""
    seconds: float
    content_sha256: str | None
    hub_commit: str | None
    """The hub commit a model named by hub id loaded at (it has no local files to hash); None otherwise."""
    chat_template_sha256: str | None
    suites: dict[str, Scores]
    """Each regression suite's metrics and item scores (eval.suites), by suite name."""
    generations: dict[str, Generations]
    """Cut-off and empty answers on the task's split (selftest.TASK) and on each suite."""

    def scores(self) -> Scores:
        return Scores(self.metrics, self.items)


def evaluate_body(ctx: JobContext) -> EvaluateSummary:
    """The stage's story: data, models, answers and metrics per model, predictions, gates."""
    cfg = ctx.config.eval
    params = EvalParams.model_validate(ctx.params)
    data = read_eval_set(ctx, params.dataset)
    require_complete_export(ctx, params.candidate)
    sources = model_sources(ctx, params)
    metrics = {name: load_metric(name, cfg.hub_metrics) for name in cfg.metrics}
    hub = [name for name in metrics if not is_local(name, cfg.hub_metrics)]
    check_references(metrics, data.references, hub)
    suites = [
        read_suite(name, suite, ctx.config.storage.endpoint_url).with_metrics(load_metric)
        for name, suite in cfg.suites.items()
    ]
    if problem := unmeasured(suites, params.suites, ctx.run_id):
        raise StageFailure(FailureClass.data, problem)
    for suite in suites:
        check_references(suite.metrics, suite.references)
    check_references_fit(ctx, data, suites)
    counter = _Progress(total=len(sources) * (len(data.prompts) + sum(len(s.ids) for s in suites)))
    results = {s.role: evaluate_model(ctx, s, data, metrics, counter, suites) for s in sources}
    split = eval_split_hash(ctx, params.dataset)
    predictions_uri = save_predictions(ctx, data, results)
    item_scores_uri = save_item_scores(ctx, split, results)
    evidence = {
        "models": {role: _model_summary(sources, results, role) for role in ROLES},
        "incumbent_version": params.incumbent.version if params.incumbent else None,
        "predictions_uri": predictions_uri,
        "item_scores_uri": item_scores_uri,
        "examples": len(data.prompts),
        "device": str(pick_device()[0]),
        "eval_split_sha256": split,
        "metric_sha256": {name: metric_module_hash(name, cfg.hub_metrics, metrics[name]) for name in cfg.metrics},
        "chat_template_sha256": data.chat_template_sha256,
    }
    base = results["base"]  # first: a scorer that does not repeat itself (sampling on) also runs answers long
    identity = base.content_sha256 or (f"{HUB_COMMIT}{base.hub_commit}" if base.hub_commit else None)
    reproduction = base_reproduction(ctx.storage, ctx.run_id, split, identity, base.answers, cfg)
    counts = {role: r.generations for role, r in results.items()}
    for line in count_lines(counts, cfg.max_truncated_fraction):
        jobkit.log(line)
    if problem := generation_problem(counts, cfg.max_new_tokens, cfg.max_truncated_fraction):
        undecided = GateDecision(passed=False, lines=[f"not decided: evaluation invalid: {problem}"], verdicts=[])
        raise invalid(problem, EvaluateSummary(**evidence, gates=undecided))
    incumbent = results["incumbent"].scores() if "incumbent" in results else None
    decision = decide(
        results["candidate"].scores(), results["base"].scores(), incumbent, cfg.gates, cfg.confidence, split
    )
    scored = [suite_score(s, {role: r.suites[s.name] for role, r in results.items()}, cfg.confidence) for s in suites]
    verdict = overall(decision, scored)
    for line in verdict.lines:
        jobkit.log(f"gate: {line}")
    from training.memory import rank_memory

    summary = EvaluateSummary(
        **evidence,
        gates=decision,
        memory=[rank_memory(0, pick_device()[0])],  # one process evaluates
        base_reproduction=reproduction,
        suites=scored,
    )
    if not verdict.passed:
        raise StageFailure(verdict.failure_class(), verdict.failure_cause(), summary)
    return summary


def check_references_fit(ctx: JobContext, data: EvalSet, suites: list[Suite]) -> None:
    """Before any model answers: invalid when over eval.max_truncated_fraction of a split's references cannot be
    answered within eval.max_new_tokens with the stop token (eval/selftest.py unfitting_references). Counted with
    the base's tokenizer, which the data stage tokenized with and the candidate's must equal (eval/loading.py
    check_tokenizer)."""
    cfg, model = ctx.config.eval, ctx.config.model
    tokenizer = load_tokenizer(model.source, model.revision, ctx.config.storage.endpoint_url)

    def lengths(references: list[str]) -> list[int]:
        return [len(ids) for ids in tokenizer(references, add_special_tokens=False)["input_ids"]]

    splits = {TASK: lengths(data.references), **{s.name: lengths(s.references) for s in suites}}
    if problem := unfitting_references(splits, cfg.max_new_tokens, cfg.max_truncated_fraction):
        raise invalid(problem)


def read_eval_set(ctx: JobContext, dataset: str) -> EvalSet:
    """The eval split's first config.eval.max_examples rows (the split order is the data stage's, seeded)."""
    table = read_split(ctx.storage, dataset, "eval")
    table = table.slice(0, ctx.config.eval.max_examples)
    if table.num_rows == 0:
        raise StageFailure(
            FailureClass.data, f"eval split of {ctx.storage.uri(dataset)} has no rows: nothing to evaluate on"
        )
    cols: dict[str, list[Any]] = {}
    for name in ("prompt", "reference", "input_ids", "labels"):
        cols[name] = table.column(name).to_pylist()
        # read with the data schema, a shard without the column reads as nulls; the data stage writes none
        if None in cols[name]:
            raise ValueError(f"eval split of {dataset}: column {name} has null rows; expected none")
    manifest = read_manifest(ctx.storage, dataset)
    template = manifest.chat_template_sha256
    if template is None:
        jobkit.log(
            f"self-test: {dataset}'s manifest records no chat template (older data stage): templates not checked"
        )
    ids = cols["input_ids"], cols["labels"]
    return EvalSet(cols["prompt"], cols["reference"], *ids, template)


def eval_split_hash(ctx: JobContext, dataset: str) -> str:
    """One hash over the eval split's shards (their sha256 from the manifest; read_split checked each)."""
    shards = read_manifest(ctx.storage, dataset).splits["eval"].shards
    return markers.hash_of_hashes({shard.path: shard.sha256 for shard in shards})


def metric_module_hash(name: str, allow_hub: bool, metric: Any) -> str | None:
    """The content hash of the files that scored: a local module's folder (eval/metrics/<name>); for a hub metric
    (whose script moves with the hub), the Python files evaluate.load imported `metric` from; None where its class
    has no source file."""
    if is_local(name, allow_hub):
        return markers.content_sha256(markers.local_digests(Path(resolve_metric(name, allow_hub))))
    loaded = loaded_module_files(metric)
    if loaded is None:
        return None
    folder, names = loaded
    return markers.content_sha256(markers.local_digests(folder, names))


def is_local(name: str, allow_hub: bool) -> bool:
    """Whether metric `name` loads from a module of ours (eval/metrics/), not from the hub."""
    return Path(resolve_metric(name, allow_hub)).is_dir()


def model_sources(ctx: JobContext, params: EvalParams) -> list[ModelSource]:
    storage, model_cfg = ctx.storage, ctx.config.model
    sources = [
        ModelSource("candidate", params.candidate, storage.uri(params.candidate), manifest=True),
        ModelSource("base", model_cfg.source, model_cfg.source, model_cfg.revision),
    ]
    if params.incumbent:
        path = params.incumbent.path
        sources.append(ModelSource("incumbent", path, storage.uri(path), manifest=True))
    return sources


def evaluate_model(
    ctx: JobContext, source: ModelSource, data: EvalSet, metrics: dict, counter: _Progress, suites: list[Suite]
) -> ModelEval:
    cfg = ctx.config.eval
    started = time.monotonic()
    model, tokenizer, content = load_for_eval(ctx, source)
    commit = None if content else hub_commit(model)
    template = check_template(source.role, tokenizer, data.chat_template_sha256)
    same_ids = check_tokenizer(source.role, tokenizer, data.prompts, data.input_ids, cfg.gates)
    named = f"content {content[:12]}" if content else f"hub commit {str(commit)[:12]}"
    jobkit.log(
        f"{source.role}: {source.path} ({named}, chat template {str(template)[:12]}) on {model.device} ({model.dtype})"
    )
    answers, cut = generate_checked(
        model,
        tokenizer,
        data.prompts,
        cfg.max_new_tokens,
        cfg.batch_size,
        on_batch=lambda n: counter.advance(n, source.role),
    )
    where = f"{source.role} on the eval split"
    values = score(metrics, answers, data.references, where)
    hub = [name for name in metrics if not is_local(name, cfg.hub_metrics)]
    items = item_scores(metrics, answers, data.references, values, where, hub)
    if problem := unscored(values, items, cfg.gates):
        raise invalid(f"{where}: {problem}")
    if same_ids:  # over another tokenizer's ids a loss means nothing (check_tokenizer)
        values.update(eval_loss(model, data.input_ids, data.labels, cfg.batch_size, pad_token_id(tokenizer)))
    answered = {s.name: answer_suite(ctx, model, tokenizer, s, source.role, counter) for s in suites}
    del model, tokenizer
    _free_memory()
    jobkit.log(f"{source.role}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    counts = {TASK: generations(answers, cut), **{name: seen for name, (_, seen) in answered.items()}}
    seconds = round(time.monotonic() - started, 2)
    suite_scores = {name: scores for name, (scores, _) in answered.items()}
    return ModelEval(answers, values, items, seconds, content, commit, template, suite_scores, counts)


def answer_suite(
    ctx: JobContext,
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    suite: Suite,
    role: str,
    counter: _Progress,
) -> tuple[Scores, Generations]:
    """One model's greedy answers to a regression suite, scored item by item with the suite's metrics, and
    its cut-off and empty answers."""
    cfg = ctx.config.eval
    if problem := suite.special_token(special_token_finder(tokenizer)):
        raise StageFailure(FailureClass.data, problem)
    answers, cut = generate_checked(
        model,
        tokenizer,
        chat_prompts(tokenizer, suite.inputs),
        cfg.max_new_tokens,
        cfg.batch_size,
        on_batch=lambda n: counter.advance(n, role),
    )
    where = f"{role} on suite {suite.name}"
    values = score(suite.metrics, answers, suite.references, where)
    items = item_scores(suite.metrics, answers, suite.references, values, where)
    if problem := unscored(values, items, suite.config.metrics):
        raise invalid(f"{where}: {problem}")
    jobkit.log(f"{role} on suite {suite.name}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    return Scores(values, items), generations(answers, cut)


def save_item_scores(ctx: JobContext, split: str, results: dict[str, ModelEval]) -> str:
    """{"split_sha256", "scores": {role: {metric: [one score per item]}}, "suites": {suite: {role: {metric:
    [...]}}}}: what the gates were decided on."""
    suites = {
        name: {role: dict(r.suites[name].items) for role, r in results.items()} for name in results["base"].suites
    }
    body = {
        "split_sha256": split,
        "scores": {role: result.items for role, result in results.items()},
        "suites": suites,
    }
    parts = ctx.stage_parts("item_scores.json")
    ctx.storage.write_bytes(json.dumps(body).encode(), *parts)
    return ctx.storage.uri(*parts)


def save_predictions(ctx: JobContext, data: EvalSet, results: dict[str, ModelEval]) -> str:
    """The first predictions_cap examples with every model's answer, as JSON lines; returns the URI."""
    cap = min(ctx.config.eval.predictions_cap, len(data.prompts))
    lines = []
    for i in range(cap):
        row: dict[str, str | None] = {"prompt": data.prompts[i], "reference": data.references[i]}
        row.update({role: (results[role].answers[i] if role in results else None) for role in ROLES})
        lines.append(json.dumps(row, ensure_ascii=False))
    parts = ctx.stage_parts("predictions.jsonl")
    ctx.storage.write_bytes(("\n".join(lines) + "\n" if lines else "").encode(), *parts)
    return ctx.storage.uri(*parts)


def _model_summary(sources: list[ModelSource], results: dict[str, ModelEval], role: str) -> ModelScore | None:
    if role not in results:
        return None
    path = next(s.path for s in sources if s.role == role)
    result = results[role]
    return ModelScore(
        path=path,
        metrics=result.metrics,
        seconds=result.seconds,
        content_sha256=result.content_sha256,
        hub_commit=result.hub_commit,
        chat_template_sha256=result.chat_template_sha256,
        generations=result.generations,
    )


def _free_memory() -> None:
    """Return a dropped model's memory before the next one loads: one model in memory at a time."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


class _Progress:
    """Examples answered across all models, as jobkit progress lines."""

    def __init__(self, total: int):
        self.done, self.total = 0, total

    def advance(self, n: int, role: str) -> None:
        self.done += n
        jobkit.progress(STAGE, self.done, self.total, model=role)


def main() -> None:
    run_stage(evaluate_body)


if __name__ == "__main__":
    main()
