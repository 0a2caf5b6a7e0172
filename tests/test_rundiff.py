"""`runs diff`: exactly the changed choices, and metric deltas; a run against itself shows no change."""

from __future__ import annotations

import copy

from tuneproof.core.config import PipelineConfig
from tuneproof.control.rundiff import diff_records, render_diff


def record(run_id: str, **config_overrides) -> dict:
    cfg = PipelineConfig().model_dump(mode="json")
    for dotted, value in config_overrides.items():
        section, key = dotted.split("__")
        cfg[section][key] = value
    node = {"is_head": True, "node_ip": "127.0.0.1", "ray_version": "2.60.0", "torch_version": "2.13.0+cpu",
            "cuda_version": None, "nccl_version": None, "python_version": "3.11.7", "environment_digest": "e" * 64}
    return {
        "run_id": run_id, "config": cfg, "runtime_env_additions": {"pip": [], "env_vars": {}},
        "code": {"git_sha": "abc", "dirty": False, "working_dir_hash": "w" * 64},
        "cluster": {"ray_version": "2.60.0", "nodes": [node], "environment_digest": "e" * 64, "image_digest": None},
        "data": {"content_hash": "d" * 64},
        "stages": {
            "connectivity": {"summary": {"allreduce": [{"size_bytes": 1024, "busbw_GBps": 0.5},
                                                       {"size_bytes": 4194304, "busbw_GBps": 2.0}]}},
            "finetune": {"summary": {"tokens_per_s": 1000.0, "final_loss": 0.2, "seconds": 30.0}},
            "evaluate": {"summary": {"models": {"candidate": {"metrics": {"exact_match": 0.9}},
                                                "base": {"metrics": {"exact_match": 0.0}}, "incumbent": None}}},
        },
    }


def test_same_run_against_itself_reports_no_change():
    a = record("a")
    result = diff_records(a, a)
    assert result["changed"] is False and result["changes"] == []
    assert all(m["delta"] in (0, 0.0, None) for m in result["metrics"])
    assert "nothing changed" in render_diff(result)


def test_one_config_field_is_exactly_the_change_and_metrics_move():
    a, b = record("a"), record("b", train__lr=0.004)
    b["stages"]["finetune"]["summary"]["final_loss"] = 0.1
    b["stages"]["evaluate"]["summary"]["models"]["candidate"]["metrics"]["exact_match"] = 0.95
    result = diff_records(a, b)
    assert [c["field"] for c in result["changes"]] == ["config.train.lr"]
    assert result["changes"][0]["a"] == 0.002 and result["changes"][0]["b"] == 0.004
    by_name = {m["metric"]: m for m in result["metrics"]}
    assert abs(by_name["finetune.final_loss"]["delta"] + 0.1) < 1e-12
    assert abs(by_name["eval.candidate.exact_match"]["delta"] - 0.05) < 1e-12
    assert "config.train.lr: 0.002 -> 0.004" in render_diff(result)


def test_an_image_update_shows_digest_and_per_node_versions():
    a, b = record("a"), record("b")
    b = copy.deepcopy(b)
    b["cluster"]["image_digest"] = "sha256:" + "1" * 64
    b["cluster"]["nodes"][0]["nccl_version"] = "2.29.7"
    b["stages"]["connectivity"]["summary"]["allreduce"][1]["busbw_GBps"] = 3.0
    result = diff_records(a, b)
    fields = {c["field"] for c in result["changes"]}
    assert fields == {"image_digest", "nodes.head.nccl_version"}
    bw = [m for m in result["metrics"] if m["metric"].startswith("connectivity.busbw")][0]
    assert bw["metric"] == "connectivity.busbw_GBps@4194304B" and bw["delta"] == 1.0
