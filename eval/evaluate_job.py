"""The evaluate stage: the candidate against its base and the production incumbent, then the gate decision.

    TUNEPROOF_JOB=<jobkit.encode_job(...)> python -m eval.evaluate_job   (submitted by tasks/ as a Ray job)

params (EvalParams): candidate "runs/<run>/model" (storage-relative HF export), dataset
"datasets/<name>/<hash>", and incumbent {version, path}: the production model the submitting task read
from the registry when it built the job (None before the first promotion).
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
a suite's failed or unresolved gate fails the stage as a modeling failure whose cause names the suite.

Before any model verdict the evaluation tests itself, and a failed self-test ends the stage as
"evaluation invalid: ..." in the infrastructure class (exit 4: the measuring apparatus failed, not the
model), never as a gate failure: every local metric must score the references, put through the same
post-processing, at its maximum (1) on every item; the candidate's and the base's tokenizer must carry the
chat template the data stage rendered the eval prompts with (the dataset manifest's chat_template_sha256);
every gated value the metric modules report must be a number (not missing, NaN or infinite), each item's in
[0, 1], for every model;
no more than eval.max_truncated_fraction of a model's answers on a split may stop at eval.max_new_tokens
without a stop token, nor come back empty (eval/selftest.py: counted per model and split, kept in the
summary; the base is not held to it on the task it has not learned); and the base's answers must repeat
those of its latest earlier evaluation on the same split (eval/reproduce.py), else "evaluation not
reproducible: ...", also infrastructure.

Every verdict names what it judged: each model's content hash (candidate and incumbent checked
against their export manifest on the copy that is loaded; the base hashed when it is a directory),
the eval split's hash (over its shards' sha256) and each metric module's hash.
"""

from __future__ import annotations

import gc
import json
import math
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from eval.gates import Scores, decide
from eval.generation import eval_loss, generate_checked, pad_token_id, pick_device
from eval.metrics_loader import load_metric
from eval.reproduce import base_reproduction
from eval.selftest import TASK, count_lines, generation_problem, generations
from eval.suites import Suite, chat_prompts, overall, read_suite, suite_score
from training import jobkit
from training.checkpoint_listing import check_complete
from training.data_files import read_manifest
from training.jobkit import JobContext, run_stage
from training.modeling import load_model, load_tokenizer, materialize, special_token_finder
from training.train_data import read_split
from tuneproof.core import markers
from tuneproof.core.hashing import chat_template_sha256
from tuneproof.core.metric_names import LOSS_METRICS, resolve_metric
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.summaries_eval import ROLES, EvaluateSummary, GateDecision, Generations, ModelScore

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from tuneproof.core.storage import Storage

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


@dataclass(frozen=True)
class EvalSet:
    prompts: list[str]
    references: list[str]
    input_ids: list[list[int]]
    labels: list[list[int]]
    chat_template_sha256: str | None
    """The template the data stage rendered the prompts with (its manifest's); None for an older manifest."""


@dataclass(frozen=True)
class ModelSource:
    role: str
    path: str
    """As recorded: storage-relative for candidate and incumbent, config.model.source for base."""
    uri: str
    """What from_pretrained loads (after materialize): a local dir, hub id or s3:// prefix."""
    revision: str | None = None
    manifest: bool = False
    """True for an export (candidate, incumbent): its files must match its tuneproof-export.json."""


@dataclass
class ModelEval:
    answers: list[str]
    metrics: dict[str, float]
    items: dict[str, list[float]]
    """Each item's score, for the metrics whose value is the mean of its items' scores."""
    seconds: float
    content_sha256: str | None
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
    check_references({n: m for n, m in metrics.items() if metric_module_hash(n, cfg.hub_metrics)}, data.references)
    suites = [
        read_suite(name, suite, ctx.config.storage.endpoint_url).with_metrics(load_metric)
        for name, suite in cfg.suites.items()
    ]
    for suite in suites:
        check_references(suite.metrics, suite.references)
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
        "metric_sha256": {name: metric_module_hash(name, cfg.hub_metrics) for name in cfg.metrics},
        "chat_template_sha256": data.chat_template_sha256,
    }
    base = results["base"]  # first: a scorer that does not repeat itself (sampling on) also runs answers long
    reproduction = base_reproduction(ctx.storage, ctx.run_id, split, base.content_sha256, base.answers, cfg)
    counts = {role: r.generations for role, r in results.items()}
    for line in count_lines(counts):
        jobkit.log(line)
    if problem := generation_problem(counts, cfg.max_new_tokens, cfg.max_truncated_fraction):
        undecided = GateDecision(passed=False, lines=[f"not decided: evaluation invalid: {problem}"], verdicts=[])
        raise invalid(problem, EvaluateSummary(**evidence, gates=undecided))
    incumbent = results["incumbent"].scores() if "incumbent" in results else None
    decision = decide(
        results["candidate"].scores(), results["base"].scores(), incumbent, cfg.gates, cfg.confidence, split
    )
    scored = [suite_score(s, {role: r.suites[s.name] for role, r in results.items()}, cfg.confidence) for s in suites]
    for line in overall(decision, scored).lines:
        jobkit.log(f"gate: {line}")
    from training.memory import rank_memory

    summary = EvaluateSummary(
        **evidence,
        gates=decision,
        memory=[rank_memory(0, pick_device()[0])],  # one process evaluates
        base_reproduction=reproduction,
        suites=scored,
    )
    verdict = overall(decision, scored)
    if not verdict.passed:
        raise StageFailure(verdict.failure_class(), verdict.failure_cause(), summary)
    return summary


def read_eval_set(ctx: JobContext, dataset: str) -> EvalSet:
    """The eval split's first config.eval.max_examples rows (the split order is the data stage's, seeded)."""
    table = read_split(ctx.storage, dataset, "eval")
    table = table.slice(0, ctx.config.eval.max_examples)
    missing = [c for c in ("prompt", "reference", "input_ids", "labels") if c not in table.column_names]
    if missing:
        raise ValueError(f"eval split of {dataset} lacks columns {missing}; has {table.column_names}")
    if table.num_rows == 0:
        raise StageFailure(
            FailureClass.data, f"eval split of {ctx.storage.uri(dataset)} has no rows: nothing to evaluate on"
        )
    cols: dict[str, list[Any]] = {}
    for name in ("prompt", "reference", "input_ids", "labels"):
        cols[name] = table.column(name).to_pylist()
        if None in cols[name]:  # the data stage writes no nulls: such a split was written by something else
            raise ValueError(f"eval split of {dataset}: column {name} has null rows; expected none")
    template = read_manifest(ctx.storage, dataset).chat_template_sha256
    if template is None:
        jobkit.log(
            f"self-test: {dataset}'s manifest records no chat template (older data stage): templates not checked"
        )
    return EvalSet(cols["prompt"], cols["reference"], cols["input_ids"], cols["labels"], template)


def eval_split_hash(ctx: JobContext, dataset: str) -> str:
    """One hash over the eval split's shards (their sha256 from the manifest; read_split checked each)."""
    shards = read_manifest(ctx.storage, dataset).splits["eval"].shards
    return markers.hash_of_hashes({shard.path: shard.sha256 for shard in shards})


def metric_module_hash(name: str, allow_hub: bool) -> str | None:
    """The content hash of a local metric module's files; None for a hub metric (its script is not ours)."""
    where = Path(resolve_metric(name, allow_hub))
    if not where.is_dir():
        return None
    return markers.content_sha256(markers.local_digests(where))


def model_hash(storage: Storage, source: ModelSource, local: Path) -> str | None:
    """The content hash of the model files that load from `local`: an export's manifest hash, after checking
    every file of the loaded copy against it; a plain directory's hash over its files; None for a hub id."""
    if source.manifest and (local / markers.EXPORT_MANIFEST).exists():
        try:
            return markers.verify_export(storage, source.path, local_dir=local).content_sha256
        except markers.ExportUnverified as e:
            raise StageFailure(FailureClass.infrastructure, f"{source.role} model: {e}") from None
    if source.role == "candidate":
        raise StageFailure(
            FailureClass.infrastructure,
            f"candidate export {storage.uri(source.path)} has no {markers.EXPORT_MANIFEST}: re-run finetune",
        )
    return markers.content_sha256(markers.local_digests(local)) if local.is_dir() else None


def require_complete_export(ctx: JobContext, candidate: str) -> None:
    """Only a finished export counts: its completion marker lists every file with its size."""
    problem = check_complete(ctx.storage, candidate)
    if problem:
        raise StageFailure(FailureClass.infrastructure, f"candidate export is not complete: {problem}")


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
    template = check_template(source.role, tokenizer, data.chat_template_sha256)
    jobkit.log(
        f"{source.role}: {source.path} (content {str(content)[:12]}, chat template {str(template)[:12]}) "
        f"on {model.device} ({model.dtype})"
    )
    answers, cut = generate_checked(
        model,
        tokenizer,
        data.prompts,
        cfg.max_new_tokens,
        cfg.batch_size,
        on_batch=lambda n: counter.advance(n, source.role),
    )
    values = score(metrics, answers, data.references)
    items = item_scores(metrics, answers, data.references, values)
    if problem := unscored(values, items, cfg.gates):
        raise invalid(f"{source.role} on the eval split: {problem}")
    values.update(eval_loss(model, data.input_ids, data.labels, cfg.batch_size, pad_token_id(tokenizer)))
    answered = {s.name: answer_suite(ctx, model, tokenizer, s, source.role, counter) for s in suites}
    del model, tokenizer
    _free_memory()
    jobkit.log(f"{source.role}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    counts = {TASK: generations(answers, cut), **{name: seen for name, (_, seen) in answered.items()}}
    seconds = round(time.monotonic() - started, 2)
    suite_scores = {name: scores for name, (scores, _) in answered.items()}
    return ModelEval(answers, values, items, seconds, content, template, suite_scores, counts)


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
    values = score(suite.metrics, answers, suite.references)
    items = item_scores(suite.metrics, answers, suite.references, values)
    if problem := unscored(values, items, suite.config.metrics):
        raise invalid(f"{role} on suite {suite.name}: {problem}")
    jobkit.log(f"{role} on suite {suite.name}: " + ", ".join(f"{k}={v:.4g}" for k, v in values.items()))
    return Scores(values, items), generations(answers, cut)


def load_for_eval(ctx: JobContext, source: ModelSource) -> tuple[PreTrainedModel, PreTrainedTokenizerBase, str | None]:
    """Model in eval mode on the device, its own tokenizer (the base model's when it ships none), and the
    content hash of the files it loaded from (checked before loading, on the very copy that loads)."""
    endpoint = ctx.config.storage.endpoint_url
    device, dtype = pick_device()
    ref = materialize(source.uri, endpoint)  # loads from the very copy that is hashed below
    local = Path(ref)
    content = model_hash(ctx.storage, source, local)
    model = load_model(ref, source.revision, endpoint, dtype=dtype)
    # ignore: transformers wraps PreTrainedModel.to with functools.wraps, which mypy reads as unbound (device as self).
    model.to(device).eval()  # type: ignore[arg-type]
    has_tokenizer = not local.is_dir() or (local / "tokenizer_config.json").exists()
    base = ctx.config.model
    tokenizer = (
        load_tokenizer(ref, source.revision, endpoint)
        if has_tokenizer
        else load_tokenizer(base.source, base.revision, endpoint)
    )
    return model, tokenizer, content


def score(metrics: dict, answers: list[str], references: list[str]) -> dict[str, float]:
    """Every numeric value each metric module reports, by its own key."""
    values: dict[str, float] = {}
    for metric in metrics.values():
        for key, value in metric.compute(predictions=answers, references=references).items():
            if isinstance(value, (int, float)):
                values[key] = float(value)
    return values


def unscored(values: dict[str, float], items: dict[str, list[float]], gated: Iterable[str]) -> str | None:
    """Why the metric modules gave no usable number for a gated value (none reported, NaN, infinite, or an item
    scored outside [0, 1]), or None.

    The scorer failed there, not the model: a gate reading it would fail the model (a modeling failure, the
    wrong class) or, worse, pass it; the gates' intervals read a score in [0, 1] per item. eval_loss and
    perplexity are computed from the model itself, and are not asked here: their NaN is a diverged model's,
    which their gates judge."""
    for name in gated:
        if name in LOSS_METRICS:
            continue
        value = values.get(name)
        if value is None:
            have = ", ".join(sorted(values)) or "nothing"
            return f"the metrics report no {name} (they report {have}): a gate on it cannot judge any model"
        if not math.isfinite(value):
            return f"{name} is {value}: the metric module computed no number, so its gates cannot judge the model"
        if off := [(i, v) for i, v in enumerate(items.get(name, [])) if not 0.0 <= v <= 1.0]:
            i, v = off[0]
            return (
                f"{name} scores {len(off)} items outside [0, 1] (first: item {i}, {v:.4g}): the gates' intervals read "
                "a score in [0, 1] per item"
            )
    return None


def item_scores(
    metrics: dict, answers: list[str], references: list[str], totals: dict[str, float]
) -> dict[str, list[float]]:
    """Each item's score under each metric, by the metric module's own computation on that one item.

    Kept only for a key whose item scores average to the value the metric reported over the whole set:
    a corpus-level metric (BLEU-like) is not a mean over items, so its gates compare points instead.
    `_compute` is the method every `evaluate` module implements; calling it per item skips the public
    compute's per-call Arrow cache (17 ms an item, 15 s for 300 items and three models on the demo).
    """
    items: dict[str, list[float]] = {}
    for metric in metrics.values():
        try:
            per_item = [metric._compute(predictions=[a], references=[r]) for a, r in zip(answers, references)]
        except Exception as e:  # a hub metric that cannot score one item alone: its gates compare points
            jobkit.log(f"{metric.name}: no per-item scores ({type(e).__name__}: {e}); its gates compare points")
            continue
        for key in (k for k in (per_item[0] if per_item else {}) if k in totals):
            values = [float(row[key]) for row in per_item]
            if math.isclose(sum(values) / len(values), totals[key], abs_tol=1e-9):
                items[key] = values
    return items


def invalid(cause: str, summary: EvaluateSummary | None = None) -> StageFailure:
    """A failed self-test: the evaluation cannot judge any model, so it is not a modeling failure."""
    return StageFailure(FailureClass.infrastructure, f"evaluation invalid: {cause}", summary)


def check_references(metrics: dict, references: list[str]) -> None:
    """Each local metric (scores in [0, 1]) must tell a right answer from a wrong one, or its scores judge no model.

    Right: the references, as answers, score 1 on every item; a post-processing or extraction step that
    changes a correct answer would score correct models down, and a score above 1 is another scale than the
    [0, 1] the gates' intervals assume. Wrong: each item answered with the next item's reference (the
    references rotated by one) must score below 1 wherever that is another text, on at least one item; a
    metric that gives full credit to every wrong answer (an extraction that finds nothing in either text and
    compares two empty strings) would pass every model.
    """
    totals = score(metrics, references, references)
    for key, values in item_scores(metrics, references, references, totals).items():
        if above := [i for i, v in enumerate(values) if v > 1.0 + 1e-9]:
            raise invalid(
                f"{key} scores the references as answers {totals[key]:.4g}, above 1 on {len(above)} of {len(values)} "
                "items: the gates' intervals read a score in [0, 1] per item, 1 for a right answer; scale the metric"
            )
        wrong = [i for i, v in enumerate(values) if v < 1.0 - 1e-9]
        if wrong:
            first = wrong[0]
            raise invalid(
                f"{key} scores the references as answers {totals[key]:.4g}, below 1 on {len(wrong)} of "
                f"{len(values)} items (first: item {first}, reference {references[first][:80]!r} scores "
                f"{values[first]:.4g}): the metric's post-processing changes a correct answer"
            )
    others = references[1:] + references[:1]
    differ = [i for i, (other, own) in enumerate(zip(others, references)) if other.strip() != own.strip()]
    if not differ:
        return
    wrong_totals = score(metrics, others, references)
    items = item_scores(metrics, others, references, wrong_totals)
    for key, total in wrong_totals.items():
        per_item = items.get(key)  # None for a corpus-level key: then its total must be below 1
        if all(per_item[i] >= 1.0 - 1e-9 for i in differ) if per_item is not None else total >= 1.0 - 1e-9:
            first = differ[0]
            raise invalid(
                f"{key} gives full credit to wrong answers: each item answered with the next item's reference "
                f"scores 1 on all {len(differ)} items where that is another text (first: item {first}, reference "
                f"{references[first][:80]!r}, answer {others[first][:80]!r}): the metric cannot tell a right "
                "answer from a wrong one"
            )


def check_template(role: str, tokenizer: PreTrainedTokenizerBase, rendered_with: str | None) -> str | None:
    """The hash of the chat template `role`'s tokenizer lays prompts out with. The eval prompts are the data
    stage's renderings: the candidate's and the base's template must be the one they were rendered with,
    else the model is scored on prompts laid out for another template and the evaluation is invalid. An
    incumbent's may differ (it was trained before a change of base model): logged, not refused."""
    mine = chat_template_sha256(getattr(tokenizer, "chat_template", None))
    if rendered_with is None or mine == rendered_with:
        return mine
    what = (
        f"the {role} model's chat template (sha256 {mine}) is not the one the data stage rendered the eval "
        f"prompts with (sha256 {rendered_with}, in the dataset manifest)"
    )
    if role == "incumbent":
        jobkit.log(f"note: {what}: the incumbent answers prompts laid out for another template")
        return mine
    raise invalid(f"{what}: prepare the data with the tokenizer the model is evaluated with (re-run data)")


def save_item_scores(ctx: JobContext, split: str, results: dict[str, ModelEval]) -> str:
    """{"split_sha256", "scores": {role: {metric: [one score per item]}}, "suites": {suite: {role: {metric:
    [...]}}}}: what the gates were decided on."""
    suites = {name: {role: dict(r.suites[name].items) for role, r in results.items()} for name in _suite_names(results)}
    body = {
        "split_sha256": split,
        "scores": {role: result.items for role, result in results.items()},
        "suites": suites,
    }
    parts = ctx.stage_parts("item_scores.json")
    ctx.storage.write_bytes(json.dumps(body).encode(), *parts)
    return ctx.storage.uri(*parts)


def _suite_names(results: dict[str, ModelEval]) -> list[str]:
    return list(next(iter(results.values())).suites) if results else []


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
