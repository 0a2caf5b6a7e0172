"""The whole pipeline on the embedded default, as `tuneproof run` runs it, against a real Ray head,
a real Prefect server (its UI too) and local storage: the demo's evidence, then the ways it must refuse.

The full run is the session's `finished_run` (tests/conftest.py, about two minutes on 2 cores); the
tests after it rerun subsets against it, in file order, the destructive one (a deleted shard) last.
Tests elsewhere that change a finished run work on their own copy (`clone_run`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest

from tests.conftest import tuneproof
from tests.reading import present, summary_of
from tuneproof.control import record as records
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import ConnectivitySummary, VerifySummary
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import EvaluateSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary

pytestmark = pytest.mark.integration
SCREENSHOTS = PROJECT_ROOT / "test-output" / "browser"


@pytest.fixture(scope="module")
def base_args(demo_env):
    return demo_env.args


@pytest.fixture(scope="module")
def storage(demo_env):
    return demo_env.storage


@pytest.fixture(scope="module")
def demo(finished_run):
    return finished_run.record


def pointer_bytes(storage: Storage) -> bytes:
    return storage.read_bytes("models", "dates-qwen2-tiny", "production.json")


def test_the_demo_learns_the_task_survives_a_resume_and_is_promoted(demo, storage):
    assert [s for s, entry in demo.stages.items() if not entry.ok] == []
    manifest = summary_of(demo, "data", DataSummary).manifest
    assert manifest is not None
    assert manifest.splits["train"].rows > 2000 and manifest.splits["eval"].rows >= 250
    finetune = summary_of(demo, "finetune", FinetuneSummary)
    assert present(finetune.final_loss) < present(finetune.first_loss) / 10
    assert all(c.uri.startswith(storage.uri("runs", "demo", "train")) for c in finetune.checkpoints)
    assert storage.exists(finetune.export_path, "config.json")
    resume = summary_of(demo, "resume", ResumeSummary)
    assert (
        resume.interrupted and present(resume.restored_step) > 0 and resume.restored_step == resume.interrupted_at_step
    )
    assert resume.loss_comparison is not None
    assert resume.max_loss_diff == 0.0 and resume.loss_comparison.steps_compared >= 5
    models = summary_of(demo, "evaluate", EvaluateSummary).models
    assert models["candidate"] is not None
    assert present(models["candidate"].metrics["exact_match"]) >= 0.8
    assert models["base"] is not None
    assert present(models["base"].metrics["exact_match"]) <= 0.05
    assert models["incumbent"] is None
    assert demo.promotion.promoted is True
    assert json.loads(pointer_bytes(storage))["run_id"] == "demo"


def test_the_demo_records_its_cluster_its_transport_and_its_code(demo, storage):
    """What verify and connectivity observed, through the flow as `tuneproof run` runs it (this was a run of its
    own in tests/test_backbone.py and tests/test_connectivity.py: the demo's record holds the same evidence, at no
    extra Ray Train run)."""
    verify, conn = summary_of(demo, "verify", VerifySummary), summary_of(demo, "connectivity", ConnectivitySummary)
    node = verify.nodes[0]
    assert node.ray_version == "2.60.0" and present(node.torch_version).startswith("2.13.0")
    assert len(present(node.environment_digest)) == 64
    assert [r.size_bytes for r in conn.allreduce] == demo.config["connectivity"]["sizes_bytes"]
    assert conn.allreduce and all(r.busbw_GBps > 0 for r in conn.allreduce)
    assert conn.backend == "gloo" and conn.world_size == 2 and [r.rank for r in conn.ranks] == [0, 1]
    assert all(r.started and r.joined and r.finished and r.pid for r in conn.ranks)
    assert all(r.algbw_GBps > 0 for r in conn.allreduce)
    steps = demo.config["connectivity"]["fsdp_steps"]
    assert conn.fsdp.steps == steps and len(conn.fsdp.losses) == steps
    assert conn.transport.to_json() == {"kind": "gloo", "evidence": ["backend gloo (CPU)"]}
    assert storage.exists("runs", "demo", "stages", "connectivity", "rank-1.json")
    assert demo.stages["connectivity"].jobs[0].submission_id == "demo-connectivity"
    assert len(present(demo.code.working_dir_hash)) == 64 and len(demo.config_hash) == 64
    assert demo.code.git_sha is not None and demo.code.dirty is not None
    assert present(demo.cluster).ray_version == "2.60.0"


def test_the_demos_resume_test_killed_every_rank_and_a_new_run_restored_the_interruption(demo, storage):
    """The resume stage's job on the demo (this was a run of its own in tests/test_finetune.py): from the seed
    checkpoint k, every rank is SIGKILLed once checkpoint k + extra_steps is complete; a new Ray Train run under
    the same name restores it, and every step replayed (extra + replay) equals the main run's, losses and data."""
    resume = summary_of(demo, "resume", ResumeSummary)
    interrupt_phase = ("runs", "demo", "stages", "resume-t1-interrupt")
    killed = storage.read_json(*interrupt_phase, "interrupted.json")
    seed = present(resume.seed_checkpoint).step
    assert resume.interrupted_at_step == killed["step"] == seed + demo.config["resume"]["extra_steps"]
    assert resume.restored_step == killed["step"] and resume.attempt_run_name == "demo-resume-t1"
    assert (resume.restored_from or "").endswith(f"demo-resume-t1/checkpoint_{killed['step']:06d}")
    # Ray Train saw the workers' processes gone (no exception of ours). Which ranks it saw is a race: its health
    # check fails the group at the first dead worker it polls, so one rank or both.
    failures = storage.read_text(*interrupt_phase, "failures.jsonl")
    seen = re.findall(r"rank (\d+): (\w+)", failures)
    assert seen and {error for _, error in seen} == {"WorkerHealthCheckFailedError"}, failures
    job = storage.read_json("runs", "demo", "stages", "resume-t1", "result.json")["summary"]
    assert job["resumed"]["run_name"] == "demo-resume-t1" and job["resumed"]["restarts"] == []  # a new run
    assert job["resumed"]["start_step"] == killed["step"]
    replayed = demo.config["resume"]["extra_steps"] + demo.config["resume"]["replay_steps"]
    losses, order = present(resume.loss_comparison), present(resume.ledger_comparison)
    assert losses.ok and losses.steps_compared == replayed and losses.max_abs_diff == 0.0
    assert order.ok and order.steps_compared == replayed and order.first_differing_step is None
    checkpoint = ("runs", "demo", "train", "demo-resume-t1", f"checkpoint_{killed['step']:06d}")
    for rank in (0, 1):  # each rank's position and running ledger travel with the checkpoint it restored
        progress = storage.read_json(*checkpoint, f"progress-rank{rank}.json")
        assert progress["step"] == killed["step"] and progress["rank"] == rank and len(progress["ledger"]) == 64


def test_the_demo_rehearses_the_skills_and_keeps_them_with_a_verdict_per_suite(demo, storage):
    """The default demo replays the add and reverse skills' training rows and is judged on their held-out
    suites: the base knows each skill, and each suite's regression gate against the base passes on its
    interval (the candidate is promoted above)."""
    manifest = summary_of(demo, "data", DataSummary).manifest
    assert manifest is not None
    assert manifest.replay is not None and manifest.replay.uri.endswith("data/skills/replay.jsonl")
    assert manifest.settings["replay"]["share"] == 0.3
    suites = {s.name: s for s in summary_of(demo, "evaluate", EvaluateSummary).suites}
    assert list(suites) == ["add", "reverse"]
    for name, suite in suites.items():
        assert (suite.metrics["base"] or {})["exact_match"] > 0.5, name
        vs_base = suite.gates.verdicts[0]
        assert (vs_base.gate, vs_base.outcome, vs_base.method) == (
            "max_regression_vs_base",
            "pass",
            "Newcombe paired score",
        )
        assert vs_base.interval is not None and vs_base.interval[0] > -0.25 and vs_base.n == suite.items
    card = storage.read_json("models", "dates-qwen2-tiny", demo.promotion.version, "card.json")
    assert card["replay"]["share"] == 0.3 and [row["suite"] for row in card["suites"]] == ["task", "add", "reverse"]
    assert all(row["verdict"].startswith("vs base: pass [") for row in card["suites"][1:])


def test_the_record_and_the_card_name_the_bases_hash_and_recipe(demo, demo_env, storage):
    source = next(s.split("=", 1)[1] for s in demo_env.sets if s.startswith("model.source="))
    built = json.loads((Path(source) / "base.json").read_text())
    base = summary_of(demo, "finetune", FinetuneSummary).base_model
    assert base is not None and (base.content_hash, base.recipe) == (built["content_hash"], built["recipe"])
    version = json.loads(pointer_bytes(storage))["version"]
    card = storage.read_json("models", "dates-qwen2-tiny", version, "card.json")
    assert (card["base_content_hash"], card["base_recipe"]) == (built["content_hash"], built["recipe"])
    card_md = storage.read_bytes("models", "dates-qwen2-tiny", version, "MODEL_CARD.md").decode()
    assert built["content_hash"] in card_md


def test_unchanged_inputs_reuse_the_prepared_dataset(demo, base_args, storage):
    result = tuneproof("run", "--only", "data", "--run-id", "demo-data-again", *base_args)
    assert result.exit_code == 0, result.output
    again = records.load(storage, "demo-data-again")
    assert again.data is not None
    assert again.data.cache_hit is True
    assert demo.data is not None
    assert again.data.content_hash == demo.data.content_hash


def test_a_gate_the_candidate_misses_is_a_modeling_failure_and_nothing_moves(demo, base_args, storage):
    # The demo's candidate answers all 300 items, so no exact-match gate can be missed on them (0.999 is
    # insufficient evidence; 1 and 1.01, which no interval over items reaches, are config errors, exit 3:
    # tests/test_bad_input.py). Its eval loss, a point the model gives, misses a floor of 1e-6 for certain.
    before = pointer_bytes(storage)
    versions = storage.listdir("models", "dates-qwen2-tiny")
    loss_gate = ("--set", "eval.gates.eval_loss={min: 0.000001, higher_is_better: false}")
    result = tuneproof("run", "--only", "evaluate,promote", "--run-id", "demo", *base_args, *loss_gate)
    assert result.exit_code == 6, result.output
    rec = records.load(storage, "demo")
    assert rec.failure_class == "modeling"
    assert "eval_loss <= 1e-06" in (rec.stages["evaluate"].cause or "")
    # Nothing moved, and no promotion stands on this invocation's evidence; the record keeps the demo's earlier
    # promotion, which production still serves (it never denies what the registry serves), and says so.
    assert "promote" not in rec.stages
    assert rec.promotion is not None and rec.promotion.version == "v0001-demo"
    assert "earlier in this run and in production when the run last ended" in result.output
    assert pointer_bytes(storage) == before
    assert storage.listdir("models", "dates-qwen2-tiny") == versions


def test_the_flow_run_page_shows_the_evidence(demo, prefect_server):
    """Headless Chromium (Debian's) on the flow run page: the evaluation table and the loss image."""
    chromium = shutil.which("chromium")
    if chromium is None and not os.environ.get("CI"):
        pytest.skip(
            "Debian's chromium is not installed (`make test` installs it where it can: apt-get install chromium)"
        )
    from tests.browser import capture_flow_run

    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    seen = capture_flow_run(prefect_server, present(demo.flow_run_id), "demo", present(chromium), SCREENSHOTS)
    assert "evaluation-demo" in seen["cards"] and "loss-curve-demo" in seen["cards"]
    assert "exact_match" in seen["evaluation_text"] and "candidate" in seen["evaluation_text"]
    assert seen["loss_image_width"] > 100
    for name in ("flow-run-artifacts.png", "evaluation.png", "loss-curve.png"):
        assert (SCREENSHOTS / name).stat().st_size > 10_000


def test_a_checkpoint_with_a_deleted_shard_is_never_used(demo, base_args, storage):
    """Last: it damages the demo run's checkpoints."""
    before = pointer_bytes(storage)
    from tasks.resume import pick_checkpoint
    from tuneproof.core.config import load_config

    cfg = load_config()
    finetune = summary_of(demo, "finetune", FinetuneSummary)
    seed = pick_checkpoint(finetune.checkpoints, finetune.steps, cfg.resume.extra_steps, cfg.resume.replay_steps)
    assert seed is not None
    ckpt_dir = Path(seed.uri)
    shard = sorted(ckpt_dir.glob("*.distcp"))[0]
    shard.unlink()
    result = tuneproof("run", "--only", "resume,evaluate,promote", "--run-id", "demo", *base_args)
    assert result.exit_code == 4, result.output
    rec = records.load(storage, "demo")
    resume = rec.stages["resume"]
    assert resume.failure_class == "infrastructure" and shard.name in (resume.cause or "")
    assert "promote" not in rec.stages  # refused with the resume test: the earlier promotion alone still stands
    assert rec.promotion is not None and rec.promotion.version == "v0001-demo"
    assert pointer_bytes(storage) == before
