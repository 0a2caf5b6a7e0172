"""The image canary and `tuneproof images`: refused requests by name, the workload it runs, and (integration)
the whole canary on the embedded default, its decision recorded and listed.

    .venv/bin/python -m pytest -q tests/test_canary.py -m integration     # about two minutes on 2 cores
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil

import pytest

from flows import canary
from flows.canary import canary_workload, image_canary, read_manifest, request_problem
from tests.conftest import tuneproof
from tests.test_images import OLD, decision
from tuneproof.app import images_cli
from tuneproof.control import images
from tuneproof.control import record as records
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config
from tuneproof.core.config_base import MAX_TIMEOUT_S
from tuneproof.core.storage import Storage


def local(tmp_path):
    return load_config(PROJECT_ROOT / "configs" / "local.yaml", [f"storage.root={tmp_path}"])


def test_requests_that_cannot_run_name_the_value(tmp_path):
    cfg = local(tmp_path)
    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    assert request_problem(cfg, None, 60, 2, 0.1, None, 1200.0) is None  # locally: this environment
    assert "candidate_image is required on eks" in (request_problem(eks, None, 60, 2, 0.1, None, 1200.0) or "")
    assert "'ray:2.58' is not pinned by digest" in (request_problem(cfg, "ray:2.58", 60, 2, 0.1, None, 1200.0) or "")
    assert "repeats must be between 2 and 20 (got 0)" in (request_problem(cfg, None, 60, 0, 0.1, None, 1200.0) or "")
    assert "repeats must be at least 2 (got 1): one run gives one value" in (
        request_problem(cfg, None, 60, 1, 0.1, None, 1200.0) or ""
    )
    assert "threshold must be between 0 and 1 (got 1.5)" in (request_problem(cfg, None, 60, 2, 1.5, None, 1200.0) or "")
    assert "decision id 'a/b'" in (request_problem(cfg, None, 60, 2, 0.1, "a/b", 1200.0) or "")


@pytest.mark.parametrize("seconds", [float("nan"), float("inf"), 0.0, -5.0, 1e9])
def test_a_ready_timeout_that_could_never_judge_the_image_is_refused(tmp_path, seconds):
    # NaN or inf waited forever with the RayCluster up; 0 or less gave up at once and recorded a reject.
    problem = request_problem(local(tmp_path), None, 60, 2, 0.1, None, seconds) or ""
    assert f"ready_timeout_s must be between 1 and {MAX_TIMEOUT_S} seconds (got {seconds})" in problem


def eks_canary(tmp_path, **params):
    """The canary flow's body as a deployment of it on eks starts it, up to where it would create a RayCluster."""
    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml", [f"storage.root={tmp_path}"])
    return image_canary.fn(config=eks, candidate_image=OLD, decision_id="d1", **params)


def test_a_deployments_bad_ready_timeout_is_refused_before_any_raycluster(tmp_path, monkeypatch):
    monkeypatch.setattr(canary, "ephemeral_raycluster", None)  # reaching it would be the bug
    state = eks_canary(tmp_path, ready_timeout_s=0.0)
    assert state.message == f"nothing ran: ready_timeout_s must be between 1 and {MAX_TIMEOUT_S} seconds (got 0.0)"
    assert not (tmp_path / "images").exists()  # no decision, the id not used up


def test_a_baseline_that_is_a_copied_decision_is_refused_before_anything_runs(tmp_path, monkeypatch):
    # The pointer names a folder holding another decision's copy: the canary compared against that decision.
    monkeypatch.setattr(canary, "run_canary", None)  # reaching it would be the bug
    storage = Storage(str(tmp_path))
    images.create_decision(storage, decision("20261201-140000-aaaaaa", OLD, finetune__tokens_per_s=[1000.0] * 3))
    shutil.copytree(tmp_path / "images" / "20261201-140000-aaaaaa", tmp_path / "images" / "20261202-140000-bbbbbb")
    copied = decision("20261202-140000-bbbbbb", OLD)
    images.adopt(storage, copied, None, "t")
    state = eks_canary(tmp_path)
    assert (state.message or "").startswith("nothing ran: ") and "(a copied decision folder?)" in (state.message or "")
    assert not (tmp_path / "images" / "d1").exists()


def test_a_config_that_fails_only_once_resolved_is_refused_not_raised(tmp_path):
    cfg = PipelineConfig.model_validate({"storage": {"root": str(tmp_path)}, "model": {"source": "a/b/c"}})
    state = image_canary.fn(config=cfg, decision_id="d1")
    assert (state.message or "").startswith("nothing ran: invalid config:") and "model.source: 'a/b/c'" in (
        state.message or ""
    )
    assert not (tmp_path / "images").exists()


SECRET = "hunter2-very-secret-value"


@pytest.mark.parametrize(
    ("name", "content", "says"),
    [
        ("app.yaml", f"password: {SECRET}\n", "holds an object whose kind is not RayCluster"),
        ("credentials", f"[default]\naws_access_key_id = {SECRET}\n", "not valid YAML at line 2, column 1"),
        ("two.yaml", f"kind: RayCluster\n---\nkind: {SECRET}\n", "holds 2 YAML documents, expected one RayCluster"),
        ("list.yaml", f"- {SECRET}\n", "holds a YAML list, expected one RayCluster object"),
        ("twice.yaml", f"kind: RayCluster\nkind: {SECRET}\n", "names a key twice in one mapping"),
        ("bytes.yaml", b"kind: \xff" + SECRET.encode(), "not UTF-8 text (byte 6)"),
    ],
    ids=["a-mapping", "an-ini-file", "two-documents", "a-list", "a-key-twice", "not-utf8"],
)
def test_a_manifest_that_is_no_raycluster_is_named_never_quoted(tmp_path, monkeypatch, name, content, says):
    # The refusal is published in the Prefect UI: it quoted the file ("got {'password': ...}", a YAML snippet).
    monkeypatch.setattr(canary, "MANIFESTS", tmp_path)
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError) as caught:
        read_manifest(str(path))
    assert str(caught.value).startswith(f"manifest {path}") and says in str(caught.value)
    assert SECRET not in str(caught.value) and "hunter2" not in str(caught.value)


def test_a_manifest_is_read_from_deployments_only(tmp_path):
    assert read_manifest("deployments/raycluster.yaml")["kind"] == "RayCluster"
    (tmp_path / "app.yaml").write_text(f"password: {SECRET}\n")
    for outside in (str(tmp_path / "app.yaml"), "deployments/../../../../../../" + str(tmp_path / "app.yaml")):
        with pytest.raises(ValueError, match="is not under .*deployments: the canary copies only a manifest lint"):
            read_manifest(outside)
    with pytest.raises(ValueError, match="is not a path: it holds a NUL byte"):
        read_manifest("deployments/a\0b")


@pytest.mark.timeout(30)
def test_a_fifo_or_a_huge_file_as_the_manifest_is_refused_without_reading_it(tmp_path, monkeypatch):
    monkeypatch.setattr(canary, "MANIFESTS", tmp_path)
    os.mkfifo(tmp_path / "fifo")  # open() blocked until a writer came
    with pytest.raises(ValueError, match=r"fifo is a FIFO \(named pipe\), not a regular file"):
        read_manifest(str(tmp_path / "fifo"))
    (tmp_path / "huge.yaml").write_bytes(b"#" * (canary.MAX_MANIFEST_BYTES + 1))
    with pytest.raises(ValueError, match="huge.yaml is larger than"):
        read_manifest(str(tmp_path / "huge.yaml"))


def test_a_deployments_manifest_outside_deployments_is_refused_before_anything_runs(tmp_path):
    (tmp_path / "app.yaml").write_text(f"password: {SECRET}\n")
    state = eks_canary(tmp_path, manifest=str(tmp_path / "app.yaml"))
    assert (state.message or "").startswith("nothing ran: manifest ") and SECRET not in (state.message or "")
    assert not (tmp_path / "images").exists()


@pytest.mark.parametrize(
    ("option", "value", "says"),
    [
        ("--repeats", "1", "--repeats: repeats must be at least 2 (got 1): one run gives one value per metric"),
        # These two started a flow run (and needed a Prefect API) before the flow refused them.
        ("--max-steps", "0", "--max-steps: max_steps must be between 1 and 100000 (got 0)"),
        ("--threshold", "nan", "--threshold: threshold must be between 0 and 1 (got nan)"),
    ],
)
def test_the_cli_refuses_a_bad_setting_before_anything_starts(tmp_path, option, value, says):
    result = tuneproof("canary", option, value, "--set", f"storage.root={tmp_path}")
    assert result.exit_code == 3 and says in result.output
    assert "image canary" not in result.output  # the flow's first line: no flow run was started


def test_the_workload_is_short_resume_free_and_measured_not_gated(tmp_path):
    cfg = local(tmp_path)
    workload = canary_workload(cfg, Storage(str(tmp_path)), images.local_image(), 40)
    assert workload.train.max_steps == 40 and workload.train.checkpoint_every == 40
    assert workload.train.warmup_steps <= 20 and not workload.resume.enabled
    gate = workload.eval.gates["exact_match"]
    assert gate.min is not None and gate.min < 0 and gate.min_improvement is None and gate.max_regression is None
    assert workload.eval.max_truncated_fraction == 1.0  # a short model's long answers are measured, not refused
    assert cfg.eval.suites and workload.eval.suites == {}  # a short model has not relearned what it rehearses
    assert workload.cluster.expect.image is None  # locally the environment digest is checked instead
    assert workload.cluster.expect.ray_version is None  # the candidate's versions are recorded, not held to the old

    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml", [f"storage.root={tmp_path}"])
    on_eks = canary_workload(eks, Storage(str(tmp_path)), OLD, 40)
    assert on_eks.cluster.expect.image == OLD and on_eks.train.num_workers == eks.train.num_workers
    assert on_eks.cluster.expect.nccl_version is None and on_eks.cluster.expect.efa  # EFA still required
    # the candidate's Ray pods may write only the canary prefix (deployments/s3-canary-policy.json)
    assert on_eks.storage.root == f"{tmp_path}/canary" and eks.storage.root == str(tmp_path)


def test_images_commands_on_an_empty_registry_and_bad_ids(tmp_path):
    listed = tuneproof("images", "list", "--set", f"storage.root={tmp_path}")
    assert listed.exit_code == 0 and "no image decisions under" in listed.output
    as_json = tuneproof("images", "list", "--json", "--set", f"storage.root={tmp_path}")
    assert as_json.exit_code == 0 and json.loads(as_json.output) == []
    absent = tuneproof("images", "show", "20261201-000000-abcdef", "--set", f"storage.root={tmp_path}")
    assert absent.exit_code == 1 and "decisions: none: run `tuneproof canary` first" in " ".join(absent.output.split())
    bad = tuneproof("images", "show", "../etc", "--set", f"storage.root={tmp_path}")
    assert bad.exit_code == 2 and "decision id '../etc'" in bad.output
    refused = tuneproof("canary", "--candidate-image", "ray:latest", "--set", f"storage.root={tmp_path}")
    assert refused.exit_code == 3 and "--candidate-image 'ray:latest' is not pinned by digest" in refused.output
    assert not (tmp_path / "images").exists()


def test_images_list_and_show_read_the_history(tmp_path):
    storage = Storage(str(tmp_path))
    first = decision("20261201-140000-aaaaaa", OLD, finetune__tokens_per_s=[1234.0])
    first.versions = images.ImageVersions(ray="2.58.0", torch="2.13.0", nccl="2.29.7", efa="1.20.0")
    images.create_decision(storage, first)
    images.adopt(storage, first, None, "t")
    table = tuneproof("images", "list", "--set", f"storage.root={tmp_path}")
    assert table.exit_code == 0 and "20261201-140000-aaaaaa" in table.output and "adopt" in table.output
    listed = tuneproof("images", "list", "--json", "--set", f"storage.root={tmp_path}")
    row = json.loads(listed.output)[0]
    assert row["digest"] == "sha256:" + "a" * 64 and row["release_tag"] == "train-ml-cuda-v1.1"
    assert row["versions"] == {"ray": "2.58.0", "torch": "2.13.0", "nccl": "2.29.7", "efa": "1.20.0"}
    assert row["candidate_metrics"] == {"finetune.tokens_per_s": 1234.0} and row["current"] is True
    assert images_cli.list_cells(row)[4] == "ray 2.58.0 torch 2.13.0 nccl 2.29.7 efa 1.20.0"
    shown = tuneproof("images", "show", "20261201-140000-aaaaaa", "--json", "--set", f"storage.root={tmp_path}")
    assert shown.exit_code == 0 and json.loads(shown.output)["current"] is True


@pytest.mark.integration
@pytest.mark.timeout(3600)  # two runs of five Ray jobs; on 2 shared cores under load five took 13+ minutes
def test_the_canary_runs_locally_end_to_end_and_images_list_shows_it(prefect_server, demo_env, tmp_path):
    env = demo_env.at(tmp_path)
    # Two runs, the fewest a canary takes: the first canary has no baseline, so more would only cost time here.
    # Each run's work is the least that still yields every metric the decision records: 10 steps of small
    # batches, one all-reduce size, one timed iteration, one FSDP step and 64 eval items.
    small = ["train.micro_batch_size=8", "connectivity.sizes_bytes=[4096]", "connectivity.iters=1"]
    small += ["connectivity.warmup_iters=0", "connectivity.fsdp_steps=1", "eval.max_examples=64"]
    args = [*env.args, *sum((["--set", s] for s in small), [])]
    result = tuneproof("canary", *args, "--id", "canary-1", "--max-steps", "10", "--repeats", "2", "--json")
    assert result.exit_code == 0, result.output

    # The decision: the first canary adopts itself as the baseline, and says so.
    stored = images.load_decision(env.storage, "canary-1")
    assert json.loads(result.stdout) == stored.to_json()  # stdout is the decision alone: progress went to stderr
    assert stored.decision == "adopt" and stored.baseline_decision is None
    assert stored.reasons == ["no current image: this canary's measurements become the baseline"]
    assert stored.candidate_image == images.local_image() and stored.release_tag is None
    assert stored.versions.ray == "2.60.0" and stored.versions.torch and stored.versions.environment_digest
    assert images.local_image_of(stored.versions.environment_digest) == stored.candidate_image
    assert stored.runs == ["canary-1-r1", "canary-1-r2"] and stored.flow_run_id
    for metric in ("finetune.tokens_per_s", "finetune.final_loss", "eval.candidate.exact_match"):
        assert len(stored.candidate_metrics[metric]) == 2, metric
    assert any(m.startswith("connectivity.busbw_GBps@") for m in stored.candidate_metrics)

    # Its run is an ordinary run: the five canary stages of a short, resume-free workload.
    rec = records.load(env.storage, "canary-1-r1")
    # (the record stores its stages by name, sorted: the order they ran is the stage table's)
    assert rec.status == "succeeded" and set(rec.stages) == {"verify", "connectivity", "data", "finetune", "evaluate"}
    assert rec.config["train"]["max_steps"] == 10 and rec.config["resume"]["enabled"] is False

    # Adopted: the pointer names it; the history lists it.
    current, _ = images.read_current(env.storage)
    assert current is not None and current.decision_id == "canary-1" and current.image == stored.candidate_image
    listed = tuneproof("images", "list", "--json", *env.args)
    assert listed.exit_code == 0, listed.output
    rows = json.loads(listed.output)
    assert [(r["decision_id"], r["decision"], r["current"]) for r in rows] == [("canary-1", "adopt", True)]
    assert rows[0]["versions"]["ray"] == "2.60.0" and rows[0]["baseline_metrics"] == {}
    table = tuneproof("images", "list", *env.args)
    assert "canary-1" in table.output and "adopt" in table.output
    print(table.output)

    # The decision's artifact is on the canary's flow run.
    from prefect.client.orchestration import get_client

    async def artifact_keys() -> set[str]:
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts() if a.key}

    assert "image-canary-canary-1" in asyncio.run(artifact_keys())

    # The id is taken: history is append-only, the same id again is refused before anything runs.
    again = tuneproof("canary", *env.args, "--id", "canary-1")
    assert again.exit_code == 3 and "already exists" in again.output
    assert images.load_decision(env.storage, "canary-1") == stored
