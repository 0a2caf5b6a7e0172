"""The verify task's Kubernetes half on EKS: findings over the fetched objects join the Ray job's verdict."""

from __future__ import annotations

import copy
from pathlib import Path

from tasks import stages
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.control.kube import load_objects_from_dir
from tuneproof.control.record import stage_entry

FIXTURE = Path(__file__).parent / "fixtures" / "k8s" / "cluster"


def verify_entry(status: str = "succeeded") -> dict:
    return stage_entry("verify", status, None, None, {"nodes": [], "cluster": {"ray_version": "2.58.0"}}, [], "t0", "t1")


def test_a_healthy_cluster_adds_its_summary_and_the_image_digest(monkeypatch):
    cfg = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    objects = load_objects_from_dir(FIXTURE)
    monkeypatch.setattr("tuneproof.control.kube.fetch_cluster_objects", lambda kcfg: {k: v for k, v in objects.items() if k != "ray_nodes"})
    entry = verify_entry()
    entry["summary"]["nodes"] = objects["ray_nodes"]
    stages.add_kubernetes_half(cfg, entry)
    assert entry["status"] == "succeeded", entry["cause"]
    assert entry["summary"]["cluster"]["image_digest"] == cfg.cluster.expect.image.split("@", 1)[1]
    assert entry["summary"]["kubernetes"]["raycluster"]["name"] == "tuneproof"


def test_a_pod_on_another_digest_fails_verify_as_infrastructure(monkeypatch):
    cfg = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    objects = copy.deepcopy(load_objects_from_dir(FIXTURE))
    worker = next(p for p in objects["pods"] if "worker" in p["metadata"]["name"])
    status = worker["status"]["containerStatuses"][0]
    status["imageID"] = status["imageID"].rsplit("@", 1)[0] + "@sha256:" + "f" * 64
    monkeypatch.setattr("tuneproof.control.kube.fetch_cluster_objects", lambda kcfg: {k: v for k, v in objects.items() if k != "ray_nodes"})
    entry = verify_entry()
    entry["summary"]["nodes"] = objects["ray_nodes"]
    stages.add_kubernetes_half(cfg, entry)
    assert entry["status"] == "failed" and entry["failure_class"] == "infrastructure"
    assert worker["metadata"]["name"] in entry["cause"] and "f" * 64 in entry["cause"]
    assert isinstance(entry["summary"]["cluster"]["image_digest"], dict)  # pods disagree: per-pod map
