"""The pre-trained tiny base: its bundled skills, its recipe's hash, the cache `local up` builds through."""

from __future__ import annotations

import hashlib
import json
import runpy
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.reading import present
from training.modeling import ModelUnreadable, base_model_facts
from tuneproof.app import tiny_model
from tuneproof.app.tiny_base import SkillsRecipe, content_hash, encode_chat, lr_at
from tuneproof.app.tiny_model import DEFAULT_DATA, ensure_tiny_model, train_tokenizer
from tuneproof.core.config import PROJECT_ROOT

SKILLS = PROJECT_ROOT / "data" / "skills"
SMALL = SkillsRecipe(steps=20, batch_size=16)
"""A build that shows the machinery in seconds; what it learns is not the point here."""


def test_committed_skills_are_the_generators_output(tmp_path):
    runpy.run_path(str(SKILLS / "make_skills.py"))["main"](str(tmp_path))
    for path in [tmp_path / "train.jsonl", tmp_path / "replay.jsonl", *sorted((tmp_path / "suites").glob("*.jsonl"))]:
        committed = SKILLS / path.relative_to(tmp_path)
        assert path.read_bytes() == committed.read_bytes(), f"{committed} is stale: rerun make_skills.py"


def test_each_suite_item_has_an_id_and_held_out_items_are_not_trained_on():
    train = {json.loads(line)["input"] for line in (SKILLS / "train.jsonl").read_text().splitlines()}
    for skill in ("add", "reverse", "capital"):
        items = [json.loads(line) for line in (SKILLS / "suites" / f"{skill}.jsonl").read_text().splitlines()]
        assert len({x["id"] for x in items}) == len(items) > 20 and all(x["id"].startswith(skill) for x in items)
        seen = [x["input"] in train for x in items]
        assert all(seen) if skill == "capital" else not any(seen)  # a lookup is knowledge; the others, skills


def test_the_replay_file_rehearses_the_skills_whose_suites_are_held_out_and_no_suite_item():
    replay = [json.loads(line) for line in (SKILLS / "replay.jsonl").read_text().splitlines()]
    suites = {
        json.loads(line)["input"]
        for path in (SKILLS / "suites").glob("*.jsonl")
        for line in path.read_text().splitlines()
    }
    assert {row["skill"] for row in replay} == {"add", "reverse"} and len(replay) == 574
    assert not suites & {row["input"] for row in replay}


def test_the_content_hash_names_the_recipe_the_shape_and_every_input_file(tmp_path):
    data = tmp_path / "a.jsonl"
    data.write_text("x\n")
    key = content_hash(SMALL, {"hidden": 64}, [data])
    assert key == content_hash(SkillsRecipe(steps=20, batch_size=16), {"hidden": 64}, [data])
    assert key != content_hash(SkillsRecipe(steps=21, batch_size=16), {"hidden": 64}, [data])
    assert key != content_hash(SMALL, {"hidden": 32}, [data])
    data.write_text("y\n")
    assert key != content_hash(SMALL, {"hidden": 64}, [data])


def test_schedule_warms_up_then_decays_to_a_tenth():
    recipe = SkillsRecipe(steps=100, warmup_steps=10, lr=1.0)
    assert lr_at(5, recipe) == 0.5 and lr_at(10, recipe) == 1.0
    assert lr_at(100, recipe) == pytest.approx(0.1)


def test_a_chat_masks_the_prompt_and_learns_the_answer_and_end_of_turn():
    tok = train_tokenizer(["user\nadd 1 and 2\nassistant\n3\n"] * 5, 300)
    ids, labels = encode_chat(tok, "add 1 and 2", "3")
    answer = [i for i, lab in zip(ids, labels) if lab != -100]
    assert tok.decode(answer) == "3<|im_end|>" and len(ids) == len(labels)


def test_the_base_is_built_once_per_hash_deterministically_and_copied_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(tiny_model, "BASE_CACHE", tmp_path / "cache")
    first = tmp_path / "one" / "tiny-qwen2"
    assert ensure_tiny_model(first, DEFAULT_DATA, recipe=SMALL) is True
    facts = json.loads((first / "base.json").read_text())
    assert facts["recipe"] == SMALL.to_json() and len(facts["content_hash"]) == 64
    assert set(facts["skills_exact_match"]) == {"add", "capital", "reverse"}
    assert present(base_model_facts(str(first))).content_hash == facts["content_hash"]  # what the fine-tune records
    assert ensure_tiny_model(first, DEFAULT_DATA, recipe=SMALL) is False  # the same hash: nothing to do

    def no_training(*args, **kwargs):
        raise AssertionError("a cached base must not be trained again")

    monkeypatch.setattr(tiny_model, "pretrain", no_training)
    second = tmp_path / "two" / "tiny-qwen2"
    assert ensure_tiny_model(second, DEFAULT_DATA, recipe=SMALL) is True
    assert weights_sha(second) == weights_sha(first)
    # The same recipe built again from nothing gives the same weights (seeded, one thread).
    monkeypatch.undo()
    monkeypatch.setattr(tiny_model, "BASE_CACHE", tmp_path / "other-cache")
    third = tmp_path / "three" / "tiny-qwen2"
    ensure_tiny_model(third, DEFAULT_DATA, recipe=SMALL)
    assert weights_sha(third) == weights_sha(first)


def test_two_builds_of_one_hash_at_once_train_it_once_and_both_copy_it(tmp_path, monkeypatch, capsys):
    # As the two pytest processes of `make test`, or two `local up`s, do on a machine whose cache is empty.
    monkeypatch.setattr(tiny_model, "BASE_CACHE", tmp_path / "cache")
    real_pretrain, trained = tiny_model.pretrain, []

    def counted(*args, **kwargs):
        trained.append(threading.current_thread().name)
        return real_pretrain(*args, **kwargs)

    monkeypatch.setattr(tiny_model, "pretrain", counted)
    targets = [tmp_path / name / "tiny-qwen2" for name in ("one", "two")]
    with ThreadPoolExecutor(2) as pool:
        placed = list(pool.map(lambda out: ensure_tiny_model(out, DEFAULT_DATA, recipe=SMALL), targets))
    assert placed == [True, True] and len(trained) == 1
    assert "waiting for another process's build of the tiny base" in capsys.readouterr().err
    assert weights_sha(targets[0]) == weights_sha(targets[1])


def weights_sha(model_dir: Path) -> str:
    return hashlib.sha256((model_dir / "model.safetensors").read_bytes()).hexdigest()


def test_a_model_without_a_build_record_names_no_base_and_a_broken_one_is_named(tmp_path):
    assert base_model_facts(str(tmp_path)) is None and base_model_facts("Qwen/Qwen2.5-1.5B") is None
    (tmp_path / "base.json").write_text('{"recipe": {}}')
    with pytest.raises(ModelUnreadable, match="base.json"):
        base_model_facts(str(tmp_path))
