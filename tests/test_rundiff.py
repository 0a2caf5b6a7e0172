"""`runs diff`: exactly the changed choices, and metric deltas; a run against itself shows no change."""

from __future__ import annotations

import json
from pathlib import Path

from tests.reading import summary_dict
from tuneproof.app.rundiff import diff_records, render_diff
from tuneproof.control.record import RunRecord, parse

FIXTURE = Path(__file__).parent / "fixtures" / "records" / "v1-demo.json"


def record(run_id: str, **config_overrides) -> RunRecord:
    """The saved demo record (a full pipeline run) under another id, with config fields changed."""
    rec = parse(json.loads(FIXTURE.read_text()))
    rec.run_id = run_id
    for dotted, value in config_overrides.items():
        section, key = dotted.split("__")
        rec.config[section][key] = value
    return rec


def test_same_run_against_itself_reports_no_change():
    a = record("a")
    result = diff_records(a, a)
    assert result["changed"] is False and result["changes"] == []
    assert all(m["delta"] in (0, 0.0, None) for m in result["metrics"])
    assert "nothing changed" in render_diff(result)


def test_one_config_field_is_exactly_the_change_and_metrics_move():
    a, b = record("a"), record("b", train__lr=0.004)
    summary_dict(b, "finetune")["final_loss"] = summary_dict(a, "finetune")["final_loss"] - 0.1
    summary_dict(b, "evaluate")["models"]["candidate"]["metrics"]["exact_match"] = 0.95
    result = diff_records(a, b)
    assert [c["field"] for c in result["changes"]] == ["config.train.lr"]
    assert result["changes"][0]["a"] == 0.002 and result["changes"][0]["b"] == 0.004
    by_name = {m["metric"]: m for m in result["metrics"]}
    assert abs(by_name["finetune.final_loss"]["delta"] + 0.1) < 1e-12
    assert abs(by_name["eval.candidate.exact_match"]["delta"] + 0.05) < 1e-12
    assert "config.train.lr: 0.002 -> 0.004" in render_diff(result)


def test_an_image_update_shows_digest_and_per_node_versions():
    a, b = record("a"), record("b")
    assert b.cluster is not None
    b.cluster.image_digest = "sha256:" + "1" * 64
    b.cluster.nodes[0].nccl_version = "2.29.7"
    allreduce = summary_dict(b, "connectivity")["allreduce"]
    allreduce[-1]["busbw_GBps"] = summary_dict(a, "connectivity")["allreduce"][-1]["busbw_GBps"] + 1.0
    result = diff_records(a, b)
    fields = {c["field"] for c in result["changes"]}
    assert fields == {"image_digest", "nodes.head.nccl_version"}
    bw = {m["metric"]: m for m in result["metrics"] if m["metric"].startswith("connectivity.busbw")}
    assert abs(bw["connectivity.busbw_GBps@4194304B"]["delta"] - 1.0) < 1e-9  # every size is a metric
    assert bw["connectivity.busbw_GBps@1024B"]["delta"] == 0.0


def test_a_failed_stages_numbers_are_no_metric():
    # A connectivity stage whose ranks did not all finish kept its summary as evidence: its bandwidth was diffed.
    a, b = record("a"), record("b")
    b.stages["connectivity"].status = "failed"
    metrics = {m["metric"]: m for m in diff_records(a, b)["metrics"]}
    busbw = [m for name, m in metrics.items() if name.startswith("connectivity.busbw")]
    assert busbw and all(m["b"] is None for m in busbw)
    assert metrics["finetune.final_loss"]["b"] is not None  # the stages that succeeded still count


def test_gate_verdicts_show_their_interval_and_items():
    a, b = record("a"), record("b")
    verdict = summary_dict(b, "evaluate")["gates"]["verdicts"][0]
    verdict.update(outcome="insufficient", passed=False, interval=[0.7961, 1.0], n=15, items_needed=16)
    text = render_diff(diff_records(a, b))
    assert "gates (a -> b):" in text
    assert "  exact_match min: pass -> insufficient evidence [0.7961, 1] n=15 (16 items would resolve it)" in text


def test_gate_verdicts_show_their_method_p_value_and_split():
    a, b = record("a"), record("b")
    split = "05433017fd51" + "0" * 52
    for rec, outcome in ((a, "pass"), (b, "insufficient")):
        summary_dict(rec, "evaluate")["gates"]["verdicts"][1].update(
            outcome=outcome,
            passed=outcome == "pass",
            interval=[0.6, 1.0] if outcome == "pass" else [-0.1, 0.9],
            n=300 if outcome == "pass" else 12,
            method="Newcombe paired score",
            p_value=0.00002 if outcome == "pass" else 0.22,
            items_needed=None if outcome == "pass" else 40,
            split_sha256=split,
        )
    text = render_diff(diff_records(a, b))
    assert (
        "  exact_match min_improvement: pass [0.6, 1] n=300, Newcombe paired score, p<0.0001, split 05433017fd51 -> "
        "insufficient evidence [-0.1, 0.9] n=12, Newcombe paired score, p=0.22, split 05433017fd51 (40 items would "
        "resolve it)"
    ) in text


def suite_edited_in_place(tmp_path: Path, answers_from: int):
    """The suite `add` as read from one path with one config, its items as an edit left them."""
    from eval.suites import read_suite
    from tuneproof.core.config_eval import SuiteConfig

    path = tmp_path / "add.jsonl"
    path.write_text(
        "".join(
            json.dumps({"input": f"add {i} and {answers_from}", "output": str(i + answers_from)}) + "\n"
            for i in range(40)
        )
    )
    return read_suite("add", SuiteConfig(source=str(path), margin=0.25), None)


def test_a_suite_edited_in_place_is_a_change(tmp_path):
    """Same path, same config, other items: the evaluate stage's suite hash (what was scored) is the change, so
    two numbers on different items never read as 'nothing changed'."""
    from eval.suites import suite_score
    from tests.test_suites import scores

    before, after = suite_edited_in_place(tmp_path, 1), suite_edited_in_place(tmp_path, 900)
    a, b = record("a"), record("b")
    for rec, suite in ((a, before), (b, after)):
        scored = suite_score(suite, {"candidate": scores(36, 40), "base": scores(36, 40)}, 0.95)
        summary_dict(rec, "evaluate")["suites"] = [scored.to_json()]
    result = diff_records(a, b)
    assert result["changes"] == [{"field": "suites.add.sha256", "a": before.sha256, "b": after.sha256}]
    assert "nothing changed" not in render_diff(result)
    assert diff_records(a, a)["changed"] is False  # the same suite file is no change


def test_a_run_not_evaluated_yet_shows_the_data_stages_suite_hash(tmp_path):
    """Without an evaluate stage, the suite hash the data stage checked for overlap names the suite."""
    from tuneproof.core.summaries_data import Contamination, SuiteFile

    a, b = record("a"), record("b")
    clean = Contamination(ngram=13, eval_items=40, exact_matches=0, overlapping=0, fraction=0.0)
    for rec, answers_from in ((a, 1), (b, 900)):
        del rec.stages["evaluate"]
        suite = suite_edited_in_place(tmp_path, answers_from)
        checked = SuiteFile(name="add", source=suite.source, sha256=suite.sha256, items=40, contamination=clean)
        summary_dict(rec, "data")["suites"] = [checked.to_json()]
    assert [c["field"] for c in diff_records(a, b)["changes"]] == ["suites.add.sha256"]
