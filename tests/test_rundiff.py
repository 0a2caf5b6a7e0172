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
