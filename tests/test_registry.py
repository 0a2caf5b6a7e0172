"""The model registry: versioned copies, the card, and a production pointer moved by compare-and-swap.

Concurrency is tested with real processes on a local root and against a real S3-compatible
server (moto's server mode, which honours If-None-Match / If-Match on PutObject).
"""

from __future__ import annotations

import json
import multiprocessing
import os
import re
import time
import uuid
from typing import Any

import pytest

from tests.conftest import TEST_BUCKET
from tests.reading import production_pointer
from tuneproof.control import registry
from tuneproof.control.history import HistoryUnreadable
from tuneproof.control.registry import PromotionConflict, next_version, promote, read_pointer, render_model_card
from tuneproof.core.storage import Storage

NAME = "dates-qwen2-tiny"
MODELS_DIR = registry.MODELS
LOCK = ".production.json.lock"
"""The pointer's lock file (tuneproof.core.cas names it after the object it guards)."""


def card(run_id: str = "r1", **extra: Any) -> registry.CardFacts:
    facts: dict[str, Any] = {
        "name": NAME,
        "run_id": run_id,
        "base_model": "tiny-qwen2",
        "metrics": {
            "candidate": {"exact_match": 0.93, "eval_loss": 0.2},
            "base": {"exact_match": 0.0, "eval_loss": 4.1},
            "incumbent": None,
        },
        "incumbent_version": None,
        "gates": ["exact_match >= 0.8: 0.93 (pass)"],
        "dataset_hash": "abc123",
        "image_digest": "sha256:feed",
        "code_sha": "c0de",
        "code_dirty": False,
        "config_hash": "cf9",
        "resume": {"restored_step": 100, "max_loss_diff": 0.0},
        "forced": None,
    }
    return registry.CardFacts.model_validate({**facts, **extra})


def versioned(facts: registry.CardFacts, version: str, **extra: Any) -> registry.ModelCard:
    """The card a promotion of `facts` as `version` writes, without the copy."""
    return registry.ModelCard.model_validate({**facts.to_json(), "version": version, "source_path": "runs/x", **extra})


def export(storage: Storage, run_id: str) -> str:
    """A stand-in for a run's HF export: the files a promotion copies."""
    path = f"runs/{run_id}/model"
    storage.write_json({"model_type": "qwen2", "run": run_id}, path, "config.json")
    storage.write_bytes(f"weights of {run_id}".encode(), path, "model.safetensors")
    storage.write_json({"chat_template": "..."}, path, "tokenizer_config.json")
    return path


@pytest.fixture
def local(tmp_path) -> Storage:
    return Storage(str(tmp_path / "store"))


def test_next_version_is_monotonic():
    assert next_version([], "runA") == "v0001-runA"
    assert next_version(["v0001-a", "v0007-b", "production.json", ".production.json.lock"], "c") == "v0008-c"


def test_promote_twice_moves_the_pointer(local):
    assert read_pointer(local, NAME) == (None, None)
    first = promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    assert first.version == "v0001-runA" and first.previous_version is None
    pointer, token = read_pointer(local, NAME)
    assert pointer == first and token
    second = promote(local, NAME, "runB", export(local, "runB"), card("runB", incumbent_version="v0001-runA"), token)
    assert second.version == "v0002-runB" and second.previous_version == "v0001-runA"
    assert second.path == "models/dates-qwen2-tiny/v0002-runB"
    assert read_pointer(local, NAME)[0] == second
    assert local.read_bytes(second.path, "model.safetensors") == b"weights of runB"
    assert local.read_json(second.path, "card.json")["version"] == "v0002-runB"
    assert "replacing v0001-runA" in local.read_text(second.path, "MODEL_CARD.md")


def test_list_and_show(local):
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    _, token = read_pointer(local, NAME)
    promote(local, NAME, "runB", export(local, "runB"), card("runB"), token)
    [row] = registry.list_models(local)
    assert row["name"] == NAME and row["production"]["version"] == "v0002-runB"
    assert row["versions"] == ["v0001-runA", "v0002-runB"]
    shown = registry.show_model(local, NAME)
    assert [(v["version"], v["production"], v["complete"]) for v in shown["versions"]] == [
        ("v0001-runA", False, True),
        ("v0002-runB", True, True),
    ]
    assert shown["versions"][0]["card"]["run_id"] == "runA"
    with pytest.raises(FileNotFoundError, match="no model 'other'.*registered: dates-qwen2-tiny"):
        registry.show_model(local, "other")


def test_a_pointer_or_card_whose_run_is_not_its_versions_is_refused(local):
    # A rollback notes the pointer's run in that run's record: '../../x' ended in "UnsafePath ... (please report)",
    # and another run's id would have noted a run production never served. The run is the version's own.
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    pointer = production_pointer(local, NAME)
    for run_id in ("../../x", "runB"):
        local.write_json({**pointer.to_json(), "run_id": run_id}, MODELS_DIR, NAME, "production.json")
        expected = f"not a usable production pointer (run_id is {run_id!r}, expected 'runA', the run of v0001-runA)"
        with pytest.raises(registry.RegistryUnreadable, match=re.escape(expected)):
            read_pointer(local, NAME)
    # A rollback writes the pointer from the target's card: a card naming another run would point production there.
    local.write_json(versioned(card("runB"), "v0001-runA").to_json(), MODELS_DIR, NAME, "v0001-runA", "card.json")
    with pytest.raises(ValueError, match=re.escape("run_id is 'runB', not the run of its version 'v0001-runA'")):
        registry.read_card(local, NAME, "v0001-runA")


def test_a_lora_version_shows_its_merged_model_and_its_adapter(local):
    """`tuneproof models show NAME` lists, per version, the merged model and (LoRA) the adapter."""
    from typer.testing import CliRunner

    from tuneproof.app.cli import app

    promote(local, NAME, "full", export(local, "full"), card("full", method="full"), None)
    lora = export(local, "lora")
    local.write_json({"peft_type": "LORA", "r": 8}, lora, "adapter", "adapter_config.json")
    local.write_bytes(b"adapter weights", lora, "adapter", "adapter_model.safetensors")
    lora_card = card("lora", method="lora", trainable_params=1234, total_params=56789, adapter="adapter")
    promote(local, NAME, "lora", lora, lora_card, read_pointer(local, NAME)[1])

    shown = CliRunner().invoke(app, ["models", "show", NAME, "--set", f"storage.root={local.root}"])
    assert shown.exit_code == 0, shown.output
    rows = {v["version"]: v for v in json.loads(shown.output)["versions"]}
    assert (rows["v0001-full"]["merged"], rows["v0001-full"]["adapter"]) == ("models/dates-qwen2-tiny/v0001-full", None)
    assert rows["v0002-lora"]["merged"] == "models/dates-qwen2-tiny/v0002-lora"
    assert rows["v0002-lora"]["adapter"] == "models/dates-qwen2-tiny/v0002-lora/adapter"
    assert local.read_bytes(rows["v0002-lora"]["adapter"], "adapter_model.safetensors") == b"adapter weights"
    text = render_model_card(versioned(lora_card, "v0002-lora"))
    assert "| method | `lora: 1,234 of 56,789 parameters trained; adapter in adapter/` |" in text


def test_a_lora_version_is_copied_and_verified_with_its_adapter(local, tmp_path):
    """The export manifest covers adapter/ as well as the merged model: promotion copies both, checks
    both against the judged content hash, and refuses (removing the copy) when an adapter file changed."""
    from training.hf_export import publish_export
    from tuneproof.core import markers

    built = tmp_path / "export"
    (built / "adapter").mkdir(parents=True)
    (built / "config.json").write_text('{"model_type": "qwen2"}')
    (built / "model.safetensors").write_bytes(b"merged weights")
    (built / "adapter" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8}')
    (built / "adapter" / "adapter_model.safetensors").write_bytes(b"adapter weights")
    made_by = {"run_id": "lora", "invocation": 1, "run_name": "lora"}
    manifest = publish_export(local, built, "runs/lora/model", 12, made_by)
    assert {"adapter/adapter_config.json", "adapter/adapter_model.safetensors"} <= set(manifest.files)
    content = manifest.content_sha256

    pointer = promote(local, NAME, "lora", "runs/lora/model", card("lora"), None, content_sha256=content)
    version = pointer.version
    assert pointer.content_sha256 == content
    assert local.read_bytes(MODELS_DIR, NAME, version, "adapter", "adapter_model.safetensors") == b"adapter weights"
    assert markers.verify_export(local, MODELS_DIR, NAME, version).content_sha256 == content

    local.write_bytes(b"other adapter", "runs/lora/model", "adapter", "adapter_model.safetensors")
    other = "other-model"  # under NAME production already serves `content`: no copy would be made to check
    with pytest.raises(markers.ExportUnverified, match=r"adapter/adapter_model\.safetensors \(size"):
        promote(local, other, "lora2", "runs/lora/model", card("lora2", name=other), None, content_sha256=content)
    assert not any(v.endswith("-lora2") for v in local.listdir(MODELS_DIR, other))


def test_stale_token_is_refused_before_copying(local):
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    with pytest.raises(PromotionConflict, match="expected no production model, found v0001-runA"):
        promote(local, NAME, "runB", export(local, "runB"), card("runB"), None)
    assert local.listdir("models", NAME) == ["history", "production.json", "v0001-runA"]


def test_a_retry_of_the_promoted_run_changes_nothing(local):
    first = promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    again = promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    assert again == first and registry.show_model(local, NAME)["versions"][0]["version"] == "v0001-runA"
    assert len(registry.show_model(local, NAME)["versions"]) == 1


def test_the_bytes_production_serves_are_never_copied_to_a_second_version(local, tmp_path):
    """Another run's model with production's content hash raises AlreadyServing naming that version, before the
    token check and the copy: no v0002 duplicate, the pointer and history as they were."""
    from training.hf_export import publish_export

    built = tmp_path / "export"
    built.mkdir()
    (built / "config.json").write_text('{"model_type": "qwen2"}')
    (built / "model.safetensors").write_bytes(b"the same weights")
    made_by = {"invocation": 1}
    content = publish_export(
        local, built, "runs/a/model", 12, {**made_by, "run_id": "a", "run_name": "a"}
    ).content_sha256
    assert (
        publish_export(local, built, "runs/b/model", 12, {**made_by, "run_id": "b", "run_name": "b"}).content_sha256
        == content
    )
    first = promote(local, NAME, "a", "runs/a/model", card("a"), None, content_sha256=content)
    for token in (read_pointer(local, NAME)[1], None):  # evaluated against v0001-a, or before it was promoted
        with pytest.raises(
            registry.AlreadyServing, match=f"v0001-a \\(run a\\) already serves this content \\({content[:12]}\\)"
        ):
            promote(local, NAME, "b", "runs/b/model", card("b"), token, content_sha256=content)
    assert local.listdir(MODELS_DIR, NAME) == ["history", "production.json", "v0001-a"]
    assert read_pointer(local, NAME)[0] == first and len(registry.read_history(local, NAME)) == 1


def test_missing_export_is_named(local):
    with pytest.raises(FileNotFoundError, match="runs/ghost/model has no config.json"):
        promote(local, NAME, "ghost", "runs/ghost/model", card("ghost"), None)


def test_whatever_stops_a_promotion_between_the_copy_and_the_swap_leaves_no_version(local):
    # A cost that could not be computed (another run's record) raised after the copy and its check, and the copy
    # stayed behind as an incomplete version; an unreadable history did the same after the copy check's Ray job.
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    _, token = read_pointer(local, NAME)

    def no_cost(move: Any) -> Any:
        raise ValueError("a record of this model cannot be read")

    with pytest.raises(ValueError, match="cannot be read"):
        promote(local, NAME, "runB", export(local, "runB"), card("runB"), token, cost_of=no_cost)
    assert local.listdir("models", NAME) == ["history", "production.json", "v0001-runA"]
    local.write_bytes(b'{"seq": 1, "kind": "prom', "models", NAME, "history", "000001.json")
    checked: list[str] = []
    with pytest.raises(HistoryUnreadable, match="000001.json: not a production-history entry"):
        promote(local, NAME, "runB", export(local, "runB"), card("runB"), token, check_copy=checked.append)
    assert checked == [] and local.listdir("models", NAME) == ["history", "production.json", "v0001-runA"]
    assert production_pointer(local, NAME).version == "v0001-runA"


def _race(root: str, endpoint: str | None, run_id: str, token: str | None, start: Any, outcomes: Any) -> None:
    storage = Storage(root, endpoint)
    source = f"runs/{run_id}/model"
    start.wait(timeout=120)  # every racer has imported and is ready: they promote at the same moment
    try:
        outcomes.put("won:" + promote(storage, NAME, run_id, source, card(run_id), token).version)
    except PromotionConflict:
        outcomes.put("lost")


def race(storage: Storage, racers: int) -> tuple[list[str], list[str]]:
    """`racers` processes promote over the same incumbent at once; returns (outcomes, run ids).

    The racers are spawned, never forked: this process holds threads (Ray, the Prefect test server,
    boto3's pools), and a forked child can inherit a lock one of them held and wait on it forever.
    """
    runs = [f"race{i}" for i in range(racers)]
    for run in runs:
        export(storage, run)
    _, token = read_pointer(storage, NAME)
    ctx = multiprocessing.get_context("spawn")
    start, outcomes = ctx.Barrier(racers), ctx.Queue()
    args = [(storage.root, storage.endpoint_url, run, token, start, outcomes) for run in runs]
    processes = [ctx.Process(target=_race, args=a) for a in args]
    for process in processes:
        process.start()
    try:
        results = [outcomes.get(timeout=180) for _ in processes]
    finally:
        for process in processes:
            process.join(timeout=30)
            if process.is_alive():
                process.kill()
    return results, runs


def assert_one_winner(storage: Storage, outcomes: list[str]) -> None:
    winners = [o for o in outcomes if o.startswith("won:")]
    assert len(winners) == 1, outcomes
    version = winners[0].removeprefix("won:")
    assert production_pointer(storage, NAME).version == version
    # Losers removed their copies: only the incumbent and the winner remain.
    versions = [v["version"] for v in registry.show_model(storage, NAME)["versions"]]
    assert versions == ["v0001-first", version], versions


def test_concurrent_promotions_one_winner_local(local):
    promote(local, NAME, "first", export(local, "first"), card("first"), None)
    outcomes, _ = race(local, 4)
    assert_one_winner(local, outcomes)
    assert not (os.path.exists(local.path("models", NAME, LOCK)))


def overtaken_during_copy(storage: Storage, monkeypatch) -> None:
    """'slow' passes the early pointer check, then 'fast' promotes while slow is copying: slow's swap must fail."""
    promote(storage, NAME, "first", export(storage, "first"), card("first"), None)
    _, token = read_pointer(storage, NAME)
    real_copy = registry._copy_model

    def copy_then_get_overtaken(st, source, dest):
        real_copy(st, source, dest)
        if source == "runs/slow/model":
            promote(st, NAME, "fast", export(st, "fast"), card("fast"), token)

    monkeypatch.setattr(registry, "_copy_model", copy_then_get_overtaken)
    with pytest.raises(PromotionConflict, match="found v0003-fast"):
        promote(storage, NAME, "slow", export(storage, "slow"), card("slow"), token)
    assert production_pointer(storage, NAME).version == "v0003-fast"
    # The loser's v0002-slow copy is removed; the version number stays used.
    assert [v["version"] for v in registry.show_model(storage, NAME)["versions"]] == ["v0001-first", "v0003-fast"]


def test_a_promotion_landing_during_the_copy_wins_local(local, monkeypatch):
    overtaken_during_copy(local, monkeypatch)


def test_a_crashed_holders_lock_is_broken(local):
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    lock = local.path("models", NAME, LOCK)
    with open(lock, "w") as f:
        json.dump({"nonce": "dead", "pid": 999999, "host": "gone"}, f)
    old = time.time() - 120
    os.utime(lock, (old, old))
    _, token = read_pointer(local, NAME)
    assert (
        promote(local, NAME, "runB", export(local, "runB"), card("runB"), token, stale_lock_s=60).version
        == "v0002-runB"
    )
    assert not os.path.exists(lock)


def test_a_live_lock_times_out_and_the_copy_is_kept_unpointed_until_the_runs_next_promotion(local):
    promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    lock = local.path("models", NAME, LOCK)
    with open(lock, "w") as f:
        json.dump({"nonce": "alive", "pid": os.getpid(), "host": "here"}, f)
    _, token = read_pointer(local, NAME)
    with pytest.raises(TimeoutError, match=r"lock .*\.production\.json\.lock still held .*alive"):
        promote(local, NAME, "runB", export(local, "runB"), card("runB"), token, lock_timeout_s=0.3, stale_lock_s=60)
    assert production_pointer(local, NAME).version == "v0001-runA"
    assert [v["production"] for v in registry.show_model(local, NAME)["versions"]] == [True, False]
    os.remove(lock)  # the run's next promotion removes the copy its swap never named
    assert promote(local, NAME, "runB", export(local, "runB"), card("runB"), token).version == "v0003-runB"
    assert registry.versions(local, NAME) == ["v0001-runA", "v0003-runB"]


def died_before_the_swap(storage: Storage, run_id: str, monkeypatch) -> None:
    """A promotion of `run_id` killed between its card and the pointer's swap: a complete copy the pointer
    never named, whose card claims a move that never happened."""
    token = read_pointer(storage, NAME)[1]

    def killed(*args: Any) -> None:
        raise SystemExit(137)  # not an Exception: nothing of promote's own cleanup runs, as after kill -9

    with monkeypatch.context() as patched:
        patched.setattr(registry, "swap_pointer", killed)
        with pytest.raises(SystemExit):
            promote(storage, NAME, run_id, export(storage, run_id), card(run_id), token)


def test_a_retry_after_a_promotion_died_before_its_swap_removes_that_copy_never_another_runs(local, monkeypatch):
    # The retry promoted a second copy and left the first, whose card claimed move #1, and `rollback --to` took it.
    died_before_the_swap(local, "runB", monkeypatch)
    died_before_the_swap(local, "runA", monkeypatch)
    assert registry.versions(local, NAME) == ["v0001-runB", "v0002-runA"]
    assert local.read_json(MODELS_DIR, NAME, "v0002-runA", "card.json")["history"][0]["to_version"] == "v0002-runA"
    retried = promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    assert retried.version == "v0003-runA" and retried.previous_version is None
    shown = registry.show_model(local, NAME)
    assert [(v["version"], v["production"], v["served"]) for v in shown["versions"]] == [
        ("v0001-runB", False, False),  # another run's: never touched, but named as never production
        ("v0003-runA", True, True),
    ]
    assert "v0001-runB was never production (no move in" in shown["versions"][0]["problem"]
    assert "problem" not in shown["versions"][1]
    assert [(m["seq"], m["to_version"]) for m in shown["history"]] == [(1, "v0003-runA")]


def test_an_attempt_still_before_its_swap_loses_to_the_retry_that_removed_its_copy(local, monkeypatch):
    # Its copy is removed only after the retry's swap: by then its own swap holds a stale token and can only lose,
    # so the pointer never names a removed folder.
    real_swap = registry.swap_pointer
    swaps: list[str] = []

    def retry_lands_first(storage: Storage, name: str, pointer: Any, *rest: Any) -> None:
        swaps.append(pointer.version)
        if len(swaps) == 1:  # the first attempt, copied and carded: the retry runs whole before its swap
            promote(storage, NAME, "runA", export(storage, "runA"), card("runA"), None)
        real_swap(storage, name, pointer, *rest)

    monkeypatch.setattr(registry, "swap_pointer", retry_lands_first)
    with pytest.raises(PromotionConflict, match="found v0002-runA"):
        promote(local, NAME, "runA", export(local, "runA"), card("runA"), None)
    assert swaps == ["v0001-runA", "v0002-runA"] and production_pointer(local, NAME).version == "v0002-runA"
    assert registry.versions(local, NAME) == ["v0002-runA"]
    assert local.exists(MODELS_DIR, NAME, "v0002-runA", "card.json")


def test_a_copy_production_never_served_has_no_cost_in_models_show():
    cost = {"money": 1.0}
    rows = [{"served": False, "card": {"cost": cost}}, {"served": True, "card": {"cost": cost}}]
    assert registry.version_costs(rows) == [cost]


def test_model_card_renders_provenance_metrics_and_gates():
    text = render_model_card(
        versioned(
            card("runB", incumbent_version="v0001-runA"),
            "v0002-runB",
            source_path="runs/runB/model",
            base_content_hash="ba5e",
            base_recipe={"steps": 900, "seed": 0},
            metrics={
                "candidate": {"exact_match": 0.93},
                "base": {"exact_match": 0.0},
                "incumbent": {"exact_match": 0.9},
            },
        )
    )
    assert text.startswith("# dates-qwen2-tiny v0002-runB\n")
    assert "after every gate and the resume test passed, replacing v0001-runA" in text
    for needle in (
        "| dataset hash | `abc123` |",
        "| image digest | `sha256:feed` |",
        "| code SHA | `c0de` |",
        "| config hash | `cf9` |",
        "| run | `runB` |",
        "| base content hash | `ba5e` |",
        '| base recipe | `{"seed": 0, "steps": 900}` |',
        "restored at step 100",
        "| exact_match | 0.93 | 0 | 0.9 | +0.93 | +0.03 |",
        "- exact_match >= 0.8: 0.93 (pass)",
    ):
        assert needle in text, needle
    override = {"by": "ana", "reason": "hotfix", "at": "2026-12-01T10:00:00+00:00", "bypassed": ["gates not passed"]}
    forced = render_model_card(versioned(card("runC", forced=override), "v0003-runC"))
    assert "Promoted by override from run `runC`, the first production model, by ana: hotfix" in forced
    assert "Checks bypassed: gates not passed." in forced and "| incumbent | `" not in forced


@pytest.fixture
def s3(s3_endpoint) -> Storage:
    return Storage(f"s3://{TEST_BUCKET}/registry-{uuid.uuid4().hex[:8]}", s3_endpoint)


@pytest.mark.integration
def test_promote_twice_on_s3(s3):
    first = promote(s3, NAME, "runA", export(s3, "runA"), card("runA"), None)
    pointer, token = read_pointer(s3, NAME)
    assert token is not None
    assert pointer == first and token.startswith('"')  # the ETag
    with pytest.raises(PromotionConflict):
        promote(s3, NAME, "runB", export(s3, "runB"), card("runB"), '"not-the-etag"')
    second = promote(s3, NAME, "runB", "runs/runB/model", card("runB"), token)
    assert production_pointer(s3, NAME).version == second.version == "v0002-runB"
    assert s3.read_bytes(second.path, "model.safetensors") == b"weights of runB"
    assert [v["version"] for v in registry.show_model(s3, NAME)["versions"]] == ["v0001-runA", "v0002-runB"]


@pytest.mark.integration
def test_the_first_pointer_is_created_only_once_on_s3(s3):
    # All think there is no production model yet: If-None-Match: * lets exactly one create it.
    outcomes, _ = race(s3, 3)
    winners = [o.removeprefix("won:") for o in outcomes if o.startswith("won:")]
    assert len(winners) == 1, outcomes
    assert [v["version"] for v in registry.show_model(s3, NAME)["versions"]] == winners


@pytest.mark.integration
def test_concurrent_promotions_one_winner_s3(s3):
    promote(s3, NAME, "first", export(s3, "first"), card("first"), None)
    outcomes, _ = race(s3, 4)
    assert_one_winner(s3, outcomes)


@pytest.mark.integration
def test_a_promotion_landing_during_the_copy_wins_s3(s3, monkeypatch):
    overtaken_during_copy(s3, monkeypatch)
