"""Controlled comparisons: the statistics (pure), then `tuneproof compare` on the embedded default.

The integration test is the issue's must-show: connectivity under two settings, three interleaved
repeats, with medians, spread, an interval and a verdict per metric, comparison.json beside the runs,
and the artifacts on the flow run.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import random
from collections import Counter

import pytest
from prefect.states import Failed

from flows.compare import compare
from tests.conftest import tuneproof
from tests.reading import present
from tuneproof.control import comparison as cmp
from tuneproof.control import record as records
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.storage import Storage

# ---- statistics -----------------------------------------------------------------------------------


def test_the_order_interleaves_the_arms_repeat_by_repeat():
    assert cmp.interleaved(3) == [("A", 1), ("B", 1), ("A", 2), ("B", 2), ("A", 3), ("B", 3)]


@pytest.mark.parametrize(
    "name, direction",
    [
        ("connectivity.busbw_GBps@1048576B", "higher"),
        ("finetune.tokens_per_s", "higher"),
        ("eval.candidate.exact_match", "higher"),
        ("finetune.final_loss", "lower"),
        ("finetune.seconds_per_step", "lower"),
        ("resume.max_loss_diff", "lower"),
        ("something.else", "none"),
    ],
)
def test_each_metric_knows_which_way_is_better(name, direction):
    assert cmp.direction(name) == direction


def test_a_clear_doubling_is_better_with_an_interval_above_one():
    m = cmp.compare_metric("finetune.tokens_per_s", [100.0, 102.0, 98.0], [200.0, 205.0, 195.0], threshold=0.05)
    assert m.a.median == 100.0 and m.b.median == 200.0 and (m.a.min, m.a.max) == (98.0, 102.0)
    assert m.ratio == pytest.approx(2.0, rel=1e-3)  # of geometric means
    assert m.ci95 is not None and m.ratio is not None and 1.8 < m.ci95[0] <= m.ratio <= m.ci95[1] < 2.2
    assert m.verdict == "better"


def test_a_slower_step_is_worse_even_though_its_number_is_higher():
    m = cmp.compare_metric("finetune.seconds_per_step", [1.0, 1.01, 0.99], [1.5, 1.52, 1.49], threshold=0.05)
    assert m.verdict == "worse"


def test_overlapping_noise_is_insufficient_repeats_with_the_repeats_needed():
    m = cmp.compare_metric("finetune.tokens_per_s", [100.0, 130.0, 90.0], [110.0, 95.0, 125.0], threshold=0.05)
    assert m.ci95 is not None and m.ci95[0] < 1.0 - 0.05 and m.ci95[1] > 1.0 + 0.05
    assert m.verdict == "insufficient repeats" and m.method == "t on log ratio"
    assert m.repeats_needed is not None and m.repeats_needed > 3


def test_two_repeats_make_a_t_interval_not_a_bootstrap():
    # A percentile bootstrap of two values per arm spans only the values seen; t with 2 df is honest.
    m = cmp.compare_metric("connectivity.busbw_GBps@1048576B", [1.0, 0.5], [0.46, 0.48], threshold=0.1)
    assert m.ci95 is not None and m.ci95[0] < 0.2 and m.ci95[1] > 1.0
    assert m.verdict == "insufficient repeats"


def test_a_and_a_is_no_detectable_difference_in_at_least_95_percent():
    """Arms that differ only in their label: 3 % multiplicative noise, 5 repeats, threshold 10 %."""
    rng = random.Random(11)
    verdicts = Counter[str]()
    for _ in range(1000):
        a, b = ([rng.lognormvariate(0, 0.03) * 100 for _ in range(5)] for _ in range(2))
        verdicts[cmp.compare_metric("finetune.tokens_per_s", a, b, threshold=0.1).verdict] += 1
    assert verdicts["no detectable difference"] >= 950, verdicts
    assert verdicts["better"] + verdicts["worse"] <= 10, verdicts


def test_a_and_a_with_two_or_three_noisy_repeats_never_claims_a_change():
    """5 % noise at 2-3 repeats cannot resolve 10 %: it says so instead of better or worse."""
    rng = random.Random(12)
    for repeats in (2, 3):
        verdicts = Counter[str]()
        for _ in range(1000):
            a, b = ([rng.lognormvariate(0, 0.05) for _ in range(repeats)] for _ in range(2))
            verdicts[cmp.compare_metric("finetune.tokens_per_s", a, b, threshold=0.1).verdict] += 1
        assert verdicts["better"] + verdicts["worse"] <= 50, (repeats, verdicts)
        assert verdicts["insufficient repeats"] > verdicts["no detectable difference"], (repeats, verdicts)


def test_a_consistent_change_below_the_threshold_is_no_detectable_difference():
    m = cmp.compare_metric("finetune.tokens_per_s", [100.0, 100.1, 99.9], [102.0, 102.1, 101.9], threshold=0.05)
    assert m.ci95 is not None and m.ci95[0] > 1.0  # real, but smaller than what the user asked to detect
    assert m.verdict == "no detectable difference"


def test_one_value_on_either_arm_is_insufficient_repeats_never_a_verdict():
    one_each = cmp.compare_metric("x.tokens_per_s", [1.0], [2.0], threshold=0.05)
    assert (one_each.verdict, one_each.ratio, one_each.ci95, one_each.repeats_needed) == (
        "insufficient repeats",
        2.0,
        None,
        None,
    )
    assert one_each.method == "one value an arm: no interval"
    # the other arm's spread sizes the repeats: B's three values sit within 1 % of each other
    sized = cmp.compare_metric("x.tokens_per_s", [1.0], [2.0, 2.02, 1.98], threshold=0.05)
    assert sized.verdict == "insufficient repeats" and sized.repeats_needed == 2
    assert cmp.needed_words(one_each) == " (one value an arm: 2 or more repeats an arm give an interval)"
    assert cmp.needed_words(sized) == " (2 repeats an arm would tell)"  # as the table's verdict column says
    assert cmp.compare_metric("x.tokens_per_s", [], [2.0, 2.0], threshold=0.05).verdict == "not enough data"
    assert cmp.compare_metric("x.tokens_per_s", [], [2.0, 2.0], threshold=0.05).ratio is None


def test_metrics_a_run_lacks_add_nothing_to_its_arm():
    out = cmp.compare_all([{"m.seconds": 1.0, "n.tokens_per_s": None}, {"m.seconds": 2.0}], [{"m.seconds": 3.0}], 0.05)
    by_name = {m.name: m for m in out}
    assert by_name["m.seconds"].a.values == [1.0, 2.0] and by_name["m.seconds"].b.values == [3.0]
    assert by_name["n.tokens_per_s"].a.values == []


def test_the_interval_is_students_t_on_the_log_ratio():
    # log values a: 0, 0.1, -0.1; b: log 2 + the same: difference log 2, pooled sd 0.1, t(0.975, 4) = 2.776
    a = [1.0, math.exp(0.1), math.exp(-0.1)]
    m = cmp.compare_metric("x.tokens_per_s", a, [2 * x for x in a], threshold=0.05)
    half = 2.7764451 * 0.1 * math.sqrt(2 / 3)
    assert m.ratio == pytest.approx(2.0) and m.ci95 == pytest.approx((2 * math.exp(-half), 2 * math.exp(half)))


def test_a_comparison_id_is_taken_once(tmp_path):
    storage = Storage(str(tmp_path))
    first = cmp.Comparison(
        comparison_id="c1",
        created_at="t0",
        stages=["connectivity"],
        repeats=2,
        threshold=0.05,
        status="running",
        arms={arm: cmp.ArmIdentity(label=arm, sets=[], config_hash=arm, config={}) for arm in ("A", "B")},
    )
    assert cmp.create(storage, first) is True
    second = first.model_copy(update={"created_at": "t1"})
    assert cmp.create(storage, second) is False  # a rerun or a concurrent comparison never overwrites it
    assert cmp.load(storage, "c1").created_at == "t0"


# ---- the command ----------------------------------------------------------------------------------


def test_a_comparison_of_a_config_with_itself_is_refused_before_anything_runs(tmp_path):
    result = tuneproof("compare", "--stages", "connectivity", "--set", f"storage.root={tmp_path}", "--repeats", "3")
    assert result.exit_code == 3, result.output
    assert "A and B are the same config" in result.output
    assert not (tmp_path / "runs").exists()


def test_a_comparison_whose_stages_need_an_earlier_run_says_which(tmp_path):
    result = tuneproof(
        "compare", "--stages", "evaluate", "--b", "eval.max_examples=10", "--set", f"storage.root={tmp_path}"
    )
    assert result.exit_code == 3, result.output
    assert "data" in result.output and "finetune" in result.output and "add them to --stages" in result.output


def test_a_bad_override_names_its_arm(tmp_path):
    result = tuneproof("compare", "--stages", "connectivity", "--b", "connectivity.iters=0")
    assert result.exit_code == 3, result.output
    assert "arm B" in result.output and "connectivity.iters" in result.output


@pytest.mark.parametrize(
    "args, code, phrase",
    [
        (["--stages", "nope", "--b", "connectivity.iters=6"], 3, "--stages: unknown stage 'nope'"),
        (["--stages", "connectivity", "--b", "connectivity.iters=6", "--repeats", "1"], 3, "at least 2"),
        (
            ["--stages", "connectivity", "--b", "connectivity.iters=6", "--repeats", "1000000000"],
            3,
            "at most 20 (got 1000000000)",
        ),
        (["--stages", "connectivity", "--b", "connectivity.iters=6", "--threshold", "2"], 3, "between 0 and 1"),
        (["--stages", "connectivity", "--b", "connectivity.iters=6", "--id", "a/b"], 2, "comparison id"),
    ],
    ids=["unknown-stage", "one-repeat", "a-billion-repeats", "threshold", "id-not-a-slug"],
)
def test_bad_comparison_requests_are_refused_by_name(args, code, phrase, tmp_path):
    result = tuneproof("compare", *args, "--set", f"storage.root={tmp_path}")
    assert result.exit_code == code, result.output
    assert phrase in " ".join(result.output.split()) and "Traceback" not in result.output
    assert not (tmp_path / "runs").exists()


def arms(tmp_path, a: dict | None = None, b: dict | None = None) -> tuple[PipelineConfig, PipelineConfig]:
    """Two arms that differ in the learning rate, as the compare deployment's form gives them, plus settings."""
    base = {"storage": {"root": str(tmp_path)}}
    return (
        PipelineConfig.model_validate({**base, "train": {"lr": 1e-4}, **(a or {})}),
        PipelineConfig.model_validate({**base, "train": {"lr": 2e-4}, **(b or {})}),
    )


@pytest.mark.parametrize(
    ("stages", "a", "b", "threshold", "says"),
    [
        (["verify"], None, None, 2.0, "threshold must be between 0 and 1 (got 2.0)"),
        (["verify"], None, None, float("nan"), "threshold must be between 0 and 1 (got nan)"),
        (["verify"], None, None, 0.0, "threshold must be between 0 and 1 (got 0.0)"),
        (["verify"], {"model": {"source": "a/b/c"}}, None, 0.05, "arm A: invalid config:\n  model.source: 'a/b/c'"),
        (
            ["data"],
            {"data": {"source": "nope/x.jsonl"}},
            {"data": {"source": "nope/x.jsonl"}},
            0.05,
            f"arm A: data.source: no such file (got '{PROJECT_ROOT}/nope/x.jsonl')",
        ),
        (
            ["verify"],
            None,
            {"eval": {"gates": {"exact_match": {"min": 1.01}}}},
            0.05,
            "arm B: invalid config:\n  eval.gates.exact_match.min: 1.01 cannot be met",
        ),
    ],
    ids=["threshold-2", "threshold-nan", "threshold-0", "unresolvable-source", "data-missing", "gate-unmeetable"],
)
def test_a_deployments_bad_parameters_are_refused_before_the_comparison_exists(tmp_path, stages, a, b, threshold, says):
    # From the Prefect form: a threshold outside (0, 1) crashed building the Comparison, a bad model source
    # crashed resolving, and a missing data file stored a failed comparison ("the run ended before writing a
    # record") under an id now used up.
    config_a, config_b = arms(tmp_path, a, b)
    state = compare.fn(config_a, config_b, stages, threshold=threshold, comparison_id="c1")
    message = state.message or ""
    assert state.is_failed() and message.startswith("nothing ran: ") and says in message, message
    assert list(tmp_path.iterdir()) == []  # no comparison, no run, the id still free


def test_a_run_refused_before_its_record_names_the_refusal_as_its_cause(tmp_path, monkeypatch):
    # A refusal only the run can find (another flow holds its lease, images/current.json is unreadable) leaves
    # no record: the comparison said "the run ended before writing a record" and dropped why.
    import flows.compare as flow

    monkeypatch.setattr(flow, "pipeline", lambda **_: Failed(message="nothing ran: run c1-a1 is held by flow X"))
    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(flow, "publish", lambda artifact, *args: None)
    state = compare.fn(*arms(tmp_path), ["verify"], repeats=2, comparison_id="c1")
    stored = cmp.load(Storage(str(tmp_path)), "c1")
    assert stored.status == "failed" and stored.cause == "c1-a1: nothing ran: run c1-a1 is held by flow X"
    assert state.is_failed() and stored.cause in (state.message or "")


def test_a_failed_runs_metrics_add_nothing_to_its_arm(tmp_path, monkeypatch):
    # The demo record, its run failed at a later stage: the stages that ran still summarised numbers.
    import flows.compare as flow
    from tests.test_rundiff import FIXTURE

    failed = records.parse(json.loads(FIXTURE.read_text())).model_copy(
        update={"status": "failed", "cause": "evaluate: the gate refused"}
    )
    monkeypatch.setattr(flow, "pipeline", lambda **_: Failed(message="failed"))
    monkeypatch.setattr(flow, "read_record", lambda storage, run_id: failed)
    monkeypatch.setattr(flow, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(flow, "publish", lambda artifact, *args: None)
    compare.fn(*arms(tmp_path), ["verify"], repeats=2, comparison_id="c1")
    stored = cmp.load(Storage(str(tmp_path)), "c1")
    assert stored.status == "failed" and stored.cause == "c1-a1: evaluate: the gate refused"
    assert stored.metrics == []


@pytest.mark.integration
def test_connectivity_under_two_settings_interleaved(prefect_server, demo_env, tmp_path):
    # Two repeats an arm, the fewest compare accepts: A1 B1 A2 B2 proves the interleaving, the records and the
    # interval as well as three did, at four connectivity runs instead of six.
    env = demo_env.at(tmp_path)
    result = tuneproof(
        "compare",
        "--stages",
        "connectivity",
        *env.args,
        "--set",
        "connectivity.sizes_bytes=[4096,1048576]",
        "--a",
        "connectivity.iters=3",
        "--b",
        "connectivity.iters=6",
        "--repeats",
        "2",
        "--id",
        "cmp-iters",
        "--json",
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)  # stdout is the document alone; the table went to stderr
    stored = cmp.load(env.storage, "cmp-iters")
    assert printed == stored.to_json()

    # A1 B1 A2 B2, each an ordinary run with its own record.
    assert [(o.arm, o.repeat) for o in stored.order] == cmp.interleaved(2)
    assert all(o.status == "succeeded" for o in stored.order)
    for o in stored.order:
        rec = records.load(env.storage, o.run_id)
        assert rec.passed("connectivity")
        assert rec.config["connectivity"]["iters"] == (3 if o.arm == "A" else 6)

    # Both arms' identity, diffable: only the override differs.
    a, b = stored.arms["A"], stored.arms["B"]
    assert a.config_hash != b.config_hash and a.sets == ["connectivity.iters=3"] and b.sets == ["connectivity.iters=6"]
    assert a.code == b.code and a.runs == [f"cmp-iters-a{i}" for i in (1, 2)]

    # Per metric: medians, spread, an interval and a verdict (bus bandwidth at every size).
    names = {m.name: m for m in stored.metrics}
    for size in (4096, 1048576):
        m = names[f"connectivity.busbw_GBps@{size}B"]
        assert len(m.a.values) == 2 and len(m.b.values) == 2
        assert present(m.a.min) <= present(m.a.median) <= present(m.a.max)
        assert present(m.b.min) <= present(m.b.median) <= present(m.b.max)
        assert m.ratio is not None and m.ci95 is not None and m.ci95[0] <= m.ci95[1]
        assert m.verdict in ("better", "worse", "no detectable difference", "insufficient repeats")
        assert m.direction == "higher"

    # The artifacts on the comparison's flow run: the table and the bandwidth plot.
    from prefect.client.orchestration import get_client

    async def artifact_keys() -> set[str]:
        async with get_client() as client:
            return {a.key for a in await client.read_artifacts() if a.key}

    keys = asyncio.run(artifact_keys())
    assert {"comparison-cmp-iters", "comparison-busbw-cmp-iters"} <= keys

    # The id is taken: the same command again is refused before anything runs, the first result kept.
    again = tuneproof(
        "compare", "--stages", "connectivity", *env.args, "--b", "connectivity.iters=6", "--id", "cmp-iters"
    )
    assert again.exit_code == 3, again.output
    assert "already exists" in again.output
    assert cmp.load(env.storage, "cmp-iters") == stored
