"""Production history and rollback: every move of a model's pointer is logged (from, to, who, when, why),
"what was production at T" is answered from the log, and a rollback moves the pointer back only to an
earlier version whose files still match its manifest, never while another flow holds the pointer.

Unit tests on a local root; the same story on a real S3-compatible server (moto), and the rollback
flow against a real Prefect server, are marked integration.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from tasks import promote as promote_tasks
from tasks.promote import evidence_sha256, forced_promotion, move_pointer, roll_back
from tests.conftest import TEST_BUCKET, tuneproof
from tests.reading import present, production_pointer, summary_dict
from tests.test_promote_task import passed_record, promoted_on_evidence, with_export
from tuneproof.control import history, registry, rollback
from tuneproof.control import record as records
from tuneproof.control.history import Move, MoveIntent, production_at
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_eval import PromoteSummary


def config(root: str, endpoint: str | None = None) -> PipelineConfig:
    return PipelineConfig.model_validate({"storage": {"root": root, "endpoint_url": endpoint}})


def promote_two(cfg: PipelineConfig) -> tuple[Storage, str, str]:
    """r1 promoted on its gates, then r2 (evaluated against r1) forced over its gates by ana."""
    storage = Storage.from_config(cfg.storage)
    for run in ("r1", "r2"):
        with_export(storage, run)
    first = passed_record(cfg, "r1")
    records.save(storage, first)
    assert move_pointer(cfg, first, "t", forced=None).ok
    second = passed_record(cfg, "r2")
    summary_dict(second, "evaluate")["gates"]["passed"] = False
    records.save(storage, second)
    assert forced_promotion(cfg, "r2", "hotfix for the date bug", "ana").promoted
    return storage, "v0001-r1", "v0002-r2"


def assert_promote_promote_rollback(cfg: PipelineConfig) -> None:
    storage, v1, v2 = promote_two(cfg)
    name = cfg.model.name
    result = roll_back(cfg, name, "v2 answers in the wrong format", "bob", None)
    assert (result.rolled_back, result.from_version, result.to_version, result.move) == (True, v2, v1, 3)
    assert production_pointer(storage, name).version == v1
    moves = registry.read_history(storage, name)
    assert [(m.seq, m.kind, m.from_version, m.to_version) for m in moves] == [
        (1, "promote", None, v1),
        (2, "forced-promote", v1, v2),
        (3, "rollback", v2, v1),
    ]
    assert [m.by.split("@")[0] for m in moves][1:] == ["ana", "bob"]
    assert [m.reason for m in moves] == [
        "every gate and the resume test passed",
        "hotfix for the date bug",
        "v2 answers in the wrong format",
    ]
    assert moves[0].evidence_sha256 == evidence_sha256(records.load(storage, "r1"))
    # The rolled-back run's record names the rollback.
    (noted,) = records.load(storage, "r2").rollbacks
    assert (noted.from_version, noted.to_version, noted.by, noted.seq) == (v2, v1, "bob", 3)


def test_promote_promote_rollback_is_three_moves_with_who_and_why(tmp_path):
    assert_promote_promote_rollback(config(str(tmp_path)))


def test_a_rollback_to_a_version_whose_files_changed_is_refused_and_the_pointer_stays(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    storage.write_bytes(b"tampered weights", "models", cfg.model.name, v1, "model.safetensors")
    result = roll_back(cfg, cfg.model.name, "bad night", "bob", v1)
    assert not result.rolled_back and "do not match its manifest" in result.reasons[0]
    assert production_pointer(storage, cfg.model.name).version == v2
    assert len(registry.read_history(storage, cfg.model.name)) == 2
    assert records.load(storage, "r2").rollbacks == []


def test_a_rollback_is_refused_while_another_flow_holds_the_pointer(tmp_path):
    cfg = config(str(tmp_path))
    storage, _, v2 = promote_two(cfg)
    with rollback.hold(storage, cfg.model.name, "r3", "promote r3"):
        result = roll_back(cfg, cfg.model.name, "bad night", "bob", None)
    assert not result.rolled_back and "held by 'promote r3'" in result.reasons[0]
    assert production_pointer(storage, cfg.model.name).version == v2


def test_a_dead_holders_hold_is_taken_over(tmp_path):
    storage = Storage(str(tmp_path))
    dead = {
        "run_id": "r3",
        "holder": os.uname().nodename,
        "pid": 2**22 + 7,
        "command": "promote r3",
        "started": "2026-01-01T00:00:00+00:00",
        "renewed": "2026-01-01T00:00:00+00:00",
        "ttl_s": 1800.0,
    }
    storage.write_json(dead, "models", "m", rollback.HOLD)
    with rollback.hold(storage, "m", "r4", "rollback m"):
        assert json.loads(storage.read_bytes("models", "m", rollback.HOLD))["run_id"] == "r4"
    assert not storage.exists("models", "m", rollback.HOLD)


def test_a_rollback_goes_back_only(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    roll_back(cfg, cfg.model.name, "bad night", "bob", None)
    for target, why in (
        (v2, "not earlier than production"),
        (v1, "already production"),
        ("v0009-x", "no complete version"),
        (None, "no earlier"),
    ):
        result = roll_back(cfg, cfg.model.name, "again", "bob", target)
        assert not result.rolled_back and why in result.reasons[0], result.reasons
    assert production_pointer(storage, cfg.model.name).version == v1


def test_a_promotion_landing_before_the_rollback_holds_the_pointer_is_not_rolled_back(tmp_path, monkeypatch):
    # The rollback read production (v2, run r2), a promotion of r3 landed, and the rollback then swapped what it
    # found: production went back to the v2 the operator wanted gone, and r2's record named a rollback from v3.
    cfg = config(str(tmp_path))
    storage = Storage(str(tmp_path))
    promoted_on_evidence(cfg, "r1", None)
    promoted_on_evidence(cfg, "r2", "v0001-r1")
    real = rollback.rollback

    def promotion_lands_first(*args: Any, **kwargs: Any) -> registry.ProductionPointer:
        promoted_on_evidence(cfg, "r3", "v0002-r2")
        return real(*args, **kwargs)

    monkeypatch.setattr(rollback, "rollback", promotion_lands_first)
    result = roll_back(cfg, cfg.model.name, "v2 answers in the wrong format", "bob", None)
    assert not result.rolled_back
    assert result.reasons == ["production moved after it was read (v0002-r2 -> v0003-r3): nothing was rolled back"]
    assert production_pointer(storage, cfg.model.name).version == "v0003-r3"
    assert records.load(storage, "r2").rollbacks == records.load(storage, "r3").rollbacks == []


def test_a_rollback_whose_record_cannot_be_noted_stands_and_its_retry_moves_nothing(tmp_path):
    # The rolled-back run's record was truncated: the pointer moved, the command failed (exit 4), and its retry
    # rolled back one more version.
    cfg = config(str(tmp_path))
    storage = Storage(str(tmp_path))
    for run, incumbent in (("r1", None), ("r2", "v0001-r1"), ("r3", "v0002-r2")):
        promoted_on_evidence(cfg, run, incumbent)
    path = storage.path("runs", "r3", records.RECORD)
    Path(path).write_text(Path(path).read_text()[:200])
    root = ["--set", f"storage.root={tmp_path}"]
    done = tuneproof("rollback", cfg.model.name, "--reason", "v3 is bad", *root)
    assert done.exit_code == 0, done.output
    result = json.loads(done.stdout)
    assert (result["rolled_back"], result["from_version"], result["to_version"]) == (True, "v0003-r3", "v0002-r2")
    assert result["warnings"][0].startswith("run r3's record does not name rollback #4: RecordUnreadable")
    again = tuneproof("rollback", cfg.model.name, "--reason", "v3 is bad", *root)
    assert again.exit_code == 0 and "already at v0002-r2 by this rollback (#4): not moved again" in again.stdout
    assert production_pointer(storage, cfg.model.name).version == "v0002-r2"
    assert len(registry.read_history(storage, cfg.model.name)) == 4


def test_a_history_artifact_that_cannot_be_published_is_a_warning_of_the_rollback(tmp_path, monkeypatch):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)

    def api_down(*args: object, **kwargs: object) -> None:
        raise ConnectionError("prefect API: connection refused")

    monkeypatch.setattr(promote_tasks, "create_markdown_artifact", api_down)
    result = promote_tasks.rollback.fn(cfg, cfg.model.name, "v2 regressed", "bob", None, "flow-run-1")
    assert (result.rolled_back, result.to_version) == (True, v1)
    assert result.warnings == [
        f"the production history artifact of {cfg.model.name} was not published: ConnectionError: prefect API: "
        "connection refused"
    ]


def with_a_copy_that_never_served(cfg: PipelineConfig) -> tuple[Storage, str]:
    """r1 promoted, a complete v0002-r2 the pointer never named (a promotion that died before its swap), then r3
    promoted over r1."""
    storage = Storage.from_config(cfg.storage)
    name = cfg.model.name
    promoted_on_evidence(cfg, "r1", None)
    models = Path(storage.path("models", name))
    shutil.copytree(models / "v0001-r1", models / "v0002-r2")  # complete, never production
    promoted_on_evidence(cfg, "r3", "v0001-r1")
    assert production_pointer(storage, name).version == "v0003-r3"
    return storage, name


def test_the_default_rollback_target_is_the_version_production_replaced(tmp_path):
    # It was the version numbered before production: a complete copy that never served (its swap timed out), or
    # one rolled back as bad.
    cfg = config(str(tmp_path))
    _, name = with_a_copy_that_never_served(cfg)
    result = roll_back(cfg, name, "v3 regressed", "bob", None)
    assert (result.from_version, result.to_version) == ("v0003-r3", "v0001-r1")


def test_a_rollback_to_a_copy_production_never_served_is_refused_by_name(tmp_path):
    # A promotion killed between its card and the swap left a complete copy whose card claimed move #1, and
    # `rollback --to` moved production onto it.
    cfg = config(str(tmp_path))
    storage, name = with_a_copy_that_never_served(cfg)
    result = roll_back(cfg, name, "v3 regressed", "bob", "v0002-r2")
    assert not result.rolled_back
    assert result.reasons == [
        f"{name}: v0002-r2 was never production (no move in {storage.uri('models', name, 'history')}/ puts it "
        "there; its promotion stopped before the pointer's swap): nothing was rolled back"
    ]
    assert production_pointer(storage, name).version == "v0003-r3"
    assert len(registry.read_history(storage, name)) == 2
    assert roll_back(cfg, name, "v3 regressed", "bob", "v0001-r1").to_version == "v0001-r1"  # it served


def test_a_pointer_written_before_moves_were_recorded_still_rolls_back_to_what_served_before_it(tmp_path):
    # Nothing tells which of those versions served, so each one up to that pointer counts, as rollbacks then took them.
    cfg = config(str(tmp_path))
    storage = Storage(str(tmp_path))
    name = cfg.model.name
    for run in ("r1", "r2"):
        promoted_on_evidence(cfg, run, None if run == "r1" else "v0001-r1")
    pointer = production_pointer(storage, name)
    storage.write_json(pointer.model_copy(update={"move": None}).to_json(), "models", name, "production.json")
    storage.remove("models", name, "history", recursive=True)
    result = roll_back(cfg, name, "v2 regressed", "bob", "v0001-r1")
    assert (result.rolled_back, result.to_version, result.move) == (True, "v0001-r1", 1)


def test_which_versions_production_served():
    def move(seq: int, old: str | None, new: str) -> Move:
        return Move(seq=seq, kind="promote", from_version=old, to_version=new, run_id="r", by="a", at="t", reason="x")

    names = ["v0001-a", "v0002-b", "v0003-c", "v0004-d", "v0005-e"]
    moves = [move(1, None, "v0001-a"), move(2, "v0001-a", "v0003-c")]
    assert history.served(moves, names, None) == {"v0001-a", "v0003-c"}  # v0002-b, v0004-d: never production
    # Moves recorded from a pointer that had none: what it named, and everything before it, may have served.
    assert history.served([move(1, "v0002-b", "v0004-d")], names, None) == {"v0001-a", "v0002-b", "v0004-d"}
    assert history.served([], names, "v0003-c") == {"v0001-a", "v0002-b", "v0003-c"}
    assert history.served([], names, None) == set()


def test_what_was_production_at_a_time():
    def move(seq: int, to: str, at: str) -> Move:
        return Move(seq=seq, kind="promote", from_version=None, to_version=to, run_id="r", by="a", at=at, reason="x")

    moves = [move(1, "v1", "2026-12-01T10:00:00+00:00"), move(2, "v2", "2026-12-02T10:00:00+00:00")]
    at = history.parse_time
    assert production_at(moves, at("2026-12-01T09:59:59Z")) is None
    assert present(production_at(moves, at("2026-12-01T10:00:00"))).to_version == "v1"  # no zone: UTC
    assert present(production_at(moves, at("2026-12-02T09:00:00+00:00"))).to_version == "v1"
    assert present(production_at(moves, at("2026-12-03T00:00:00+00:00"))).to_version == "v2"
    with pytest.raises(ValueError, match="'yesterday' is not ISO 8601"):
        at("yesterday")


def test_a_move_whose_append_was_lost_is_read_from_the_pointer_and_backfilled(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    name = cfg.model.name
    storage.remove(*history.entry_parts(name, 2))  # the mover died between the swap and the append
    assert [m.to_version for m in registry.read_history(storage, name)] == [v1, v2]
    roll_back(cfg, name, "bad night", "bob", None)
    assert sorted(storage.listdir("models", name, "history")) == ["000001.json", "000002.json", "000003.json"]


def test_an_entry_is_never_rewritten(tmp_path):
    storage = Storage(str(tmp_path))
    intent = MoveIntent(kind="promote", by="a", reason="x")
    first = history.next_move(None, None, intent, "v0001-r1", "r1", "2026-12-01T10:00:00+00:00")
    history.append(storage, "m", first)
    history.append(storage, "m", first)  # a retry of the same move: fine
    with pytest.raises(history.HistoryUnreadable, match="two movers claimed one sequence number"):
        history.append(storage, "m", first.model_copy(update={"to_version": "v0002-r2"}))


def test_the_cli_shows_the_history_answers_at_and_rolls_back(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    root = ["--set", f"storage.root={tmp_path}"]
    refused = tuneproof("rollback", cfg.model.name, *root)
    assert refused.exit_code == 2 and "--reason" in refused.output
    done = tuneproof("rollback", cfg.model.name, "--reason", "v2 regressed", *root)
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["to_version"] == v1
    shown_run = tuneproof("runs", "show", "r2", *root)  # the run whose model was production says so
    assert shown_run.exit_code == 0, shown_run.output
    assert "rolled back: dates-qwen2-tiny v0002-r2 -> v0001-r1 at " in shown_run.output
    assert "(history #3): v2 regressed" in shown_run.output
    shown = tuneproof("models", "history", cfg.model.name, "--json", *root)
    assert [m["to_version"] for m in json.loads(shown.stdout)] == [v1, v2, v1]
    text = tuneproof("models", "history", cfg.model.name, *root).stdout
    assert "#3" in text and "rollback v0002-r2 -> v0001-r1" in text and "v2 regressed" in text
    second = registry.read_history(storage, cfg.model.name)[1]
    just_after = (history.parse_time(second.at) + timedelta(milliseconds=1)).isoformat()
    at = tuneproof("models", "history", cfg.model.name, "--at", just_after, "--json", *root)
    assert [m["to_version"] for m in json.loads(at.stdout)] == [v2]
    before = tuneproof("models", "history", cfg.model.name, "--at", "2000-01-01", *root)
    assert before.exit_code == 1 and "no recorded production model" in before.output
    again = tuneproof("rollback", cfg.model.name, "--reason", "x", "--to", v2, *root)
    assert again.exit_code == 3 and "not earlier" in again.output, again.output


def test_the_card_shows_the_history_up_to_its_promotion(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    card = storage.read_text("models", cfg.model.name, v2, registry.CARD_MD)
    assert "## Production history" in card
    assert "| 2 |" in card and "forced-promote | v0001-r1 | v0002-r2 | ana | hotfix for the date bug |" in card
    shown = registry.show_model(storage, cfg.model.name)
    assert [m["seq"] for m in shown["history"]] == [1, 2]


def test_the_promote_summary_keeps_the_pointer_fields_only(tmp_path):
    cfg = config(str(tmp_path))
    storage, v1, _ = promote_two(cfg)
    summary = records.load(storage, "r2").promotion
    assert isinstance(summary, PromoteSummary) and summary.previous_version == v1


@pytest.mark.integration
def test_promote_promote_rollback_on_s3(s3_endpoint):
    assert_promote_promote_rollback(config(f"s3://{TEST_BUCKET}/history-{uuid.uuid4().hex[:8]}", s3_endpoint))


@pytest.mark.integration
@pytest.mark.timeout(900)
def test_the_rollback_deployment_runs_from_prefect_with_a_reason(prefect_server, tmp_path):
    """`prefect deploy` of prefect.yaml's `rollback`, a run of it with the form's parameters (run_deployment),
    executed as the local process worker executes it (`prefect flow-run execute`: its pull step, then the
    deployment's entrypoint): the history moves with the reason and who; the server refuses a form without `by`."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.objects import FlowRun
    from prefect.deployments import run_deployment
    from prefect.exceptions import PrefectHTTPStatusError

    from tuneproof.app import localctl

    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    env = {**os.environ, "PREFECT_API_URL": f"{prefect_server}/api", "PWD": str(PROJECT_ROOT)}
    localctl.ensure_work_pools(env)
    prefect = str(Path(sys.executable).parent / "prefect")

    def cli(*args: str) -> None:
        done = subprocess.run([prefect, *args], env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (args, done.stdout[-3000:], done.stderr[-3000:])

    cli("--no-prompt", "deploy", "--name", "rollback")
    form = {"model": cfg.model.name, "reason": "v2 regressed overnight", "storage": {"root": str(tmp_path)}}
    with pytest.raises(PrefectHTTPStatusError, match="by"):  # who rolls back is required: no silent default
        run_deployment("tuneproof-rollback/rollback", parameters=form, timeout=0)
    run = run_deployment("tuneproof-rollback/rollback", parameters={**form, "by": "oncall"}, timeout=0)
    assert isinstance(run, FlowRun)  # called from sync code: the run itself, not a coroutine
    cli("flow-run", "execute", str(run.id))

    async def final_state():
        async with get_client() as client:
            return (await client.read_flow_run(run.id)).state

    state = asyncio.run(final_state())
    assert state is not None and state.is_completed(), state
    moves = registry.read_history(storage, cfg.model.name)
    assert [(m.kind, m.from_version, m.to_version, m.by, m.reason) for m in moves[2:]] == [
        ("rollback", v2, v1, "oncall", "v2 regressed overnight")
    ]
    assert production_pointer(storage, cfg.model.name).version == v1
    assert records.load(storage, "r2").rollbacks[0].reason == "v2 regressed overnight"


@pytest.mark.integration
def test_the_rollback_flow_refuses_with_the_pointer_kept_and_publishes_the_history(prefect_server, tmp_path):
    from prefect.client.orchestration import get_client

    from flows.rollback import rollback as rollback_flow

    cfg = config(str(tmp_path))
    storage, v1, v2 = promote_two(cfg)
    done = rollback_flow(
        model=cfg.model.name, reason="v2 regressed", by="oncall", storage=cfg.storage, return_state=True
    )
    assert done.is_completed(), done.message
    refused = rollback_flow(model=cfg.model.name, reason="again", by="oncall", storage=cfg.storage, return_state=True)
    assert refused.is_failed() and "no earlier version to go back to by default" in (refused.message or "")
    assert production_pointer(storage, cfg.model.name).version == v1

    async def artifact():
        async with get_client() as client:
            return await client.read_artifacts()

    texts = [a.data for a in asyncio.run(artifact()) if a.key and a.key.startswith("production-history-rollback-")]
    assert any("v2 regressed" in t for t in texts)


def test_the_rollback_deployment_takes_a_typed_form():
    import yaml
    from prefect.utilities.callables import parameter_schema

    from flows.rollback import rollback as rollback_flow
    from flows.rollback import who
    from tuneproof.core.config import load_config
    from tuneproof.core.config_cluster import StorageConfig

    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    deployments = {d["name"]: d for d in doc["deployments"]}
    local, eks = deployments["rollback"], deployments["eks-rollback"]
    assert local["entrypoint"] == eks["entrypoint"] == "flows/rollback.py:rollback" and local["parameters"] == {}
    assert (local["work_pool"]["name"], eks["work_pool"]["name"]) == ("local-process", "tuneproof-eks")
    eks_storage = load_config(PROJECT_ROOT / "configs" / "eks.yaml", resolve=False).storage
    assert StorageConfig.model_validate(eks["parameters"]["storage"]) == eks_storage  # the EKS registry
    schema = parameter_schema(rollback_flow).model_dump_for_openapi()
    assert set(schema["required"]) == {"model", "reason", "by"}
    assert all(schema["properties"][p]["minLength"] == 1 for p in ("model", "reason", "by"))
    assert "root" in schema["definitions"]["StorageConfig"]["properties"]  # the registry it acts on
    assert rollback_flow.validate_parameters({"model": "m", "reason": "r", "by": "b"})["storage"] == StorageConfig()
    assert who("oncall", None) == "oncall"
    assert who("oncall", "AUTOMATION guard") == "oncall (flow run created by AUTOMATION guard)"


def test_a_rollback_of_an_unknown_model_is_refused_and_leaves_nothing_behind(tmp_path):
    result = roll_back(config(str(tmp_path)), "never-promoted", "x", "bob", None)
    assert not result.rolled_back and "no production model to roll back" in result.reasons[0]
    assert not (tmp_path / "models").exists()
