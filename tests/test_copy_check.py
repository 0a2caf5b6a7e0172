"""The registry copy is loaded from the registry's own bytes and scored before the pointer moves.

Unit tests for the pure parts (which items, what counts as different); then, on a private copy of the
session's demo run (integration), the demo's own promotion passed the check, and a corruption planted
between the copy and the pointer move (weights swapped for the untrained base's, with a manifest to
match, so only scoring can tell) stops the promotion as infrastructure with the pointer unchanged.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from eval.copy_check import score_differences
from tasks.promote import COPY_CHECK_EXAMPLES, copy_check_slice, promote
from tests.conftest import tuneproof
from tests.reading import entry_summary, present
from tests.test_promote_task import passed_record, stage_call, with_export
from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.core import markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import EvaluateSummary, GateDecision, PromoteSummary


def test_scores_that_differ_are_named_and_equal_ones_are_not():
    assert score_differences({"exact_match": 0.9375}, {"exact_match": 0.9375}) == []
    assert score_differences({"exact_match": 0.9375}, {"exact_match": 0.0}) == [
        "exact_match: evaluate 0.9375, copy 0.0"
    ]
    assert score_differences({"exact_match": 1.0}, {}) == ["exact_match: evaluate 1.0, copy None"]


def evaluation(uri: str | None) -> EvaluateSummary:
    return EvaluateSummary(
        models={}, gates=GateDecision(passed=True, lines=[], verdicts=[]), predictions_uri=uri, examples=3
    )


def test_the_slice_is_the_first_saved_candidate_answers(tmp_path):
    storage = Storage(str(tmp_path))
    rows: list[dict[str, str | None]] = [
        {"prompt": f"p{i}", "reference": f"r{i}", "candidate": f"a{i}", "base": "x"} for i in range(40)
    ]
    rows[1]["candidate"] = None  # a row without a candidate answer cannot be compared
    storage.write_bytes("\n".join(map(json.dumps, rows)).encode(), "runs", "r1", "stages", "evaluate", "p.jsonl")
    items = present(copy_check_slice(storage, evaluation(storage.uri("runs", "r1", "stages", "evaluate", "p.jsonl"))))
    assert len(items["prompts"]) == COPY_CHECK_EXAMPLES and items["prompts"][:2] == ["p0", "p2"]
    assert items["references"][1] == "r2" and items["answers"][1] == "a2"
    assert copy_check_slice(storage, evaluation(None)) is None
    assert copy_check_slice(storage, evaluation("s3://elsewhere/p.jsonl")) is None


def test_an_evaluation_that_saved_no_answers_refuses_the_promotion(tmp_path):
    # eval.predictions_cap 0 (or a record of a release without the floor) saved no answers, and promotion went
    # ahead with the registry copy unscored.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    entry = promote.fn(stage_call(cfg, passed_record(cfg)))  # its evaluation has no predictions file
    assert (entry.status, entry.failure_class) == ("failed", "modeling")
    assert "evaluate saved no candidate answers (no predictions file) to score the registry copy" in (entry.cause or "")
    assert f"rerun evaluate with eval.predictions_cap >= {COPY_CHECK_EXAMPLES}" in (entry.cause or "")
    assert not storage.exists("models")


@pytest.mark.integration
def test_the_demo_promotion_scored_its_registry_copy(finished_run):
    promotion = finished_run.record.stages["promote"]
    check = entry_summary(promotion, PromoteSummary).copy_check
    assert check is not None and check.passed and check.examples == COPY_CHECK_EXAMPLES
    assert check.copy_scores == check.evaluate_scores and check.model_path.startswith("models/")
    assert [j.submission_id for j in promotion.jobs] == ["demo-promote-copy-check"]


@pytest.mark.integration
def test_a_corruption_planted_between_the_copy_and_the_pointer_move_is_caught(clone_run, monkeypatch):
    storage = clone_run.storage
    shutil.rmtree(Path(storage.root) / "models")  # start over: no production model, as the demo found it
    base = Path(next(s for s in clone_run.sets if s.startswith("model.source=")).split("=", 1)[1])
    real_check = registry._check_copy

    def check_then_corrupt(st, name, version, content):
        real_check(st, name, version, content)
        plant_base_weights(st, (registry.MODELS, name, version), base)

    monkeypatch.setattr(registry, "_check_copy", check_then_corrupt)
    result = tuneproof("run", "--only", "promote", "--run-id", "demo", *clone_run.args)
    assert result.exit_code == 4, result.output
    entry = records.load(storage, "demo").stages["promote"]
    assert entry.failure_class == "infrastructure" and "scores differently" in (entry.cause or ""), entry.cause
    check = entry_summary(entry, PromoteSummary).copy_check
    assert check is not None and not check.passed and check.copy_scores != check.evaluate_scores
    name = records.load(storage, "demo").config["model"]["name"]
    assert registry.read_pointer(storage, name) == (None, None)
    assert registry.versions(storage, name) == []  # the checked copy is removed


def plant_base_weights(storage: Storage, parts: tuple[str, ...], base: Path) -> None:
    """The copy's weights become the untrained base's, and its manifest is rewritten to match them: a
    corruption no hash check of the copy can see."""
    data = (base / "model.safetensors").read_bytes()
    storage.write_bytes(data, *parts, "model.safetensors")
    manifest = markers.read_export_manifest(storage, *parts)
    files = {**manifest.files, "model.safetensors": markers.FileDigest(size=len(data), sha256=_sha(data))}
    rewritten = manifest.model_copy(update={"files": files, "content_sha256": markers.content_sha256(files)})
    storage.write_bytes(rewritten.model_dump_json().encode(), *parts, markers.EXPORT_MANIFEST)


def _sha(data: bytes) -> str:
    import hashlib

    return hashlib.sha256(data).hexdigest()
