"""Code identity: what a stage's inputs key says about the code that reached its verdict."""

from __future__ import annotations

from flows.pipeline import outside_inputs
from tuneproof.control import stages as table
from tuneproof.control.identity import code_hash, files_under, job_files
from tuneproof.control.record import CodeIdentity, new_record
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.storage import Storage

JUDGED_IN_THE_FLOW = {
    "verify": {"tuneproof/control/kube_checks.py"},
    "resume": {"tasks/resume.py", "tuneproof/control/resume_evidence.py"},
    "promote": {"tasks/promote.py"},
}
"""The modules outside the job code that decide a stage's verdict: the resume test's checks of the restart, the
losses and the data order; promotion's refusals; on eks, verify's checks of the Kubernetes objects."""


def test_the_modules_that_judge_a_stage_in_the_flow_are_in_its_key_not_in_the_jobs_working_dir(tmp_path):
    """A fix to the resume test's pass/fail logic left the working_dir hash, the only code in the key, unchanged:
    a continuation kept the verdict the old code reached."""
    shipped = {p.relative_to(PROJECT_ROOT).as_posix() for p in job_files()}
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}})
    rec = new_record("r", cfg, CodeIdentity(), None)
    for name, modules in JUDGED_IN_THE_FLOW.items():
        stage = table.by_name(name)
        assert set(stage.verdict_code) == modules and not modules & shipped, name
        assert len(files_under(stage.verdict_code)) == len(modules), f"{name}: a verdict_code path names no file"
        key = f"code {', '.join(stage.verdict_code)}"
        assert outside_inputs(stage, cfg, Storage(str(tmp_path)), rec)[key] == code_hash(stage.verdict_code)
    assert all(not table.by_name(name).verdict_code for name in ("connectivity", "data", "finetune", "evaluate"))


def test_a_change_to_a_verdict_module_changes_its_hash_and_nothing_else(tmp_path):
    (tmp_path / "tasks").mkdir()
    judge = tmp_path / "tasks" / "resume.py"
    judge.write_text("PASS_IF = 'restored at the interruption step'\n")
    before = code_hash(["tasks/resume.py"], tmp_path)
    (tmp_path / "tasks" / "jobs.py").write_text("# another module\n")
    assert code_hash(["tasks/resume.py"], tmp_path) == before
    judge.write_text("PASS_IF = 'restored at the interruption step, same data order'\n")
    assert code_hash(["tasks/resume.py"], tmp_path) != before
