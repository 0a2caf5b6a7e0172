"""A LoRA run of the pipeline on the embedded default, as `tuneproof run --set train.method=lora` runs it, from
data to promotion (verify and connectivity judge the cluster, not the method, and are left out): real Ray job
submissions (peft through the fine-tune jobs' runtime_env pip), checkpoints that hold only the adapters and
their optimizer state, the real resume stage with loss_rtol 0, a merged export that loads with plain
transformers and gives the adapter's logits, evaluation of that export, promotion, and `models show` listing
adapter and merged.

Costs a few minutes on 2 cores. Ray's pip environment for peft (on a local head, a clone of the project
virtualenv) is built beside the unit tests by the session (tests/conftest.py, SessionStart.peft_env).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import tuneproof
from tests.reading import present, summary_of
from training.lora import ADAPTER_DIR
from tuneproof.control import record as records
from tuneproof.core import markers
from tuneproof.core.config_train import PEFT_REQUIREMENT
from tuneproof.core.markers import read_export_manifest
from tuneproof.core.summaries_eval import EvaluateSummary
from tuneproof.core.summaries_training import FinetuneSummary, ResumeSummary

# The first test also runs the pipeline (six Ray jobs, four of them in Ray's peft environment).
pytestmark = [pytest.mark.integration, pytest.mark.timeout(1800)]

# A short run (the mechanics, not the skill: configs/local-chat.yaml's 1000 LoRA steps are what learns a
# task, README "LoRA"), so the gate is only that the candidate was scored, and the demo's regression suites
# (which judge a model that has relearned what it rehearses) are left out.
LORA = [
    *("--set", "train.method=lora", "--set", "model.name=dates-lora", "--set", "train.max_steps=60"),
    *("--set", "train.checkpoint_every=20", "--set", "train.log_every=20", "--set", "eval.max_examples=64"),
    *("--set", "eval.gates={exact_match: {min: 0.0}}", "--set", "eval.suites={}"),
    # 60 steps need not teach the end of every answer (9 of 64 ran past 16 tokens on the dates drawn once):
    # counted, not capped, as in the other short runs (tests/test_data_shapes.py).
    *(
        "--set",
        "eval.max_truncated_fraction=1.0",
    ),
]


@pytest.fixture(scope="module")
def lora_env(demo_env, tmp_path_factory):
    """The session's embedded default over a storage root of its own (the demo run's stays untouched)."""
    return demo_env.at(tmp_path_factory.mktemp("lora"))


@pytest.fixture(scope="module")
def lora_demo(prefect_server, lora_env, session_start):
    session_start.peft_env().result()  # Ray's peft environment, built beside the unit tests (tests/conftest.py)
    # The stages LoRA changes; verify and connectivity judge the cluster, which the demo run already did.
    only = ("--only", "data,finetune,resume,evaluate,promote")
    result = tuneproof("run", "--run-id", "lora", *only, *lora_env.args, *LORA)
    assert result.exit_code == 0, result.output
    return records.load(lora_env.storage, "lora")


def test_a_lora_run_names_its_method_and_records_peft_as_a_submission_dependency(lora_demo):
    finetune = summary_of(lora_demo, "finetune", FinetuneSummary)
    assert finetune.method == "lora" and 0 < present(finetune.trainable_params) < present(finetune.total_params)
    assert lora_demo.runtime_env_additions.pip == [PEFT_REQUIREMENT]
    added = {job.submission_id: job.runtime_env_additions.pip for e in lora_demo.stages.values() for job in e.jobs}
    assert added["lora-finetune"] == [PEFT_REQUIREMENT]
    resume_jobs = [pip for sid, pip in added.items() if sid.startswith("lora-resume")]
    assert resume_jobs and all(pip == [PEFT_REQUIREMENT] for pip in resume_jobs)
    assert added["lora-evaluate"] == [] and added["lora-data"] == []


def test_a_lora_run_checkpoints_only_the_adapters_and_their_optimizer_state(lora_demo):
    from torch.distributed.checkpoint import FileSystemReader

    finetune = summary_of(lora_demo, "finetune", FinetuneSummary)
    assert 0 < present(finetune.trainable_params) < present(finetune.total_params) / 2
    assert [c.step for c in finetune.checkpoints] == [20, 40, 60]
    assert present(finetune.final_loss) < present(finetune.first_loss)
    first = Path(finetune.checkpoints[0].uri)
    saved = set(FileSystemReader(str(first)).read_metadata().state_dict_metadata)
    weights = {k for k in saved if k.startswith("model.")}
    assert weights and all(".lora_A." in k or ".lora_B." in k for k in weights), sorted(weights)[:5]
    assert any(k.startswith("optim.state.") for k in saved)  # the adapters' Adam moments
    # The completion marker hashes every file the LoRA checkpoint has, every rank's shards included.
    listed = markers.parse_digests(json.loads((first / markers.COMPLETION_MARKER).read_text()))
    on_disk = markers.local_digests(first)
    del on_disk[markers.COMPLETION_MARKER]
    assert listed == on_disk and any(n.endswith(".distcp") for n in listed)


def test_the_merged_export_loads_plain_and_gives_the_adapters_logits(lora_demo, lora_env):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    finetune = summary_of(lora_demo, "finetune", FinetuneSummary)
    storage = lora_env.storage
    assert finetune.export_path == "runs/lora/model" and finetune.adapter_path == f"runs/lora/model/{ADAPTER_DIR}"
    base = next(s.split("=", 1)[1] for s in lora_env.sets if s.startswith("model.source="))
    merged = AutoModelForCausalLM.from_pretrained(storage.path(finetune.export_path)).eval()
    adapter = storage.path(present(finetune.adapter_path))
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    ids = torch.tensor([[3, 4, 5, 6, 13, 6, 5, 4, 3, 14], [7, 8, 9, 13, 9, 8, 7, 14, 0, 0]])
    with torch.no_grad():
        want, got = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
    assert torch.allclose(want, got, atol=1e-5, rtol=1e-5), (want - got).abs().max()
    # The export's manifest, whose content hash evaluation names, covers the merged model and the adapter alike.
    manifest = present(read_export_manifest(storage, finetune.export_path))
    assert "model.safetensors" in manifest.files
    assert {f"{ADAPTER_DIR}/adapter_config.json", f"{ADAPTER_DIR}/adapter_model.safetensors"} <= set(manifest.files)
    assert manifest.run_name == finetune.run_name and manifest.step == 60


def test_a_lora_run_passes_the_resume_test_exactly_and_evaluation_scores_its_merged_export(lora_demo, lora_env):
    storage = lora_env.storage
    resume = summary_of(lora_demo, "resume", ResumeSummary)
    assert resume.interrupted and resume.restored_step == resume.interrupted_at_step
    assert resume.loss_comparison is not None
    assert resume.max_loss_diff == 0.0 and resume.loss_comparison.steps_compared >= 5
    finetune = summary_of(lora_demo, "finetune", FinetuneSummary)
    assert storage.exists(finetune.adapter_path, "adapter_config.json")
    evaluation = summary_of(lora_demo, "evaluate", EvaluateSummary)
    # Evaluation scored the merged model (not the adapter), by content: the export's manifest hash.
    assert evaluation.models["candidate"] is not None
    assert evaluation.models["candidate"].path == finetune.export_path
    assert evaluation.models["candidate"].content_sha256 == finetune.export_sha256 is not None
    assert resume.tested_run_name == finetune.run_name and resume.attempt_run_name == "lora-resume-t1"
    assert storage.exists(finetune.export_path, "model.safetensors")


def test_the_promoted_lora_model_shows_adapter_and_merged(lora_demo, lora_env):
    assert lora_demo.promotion.promoted is True
    shown = tuneproof("models", "show", "dates-lora", *lora_env.args)
    assert shown.exit_code == 0, shown.output
    [version] = json.loads(shown.output)["versions"]
    assert version["merged"] == f"models/dates-lora/{version['version']}"
    assert version["adapter"] == f"models/dates-lora/{version['version']}/adapter"
    assert version["card"]["method"] == "lora" and version["card"]["adapter"] == "adapter"
