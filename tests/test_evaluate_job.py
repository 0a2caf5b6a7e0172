"""The evaluate stage end to end on a tiny Qwen2 and a tiny prepared dataset built here; plus generation checks.

The candidate is the base model trained for a few dozen steps to always answer "2024-01-05", so
it scores 1.0 where the untrained base scores 0: the gates have something real to decide.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from eval import evaluate_job, generation
from eval.evaluate_job import evaluate_body
from eval.generation import eval_loss, generate, right_padded
from eval.metrics_loader import case_insensitive, load_metric
from eval.selftest import check_references, item_scores, score, unscored
from eval.suites import read_suite
from tests.conftest import TEST_BUCKET, run_job_module
from tests.reading import present, production_pointer
from training import jobkit, modeling
from training.data_prep import tokenizer_sha256
from training.hf_export import publish_export
from training.jobkit import JobContext
from tuneproof.app.tiny_model import CHAT_TEMPLATE, build_tiny_model, conversation_text
from tuneproof.control import registry
from tuneproof.core import markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ENV_VAR, PROGRESS_PREFIX
from tuneproof.core.hashing import chat_template_sha256
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import Contamination, SuiteFile
from tuneproof.core.summaries_eval import EvaluateSummary

ANSWER = "2024-01-05"
PROMPTS = [f"date {'x' * (i % 5)} {i}" for i in range(36)]
DATASET = "datasets/dates/0123abcd"
GATES = {"exact_match": {"min": 0.8, "min_improvement": 0.5, "max_regression": 0.02}}
TEMPLATE_SHA = chat_template_sha256(CHAT_TEMPLATE)
"""The tiny model's chat template, which rendered the eval rows (chat_prompt)."""


def chat_prompt(tokenizer, text: str) -> str:
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )


def encode(tokenizer, text: str, answer: str) -> dict:
    """One eval row as the data stage writes it: prompt, reference, input_ids, labels (-100 on the prompt)."""
    prompt = chat_prompt(tokenizer, text)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    return {
        "prompt": prompt,
        "reference": answer,
        "input_ids": prompt_ids + answer_ids,
        "labels": [-100] * len(prompt_ids) + answer_ids,
    }


def write_dataset(storage: Storage, rows: list[dict], tokenizer_sha: str) -> None:
    """The eval split as the data stage writes it: checksummed parquet shards, manifest.json last, naming the
    tokenizer that tokenized the rows (tokenizer_sha, data_prep.tokenizer_sha256) and its chat template."""
    from tests.datasets import write_prepared
    from training.data_files import Example

    examples = {"eval": [Example(**row) for row in rows]}
    manifest = write_prepared(storage, DATASET, "dates", examples, chat_template_sha256=TEMPLATE_SHA)
    storage.write_json(
        manifest.model_copy(update={"tokenizer_sha256": tokenizer_sha}).to_json(), DATASET, "manifest.json"
    )


def train_constant_answer(base: Path, rows: list[dict], out: Path, steps: int = 60) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    ids, labels, mask = right_padded(
        [r["input_ids"] for r in rows], [r["labels"] for r in rows], tokenizer.pad_token_id
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(steps):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


RAMBLE = "2024-05" + "-" * 24
"""What the rambler answers, never ending its turn: like the forgetting demo's candidate on `add 3 and 4`
('2024-05---------'), longer than max_new_tokens=16, so it is cut off with text (not an empty answer)."""


@pytest.fixture(scope="module")
def rambler(world) -> Path:
    """The base trained to answer RAMBLE with no stop token after it (its labels end before the eos)."""
    tokenizer = world["tokenizer"]
    rows = []
    for text in PROMPTS:
        prompt_ids = tokenizer(chat_prompt(tokenizer, text), add_special_tokens=False)["input_ids"]
        answer_ids = tokenizer(RAMBLE, add_special_tokens=False)["input_ids"]
        rows.append({"input_ids": prompt_ids + answer_ids, "labels": [-100] * len(prompt_ids) + answer_ids})
    return train_constant_answer(world["base"], rows, world["root"] / "rambler")


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("evaluate")
    corpus = [conversation_text(None, p, ANSWER) for p in PROMPTS]
    base = build_tiny_model(root / "base", corpus, hidden=32, layers=2, vocab_size=300)
    tokenizer = AutoTokenizer.from_pretrained(base)
    rows = [encode(tokenizer, p, ANSWER) for p in PROMPTS]
    trained = train_constant_answer(base, rows, root / "trained")
    tokenizer_sha = tokenizer_sha256(tokenizer)  # the rows' tokenizer, as the data stage hashes it
    return {
        "root": root,
        "base": base,
        "rows": rows,
        "trained": trained,
        "tokenizer": tokenizer,
        "tokenizer_sha256": tokenizer_sha,
    }


def make_ctx(
    world, run_id: str, storage_root: str, endpoint: str | None = None, base: Path | None = None, **eval_overrides
) -> JobContext:
    """The job as tasks/ submits it; `base` replaces the tiny random base (config.model.source)."""
    cfg = PipelineConfig.model_validate(
        {
            "storage": {"root": storage_root, "endpoint_url": endpoint},
            "model": {"name": "dates-qwen2-tiny", "source": str(base or world["base"])},
            "eval": {
                "metrics": ["exact_match", "rouge_l"],
                "max_new_tokens": 16,
                "batch_size": 5,
                "max_examples": 30,
                "predictions_cap": 32,
                "gates": GATES,
                **eval_overrides,
            },
        }
    )
    params = {"candidate": f"runs/{run_id}/model", "dataset": DATASET, "suites": measured(cfg)}
    return JobContext(run_id, "evaluate", cfg, params)


def measured(cfg: PipelineConfig) -> list[dict]:
    """Each configured suite as its files read now, as a data stage that found no overlap with the training split
    passes them to the evaluate job (DataSummary.suites)."""
    files = []
    for name, suite_cfg in cfg.eval.suites.items():
        suite = read_suite(name, suite_cfg, None)
        clean = Contamination(ngram=13, eval_items=len(suite.ids), exact_matches=0, overlapping=0, fraction=0.0)
        files.append(
            SuiteFile(name=name, source=suite.source, sha256=suite.sha256, items=len(suite.ids), contamination=clean)
        )
    return [f.to_json() for f in files]


def upload_export(storage: Storage, local_dir: Path, run_id: str) -> None:
    """A finished export, as the fine-tune stage leaves it: files, manifest, then the completion marker."""
    publish_export(storage, local_dir, f"runs/{run_id}/model", 60, {"run_id": run_id, "run_name": run_id})


@pytest.fixture
def store(world, tmp_path) -> Storage:
    storage = Storage(str(tmp_path / "store"))
    write_dataset(storage, world["rows"], world["tokenizer_sha256"])
    return storage


def test_trained_candidate_passes_as_the_first_model(world, store, capsys):
    upload_export(store, world["trained"], "good")
    summary = evaluate_body(make_ctx(world, "good", store.root)).to_json()

    cand, base = summary["models"]["candidate"], summary["models"]["base"]
    assert cand["path"] == "runs/good/model" and base["path"] == str(world["base"])
    assert cand["metrics"]["exact_match"] == 1.0 and cand["metrics"]["rouge_l"] == 1.0
    assert base["metrics"]["exact_match"] == 0.0
    assert cand["metrics"]["eval_loss"] < base["metrics"]["eval_loss"]
    assert cand["metrics"]["perplexity"] == pytest.approx(math.exp(cand["metrics"]["eval_loss"]))
    assert summary["models"]["incumbent"] is None and summary["incumbent_version"] is None
    assert summary["examples"] == 30
    assert (
        summary["chat_template_sha256"] == cand["chat_template_sha256"] == base["chat_template_sha256"] == TEMPLATE_SHA
    )
    assert summary["gates"]["passed"]
    assert summary["gates"]["lines"][0] == (
        "exact_match >= 0.8: 1 [0.8865, 1] (n=30, Wilson score, 95% interval: 95% with Holm over 2, p=0.0031) (pass)"
    )
    first = summary["gates"]["verdicts"][0]
    assert first["outcome"] == "pass" and first["split_sha256"] == summary["eval_split_sha256"]
    scored = json.loads(store.read_text("runs/good/stages/evaluate/item_scores.json"))
    assert scored["split_sha256"] == summary["eval_split_sha256"]
    assert scored["scores"]["candidate"]["exact_match"] == [1.0] * 30
    assert scored["scores"]["base"]["rouge_l"] == [0.0] * 30
    assert summary["gates"]["lines"][2].endswith("no incumbent: first model, regression gate not applicable")
    # every answer counted: the candidate stops on all 30; the random base runs all 30 to max_new_tokens on the
    # task it never learned, which the cap does not hold against it (eval/selftest.py)
    assert cand["generations"] == {"task": {"answers": 30, "cut_off": 0, "empty": 0}}
    assert base["generations"]["task"]["cut_off"] == 30

    predictions = [
        json.loads(line) for line in store.read_text("runs/good/stages/evaluate/predictions.jsonl").splitlines()
    ]
    assert summary["predictions_uri"] == store.uri("runs/good/stages/evaluate/predictions.jsonl")
    assert len(predictions) == 30  # every eval item: the cap (32, the copy check's floor) is more
    assert set(predictions[0]) == {"prompt", "reference", "candidate", "base", "incumbent"}
    assert predictions[0]["candidate"] == ANSWER and predictions[0]["incumbent"] is None
    assert predictions[0]["prompt"] == world["rows"][0]["prompt"]

    progress = [
        json.loads(line.removeprefix(PROGRESS_PREFIX))
        for line in capsys.readouterr().out.splitlines()
        if line.startswith(PROGRESS_PREFIX)
    ]
    assert progress[-1] == {"stage": "evaluate", "done": 60, "total": 60, "model": "base"}


def test_a_candidate_that_never_stops_is_invalid_where_no_model_stops_and_its_own_verdict_where_one_does(
    world, store, rambler
):
    """The untrained (random) model as candidate runs every answer to max_new_tokens. Beside the random base, which
    never stops either, no model shows that the stop tokens end an answer: the evaluation is invalid, no gate
    decides, and the summary keeps every model's counts. A candidate that rambles beside a base that stops (the
    trained model as base: same tokenizer, template and stop tokens) is cut off on its own: scored wrong, a
    modeling failure."""
    upload_export(store, world["base"], "raw")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "raw", store.root))
    failure = info.value
    assert failure.failure_class is FailureClass.infrastructure
    assert failure.cause == (
        "evaluation invalid: candidate 30/30 answers cut off at eval.max_new_tokens=16 (cap 0.02, "
        "eval.max_truncated_fraction), and no model stopped within the cap on the task (base 30/30 cut off): the "
        "references fit, so the stop tokens end no answer there; check the stop tokens and the chat template"
    )
    assert isinstance(failure.summary, EvaluateSummary)
    assert failure.summary.gates.verdicts == [] and not failure.summary.gates.passed  # not a gate verdict
    counted = {role: m.generations["task"].cut_off for role, m in failure.summary.models.items() if m}
    assert counted == {"candidate": 30, "base": 30}

    upload_export(store, rambler, "rambles")
    with pytest.raises(StageFailure) as own:
        evaluate_body(make_ctx(world, "rambles", store.root, base=world["trained"]))
    assert own.value.failure_class is FailureClass.modeling
    assert own.value.cause.startswith("exact_match >= 0.8: 0 [0, 0.1434] (n=30, Wilson score")
    assert isinstance(own.value.summary, EvaluateSummary)
    counted = {role: m.generations["task"].cut_off for role, m in own.value.summary.models.items() if m}
    assert counted == {"candidate": 30, "base": 0}
    candidate = present(own.value.summary.models["candidate"])
    assert candidate.metrics["exact_match"] == 0.0 and candidate.generations["task"].empty == 0
    first = json.loads(store.read_text("runs/rambles/stages/evaluate/predictions.jsonl").splitlines()[0])
    assert first["candidate"].endswith("-05---------") and first["base"] == ANSWER  # scored as it answered


def test_stop_tokens_that_end_no_answer_make_the_evaluation_invalid_even_for_a_good_candidate(
    world, store, monkeypatch
):
    """A planted apparatus fault: generation stops at an id no model emits, so every model runs to max_new_tokens
    on every split. The trained candidate would pass; with no model stopping, no verdict is given."""
    upload_export(store, world["trained"], "nostop")
    monkeypatch.setattr(generation, "stop_token_ids", lambda tokenizer: [len(tokenizer) + 7])
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "nostop", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(
        "evaluation invalid: candidate 30/30 answers cut off at eval.max_new_tokens=16 (cap 0.02, "
        "eval.max_truncated_fraction), and no model stopped within the cap on the task (base 30/30 cut off)"
    )


def test_within_the_cap_the_gates_judge_the_candidate_with_the_evidence(world, store):
    """The same candidate with eval.max_truncated_fraction=1: its 30 cut-off answers are within the cap, so the
    gates decide, and it fails them as a modeling failure."""
    upload_export(store, world["base"], "raw")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "raw", store.root, max_truncated_fraction=1.0))
    failure = info.value
    assert failure.failure_class is FailureClass.modeling
    assert failure.cause.startswith("exact_match >= 0.8: 0 [0, 0.1434] (n=30, Wilson score")
    assert failure.cause.endswith("(fail) (+1 more)")
    assert isinstance(failure.summary, EvaluateSummary)
    assert failure.summary.gates.passed is False
    candidate = present(failure.summary.models["candidate"])
    assert candidate.metrics["exact_match"] == 0.0 and candidate.generations["task"].cut_off == 30
    assert store.exists("runs/raw/stages/evaluate/predictions.jsonl")


def test_the_production_model_is_the_incumbent_and_a_handful_of_items_cannot_resolve_its_margin(world, store):
    upload_export(store, world["trained"], "first")
    card = registry.CardFacts(name="dates-qwen2-tiny", run_id="first")
    registry.promote(store, "dates-qwen2-tiny", "first", "runs/first/model", card, expected_token=None)
    upload_export(store, world["trained"], "second")
    ctx = make_ctx(world, "second", store.root)
    pointer = production_pointer(store, "dates-qwen2-tiny")
    ctx.params["incumbent"] = {"version": pointer.version, "path": pointer.path}
    with pytest.raises(StageFailure) as info:
        evaluate_body(ctx)
    assert isinstance(info.value.summary, EvaluateSummary)
    summary = info.value.summary.to_json()
    assert summary["incumbent_version"] == "v0001-first"
    assert summary["models"]["incumbent"]["path"] == "models/dates-qwen2-tiny/v0001-first"
    assert summary["models"]["incumbent"]["metrics"]["exact_match"] == 1.0
    # 30 items on which both are right cannot show a regression of at most 0.02: refused, not "worse"
    regression = summary["gates"]["verdicts"][2]
    assert regression["outcome"] == "insufficient" and regression["items_needed"] > 30
    assert info.value.failure_class is FailureClass.data  # the items cannot tell: no verdict on the model
    assert info.value.cause == regression["line"]
    assert regression["line"].startswith("exact_match regression vs incumbent <= 0.02: +0 [-0.1")
    assert regression["line"].endswith(
        f"(insufficient evidence: the interval straddles 0.02; about {regression['items_needed']:,} items at the "
        "observed disagreement would resolve it)"
    )
    first = json.loads(store.read_text("runs/second/stages/evaluate/predictions.jsonl").splitlines()[0])
    assert first["incumbent"] == ANSWER


def test_the_entrypoint_writes_a_classified_result(world, store):
    """`python -m eval.evaluate_job` as tasks/ submits it: exit 1 and a modeling result for a failed gate."""
    upload_export(store, world["base"], "cli")
    ctx = make_ctx(world, "cli", store.root, max_examples=3, max_truncated_fraction=1.0)  # the random model rambles
    env = {**os.environ, ENV_VAR: jobkit.encode_job(ctx.run_id, ctx.job, ctx.config, ctx.params)}
    proc = run_job_module("eval.evaluate_job", env)
    assert proc.returncode == 1, proc.stderr[-2000:]
    result = store.read_json("runs/cli/stages/evaluate/result.json")
    assert result["status"] == "failed" and result["failure_class"] == "modeling"
    assert result["cause"].startswith("exact_match >= 0.8: 0 [0, 0.6261] (n=3, Wilson score")
    assert "[tuneproof] gate: exact_match >= 0.8: 0 [0, 0.6261]" in proc.stdout


def test_an_unfinished_export_is_not_evaluated(world, store):
    store.upload_dir(world["trained"], "runs/half/model")  # no completion marker: the export was cut short
    with pytest.raises(StageFailure, match="candidate export is not complete: .*no completion marker") as info:
        evaluate_body(make_ctx(world, "half", store.root))
    assert info.value.failure_class is FailureClass.infrastructure


def test_a_missing_parameter_is_named(world, store):
    ctx = make_ctx(world, "noparams", store.root)
    ctx.params.pop("candidate")
    with pytest.raises(ValueError, match="candidate\n  Field required"):
        evaluate_body(ctx)


@pytest.mark.integration
def test_candidate_and_dataset_on_s3(world, s3_endpoint, tmp_path, monkeypatch):
    monkeypatch.setattr(modeling, "CACHE_ROOT", tmp_path / "model-cache")
    storage = Storage(f"s3://{TEST_BUCKET}/evaluate-{uuid.uuid4().hex[:8]}", s3_endpoint)
    write_dataset(storage, world["rows"], world["tokenizer_sha256"])
    upload_export(storage, world["trained"], "s3run")
    # Five items are all this test needs to read and write through S3; a gate five items can resolve.
    gates = {"exact_match": {"min": 0.3}}
    summary = evaluate_body(make_ctx(world, "s3run", storage.root, s3_endpoint, max_examples=5, gates=gates))
    assert summary.models["candidate"] is not None
    assert summary.models["candidate"].metrics["exact_match"] == 1.0
    assert summary.predictions_uri is not None
    assert summary.predictions_uri.startswith("s3://") and storage.exists(
        "runs/s3run/stages/evaluate/predictions.jsonl"
    )


# ---- generation ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def base_model(world):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(world["base"]).eval()


def test_batched_left_padded_generation_equals_one_at_a_time(world, base_model):
    tokenizer = world["tokenizer"]
    prompts = [chat_prompt(tokenizer, p) for p in ("a", "date xxxx 11", "date x 3", "longer prompt with many words")]
    batched = generate(base_model, tokenizer, prompts, max_new_tokens=6, batch_size=4)
    single = [generate(base_model, tokenizer, [p], max_new_tokens=6, batch_size=1)[0] for p in prompts]
    assert batched == single
    done: list[int] = []
    generate(base_model, tokenizer, prompts, max_new_tokens=2, batch_size=3, on_batch=done.append)
    assert done == [3, 1]


def test_prompts_of_equal_token_count_share_a_batch(world, base_model, monkeypatch):
    """Batches were formed by characters, a poor proxy for tokens: a word the tokenizer merges is long in
    characters and short in tokens, so a batch mixed long and short prompts and padded the short ones."""
    tokenizer = world["tokenizer"]
    texts = ("date", "qzqzqz", "date date", "qzqzqzqzqz")
    prompts = [chat_prompt(tokenizer, text) for text in texts]
    counts = [len(tokenizer(p, add_special_tokens=False)["input_ids"]) for p in prompts]
    padded: list[int] = []
    own_generate = base_model.generate

    def counting(**kwargs):
        padded.append(int((kwargs["attention_mask"] == 0).sum()))
        return own_generate(**kwargs)

    monkeypatch.setattr(base_model, "generate", counting)
    generate(base_model, tokenizer, prompts, max_new_tokens=1, batch_size=2)

    def padding(order: list[int]) -> int:
        return sum(max(counts[i] for i in pair) - counts[j] for pair in (order[:2], order[2:]) for j in pair)

    by_tokens = padding(sorted(range(4), key=lambda i: counts[i]))
    assert by_tokens < padding(sorted(range(4), key=lambda i: len(prompts[i])))  # the prompts tell the two apart
    assert sum(padded) == by_tokens


def test_the_models_own_generation_settings_are_ignored_for_scoring(world):
    """Before, only sampling, beams and repetition_penalty were pinned: a checkpoint's suppress_tokens turned
    '2024-01-05' into '2024-01-0', read as the model's answer (a modeling failure)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(world["trained"]).eval()
    tokenizer = world["tokenizer"]
    prompts = [r["prompt"] for r in world["rows"][:5]]
    assert generate(model, tokenizer, prompts, max_new_tokens=16, batch_size=5) == [ANSWER] * 5
    own = model.generation_config
    own.suppress_tokens = [tokenizer.convert_tokens_to_ids("5")]
    own.no_repeat_ngram_size = 1
    own.min_new_tokens = 14  # past the stop token
    own.do_sample, own.temperature, own.top_k = True, 2.0, 0
    assert generate(model, tokenizer, prompts, max_new_tokens=16, batch_size=5) == [ANSWER] * 5
    assert model.generation_config is own  # the model's own settings are back after scoring


def test_eval_loss_matches_the_models_own_loss(world, base_model):
    rows = world["rows"][:3]
    tokenizer = world["tokenizer"]
    ours = eval_loss(base_model, [r["input_ids"] for r in rows], [r["labels"] for r in rows], 2, tokenizer.pad_token_id)
    ids, labels, mask = right_padded(
        [r["input_ids"] for r in rows], [r["labels"] for r in rows], tokenizer.pad_token_id
    )
    with torch.no_grad():
        theirs = base_model(input_ids=ids, attention_mask=mask, labels=labels).loss.item()
    assert ours["eval_loss"] == pytest.approx(theirs, rel=1e-5)
    assert ours["perplexity"] == pytest.approx(math.exp(theirs), rel=1e-5)


def test_right_padding_rejects_misaligned_rows():
    with pytest.raises(ValueError, match="eval row 1: 2 input_ids but 3 labels"):
        right_padded([[1], [1, 2]], [[1], [1, 2, 3]], 0)


# ---- the self-test -------------------------------------------------------------------------------


class OffByOne:
    """exact_match with a planted extraction bug: the answer's last character is lost before comparing."""

    name = "exact_match"

    def _compute(self, predictions, references):
        hits = sum(p.strip()[:-1] == r.strip() for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions) if predictions else 0.0}

    def compute(self, predictions, references):
        return self._compute(predictions, references)


class OutOfTen(OffByOne):
    """A score out of 10 per item: the gates' intervals (their edges, and under 20 items) assume [0, 1]."""

    def _compute(self, predictions, references):
        return {"exact_match": 10.0 * sum(p == r for p, r in zip(predictions, references)) / max(len(predictions), 1)}


@pytest.mark.parametrize(
    "metric, cause",
    [
        (
            OffByOne(),
            "exact_match scores the references as answers 0, below 1 on 2 of 2 items (first: item 0, reference "
            "'2024-01-05' scores 0): the metric's post-processing changes a correct answer",
        ),
        (
            OutOfTen(),
            "exact_match scores the references as answers 10, above 1 on 2 of 2 items: the gates' intervals read a "
            "score in [0, 1] per item, 1 for a right answer; scale the metric",
        ),
    ],
)
def test_a_planted_extraction_bug_or_another_scale_fails_the_self_test(metric, cause):
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": metric}, [ANSWER, "1999-12-14"])
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == f"evaluation invalid: {cause}"
    check_references({"exact_match": load_metric("exact_match"), "rouge_l": load_metric("rouge_l")}, [ANSWER, "a b"])


class FindsNothing:
    """exact_match with a planted extraction bug of the other kind: it looks for a number in words ("answer: 42")
    that a date answer never has, finds none in either text and compares two empty strings."""

    name = "exact_match"

    def _compute(self, predictions, references):
        def extract(text):
            return text.split("answer:")[1].strip() if "answer:" in text else ""

        hits = sum(extract(p) == extract(r) for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions) if predictions else 0.0}

    def compute(self, predictions, references):
        return self._compute(predictions, references)


def test_a_metric_that_gives_full_credit_to_wrong_answers_fails_the_self_test():
    """References score 1 under it, so the first half of the self-test passes; every model would pass too."""
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": FindsNothing()}, [ANSWER, "1999-12-14", "2001-02-03"])
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == (
        "evaluation invalid: exact_match gives full credit to wrong answers: each item answered with the next "
        "item's reference scores 1 on all 3 items where that is another text (first: item 0, reference "
        "'2024-01-05', answer '1999-12-14'): the metric cannot tell a right answer from a wrong one"
    )
    # A set whose references are all one text has no other reference to answer with, but answers wrong by
    # construction (empty, one character changed) still show it; before, the self-test passed it.
    with pytest.raises(StageFailure) as one_text:
        check_references({"exact_match": FindsNothing()}, [ANSWER, ANSWER])
    assert one_text.value.cause.startswith(
        "evaluation invalid: exact_match gives credit to answers with nothing right: the empty answer scores above "
        "WRONG_FLOOR=0.05 on 2 of 2 items (first: item 0, reference '2024-01-05', answer '', score 1): the gates "
        "read 0 as the worst answer"
    )
    # Labels that differ only in case, under accuracy's casefold: full credit where the texts differ, but not
    # on every item (the third label is another class), so the metric still tells answers apart.
    check_references({"accuracy": load_metric("accuracy")}, ["Yes", "yes", "no"])


class YearOnly(OffByOne):
    """exact_match with an extraction bug that compares only a date's year: the rotation's next reference is another
    date, mostly of the same year, so only its one item of another year scores 0."""

    def _compute(self, predictions, references):
        hits = sum(p.strip()[:4] == r.strip()[:4] for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}


class Constant(OffByOne):
    """A scorer that reads no text: every answer scores 1."""

    def _compute(self, predictions, references):
        return {"exact_match": 1.0}


class PartOfReference(OffByOne):
    """A lenient scorer: 1 when the stripped answer is non-empty and occurs in the reference, so a cut answer ('1'
    for '19', 'Par' for 'Paris') gets full credit."""

    def _compute(self, predictions, references):
        hits = sum(bool(p.strip()) and p.strip() in r for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}


def test_wrong_answers_by_construction_find_a_metric_the_rotation_misses():
    """Empty answers, references with one character changed and references cut short are wrong under any metric
    that reads the text; before, the year-only metric (rotation: 4 of 5 items full credit), a constant on one-text
    references and a metric that credits any part of the reference passed."""
    dates = ["2024-01-05", "2024-03-17", "2024-07-30", "2024-11-02", "2023-12-31"]
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": YearOnly()}, dates)
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == (
        "evaluation invalid: exact_match gives full credit to wrong answers: each reference with 'x' appended to its "
        "first line scores 1 on 5 of 5 items, more than WRONG_CREDIT_SHARE=0.1 of them (first: item 0, reference "
        "'2024-01-05', answer '2024-01-05x'): the metric cannot tell a right answer from a wrong one"
    )
    with pytest.raises(StageFailure, match="the empty answer scores above WRONG_FLOOR=0.05 on 30 of 30 items"):
        check_references({"exact_match": Constant()}, [ANSWER] * 30)
    with pytest.raises(StageFailure) as lenient:
        check_references({"exact_match": PartOfReference()}, ["19", "Paris", "Madrid", "d n a b", "42", "Rome"])
    assert lenient.value.cause == (
        "evaluation invalid: exact_match gives full credit to wrong answers: each reference's first line without "
        "its last letter or digit scores 1 on 6 of 6 items, more than WRONG_CREDIT_SHARE=0.1 of them (first: item 0, "
        "reference '19', answer '1'): the metric cannot tell a right answer from a wrong one"
    )


def test_the_shipped_metrics_give_no_wrong_answer_full_credit():
    """rouge_l is an F1 over tokens: one character changed in one token of several, or the reference cut short,
    scores high but below 1, which is not full credit; accuracy reads an answer's first line, which both
    one-character changes and each cut alter."""
    metrics = {name: load_metric(name) for name in ("exact_match", "rouge_l", "accuracy")}
    references = [ANSWER, "a b", "Paris is the capital", "Yes\nbecause it is", "x marks", "(a) first", "- 5", "Paris."]
    check_references(metrics, references)
    rouge = metrics["rouge_l"]
    assert 0.5 < rouge.compute(predictions=["Paris is the capitalx"], references=[references[2]])["rouge_l"] < 1.0
    assert 0.5 < rouge.compute(predictions=["Paris is the capita"], references=[references[2]])["rouge_l"] < 1.0
    for suite in sorted(Path("data/skills/suites").glob("*.jsonl")):  # the bundled suites, scored by exact_match
        outputs = [json.loads(line)["output"] for line in suite.read_text().splitlines() if line.strip()]
        check_references({"exact_match": metrics["exact_match"]}, outputs)


def edit_distance(a: str, b: str) -> int:
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


class EditOverHundred(OffByOne):
    """A similarity with a wrong denominator, 1 - edit distance / 100: the empty answer to a date scores 0.9, so a
    candidate that answers every item wrong passes `min: 0.8`."""

    def _compute(self, predictions, references):
        scores = [1 - edit_distance(p.strip(), r.strip()) / 100 for p, r in zip(predictions, references)]
        return {"exact_match": sum(scores) / len(scores) if scores else 0.0}


class SameLength(OffByOne):
    """Reads only the answer's length: 1 for an answer as long as the reference, less the longer it is off. It gives
    the empty answer 0, but an answer of as many wrong characters full credit."""

    def _compute(self, predictions, references):
        scores = [1 - abs(len(p) - len(r)) / max(len(p), len(r), 1) for p, r in zip(predictions, references)]
        return {"exact_match": sum(scores) / len(scores) if scores else 0.0}


def test_a_metric_whose_floor_is_above_zero_fails_the_self_test():
    """The gates read 0 as the worst answer. Before, a floor of 0.9 passed (wrong answers never scored exactly 1)
    and an all-wrong candidate passed `min: 0.8`; partial credit for a partly right answer is still allowed
    (rouge_l: test_the_shipped_metrics_give_no_wrong_answer_full_credit)."""
    dates = ["2024-01-05", "2024-03-17", "2024-07-30", "2024-11-02", "2023-12-31"]
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": EditOverHundred()}, dates)
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == (
        "evaluation invalid: exact_match gives credit to answers with nothing right: the empty answer scores above "
        "WRONG_FLOOR=0.05 on 5 of 5 items (first: item 0, reference '2024-01-05', answer '', score 0.9): the gates "
        "read 0 as the worst answer, so a model that answers every item wrong would score near this floor; rescale "
        "the metric so that such an answer scores 0"
    )
    with pytest.raises(StageFailure) as shape:
        check_references({"exact_match": SameLength()}, ["19", "Paris", "Madrid", "New Delhi"])  # lengths differ
    assert shape.value.cause.startswith(
        "evaluation invalid: exact_match gives credit to answers with nothing right: each reference with every "
        "character replaced by one it does not contain scores above WRONG_FLOOR=0.05 on 4 of 4 items (first: item 0, "
        "reference '19', answer 'xx', score 1)"
    )


class SortedWords(OffByOne):
    """'Order does not matter' normalisation (for list answers), applied to dates: 2024-13-01 for 2024-01-13."""

    def _compute(self, predictions, references):
        def words(text):
            return sorted(re.findall(r"\w+", text.lower()))

        return {"exact_match": sum(words(p) == words(r) for p, r in zip(predictions, references)) / len(predictions)}


class Casefolded(OffByOne):
    """exact_match that casefolds without declaring it: 'paris' for 'Paris', 'NO' for 'no'."""

    def _compute(self, predictions, references):
        hits = sum(p.strip().casefold() == r.strip().casefold() for p, r in zip(predictions, references))
        return {"exact_match": hits / len(predictions)}


class DeclaredCasefolded(Casefolded):
    """The same, declared: case carries no meaning to its labels."""

    CASE_INSENSITIVE = True


class Contains(OffByOne):
    """'The reference appears in the answer as a whole word' (TriviaQA-style), used as exact match: a hedge that
    lists several dates gets full credit."""

    def _compute(self, predictions, references):
        def found(p, r):
            return re.search(r"(?<!\w)" + re.escape(r.strip()) + r"(?!\w)", p) is not None

        return {"exact_match": sum(found(p, r) for p, r in zip(predictions, references)) / len(predictions)}


@pytest.mark.parametrize(
    "metric, references, says",
    [
        (
            SortedWords(),
            ["2024-01-13", "2024-02-14", "2024-03-15"],
            "each reference with its first line's words in reverse order scores 1 on 3 of 3 items, more than "
            "WRONG_CREDIT_SHARE=0.1 of them (first: item 0, reference '2024-01-13', answer '13-01-2024')",
        ),
        (
            Casefolded(),
            ["Paris", "Berlin", "Tokyo"],
            "each reference in swapped case scores 1 on 3 of 3 items, more than WRONG_CREDIT_SHARE=0.1 of them "
            "(first: item 0, reference 'Paris', answer 'pARIS')",
        ),
        (
            Contains(),
            ["2024-01-13", "2024-02-14", "2024-03-15"],
            "each reference with another item's reference after it on its first line scores 1 on 3 of 3 items, more "
            "than WRONG_CREDIT_SHARE=0.1 of them (first: item 0, reference '2024-01-13', answer '2024-01-13 "
            "2024-02-14')",
        ),
    ],
)
def test_a_metric_blind_to_order_case_or_extra_text_fails_the_self_test(metric, references, says):
    """Before, each passed: the wrong answers by construction changed only the ends of the first line or cut it."""
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": metric}, references)
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(f"evaluation invalid: exact_match gives full credit to wrong answers: {says}")


def test_a_metric_that_declares_case_meaningless_is_not_held_to_the_case_swap():
    check_references({"exact_match": DeclaredCasefolded()}, ["Paris", "Berlin", "Tokyo"])
    # the shipped accuracy and rouge_l declare it; exact_match does not, and tells 'Paris' from 'pARIS'
    metrics = {name: load_metric(name) for name in ("exact_match", "rouge_l", "accuracy")}
    assert [case_insensitive(name, m) for name, m in metrics.items()] == [False, True, True]
    check_references(metrics, ["Paris", "Berlin", "Tokyo", "Yes", "no"])


class PercentCorpus(OffByOne):
    """exact_match on a 0-100 scale that will not score an item alone (a corpus statistic)."""

    def _compute(self, predictions, references):
        if len(predictions) < 2:
            raise ValueError("needs two items or more")
        return {"exact_match": 100.0 * sum(p == r for p, r in zip(predictions, references)) / len(predictions)}


class ReturnInLoop(OffByOne):
    """exact_match with its return indented into the loop: the value is the first item's hit over n."""

    def _compute(self, predictions, references):
        for p, r in zip(predictions, references):
            return {"exact_match": float(p == r) / len(predictions)}
        return {"exact_match": 0.0}


class DistinctDenominator(OffByOne):
    """exact_match divided by the number of distinct references instead of items."""

    def _compute(self, predictions, references):
        return {"exact_match": sum(p == r for p, r in zip(predictions, references)) / len(set(references))}


@pytest.mark.parametrize(
    "metric, says",
    [
        (PercentCorpus(), "exact_match cannot score an item alone (ValueError: needs two items or more)"),
        (ReturnInLoop(), "exact_match's item scores average 1, but exact_match reports 0.3333 over the same 3 items"),
        (
            DistinctDenominator(),
            "exact_match's item scores average 1, but exact_match reports 1.5 over the same 3 items",
        ),
    ],
)
def test_a_local_metric_whose_item_scores_are_not_its_value_fails_the_self_test(metric, says):
    """Before, such a metric lost its item scores without a word and its gates compared the bare total (50 for a
    half-right candidate passed exact_match >= 0.8)."""
    with pytest.raises(StageFailure) as info:
        check_references({"exact_match": metric}, [ANSWER, ANSWER, "1999-12-14"])
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(f"evaluation invalid: the references as answers: {says}: ")


def test_item_scores_a_local_metric_cannot_pair_are_invalid_and_a_hub_metrics_compare_points():
    answers, references = [ANSWER, "1999-12-14", ANSWER], [ANSWER] * 3
    totals = score({"exact_match": ReturnInLoop()}, answers, references, "test")
    with pytest.raises(StageFailure) as info:
        item_scores({"exact_match": ReturnInLoop()}, answers, references, totals, "candidate on the eval split")
    assert info.value.cause == (
        "evaluation invalid: candidate on the eval split: exact_match's item scores average 0.6667, but exact_match "
        "reports 0.3333 over the same 3 items: a local metric's value must be the mean of its items' scores, which "
        "its gates are decided on"
    )
    # A hub metric may be corpus-level (BLEU-like): no item scores, and its gates compare points, as before.
    for hub_metric in (ReturnInLoop(), PercentCorpus()):
        assert item_scores({"bleu": hub_metric}, answers, references, totals, "candidate", hub=["bleu"]) == {}
    # A fraction's total on another scale is no number its gates can read, items or not.
    assert unscored({"exact_match": 50.0}, {}, ["exact_match"]) == (
        "exact_match is 50, outside [0, 1]: a fraction on another scale, which no gate on it can read"
    )


class NumpyMean(OffByOne):
    """exact_match as np.mean gives it: a numpy scalar, not a Python float."""

    def _compute(self, predictions, references):
        return {"exact_match": np.mean([p == r for p, r in zip(predictions, references)], dtype=np.float32)}


def test_a_numpy_scalar_is_a_number():
    """Before, np.float32 was skipped and the gate read 'the metrics report no exact_match'."""
    assert score({"exact_match": NumpyMean()}, [ANSWER, "1999-12-14"], [ANSWER, ANSWER], "test") == {"exact_match": 0.5}


class FirstWord(OffByOne):
    """A rouge-like metric that compares each answer's first word, and so raises IndexError on an empty answer."""

    def _compute(self, predictions, references):
        return {"exact_match": np.mean([p.split()[0] == r.split()[0] for p, r in zip(predictions, references)])}


RAISED = "raised IndexError (list index out of range) scoring"


def test_a_metric_that_raises_is_the_scorers_failure_naming_the_metric_and_where():
    """Before, the IndexError ended the job as a bare 'IndexError: list index out of range', naming no metric. Now
    the evaluation is invalid (infrastructure: the scorer failed, not the model), naming the metric as configured,
    the exception and where: in the self-test, or on a model's answers (the demo's base leaves 20 of 300 empty)."""
    metrics = {"first_word": FirstWord()}
    with pytest.raises(StageFailure) as selftest:
        check_references(metrics, [ANSWER, "1999-12-14"])
    assert selftest.value.failure_class is FailureClass.infrastructure
    assert selftest.value.cause.startswith(
        f"evaluation invalid: the self-test's wrong answers (the empty answer): first_word {RAISED} 2 answers"
    )
    with pytest.raises(StageFailure) as answered:
        score(metrics, [ANSWER, "", "1999-12-14"], [ANSWER] * 3, "base on suite add")
    assert answered.value.failure_class is FailureClass.infrastructure
    assert answered.value.cause == (
        f"evaluation invalid: base on suite add: first_word {RAISED} 3 answers: a metric must score any answer (the "
        "empty one too), so the scorer failed, not the model; fix the metric module"
    )


def test_a_metric_that_raises_on_a_models_answers_ends_evaluate_as_invalid_naming_the_model(world, store, monkeypatch):
    """A metric that raises on answers the self-test did not construct (stood in for by skipping the self-test):
    the trained candidate's answers score, the random base's empty ones raise, and the cause names the base."""
    upload_export(store, world["trained"], "raises")
    monkeypatch.setattr(evaluate_job, "load_metric", lambda name, hub: FirstWord())
    monkeypatch.setattr(evaluate_job, "check_references", lambda *args: None)
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "raises", store.root, metrics=["exact_match"]))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(f"evaluation invalid: base on the eval split: exact_match {RAISED} 30 answers")


@pytest.mark.parametrize(
    "metric, says",
    [
        (PercentCorpus(), "the references as answers: exact_match cannot score an item alone (ValueError: "),
        (FirstWord(), f"the self-test's wrong answers (the empty answer): exact_match {RAISED} 30 answers"),
        (
            Constant(),
            "exact_match gives credit to answers with nothing right: the empty answer scores above WRONG_FLOOR=0.05 "
            "on 30 of 30 items",
        ),
        (
            EditOverHundred(),
            "exact_match gives credit to answers with nothing right: the empty answer scores above WRONG_FLOOR=0.05 "
            "on 30 of 30 items",
        ),
    ],
)
def test_a_broken_scorer_ends_evaluate_as_invalid_not_as_a_verdict(world, store, monkeypatch, metric, says):
    """Before, the percentage passed its gates on the bare total (50 >= 0.8), and the constant passed the self-test
    and failed the candidate as a modeling failure (its improvement over a base that 'scored' 1)."""
    upload_export(store, world["trained"], "broken")
    monkeypatch.setattr(evaluate_job, "load_metric", lambda name, hub: metric)
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "broken", store.root, metrics=["exact_match"]))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(f"evaluation invalid: {says}")
    assert not store.exists("runs/broken/stages/evaluate/predictions.jsonl")  # no model answered


class HubConstant(OffByOne):
    """A hub metric (eval.hub_metrics: true, 'myorg/date_match') whose extraction finds nothing: 1 for any answer."""

    def _compute(self, predictions, references):
        return {"exact_match": 1.0}


class HubDateMatch(OffByOne):
    """A working hub metric: exact match of the stripped texts."""

    def _compute(self, predictions, references):
        return {"exact_match": sum(p.strip() == r.strip() for p, r in zip(predictions, references)) / len(predictions)}


HUB_COMMIT = "c0ffee" * 6 + "c0ff"
"""A 40-hex commit, as from_pretrained records the revision a hub id resolved to in config._commit_hash."""


def test_a_hub_metric_is_self_tested_and_what_scored_is_named_by_hash_or_hub_commit(world, store, monkeypatch, capsys):
    """Before, a hub metric was never self-tested: a constant 1 failed a correctly trained candidate as a modeling
    failure (+0 over a base that 'scored' 1). A hub metric's module files and a base named by hub id (no files to
    hash) had no identity in the summary either."""
    upload_export(store, world["trained"], "hubconst")
    monkeypatch.setattr(evaluate_job, "load_metric", lambda name, hub: HubConstant())
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "hubconst", store.root, metrics=["myorg/date_match"], hub_metrics=True))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(
        "evaluation invalid: exact_match gives credit to answers with nothing right: the empty answer scores above "
        "WRONG_FLOOR=0.05 on 30 of 30 items"
    )
    assert not store.exists("runs/hubconst/stages/evaluate/predictions.jsonl")  # no model answered

    real_load = evaluate_job.load_for_eval

    def base_from_hub(ctx, source):  # the base as a hub id loads it: a commit in its config, no files to hash
        model, tokenizer, content = real_load(ctx, source)
        if source.role != "base":
            return model, tokenizer, content
        model.config._commit_hash = HUB_COMMIT
        return model, tokenizer, None

    monkeypatch.setattr(evaluate_job, "load_metric", lambda name, hub: HubDateMatch())
    monkeypatch.setattr(evaluate_job, "load_for_eval", base_from_hub)
    upload_export(store, world["trained"], "hub")
    summary = evaluate_body(make_ctx(world, "hub", store.root, metrics=["myorg/date_match"], hub_metrics=True))
    here = Path(__file__).parent
    module_files = markers.local_digests(here, sorted(p.name for p in here.glob("*.py")))
    assert summary.metric_sha256 == {"myorg/date_match": markers.content_sha256(module_files)}
    base, candidate = summary.models["base"], summary.models["candidate"]
    assert base is not None and candidate is not None
    assert (base.content_sha256, base.hub_commit) == (None, HUB_COMMIT)
    assert candidate.content_sha256 is not None and candidate.hub_commit is None
    assert summary.base_reproduction is not None  # keyed by the commit: a moved 'main' is another base
    assert summary.base_reproduction.reference_uri.endswith(f"base-hub-commit-{HUB_COMMIT}-tokens16.json")
    assert f"base: {world['base']} (hub commit {HUB_COMMIT[:12]}, chat template" in capsys.readouterr().out


def test_too_small_max_new_tokens_is_an_invalid_evaluation_not_a_gate_failure(world, store, tmp_path):
    """The references need 11 tokens with the stop token: at 2 none fits, which the references show before any model
    answers (a model's cut-off answers are not what tells). Per split: a suite's long references too."""
    upload_export(store, world["trained"], "short")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "short", store.root, max_new_tokens=2))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == (
        "evaluation invalid: the task: 30 of 30 references need more than eval.max_new_tokens=2 tokens with the "
        "stop token (cap 0.02, eval.max_truncated_fraction): a model that answers them right is cut off and scores "
        "wrong; the longest is 10 tokens: raise eval.max_new_tokens to at least 11"
    )
    assert info.value.summary is None and not store.exists("runs/short/stages/evaluate/predictions.jsonl")
    print(info.value.cause)

    long = tmp_path / "long.jsonl"
    long.write_text("".join(json.dumps({"input": f"q {i}", "output": f"{ANSWER} " * 3}) + "\n" for i in range(10)))
    with pytest.raises(StageFailure) as suite:
        evaluate_body(make_ctx(world, "short", store.root, suites={"long": {"source": str(long), "margin": 0.2}}))
    assert suite.value.failure_class is FailureClass.infrastructure
    assert suite.value.cause.startswith(
        "evaluation invalid: suite long: 10 of 10 references need more than eval.max_new_tokens=16 tokens"
    )


def test_a_planted_extraction_bug_ends_evaluate_before_any_model_is_scored(world, store, monkeypatch):
    upload_export(store, world["trained"], "offbyone")
    monkeypatch.setattr(
        evaluate_job, "load_metric", lambda name, hub: OffByOne() if name == "exact_match" else load_metric(name)
    )
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "offbyone", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith(
        "evaluation invalid: exact_match scores the references as answers 0, below 1 on 30 of 30"
    )
    assert not store.exists("runs/offbyone/stages/evaluate/predictions.jsonl")  # no model answered


class NoNumber:
    """A local metric that passes the self-test (the references score 1, the rotated references not 1) but gives
    a model's answers no usable number: NaN as a division by an empty count gives, its value under another key,
    or a score below 0 for a wrong answer."""

    name = "exact_match"

    def __init__(self, key: str) -> None:
        self.key = key

    def _compute(self, predictions, references):
        if self.key == "below_zero":  # each wrong answer -0.5: passes the self-test, which asks the references
            return {
                "exact_match": sum(1.0 if p == r else -0.5 for p, r in zip(predictions, references)) / len(references)
            }
        if predictions == references:
            return {"exact_match": 1.0}
        return {"exact_match": float("nan")} if self.key == "exact_match" else {self.key: 0.0}

    def compute(self, predictions, references):
        return self._compute(predictions, references)


@pytest.mark.parametrize(
    "key, says",
    [
        (
            "exact_match",
            "exact_match is nan: the metric module computed no number, so its gates cannot judge the model",
        ),
        ("em", "the metrics report no exact_match (they report em, rouge_l): a gate on it cannot judge any model"),
        (
            "below_zero",
            "exact_match scores 30 items outside [0, 1] (first: item 0, -0.5): the gates' intervals read a score in "
            "[0, 1] per item",
        ),
    ],
)
def test_a_gated_value_the_metric_gives_no_usable_number_is_an_invalid_evaluation_not_a_model_verdict(
    world, store, monkeypatch, key, says
):
    # Before, its gate failed the candidate as a modeling failure ("candidate value is NaN (fail)").
    upload_export(store, world["trained"], f"nan-{key}")
    monkeypatch.setattr(
        evaluate_job, "load_metric", lambda name, hub: NoNumber(key) if name == "exact_match" else load_metric(name)
    )
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, f"nan-{key}", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    # The trained candidate answers all 30 items right, which scores; the untrained base's answers do not.
    assert info.value.cause == f"evaluation invalid: base on the eval split: {says}"


def test_a_chat_template_changed_after_data_prep_makes_the_evaluation_invalid(world, store, tmp_path):
    """The candidate's tokenizer now lays prompts out with another template than the eval rows were rendered with."""
    edited = shutil.copytree(world["trained"], tmp_path / "edited")
    changed = "{{- '<|im_start|>system\\nBe brief.<|im_end|>\\n' }}" + CHAT_TEMPLATE
    (edited / "chat_template.jinja").write_text(changed)
    upload_export(store, edited, "edited")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "edited", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause == (
        f"evaluation invalid: the candidate model's chat template (sha256 {chat_template_sha256(changed)}) is not "
        f"the one the data stage rendered the eval prompts with (sha256 {TEMPLATE_SHA}, in the dataset manifest): "
        "prepare the data with the tokenizer the model is evaluated with (re-run data)"
    )
    print(info.value.cause)


def without_merges(model_dir: Path, out: Path) -> Path:
    """A copy of the model whose tokenizer has no BPE merges: the same vocabulary and chat template, but "user"
    and "assistant" encode byte by byte, so every prompt's ids are another tokenizer's (all within the model's)."""
    shutil.copytree(model_dir, out)
    path = out / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["model"]["merges"] = []
    path.write_text(json.dumps(spec))
    return out


def test_a_candidate_tokenizer_other_than_the_datasets_makes_the_evaluation_invalid(world, store, tmp_path):
    """The eval split's input_ids are the data stage's tokenizer's. Before, nothing compared them with the model's:
    a candidate with another tokenizer (same template) was judged on its answers and a loss over ids that are not
    its own. Compared by what it does, not by a hash of its files, which name where it was loaded from."""
    upload_export(store, without_merges(world["trained"], tmp_path / "retokenized"), "retok")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "retok", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    cause = info.value.cause or ""
    assert cause.startswith(
        "evaluation invalid: the candidate's tokenizer does not encode the eval split's prompts to the split's ids "
        "(row 0, token 1: "  # "user": byte by byte without merges, one token with them
    )
    assert cause.endswith(
        "): the split's ids are another tokenizer's, its eval loss over them means nothing, and a model trained on "
        "them decodes its answers wrongly; prepare the data with the tokenizer the model is evaluated with (re-run data)"
    )


def test_a_tokenizer_saved_from_elsewhere_with_the_same_vocabulary_is_the_same_tokenizer(world, store, tmp_path):
    # A hash of the saved files moves with where the tokenizer was loaded from (tokenizer_config.json's is_local): a
    # base named by hub id and the export read from storage would hash apart, and every evaluation be invalid.
    moved = tmp_path / "moved"
    shutil.copytree(world["trained"], moved)
    config = json.loads((moved / "tokenizer_config.json").read_text())
    (moved / "tokenizer_config.json").write_text(json.dumps({**config, "is_local": not config.get("is_local")}))
    upload_export(store, moved, "moved")
    summary = evaluate_body(make_ctx(world, "moved", store.root, max_examples=5, gates={"exact_match": {"min": 0.3}}))
    assert "eval_loss" in present(summary.models["candidate"]).metrics


def test_an_incumbent_with_another_tokenizer_is_judged_on_its_answers_with_no_loss_over_foreign_ids(
    world, store, tmp_path
):
    """An incumbent may predate a change of tokenizer: its answers are text and still compare, item by item; its eval
    loss over the split's ids would be another tokenizer's, so it is left out, and a gate that compares losses
    with the incumbent cannot judge (invalid, not a verdict)."""
    upload_export(store, without_merges(world["trained"], tmp_path / "older"), "older")
    card = registry.CardFacts(name="dates-qwen2-tiny", run_id="older")
    registry.promote(store, "dates-qwen2-tiny", "older", "runs/older/model", card, expected_token=None)
    pointer = production_pointer(store, "dates-qwen2-tiny")
    upload_export(store, world["trained"], "newer")

    def ctx_with(gates: dict) -> JobContext:
        # Byte by byte the incumbent does not end its answers: counted, not held to the cut-off cap here.
        ctx = make_ctx(world, "newer", store.root, max_examples=5, gates=gates, max_truncated_fraction=1.0)
        ctx.params["incumbent"] = {"version": pointer.version, "path": pointer.path}
        return ctx

    summary = evaluate_body(ctx_with({"exact_match": {"min": 0.3}}))
    incumbent, candidate = present(summary.models["incumbent"]), present(summary.models["candidate"])
    assert "exact_match" in incumbent.metrics  # its answers are scored
    assert "eval_loss" not in incumbent.metrics and "perplexity" not in incumbent.metrics
    assert "eval_loss" in candidate.metrics
    loss_gate = {"eval_loss": {"max_regression": 0.5, "higher_is_better": False}}
    with pytest.raises(StageFailure) as info:
        evaluate_body(ctx_with({"exact_match": {"min": 0.3}, **loss_gate}))
    assert info.value.failure_class is FailureClass.infrastructure
    assert info.value.cause.startswith("evaluation invalid: the incumbent's tokenizer does not encode the eval split")
    assert info.value.cause.endswith(
        "its loss over the split's ids means nothing, so gate eval_loss.max_regression cannot compare the candidate "
        "with it"
    )


def test_the_base_reproduces_its_answers_and_planted_sampling_is_not_reproducible(world, store, monkeypatch, capsys):
    from transformers.generation.utils import GenerationMixin

    for run in ("first", "again"):
        upload_export(store, world["trained"], run)
        summary = evaluate_body(make_ctx(world, run, store.root))
    reproduction = summary.base_reproduction
    assert reproduction is not None
    assert (reproduction.earlier_run, reproduction.items, reproduction.differing) == ("first", 30, 0)
    assert (
        "self-test: base answers 30 of 30 items as in run 'first' (batch 5 on cpu): reproduced"
        in capsys.readouterr().out
    )
    reference = reproduction.reference_uri

    greedy = GenerationMixin.generate

    def sampling(self, *args, **kwargs):  # a planted nondeterminism: sampling left on
        return greedy(self, *args, **{**kwargs, "do_sample": True, "temperature": 2.0, "top_k": 0})

    monkeypatch.setattr(GenerationMixin, "generate", sampling)
    upload_export(store, world["trained"], "sampled")
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "sampled", store.root))
    assert info.value.failure_class is FailureClass.infrastructure
    cause = info.value.cause
    assert cause.startswith("evaluation not reproducible: the base (content ")
    assert "items differently than in run 'again' on the same split" in cause
    assert "(then batch 5 on cpu, now batch 5 on cpu), over eval.max_irreproducible_fraction=0.02" in cause
    assert json.loads(Path(reference).read_text())["run_id"] == "again"  # a failed check leaves the reference
    print(cause)


def test_a_users_own_suite_file_is_scored_for_every_model_and_gated(world, store, tmp_path):
    """eval.suites names a JSONL file of the user's: every model answers its items, and its gates (at most
    `margin` below the base; no incumbent yet) decide on them, paired by item, naming the file's hash. The tests'
    random base answers none of them, so the suite cannot show forgetting: insufficient evidence, a data failure
    whose summary still carries every number (a candidate that answered nothing would have passed)."""
    import hashlib

    mine = tmp_path / "must-not-regress.jsonl"
    mine.write_text("".join(json.dumps({"input": f"date q {i}", "output": ANSWER}) + "\n" for i in range(12)))
    upload_export(store, world["trained"], "suite")
    # The tests' random base runs its suite answers to max_new_tokens, and they decode to nothing (a pre-trained
    # base answers its skills): the candidate stops there, so the cut-offs are the base's own, but the empty-answer
    # cap would hold the empty answers against the evaluation, so it is lifted here.
    suites = {"mine": {"source": str(mine), "margin": 0.2}}
    ctx = make_ctx(world, "suite", store.root, suites=suites, max_truncated_fraction=1.0)
    with pytest.raises(StageFailure) as unsure:
        evaluate_body(ctx)
    assert unsure.value.failure_class is FailureClass.data
    summary = unsure.value.summary
    assert isinstance(summary, EvaluateSummary) and summary.gates.passed  # the task's own gates passed

    [suite] = summary.suites
    assert (suite.name, suite.items, suite.sha256) == ("mine", 12, hashlib.sha256(mine.read_bytes()).hexdigest())
    assert suite.metrics["candidate"] == {"exact_match": 1.0} and suite.metrics["base"] == {"exact_match": 0.0}
    assert suite.metrics["incumbent"] is None
    candidate = summary.models["candidate"]
    assert candidate is not None and candidate.generations["mine"].model_dump() == {
        "answers": 12,
        "cut_off": 0,
        "empty": 0,
    }
    vs_base = suite.gates.verdicts[0]
    assert vs_base.gate == "max_regression_vs_base" and vs_base.outcome == "insufficient" and vs_base.n == 12
    assert vs_base.split_sha256 == suite.sha256
    assert vs_base.line.startswith(
        "suite mine: exact_match regression vs base <= 0.2: -1 [-1, -0.6571] (candidate 1, base 0; n=12"
    )
    assert vs_base.line.endswith("cannot show a loss at this margin; use items the base answers)")
    assert unsure.value.cause == vs_base.line
    scored = json.loads(store.read_text("runs/suite/stages/evaluate/item_scores.json"))
    assert scored["suites"]["mine"]["candidate"]["exact_match"] == [1.0] * 12
    assert [row.suite for row in summary.suite_rows()] == ["task", "mine"]

    # An item holding a special token's text asks or answers something else than its text says (the tokenizer
    # reads "<|im_end|>" as the end of the turn): a data failure naming the item, not a model verdict.
    mine.write_text(mine.read_text().replace(ANSWER, f"{ANSWER}<|im_end|>", 1))
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "suite", store.root, suites=suites, max_truncated_fraction=1.0))
    assert info.value.failure_class is FailureClass.data
    assert info.value.cause == (
        "suite mine: item mine:1's output holds '<|im_end|>', one of the tokenizer's special tokens, which it reads "
        "as that control token and not as text"
    )


def test_a_candidate_cut_off_on_a_suite_where_the_base_stops_is_scored_and_gated_as_forgetting(
    world, store, tmp_path, rambler
):
    """The forgetting demo's shape: the base answers a suite and stops; the candidate (the rambler) runs its
    answers to max_new_tokens there. The base shows the stop tokens end an answer on that suite, so the
    candidate's cut-off answers are its own: scored wrong, counted, and the suite's gate fails it as a modeling
    failure ("forgot"), not as an evaluation to re-run with a larger max_new_tokens."""
    mine = tmp_path / "skill.jsonl"
    mine.write_text("".join(json.dumps({"input": f"date q {i}", "output": ANSWER}) + "\n" for i in range(12)))
    upload_export(store, rambler, "forgot")
    suites = {"skill": {"source": str(mine), "margin": 0.2}}
    with pytest.raises(StageFailure) as info:
        evaluate_body(make_ctx(world, "forgot", store.root, base=world["trained"], suites=suites))
    assert info.value.failure_class is FailureClass.modeling
    summary = info.value.summary
    assert isinstance(summary, EvaluateSummary)
    candidate, base = present(summary.models["candidate"]), present(summary.models["base"])
    assert candidate.generations["skill"].model_dump() == {"answers": 12, "cut_off": 12, "empty": 0}
    assert base.generations["skill"].cut_off == 0
    [suite] = summary.suites
    assert suite.metrics["candidate"] == {"exact_match": 0.0} and suite.metrics["base"] == {"exact_match": 1.0}
    vs_base = suite.gates.verdicts[0]
    assert vs_base.gate == "max_regression_vs_base" and vs_base.outcome == "fail"
    assert vs_base.line.startswith("suite skill: exact_match regression vs base <= 0.2: +1 [")


def test_a_suite_the_data_stage_did_not_measure_is_a_data_failure_before_any_model_loads(world, store, tmp_path):
    """The data stage checked the suite's bytes against the training split; replaced since (by training rows, say),
    or added to eval.suites since, its items are unchecked: refused naming the suite, both hashes and the remedy,
    not scored under a hash no contamination check stands behind."""
    mine = tmp_path / "mine.jsonl"
    mine.write_text("".join(json.dumps({"input": f"capital {i}", "output": f"city {i}"}) + "\n" for i in range(40)))
    upload_export(store, world["trained"], "edited-suite")
    suites = {"mine": {"source": str(mine), "margin": 0.2}}
    ctx = make_ctx(world, "edited-suite", store.root, suites=suites)
    before = read_suite("mine", ctx.config.eval.suites["mine"], None).sha256
    mine.write_text("".join(json.dumps({"input": f"date q {i}", "output": ANSWER}) + "\n" for i in range(40)))
    after = read_suite("mine", ctx.config.eval.suites["mine"], None).sha256
    with pytest.raises(StageFailure) as edited:
        evaluate_body(ctx)
    assert edited.value.failure_class is FailureClass.data and edited.value.summary is None
    assert edited.value.cause.startswith(
        f"suite mine: {mine} is sha256 {after[:12]} now, not the {before[:12]} the data stage of run edited-suite "
        "measured against the training split (0 of 40 items overlapping): the file changed since"
    )
    assert "re-run data for this run: `tuneproof run --run-id edited-suite`" in edited.value.cause
    never = JobContext("edited-suite", "evaluate", ctx.config, {**ctx.params, "suites": []})
    with pytest.raises(StageFailure) as added:
        evaluate_body(never)
    assert added.value.failure_class is FailureClass.data
    assert added.value.cause.startswith(
        f"suite mine: {mine} (sha256 {after[:12]}) was never measured against the training split: the data stage "
        "of run edited-suite measured no suite"
    )
