"""Promotion on the Prefect side: when promotion is refused, the stale-incumbent guard, and the logged override."""

from __future__ import annotations

import asyncio
import contextvars
import hashlib
import io
import json
import threading

import pytest
from typer.testing import CliRunner

from tasks import promote as promote_tasks
from tasks.jobs import StageCall
from tasks.promote import forced_promotion, model_card, move_pointer, refusal_reasons, roll_back
from tests.reading import entry_summary, present, production_pointer, summary_dict, summary_of
from tuneproof.app.cli import app
from tuneproof.control import lease as leases
from tuneproof.control import record as records
from tuneproof.control import registry
from tuneproof.control.history import Move
from tuneproof.control.lease import Lease, LeaseInfo, LeaseLost
from tuneproof.control.record import (
    CodeIdentity,
    Invocation,
    JobEntry,
    RunRecord,
    RuntimeEnvAdditions,
    StageEntry,
    StageInputs,
    new_record,
)
from tuneproof.core import config_reads
from tuneproof.core.config import PipelineConfig
from tuneproof.core.markers import EXPORT_MANIFEST, ExportManifest, FileDigest, content_sha256
from tuneproof.core.results import StageResult, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import CopyCheckSummary, EvaluateSummary, GateDecision, ModelScore, PromoteSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary


def export_files(run_id: str) -> dict[str, bytes]:
    """A run's export: weights of its own, so two runs' models are different content (the registry mints no
    duplicate version of the bytes production serves)."""
    return {"config.json": b'{"model_type": "qwen2"}', "model.safetensors": f"weights of {run_id}".encode()}


def export_digests(run_id: str) -> dict[str, FileDigest]:
    return {n: FileDigest(size=len(d), sha256=hashlib.sha256(d).hexdigest()) for n, d in export_files(run_id).items()}


def export_sha256(run_id: str) -> str:
    return content_sha256(export_digests(run_id))


EXPORT_FILES, EXPORT_SHA256 = export_files("r1"), export_sha256("r1")


def passed_record(cfg: PipelineConfig, run_id: str = "r1") -> RunRecord:
    """A run whose fine-tune, resume test and evaluation (of the export's content hash) all passed."""
    rec = new_record(run_id, cfg, CodeIdentity(git_sha="abc", dirty=False), None)
    rec.stages["finetune"] = StageEntry.succeeded(
        "finetune",
        FinetuneSummary(
            run_name=run_id,
            train_storage_uri="t",
            checkpoints=[],
            start_step=0,
            steps=400,
            seconds=1.0,
            export_path=f"runs/{run_id}/model",
            export_sha256=export_sha256(run_id),
        ),
        "a",
    )
    rec.stages["resume"] = StageEntry.succeeded(
        "resume",
        ResumeSummary(
            interrupted=True, interrupted_at_step=304, restored_step=304, max_loss_diff=0.0, tested_run_name=run_id
        ),
        "a",
    )
    gates = GateDecision(passed=True, lines=["exact_match >= 0.8: 1 (pass)"], verdicts=[])
    models = {
        "candidate": ModelScore(
            path=f"runs/{run_id}/model", metrics={"exact_match": 1.0}, seconds=1.0, content_sha256=export_sha256(run_id)
        ),
        "base": ModelScore(path="base", metrics={"exact_match": 0.0}, seconds=1.0),
        "incumbent": None,
    }
    rec.stages["evaluate"] = StageEntry.succeeded(
        "evaluate", EvaluateSummary(models=models, gates=gates, examples=300), "a"
    )
    return rec


def with_export(storage: Storage, run_id: str) -> None:
    """An export as the fine-tune leaves it: its files and a manifest with their hashes."""
    for name, data in export_files(run_id).items():
        storage.write_bytes(data, "runs", run_id, "model", name)
    manifest = ExportManifest(
        content_sha256=export_sha256(run_id),
        files=export_digests(run_id),
        run_id=run_id,
        run_name=run_id,
        step=400,
        written_at="t",
    )
    storage.write_bytes(manifest.model_dump_json().encode(), "runs", run_id, "model", EXPORT_MANIFEST)


def with_predictions(storage: Storage, rec: RunRecord) -> RunRecord:
    """`rec` whose evaluation saved its candidate answers (the copy check's items) under its run."""
    rows = [{"prompt": f"p{i}", "reference": f"r{i}", "candidate": f"r{i}"} for i in range(40)]
    parts = ("runs", rec.run_id, "stages", "evaluate", "predictions.jsonl")
    storage.write_bytes("\n".join(map(json.dumps, rows)).encode(), *parts)
    summary_dict(rec, "evaluate")["predictions_uri"] = storage.uri(*parts)
    return rec


def stage_call(cfg: PipelineConfig, rec: RunRecord) -> StageCall:
    """The flow's call of the promote stage on `rec`."""
    return StageCall(
        stage="promote",
        cfg=cfg,
        run_id=rec.run_id,
        invocation=1,
        timeout_s=60,
        summary=PromoteSummary,
        inputs={},
        record=rec,
    )


def promoted_on_evidence(cfg: PipelineConfig, run_id: str, incumbent: str | None) -> RunRecord:
    """Run `run_id` exported, evaluated against `incumbent`, saved and promoted by the flow's move_pointer."""
    storage = Storage.from_config(cfg.storage)
    with_export(storage, run_id)
    rec = passed_record(cfg, run_id)
    summary_dict(rec, "evaluate")["incumbent_version"] = incumbent
    records.save(storage, rec)
    assert move_pointer(cfg, rec, "t", forced=None).ok
    return rec


READS = {
    "finetune": ["model.source", "storage.root", "train.lr"],
    "resume": ["storage.root", "train.lr"],
    "evaluate": ["eval.gates", "model.name", "model.source", "storage.root"],
}
"""Settings each evidence stage read, as the flow observes them (a few of the real ones)."""


def with_inputs(rec: RunRecord, cfg: PipelineConfig) -> RunRecord:
    """`rec` whose evidence stages record their inputs as the flow does: each setting they read (READS), hashed."""
    for stage, reads in READS.items():
        observed = config_reads.reads_hashes(cfg.model_dump(mode="json"), reads)
        rec.stages[stage].inputs = StageInputs(key=stage, config=observed, working_dir_hash="wd")
    return rec


def test_promotion_needs_the_resume_test_and_every_gate():
    cfg = PipelineConfig()
    rec = passed_record(cfg)
    assert refusal_reasons(cfg, rec) == []
    rec.stages["resume"].status = "failed"
    rec.stages["resume"].cause = "checkpoint_000300 incomplete: missing __0_0.distcp"
    summary_dict(rec, "evaluate")["gates"]["passed"] = False
    reasons = refusal_reasons(cfg, rec)
    assert len(reasons) == 2 and "missing __0_0.distcp" in reasons[0] and "gates not passed" in reasons[1]
    disabled = PipelineConfig.model_validate({"resume": {"enabled": False}})
    assert "resume test disabled" in refusal_reasons(disabled, passed_record(disabled))[0]


def test_a_production_model_that_changed_since_evaluation_is_not_overwritten(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    with_export(storage, "r2")
    first = move_pointer(cfg, passed_record(cfg, "r1"), "t", forced=None)
    assert first.status == "succeeded"
    stale = move_pointer(cfg, passed_record(cfg, "r2"), "t", forced=None)  # evaluated with no incumbent
    assert stale.status == "failed" and "changed since evaluation" in (stale.cause or "")
    assert production_pointer(storage, cfg.model.name).run_id == "r1"


def test_promoting_again_a_run_that_is_already_production_keeps_its_version_and_its_previous(tmp_path):
    # A continuation of a run whose flow died after the pointer swap, before the record was saved: its
    # promote runs again against the evaluation's incumbent (the one before it) and must find its own
    # promotion, neither refusing ("changed since evaluation") nor copying a second version of itself.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    with_export(storage, "r2")
    first = move_pointer(cfg, passed_record(cfg, "r1"), "t", forced=None).summary_as(PromoteSummary)
    second_rec = passed_record(cfg, "r2")
    assert first is not None
    summary_dict(second_rec, "evaluate")["incumbent_version"] = first.version
    second = move_pointer(cfg, second_rec, "t", forced=None).summary_as(PromoteSummary)
    assert second is not None
    again = move_pointer(cfg, second_rec, "t2", forced=None)
    assert again.status == "succeeded"
    repeated = entry_summary(again, PromoteSummary)
    assert (repeated.version, repeated.previous_version) == (second.version, first.version) == ("v0002-r2", "v0001-r1")
    assert repeated.promoted_at == second.promoted_at  # the first promotion's, not a new one
    assert storage.listdir("models", cfg.model.name) == sorted(["v0001-r1", "v0002-r2", registry.POINTER, "history"])


def test_a_candidate_with_the_bytes_production_serves_mints_no_duplicate_version_and_fails_nothing(tmp_path):
    # Two runs that trained the same bytes (a deterministic rerun): the second promotion minted v0002-r2, a copy of
    # v0001-r1 whose rollback would change nothing that serves.
    import shutil

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    promoted_on_evidence(cfg, "r1", None)
    shutil.copytree(tmp_path / "runs" / "r1" / "model", tmp_path / "runs" / "r2" / "model")
    rec = with_predictions(storage, passed_record(cfg, "r2"))
    summary_dict(rec, "finetune")["export_sha256"] = EXPORT_SHA256
    summary_dict(rec, "evaluate")["models"]["candidate"]["content_sha256"] = EXPORT_SHA256
    summary_dict(rec, "evaluate")["incumbent_version"] = "v0001-r1"
    entry = move_pointer(cfg, rec, "t", forced=None)
    why = f"{cfg.model.name} v0001-r1 (run r1) already serves this content ({EXPORT_SHA256[:12]}): no duplicate version minted"
    assert (entry.status, entry.failure_class, entry.cause) == ("skipped", None, why)
    assert entry_summary(entry, PromoteSummary) == PromoteSummary(
        promoted=False, reasons=[why], content_sha256=EXPORT_SHA256
    )
    assert storage.listdir("models", cfg.model.name) == ["history", registry.POINTER, "v0001-r1"]
    assert production_pointer(storage, cfg.model.name).run_id == "r1"
    # The stage itself, evaluated before r1 was promoted (the pointer moved since): those bytes serve now, so it
    # neither copies (nor runs the copy check) nor refuses as "changed since evaluation".
    summary_dict(rec, "evaluate")["incumbent_version"] = None
    staged = promote_tasks.promote.fn(stage_call(cfg, rec))
    assert (staged.status, staged.cause, staged.jobs) == ("skipped", why, [])
    assert storage.listdir("models", cfg.model.name) == ["history", registry.POINTER, "v0001-r1"]
    rec.stages["promote"] = staged  # `runs show` says it was not needed, not that it was refused
    shown = rec.model_copy(update={"promotion": entry_summary(staged, PromoteSummary)})
    assert promotion_line(shown) == f"promotion: not needed: {why}"


def test_an_unreadable_pointer_refuses_the_promotion_and_is_left_as_it_was(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    storage.write_bytes(b'{"version": "v0001-x"}', "models", cfg.model.name, registry.POINTER)
    entry = move_pointer(cfg, passed_record(cfg, "r1"), "t", forced=None)
    assert (entry.status, entry.failure_class) == ("failed", "infrastructure")
    assert "not a production pointer (name: Field required" in (entry.cause or "")
    assert storage.read_bytes("models", cfg.model.name, registry.POINTER) == b'{"version": "v0001-x"}'
    assert storage.listdir("models", cfg.model.name) == [registry.POINTER]  # no version copied


def test_forced_promotion_is_recorded_with_who_and_why(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    rec = passed_record(cfg)
    summary_dict(rec, "evaluate")["gates"]["passed"] = False
    records.save(storage, rec)
    refused = CliRunner().invoke(app, ["promote", "r1", "--set", f"storage.root={tmp_path}"])
    assert refused.exit_code == 2 and "--force" in refused.output
    result = forced_promotion(cfg, "r1", "hotfix approved by the model owner", "alice")
    assert result.forced is not None
    assert result.promoted is True and result.forced.by == "alice"
    saved = records.load(storage, "r1")
    assert saved.overrides[0].reason == "hotfix approved by the model owner"
    assert "evaluation gates not passed" in saved.overrides[0].bypassed[0]
    card = storage.read_text("models", cfg.model.name, present(result.version), "MODEL_CARD.md")
    assert "hotfix approved by the model owner" in card
    listed = CliRunner().invoke(app, ["models", "list", "--json", "--set", f"storage.root={tmp_path}"])
    assert json.loads(listed.output)[0]["production"]["run_id"] == "r1"


def test_evidence_reached_under_other_settings_is_not_promoted():
    # `--only promote` with stricter gates, or under another model's config, promoted on the evaluation (and the
    # fine-tune) the old config had passed: the verdict was not about the config now promoting.
    model_a = {"name": "model-a", "source": "Qwen/Qwen2.5-0.5B"}
    ran = PipelineConfig.model_validate({"model": model_a})
    rec = with_inputs(passed_record(ran), ran)
    assert refusal_reasons(ran, rec) == []
    stricter = PipelineConfig.model_validate({"model": model_a, "eval": {"gates": {"exact_match": {"min": 0.99}}}})
    assert refusal_reasons(stricter, rec) == [
        "evaluate ran with other settings than this config gives: eval.gates; rerun evaluate with this config, "
        "or promote with the config it ran with"
    ]
    other = PipelineConfig.model_validate({"model": {"name": "model-b", "source": "Qwen/Qwen2.5-7B"}})
    reasons = refusal_reasons(other, rec)
    assert [r.split(";")[0].split(": ")[1] for r in reasons] == ["model.source", "model.name, model.source"]
    assert reasons[0].startswith("finetune ran with other settings") and reasons[1].startswith("evaluate ")
    moved = PipelineConfig.model_validate({"model": model_a, "storage": {"root": "/elsewhere"}})
    assert refusal_reasons(moved, rec) == []  # a run moved or cloned: where its files are is not what was judged


def test_an_evaluation_of_a_split_prepared_from_another_eval_source_is_not_promoted():
    """`--only evaluate,promote` after data.eval_source changed scored the old file's eval split and promoted: no
    evaluate or fine-tune job reads a data.* source setting, so only the data stage's reads can tell."""
    ran = PipelineConfig.model_validate({"data": {"eval_source": "/data/old-eval.jsonl"}})
    rec = with_inputs(passed_record(ran), ran)
    prepared = DataSummary(dataset_path="datasets/d/abc", content_hash="abc", dataset_uri="/x")
    rec.stages["data"] = StageEntry.succeeded("data", prepared, "a")
    observed = config_reads.reads_hashes(ran.model_dump(mode="json"), ["data.eval_source", "data.source"])
    rec.stages["data"].inputs = StageInputs(key="data", config=observed, working_dir_hash="wd")
    assert refusal_reasons(ran, rec) == []
    new_eval = PipelineConfig.model_validate({"data": {"eval_source": "/data/new-eval.jsonl"}})
    assert refusal_reasons(new_eval, rec) == [
        "data ran with other settings than this config gives: data.eval_source; rerun data with this config, "
        "or promote with the config it ran with"
    ]


def test_the_card_names_what_the_fine_tune_ran_under_not_a_later_promote_only_config():
    ran = PipelineConfig.model_validate({"model": {"source": "Qwen/Qwen2.5-0.5B"}})
    rec = passed_record(ran)
    rec.invocations = [Invocation(number=1, at="t1", config_hash=ran.config_hash(), config=ran.model_dump(mode="json"))]
    later = PipelineConfig.model_validate({"model": {"source": "Qwen/Qwen2.5-7B"}})
    # `--only promote` under `later`: the record takes its config, the fine-tune stays invocation 1's
    rec.config, rec.config_hash = later.model_dump(mode="json"), later.config_hash()
    rec.invocations.append(Invocation(number=2, at="t2", config_hash=later.config_hash(), only=["promote"]))
    facts = model_card(later, rec)
    assert (facts.base_model, facts.config_hash) == ("Qwen/Qwen2.5-0.5B", ran.config_hash())


def test_a_rolled_back_model_is_promoted_again_only_by_the_override(tmp_path):
    # A plain rerun of the rolled-back run's promote stage put it back in production, undoing the rollback.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    promoted_on_evidence(cfg, "r1", None)
    promoted_on_evidence(cfg, "r2", "v0001-r1")
    assert roll_back(cfg, cfg.model.name, "v2 answers in the wrong format", "bob", None).rolled_back
    rec = records.load(storage, "r2")
    again = move_pointer(cfg, rec, "t2", forced=None)
    assert (again.status, again.failure_class) == ("failed", "modeling")
    assert f"v0002-r2, this content ({export_sha256('r2')[:12]}), was rolled back by bob (history #3)" in (
        again.cause or ""
    )
    assert "v2 answers in the wrong format; only `tuneproof promote r2 --force --reason ...`" in (again.cause or "")
    rec.rollbacks = []  # the record's note was lost: the history alone says so
    assert "was rolled back by bob" in (move_pointer(cfg, rec, "t3", forced=None).cause or "")
    assert production_pointer(storage, cfg.model.name).version == "v0001-r1"
    forced = forced_promotion(cfg, "r2", "the downstream parser is fixed", "ana")
    assert forced.promoted and "was rolled back by bob" in present(forced.forced).bypassed[-1]
    assert "was rolled back by bob" in records.load(storage, "r2").overrides[0].bypassed[-1]


def promotion_line(rec: RunRecord) -> str:
    """The `promotion:` line `runs show` prints for `rec`."""
    from rich.console import Console

    from tuneproof.app.terminal import print_record

    out = io.StringIO()
    print_record(rec, Console(file=out, width=400, no_color=True))
    return next(line.strip() for line in out.getvalue().splitlines() if line.strip().startswith("promotion:"))


def test_a_rolled_back_promotion_is_never_shown_as_still_in_production(tmp_path):
    # `runs show` said "still in production" right above the record's own "rolled back" line.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    promoted_on_evidence(cfg, "r1", None)
    promoted_on_evidence(cfg, "r2", "v0001-r1")
    promotion = PromoteSummary(promoted=True, name=cfg.model.name, version="v0002-r2")  # as live_promotion keeps it
    rec = records.load(storage, "r2").model_copy(update={"promotion": promotion})  # its promote entry superseded
    assert promotion_line(rec).startswith(
        "promotion: promoted v0002-r2 earlier in this run and in production when the run last ended"
    )
    assert roll_back(cfg, cfg.model.name, "v2 answers in the wrong format", "bob", None).rolled_back
    rec = records.load(storage, "r2").model_copy(update={"promotion": promotion})
    assert promotion_line(rec) == "promotion: promoted v0002-r2, since rolled back to v0001-r1 (history #3)"
    rec.stages["promote"] = StageEntry.succeeded("promote", promotion, "t")  # on current evidence: the same
    assert promotion_line(rec) == "promotion: promoted v0002-r2, since rolled back to v0001-r1 (history #3)"


def test_runs_show_names_who_approved_a_promotion(tmp_path):
    from tuneproof.app.terminal import promotion_verdict
    from tuneproof.core.summaries_eval import ApprovalAnswer

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    answer = ApprovalAnswer(approve=True, by="bob", comment="looks right", at="2026-12-07T16:00:00+00:00")
    promotion = PromoteSummary(promoted=True, name=cfg.model.name, version="v0001-r1", approval=answer)
    rec = passed_record(cfg, "r1")
    rec.stages["promote"] = StageEntry.succeeded("promote", promotion, "t")
    assert promotion_verdict(rec, promotion) == "promoted v0001-r1, approved by bob (looks right)"


def test_a_history_artifact_that_cannot_be_published_does_not_fail_a_promotion(tmp_path, monkeypatch):
    # The artifact API raised after the swap: the stage was recorded failed while production served its model.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    rec = with_predictions(storage, passed_record(cfg))
    monkeypatch.setattr(promote_tasks, "copy_checker", lambda *args: lambda path: None)  # no Ray job here

    def api_down(*args: object, **kwargs: object) -> None:
        raise ConnectionError("prefect API: connection refused")

    monkeypatch.setattr(promote_tasks, "create_markdown_artifact", api_down)
    entry = promote_tasks.promote.fn(stage_call(cfg, rec))
    assert entry.ok, entry.cause
    assert production_pointer(storage, cfg.model.name).run_id == "r1"


def approved_through_the_stage(
    tmp_path, monkeypatch, approve: bool, comment: str = "looks right"
) -> tuple[StageEntry, Storage, PipelineConfig]:
    """promote_stage under promote.require_approval, bob answering the form (no Prefect pause, no Ray job)."""
    import flows.approval
    from flows import stage_tasks

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "promote": {"require_approval": True}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    rec = with_predictions(storage, passed_record(cfg))
    form = flows.approval.Approval(approve=approve, approver=" bob ", comment=comment)
    monkeypatch.setattr(flows.approval, "ask_for_approval", lambda cfg, record: form)
    monkeypatch.setattr(promote_tasks, "promote", promote_tasks.promote.fn)  # the task's body, no Prefect API
    monkeypatch.setattr(promote_tasks, "copy_checker", lambda *args: lambda path: None)
    monkeypatch.setattr(promote_tasks, "create_markdown_artifact", lambda *args, **kwargs: None)
    return stage_tasks.promote_stage(stage_call(cfg, rec)), storage, cfg


def test_an_approved_promotion_names_its_approver_on_the_summary_the_card_and_the_history(tmp_path, monkeypatch):
    # The history said "by root@vm: every gate and the resume test passed" and nothing kept who approved.
    entry, storage, cfg = approved_through_the_stage(tmp_path, monkeypatch, approve=True)
    assert entry.ok, entry.cause
    summary = entry_summary(entry, PromoteSummary)
    approval = present(summary.approval)
    assert (approval.approve, approval.by, approval.comment) == (True, "bob", "looks right")
    version = present(summary.version)
    assert present(registry.read_card(storage, cfg.model.name, version).approval).by == "bob"
    card = storage.read_text("models", cfg.model.name, version, "MODEL_CARD.md")
    assert "after every gate and the resume test passed and bob approved it (looks right)" in card
    move = registry.read_history(storage, cfg.model.name)[-1]
    assert (move.kind, move.by) == ("promote", "bob")
    assert move.reason == "every gate and the resume test passed; approved: looks right"


def test_a_refused_approval_names_who_refused_and_moves_nothing(tmp_path, monkeypatch):
    entry, storage, cfg = approved_through_the_stage(tmp_path, monkeypatch, approve=False, comment="")
    assert (entry.status, entry.failure_class, entry.cause) == (
        "failed",
        "modeling",
        "approval refused by bob: no comment",
    )
    assert present(entry_summary(entry, PromoteSummary).approval).by == "bob"
    assert registry.read_pointer(storage, cfg.model.name)[0] is None


@pytest.mark.parametrize("approve", [True, False])
def test_the_approval_form_needs_an_approver_whichever_the_answer(approve):
    """Approval(approve=True, approver="") moved the pointer by nobody. The rule is in the form's JSON schema,
    so Prefect's server refuses such an answer and the flow stays paused (the integration test below)."""
    from pydantic import ValidationError

    from flows.approval import Approval

    for blank in ["", "  "]:
        with pytest.raises(ValidationError, match="approver"):
            Approval(approve=approve, approver=blank, comment="ok")
    schema = Approval.model_json_schema()
    assert "approver" in schema["required"] and schema["properties"]["approver"]["pattern"] == r"\S"


def taken_over(storage: Storage, run_id: str) -> None:
    """Another holder took the run over (this one was presumed dead)."""
    now = now_iso()
    successor = LeaseInfo(run_id=run_id, holder="elsewhere", pid=1, command="successor", started=now, renewed=now)
    storage.write_bytes(successor.model_dump_json().encode(), "runs", run_id, leases.LEASE)


def test_a_forced_promotion_whose_lease_was_lost_writes_nothing(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    records.save(storage, passed_record(cfg))
    lease = Lease(storage, "r1", None, "tuneproof promote r1 --force")
    lease.acquire()
    taken_over(storage, "r1")
    with pytest.raises(LeaseLost):
        forced_promotion(cfg, "r1", "hotfix", "alice", lease)
    assert records.load(storage, "r1").overrides == []
    assert registry.read_pointer(storage, cfg.model.name)[0] is None


def test_a_forced_promotion_over_an_unreadable_stage_summary_is_refused_and_writes_nothing(tmp_path):
    # It ended in "error: ValidationError: 1 validation error for FinetuneSummary ... (please report)", exit 4.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    rec = passed_record(cfg)
    summary_dict(rec, "finetune")["steps"] = "many"
    records.save(storage, rec)
    before = storage.read_bytes("runs", "r1", records.RECORD)
    expected = "run r1: a stage summary in record.json is not readable: finetune.steps: Input should be a valid integer"
    with pytest.raises(records.RecordUnreadable, match=expected):
        forced_promotion(cfg, "r1", "hotfix", "alice")
    assert storage.read_bytes("runs", "r1", records.RECORD) == before
    assert registry.read_pointer(storage, cfg.model.name)[0] is None
    shown = CliRunner().invoke(
        app, ["promote", "r1", "--force", "--reason", "hotfix", "--set", f"storage.root={tmp_path}"]
    )
    assert shown.exit_code == 3 and f"promote refused: {expected}" in shown.output, shown.output


def test_a_pointer_naming_another_run_rolls_nothing_back_and_notes_no_run(tmp_path):
    # v0002-r2's pointer with r1's run id: the rollback went ahead and noted r1's record as rolled back, a run that
    # production never moved away from; '../../x' ended in "UnsafePath ... (please report)".
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    promoted_on_evidence(cfg, "r1", None)
    promoted_on_evidence(cfg, "r2", "v0001-r1")
    pointer = production_pointer(storage, cfg.model.name)
    for run_id in ("r1", "../../x"):
        storage.write_json({**pointer.to_json(), "run_id": run_id}, "models", cfg.model.name, "production.json")
        result = roll_back(cfg, cfg.model.name, "v2 answers in the wrong format", "bob", None)
        assert not result.rolled_back
        assert f"not a usable production pointer (run_id is {run_id!r}, expected 'r2'" in result.reasons[0]
    assert records.load(storage, "r1").rollbacks == [] and records.load(storage, "r2").rollbacks == []


def test_a_rollback_note_whose_lease_was_lost_is_a_warning_and_writes_nothing(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    records.save(storage, passed_record(cfg))
    lease = Lease(storage, "r1", None, "tuneproof rollback")
    lease.acquire()
    taken_over(storage, "r1")
    move = Move(seq=3, kind="rollback", from_version="v2", to_version="v1", run_id="r0", by="bob", at="t", reason="r")
    warnings = promote_tasks.noted(storage, lease, cfg.model.name, move)
    assert len(warnings) == 1 and "does not name rollback #3: LeaseLost" in warnings[0]
    assert records.load(storage, "r1").rollbacks == []


def copy_check_job(sid: str, summary: CopyCheckSummary | None) -> JobEntry:
    status = "succeeded" if summary else "failed"
    result = StageResult(
        stage="promote", status=status, summary=summary.to_json() if summary else None, started_at="t", ended_at="t"
    )
    return JobEntry(
        submission_id=sid,
        entrypoint="python -m eval.copy_check",
        job_status="SUCCEEDED" if summary else "STOPPED",
        attached=False,
        working_dir_hash="w",
        runtime_env_additions=RuntimeEnvAdditions(),
        submitted_at="2026-01-01T00:00:00+00:00",
        ended_at="2026-01-01T00:01:00+00:00",
        result=result,
    )


def test_the_copy_check_lists_the_attempt_it_replaced(tmp_path, monkeypatch):
    # A retried copy check whose first job left no verdict ran again; the first, paid for, was not listed.
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    rec = with_predictions(storage, passed_record(cfg))
    checked = CopyCheckSummary(model_path="m", examples=32, evaluate_scores={}, copy_scores={}, passed=True)
    stale, fresh = copy_check_job("r1-promote-copy-check", None), copy_check_job("r1-promote-copy-check-a2", checked)

    class Runner:
        superseded: list[JobEntry] = []

        def run(self, spec: object) -> JobEntry:
            self.superseded = [stale]
            return fresh

    monkeypatch.setattr(promote_tasks, "runner_for", lambda call: Runner())
    monkeypatch.setattr(promote_tasks, "create_markdown_artifact", lambda *args, **kwargs: None)
    entry = promote_tasks.promote.fn(stage_call(cfg, rec))
    assert entry.ok, entry.cause
    assert [job.submission_id for job in entry.jobs] == [stale.submission_id, fresh.submission_id]
    assert present(entry_summary(entry, PromoteSummary).copy_check).passed


@pytest.mark.integration
@pytest.mark.parametrize("approve", [True, False])
def test_approval_pauses_the_flow_before_the_pointer_moves(prefect_harness, tmp_path, approve, monkeypatch):
    """With promote.require_approval the flow pauses for a typed form; the answer decides the pointer."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType
    from prefect.client.schemas.objects import StateType
    from prefect.flow_runs import aresume_flow_run

    from flows.pipeline import pipeline

    cfg = PipelineConfig.model_validate(
        {"storage": {"root": str(tmp_path)}, "promote": {"require_approval": True, "approval_timeout_s": 120}}
    )
    storage = Storage(str(tmp_path))
    with_export(storage, "r1")
    records.save(storage, with_predictions(storage, passed_record(cfg)))
    monkeypatch.setattr(promote_tasks, "copy_checker", lambda *args: lambda path: None)  # its model is no model
    answered = {}
    paused_only = FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.PAUSED])))

    def approver():
        async def answer():
            async with get_client() as client:
                for _ in range(240):
                    # The session's server holds other tests' flow runs too: ask for the paused ones only.
                    runs = await client.read_flow_runs(flow_run_filter=paused_only)
                    paused = [r for r in runs if r.state and r.state.is_paused()]
                    if paused:
                        # The server checks the answer against the form's schema: no approver, no answer.
                        blank = {"approve": approve, "approver": " ", "comment": "anonymous"}
                        with pytest.raises(RuntimeError, match="Cannot resume this run: .*approver"):
                            await aresume_flow_run(paused[0].id, run_input=blank)
                        await aresume_flow_run(
                            paused[0].id,
                            run_input={
                                "approve": approve,
                                "approver": "bob",
                                "comment": "looks right" if approve else "not yet",
                            },
                        )
                        answered["id"] = paused[0].id
                        return
                    await asyncio.sleep(0.5)

        asyncio.run(answer())

    # The session server's API URL is a context setting: the approver's thread needs this context's copy.
    thread = threading.Thread(target=contextvars.copy_context().run, args=(approver,))
    thread.start()
    state = pipeline(config=cfg, run_id="r1", only=["promote"], return_state=True)
    thread.join(60)
    assert "id" in answered, "the flow never paused for approval"
    pointer, _ = registry.read_pointer(storage, cfg.model.name)
    promotion = records.load(storage, "r1").promotion
    if approve:
        assert promotion is not None and pointer is not None
        assert state.is_completed() and pointer.run_id == "r1" and promotion.promoted is True
        assert (
            present(promotion.approval).by == "bob" and registry.read_history(storage, cfg.model.name)[-1].by == "bob"
        )
    else:
        assert state.is_failed() and pointer is None
        assert promotion is not None
        assert promotion.promoted is False and "approval refused by bob: not yet" in promotion.reasons[0]


def test_the_model_card_shows_each_gate_with_its_interval_method_p_value_and_split(tmp_path):
    """The demo's evaluation (298 of 300 right, the base none, no incumbent), decided by the real gates and
    carried by a record into the card: no pipeline."""
    from eval.gates import Scores, decide
    from tasks.promote import model_card

    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    rec = passed_record(cfg)
    candidate, base = [1.0] * 298 + [0.0] * 2, [0.0] * 300
    split = "05433017fd51" + "0" * 52
    gates = decide(
        Scores({"exact_match": 298 / 300}, {"exact_match": candidate}),
        Scores({"exact_match": 0.0}, {"exact_match": base}),
        None,
        cfg.eval.gates,
        split_sha256=split,
    )
    summary = summary_of(rec, "evaluate", EvaluateSummary).model_copy(
        update={"gates": gates, "eval_split_sha256": split}
    )
    rec.stages["evaluate"] = StageEntry.succeeded("evaluate", summary, "a")
    facts = model_card(cfg, rec)
    text = registry.render_model_card(
        registry.ModelCard(**dict(facts), version="v0001-r1", source_path="runs/r1/model")
    )
    assert (
        "- exact_match >= 0.8: 0.9933 [0.972, 0.9984] (n=300, Wilson score, 97.5% interval: 95% with Holm over 2, "
        "p<0.0001) (pass) (split `05433017fd51`)"
    ) in text
    assert (
        "- exact_match improvement over base >= 0.5: +0.9933 [+0.9719, +0.9982] (candidate 0.9933, base 0; n=300, "
        "Newcombe paired score, 95% interval: 95% with Holm over 2, p<0.0001) (pass) (split `05433017fd51`)"
    ) in text
    assert "regression gate not applicable (split `05433017fd51`)" in text
