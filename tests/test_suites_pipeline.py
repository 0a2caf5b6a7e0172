"""Regression suites through the real pipeline (data, fine-tune and evaluate as Ray jobs on the session's Ray
head): a fine-tune on dates only forgets the base's skills and is refused, naming the suite and its interval;
a user's own suite file given by config is hashed, checked against the training split, scored and gated
beside the bundled ones."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from tests.conftest import tuneproof
from tests.reading import summary_of
from tuneproof.control import record as records
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.summaries_data import DataSummary
from tuneproof.core.summaries_eval import EvaluateSummary

FORGET = PROJECT_ROOT / "configs" / "local-forget.yaml"
# The fewest steps that prove it: by step 100 every skill is lost (the documented setting's full 400 steps
# also win the date task, README "Regression suites and forgetting"). The task's gate is left to what 100
# steps can pass, so the refusal is the suites' alone. The cut-off cap is lifted: a model 100 steps into
# dates alone may also stop ending its turns on a suite (17 of 32 capitals ran to max_new_tokens on one CI
# machine, 0 on another: the floats of a half-trained model differ by CPU), and the cap would then end the
# evaluation as invalid before any gate. The cap has its own tests (tests/test_evaluate_job.py); this one
# is about the suites' gates.
SHORT = (
    "train.max_steps=100",
    "train.checkpoint_every=50",
    "eval.max_examples=40",
    "eval.max_truncated_fraction=1",
    "eval.gates={exact_match: {max_regression: 0.02}}",
)


@pytest.mark.integration
def test_a_fine_tune_that_forgets_a_skill_is_refused_naming_the_suite(prefect_server, demo_env, tmp_path):
    from prefect.settings import PREFECT_API_URL, temporary_settings

    mine = tmp_path / "mine.jsonl"  # the user's own "must not regress" items: capitals the base knows
    rows = [json.loads(r) for r in (PROJECT_ROOT / "data/skills/suites/capital.jsonl").read_text().splitlines()]
    mine.write_text("".join(json.dumps({"input": r["input"], "output": r["output"]}) + "\n" for r in rows[:12]))
    env = demo_env.at(tmp_path)
    sets = [*SHORT, f"eval.suites.mine={{source: {mine}, margin: 0.25}}"]
    with temporary_settings({PREFECT_API_URL: f"{prefect_server}/api"}):
        result = tuneproof(
            "run", "--config", str(FORGET), "--run-id", "forget", "--only", "data,finetune,evaluate",
            *env.args, *sum((["--set", s] for s in sets), []),
        )  # fmt: skip
    assert result.exit_code == 6, result.output
    rec = records.load(env.storage, "forget")
    cause = rec.stages["evaluate"].cause or ""
    assert cause.startswith("suite add: exact_match regression vs base <= 0.25: +"), cause
    # The base's own score on add (0.8625 for today's recipe) is checked against the record below.
    assert re.search(r"\(candidate 0, base 0\.\d+; n=80, Newcombe paired score", cause) and "(fail)" in cause, cause
    assert f"run forget failed (modeling: evaluate: {cause[:40]}" in result.output

    evaluation = summary_of(rec, "evaluate", EvaluateSummary)
    assert evaluation is not None
    scored = {s.name: s for s in evaluation.suites}
    assert list(scored) == ["add", "capital", "reverse", "mine"]
    for name in ("add", "capital", "reverse"):  # the pre-trained base knows every bundled skill
        assert (scored[name].metrics["base"] or {})["exact_match"] > 0, name
    assert f"base {(scored['add'].metrics['base'] or {})['exact_match']:.4g}; n=80" in cause
    assert not scored["add"].gates.passed and not scored["mine"].gates.passed
    vs_base = scored["mine"].gates.verdicts[0]
    assert (vs_base.gate, vs_base.n, vs_base.outcome) == ("max_regression_vs_base", 12, "fail")
    assert scored["mine"].sha256 == vs_base.split_sha256 == hashlib.sha256(mine.read_bytes()).hexdigest()

    data = summary_of(rec, "data", DataSummary)
    assert data is not None
    assert {s.name: (s.sha256, s.contamination.overlapping) for s in data.suites}["mine"] == (scored["mine"].sha256, 0)
