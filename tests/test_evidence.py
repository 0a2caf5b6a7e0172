"""Evidence bound by content: a verdict names what it judged, and no path turns missing evidence into a pass.

Unit tests first (markers, export manifest, compare-and-swap, supersede planning, run names, promote's
reasons), then the paths a user takes on a finished run (integration, each on a private copy of the
session's demo run): a fine-tune rerun, then promote; an export edited after evaluation; a resume test
retried after a lost connection.
"""

from __future__ import annotations

import hashlib
import json

import pytest

from flows import pipeline
from tasks import promote as promote_tasks
from tasks.jobs import finetune_run_name
from tests.conftest import TEST_BUCKET, tuneproof
from tests.reading import entry_summary, present, production_pointer, summary_dict, summary_of
from tests.test_promote_task import EXPORT_FILES, EXPORT_SHA256, passed_record, with_export
from training.checkpoint_listing import check_complete
from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.control import stages as table
from tuneproof.control.record import StageEntry
from tuneproof.core import cas, markers
from tuneproof.core.config import PipelineConfig
from tuneproof.core.markers import FileDigest
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import EvaluateSummary, PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary

NAME = "dates-qwen2-tiny"


def digest(data: bytes) -> FileDigest:
    return FileDigest(size=len(data), sha256=hashlib.sha256(data).hexdigest())


# ---- markers and the export manifest --------------------------------------------------------------


def test_the_content_hash_covers_model_files_in_any_order_and_leaves_markers_out():
    files = {"model.safetensors": digest(b"w"), "config.json": digest(b"c")}
    same = dict(reversed(list(files.items())))
    with_markers = {**files, markers.EXPORT_MANIFEST: digest(b"m"), markers.COMPLETION_MARKER: digest(b"x")}
    assert markers.content_sha256(files) == markers.content_sha256(same) == markers.content_sha256(with_markers)
    assert markers.content_sha256({**files, "config.json": digest(b"C")}) != markers.content_sha256(files)


def test_digest_problems_name_each_missing_resized_or_changed_file():
    expected = {"a": digest(b"aaaa"), "b": digest(b"bb"), "c": digest(b"c")}
    present = {"a": digest(b"aaab"), "b": digest(b"b")}
    problems = markers.digest_problems(expected, present)
    assert problems[0].startswith("a (sha256 ") and "expected" in problems[0]
    assert problems[1:] == ["b (size 1 bytes, expected 2)", "c (missing, expected 1 bytes)"]


def test_a_shard_rewritten_with_the_same_size_makes_its_checkpoint_unusable(tmp_path):
    from tests.test_checkpointing import RUN, fake_checkpoint

    storage = Storage(str(tmp_path))
    parts = fake_checkpoint(storage, 4)
    assert check_complete(storage, *parts) is None
    storage.write_bytes(b"z" * 100, *parts, "__0_0.distcp")  # same size, other bytes
    problem = check_complete(storage, *parts)
    assert problem is not None and "__0_0.distcp (sha256 " in problem
    assert RUN[-1] in problem


def test_an_export_edited_after_its_manifest_is_named_file_by_file(tmp_path):
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    assert markers.verify_export(storage, "runs/r1/model").content_sha256 == EXPORT_SHA256
    storage.write_bytes(EXPORT_FILES["model.safetensors"][:-1] + b"!", "runs", "r1", "model", "model.safetensors")
    with pytest.raises(markers.ExportUnverified, match=r"model\.safetensors \(sha256 "):
        markers.verify_export(storage, "runs/r1/model")
    storage.remove("runs", "r1", "model", markers.EXPORT_MANIFEST)
    with pytest.raises(markers.ExportUnverified, match="has no content manifest"):
        markers.verify_export(storage, "runs/r1/model")


# ---- compare-and-swap -----------------------------------------------------------------------------


def cas_round(storage: Storage) -> None:
    parts = ("models", NAME, "production.json")
    assert cas.read_versioned(storage, *parts) == (None, None)
    assert cas.write_if(storage, b"v1", None, *parts)
    assert not cas.write_if(storage, b"again", None, *parts)  # create-only over an existing object
    data, first = cas.read_versioned(storage, *parts)
    assert data == b"v1"
    assert cas.write_if(storage, b"v2", first, *parts)
    assert not cas.write_if(storage, b"stale", first, *parts)
    data, second = cas.read_versioned(storage, *parts)
    assert data == b"v2" and second != first
    assert first is not None and second is not None
    assert not cas.delete_if(storage, first, *parts)
    assert cas.delete_if(storage, second, *parts)
    assert cas.read_versioned(storage, *parts) == (None, None)
    assert cas.honours_conditional_writes(storage, "probe", "cas") is None
    assert not storage.exists("probe", "cas")


def test_compare_and_swap_on_a_local_root(tmp_path):
    cas_round(Storage(str(tmp_path)))


@pytest.mark.integration
def test_compare_and_swap_on_s3_and_moto_honours_conditional_writes(s3_endpoint):
    cas_round(Storage(f"s3://{TEST_BUCKET}/cas-unit", s3_endpoint))


def test_a_store_that_ignores_conditions_is_a_verify_finding(tmp_path, monkeypatch):
    from training.verify import conditional_write_findings

    def blind_write(storage, data, expected, *parts, **kwargs):
        storage.write_bytes(data, *parts)
        return True

    monkeypatch.setattr(cas, "write_if", blind_write)
    problem = cas.honours_conditional_writes(Storage(str(tmp_path)), "probe", "cas")
    assert problem is not None and "accepted" in problem
    findings = conditional_write_findings({"uri": "s3://b/p", "ok": True, "conditional_writes": problem})
    assert len(findings) == 1 and findings[0].severity == "error" and "ignores If-Match" in findings[0].message
    assert conditional_write_findings({"uri": "s3://b/p", "ok": True, "conditional_writes": "honoured"}) == []


def test_a_lost_write_response_that_landed_is_success_not_a_conflict(tmp_path, monkeypatch):
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    real = cas.write_if

    def lands_but_answers_conflict(*args, **kwargs):
        real(*args, **kwargs)
        return False

    monkeypatch.setattr(cas, "write_if", lands_but_answers_conflict)
    card = registry.CardFacts(name=NAME, run_id="r1")
    pointer = registry.promote(storage, NAME, "r1", "runs/r1/model", card, None, content_sha256=EXPORT_SHA256)
    assert production_pointer(storage, NAME).version == pointer.version == "v0001-r1"
    assert pointer.content_sha256 == EXPORT_SHA256


@pytest.mark.integration
def test_the_s3_model_mirror_is_keyed_by_content_not_by_uri(s3_endpoint, tmp_path, monkeypatch):
    from training import modeling

    monkeypatch.setattr(modeling, "CACHE_ROOT", tmp_path / "model-cache")
    prefix = f"s3://{TEST_BUCKET}/mirror-unit/model"
    source = Storage(prefix, s3_endpoint)
    source.write_bytes(b'{"model_type": "qwen2"}', "config.json")
    source.write_bytes(b"old weights", "model.safetensors")
    first = modeling.materialize(prefix, s3_endpoint)
    assert modeling.materialize(prefix, s3_endpoint) == first
    source.write_bytes(b"new weights", "model.safetensors")  # a rerun rewrote the export under the same URI
    second = modeling.materialize(prefix, s3_endpoint)
    assert second != first
    assert (tmp_path / "model-cache" / second.rsplit("/", 1)[-1] / "model.safetensors").read_bytes() == b"new weights"


# ---- supersede planning, run names ----------------------------------------------------------------


def test_a_rerun_makes_itself_and_everything_downstream_stale():
    assert table.stale_after(["finetune"]) == ["finetune", "resume", "evaluate", "promote"]
    assert table.stale_after(["data"]) == ["data", "finetune", "resume", "evaluate", "promote"]
    assert table.stale_after(["evaluate"]) == ["evaluate", "promote"]
    assert table.stale_after(["verify"]) == ["verify"]


def test_supersede_moves_downstream_entries_and_clears_the_promotion():
    cfg = PipelineConfig()
    rec = passed_record(cfg)
    rec.stages["promote"] = StageEntry.skipped("promote", "x")
    rec.promotion = PromoteSummary(promoted=True)
    pipeline.supersede(rec, ["finetune"])
    assert rec.stages == {}
    assert [e.stage for e in rec.superseded] == ["finetune", "resume", "evaluate", "promote"]
    assert rec.promotion is None
    reasons = promote_tasks.refusal_reasons(cfg, rec)
    assert reasons and "no succeeded fine-tune" in reasons[0]


def test_each_finetune_invocation_has_its_own_ray_train_name_unless_it_continues():
    rec = passed_record(PipelineConfig(), "run1")
    assert finetune_run_name(rec, "run1", 1, continue_previous=False) == "run1"
    assert finetune_run_name(rec, "run1", 3, continue_previous=False) == "run1-r3"
    pipeline.supersede(rec, ["finetune"])
    assert finetune_run_name(rec, "run1", 3, continue_previous=True) == "run1"


def test_continuing_a_fine_tune_that_failed_without_a_summary_resumes_its_own_ray_train_run():
    rec = passed_record(PipelineConfig(), "run1")
    failed = rec.stages["finetune"].model_copy(update={"status": "failed", "summary": None, "invocation": 2})
    rec.stages["finetune"] = failed
    assert finetune_run_name(rec, "run1", 3, continue_previous=True) == "run1-r2"
    assert finetune_run_name(rec, "run1", 3, continue_previous=False) == "run1-r3"


# ---- promote's reasons ----------------------------------------------------------------------------


def test_promotion_refuses_evidence_about_other_content_or_another_lineage():
    cfg = PipelineConfig()
    rec = passed_record(cfg)
    assert promote_tasks.refusal_reasons(cfg, rec) == []
    other = passed_record(cfg)
    summary_dict(other, "evaluate")["models"]["candidate"]["content_sha256"] = "0" * 64
    assert "evaluation scored content 000000000000" in promote_tasks.refusal_reasons(cfg, other)[0]
    other = passed_record(cfg)
    summary_dict(other, "resume")["tested_run_name"] = "r1-r2"
    assert "tested Ray Train run r1-r2" in promote_tasks.refusal_reasons(cfg, other)[0]
    other = passed_record(cfg)
    summary_dict(other, "resume")["interrupted"] = False
    assert "no proof of an interruption" in promote_tasks.refusal_reasons(cfg, other)[0]


# ---- the paths a user takes (integration, each on a private copy of the demo run) ------------------


def pointer_bytes(storage: Storage) -> bytes:
    return storage.read_bytes("models", NAME, "production.json")


@pytest.mark.integration
def test_a_finetune_rerun_trains_under_its_own_name_and_its_stale_evidence_is_never_promoted(clone_run):
    storage, before = clone_run.storage, pointer_bytes(clone_run.storage)
    rerun = tuneproof("run", "--only", "finetune", "--run-id", "demo", *clone_run.args, "--set", "train.max_steps=110")
    assert rerun.exit_code == 0, rerun.output
    rec = records.load(storage, "demo")
    finetune = summary_of(rec, "finetune", FinetuneSummary)
    assert finetune.run_name == "demo-r2" and finetune.start_step == 0 and finetune.steps == 110
    assert finetune.export_path == "runs/demo/model-demo-r2" and finetune.invocation == 2
    assert [e.stage for e in rec.superseded] == ["finetune", "resume", "evaluate", "promote"]
    assert present(rec.invocations[-1].config)["train"]["max_steps"] == 110 and rec.config["train"]["max_steps"] == 110
    assert rec.config_hash == rec.invocations[-1].config_hash != rec.invocations[0].config_hash

    promote = tuneproof("run", "--only", "promote", "--run-id", "demo", *clone_run.args, "--set", "train.max_steps=110")
    assert promote.exit_code != 0, promote.output
    rec = records.load(storage, "demo")
    assert "evaluate did not run for the current fine-tune" in (rec.stages["promote"].cause or "")
    assert "superseded" in (rec.stages["promote"].cause or "")
    assert pointer_bytes(storage) == before
    shown = tuneproof("runs", "show", "demo", *clone_run.args)
    assert shown.exit_code == 0 and "superseded" in shown.output


@pytest.mark.integration
def test_continuing_a_finished_finetune_with_nothing_left_to_train_is_refused(clone_run):
    # Clones share the session's Ray head and run id: a job-free invocation first (promote, refused) makes
    # this fine-tune invocation 3, so its submission id differs from the rerun test's demo-finetune-r2.
    tuneproof("run", "--only", "promote", "--run-id", "demo", *clone_run.args)
    result = tuneproof(
        "run", "--only", "finetune", "--run-id", "demo", *clone_run.args, "--set", "train.continue_previous=true"
    )
    assert result.exit_code == 6, result.output
    entry = records.load(clone_run.storage, "demo").stages["finetune"]
    assert (
        entry.failure_class == "modeling"
        and "nothing to train" in (entry.cause or "")
        and "max_steps" in (entry.cause or "")
    )


@pytest.mark.integration
def test_an_export_edited_after_evaluation_is_not_promoted(clone_run, finished_run):
    storage, before = clone_run.storage, pointer_bytes(clone_run.storage)
    evaluated = present(summary_of(finished_run.record, "evaluate", EvaluateSummary).models["candidate"]).content_sha256
    assert evaluated == summary_of(finished_run.record, "finetune", FinetuneSummary).export_sha256
    assert json.loads(before)["content_sha256"] == evaluated
    config = storage.read_json("runs", "demo", "model", "config.json")
    storage.write_json({**config, "tampered": True}, "runs", "demo", "model", "config.json")
    result = tuneproof("run", "--only", "promote", "--run-id", "demo", *clone_run.args)
    assert result.exit_code == 4, result.output
    cause = records.load(storage, "demo").stages["promote"].cause
    assert "does not match its manifest" in (cause or "") and "config.json (" in (cause or "")
    assert pointer_bytes(storage) == before


def test_an_unreadable_production_pointer_is_an_input_of_evaluate_not_an_error_of_the_run(tmp_path):
    # A continued run reads every stage's inputs before any runs: the pointer read there must not end the run.
    storage, cfg = Storage(str(tmp_path)), PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage.write_bytes(b"{not json", "models", cfg.model.name, "production.json")
    record = records.new_record("r1", cfg, records.CodeIdentity(), "flow-run")
    external = table.by_name("evaluate").external
    assert external is not None
    seen = external(cfg, storage, record)
    assert seen["registry.production"].startswith("unreadable: ") and "production.json" in seen["registry.production"]


@pytest.mark.integration
def test_an_unreadable_production_pointer_fails_evaluate_as_infrastructure_and_is_left_as_it_was(clone_run):
    # No candidate is scored against an incumbent nobody can name, and the run ends failed, not crashed.
    storage = clone_run.storage
    storage.write_bytes(b"{not json", "models", NAME, "production.json")
    result = tuneproof("run", "--only", "evaluate", "--run-id", "demo", *clone_run.args)
    assert result.exit_code == 4, result.output
    rec = records.load(storage, "demo")
    entry = rec.stages["evaluate"]
    assert (rec.status, entry.status, entry.failure_class) == ("failed", "failed", "infrastructure")
    assert "production.json: not a JSON production pointer" in (entry.cause or ""), entry.cause
    assert entry.jobs == [] and "unreadable: " in present(entry.inputs).needs["registry.production"]
    assert pointer_bytes(storage) == b"{not json"


@pytest.mark.integration
def test_a_resume_test_retried_after_a_lost_connection_still_proves_an_interruption(clone_run, monkeypatch):
    from flows import stage_tasks
    from tasks.rayjob import RayJobRunner
    from tasks.resume import resume_test

    # The retry itself is the point, not the 5 s Prefect waits before it (as in tests/test_backbone.py).
    monkeypatch.setitem(stage_tasks.TASKS, "resume", resume_test.with_options(retry_delay_seconds=0))

    real_follow, lost = RayJobRunner.follow, list[str]()

    def follow_then_lose_the_connection(self, sid, timeout_s, stop_when=None):
        status = real_follow(self, sid, timeout_s, stop_when)
        if "-resume-t" in sid and not lost:
            lost.append(sid)  # the job ran to its end; the task only learns of it after a retry
            raise ConnectionError(f"lost the dashboard while following {sid}")
        return status

    monkeypatch.setattr(RayJobRunner, "follow", follow_then_lose_the_connection)
    result = tuneproof("run", "--only", "resume", "--run-id", "demo", *clone_run.args)
    assert lost, "the fault was never injected"
    entry = records.load(clone_run.storage, "demo").stages["resume"]
    if entry.ok:
        summary = entry_summary(entry, ResumeSummary)
        assert result.exit_code == 0, result.output
        assert summary.interrupted and summary.restored_step == summary.interrupted_at_step
        # The retry attached to t1's ended job and read its verdict: a retry never re-rolls one (tasks/rayjob.py).
        assert summary.attempt_run_name == "demo-resume-t1-r2" and summary.tested_run_name == "demo"
    else:
        assert result.exit_code == 4 and entry.failure_class == "infrastructure", result.output


def test_runs_show_prints_a_finetune_that_logged_no_loss():
    from io import StringIO

    from rich.console import Console

    from tuneproof.app.terminal import print_record

    rec = passed_record(PipelineConfig())
    summary_dict(rec, "finetune").update(first_loss=None, final_loss=None, steps=0)
    pipeline.supersede(rec, ["evaluate"])
    out = StringIO()
    print_record(rec, Console(file=out, width=200))
    assert "loss n/a -> n/a in 0 steps" in out.getvalue()
    assert "superseded" in out.getvalue() and "evaluate" in out.getvalue()
