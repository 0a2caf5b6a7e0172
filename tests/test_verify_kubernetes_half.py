"""The verify task's Kubernetes half on EKS: findings over the fetched objects join the Ray job's verdict."""

from __future__ import annotations

import copy
from pathlib import Path

from tasks.jobs import add_kubernetes_half
from tests.reading import entry_summary, present
from tuneproof.control.kube import load_objects_from_dir
from tuneproof.control.kube_checks import normalize_ray_nodes
from tuneproof.control.record import StageEntry
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.summaries import ClusterFacts, NodeFacts, VerifySummary

FIXTURE = Path(__file__).parent / "fixtures" / "k8s" / "cluster"


def verify_entry(ray_nodes: list[dict]) -> StageEntry:
    """The Ray half's entry as the verify job leaves it: the nodes Ray lists, no findings."""
    nodes = [
        NodeFacts(node_id=n["node_id"], node_ip=n["ip"], is_head=n["is_head"], gpus_advertised=n["gpus"])
        for n in normalize_ray_nodes(ray_nodes)
    ]
    summary = VerifySummary(nodes=nodes, findings=[], cluster=ClusterFacts(ray_version="2.58.0", nodes=nodes))
    return StageEntry.succeeded("verify", summary, "t0")


def test_a_healthy_cluster_adds_its_summary_and_the_image_digest(monkeypatch):
    cfg = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    objects = load_objects_from_dir(FIXTURE)
    monkeypatch.setattr(
        "tuneproof.control.kube.fetch_cluster_objects",
        lambda kcfg: {k: v for k, v in objects.items() if k != "ray_nodes"},
    )
    entry = add_kubernetes_half(cfg, verify_entry(objects["ray_nodes"]))
    assert entry.status == "succeeded", entry.cause
    summary = entry_summary(entry, VerifySummary)
    assert cfg.cluster.expect.image is not None
    assert summary.cluster.image_digest == cfg.cluster.expect.image.split("@", 1)[1]
    assert present(summary.kubernetes)["raycluster"]["name"] == "tuneproof"


def test_a_pod_on_another_digest_fails_verify_as_infrastructure(monkeypatch):
    cfg = load_config(PROJECT_ROOT / "configs" / "eks.yaml")
    objects = copy.deepcopy(load_objects_from_dir(FIXTURE))
    worker = next(p for p in objects["pods"] if "worker" in p["metadata"]["name"])
    status = worker["status"]["containerStatuses"][0]
    status["imageID"] = status["imageID"].rsplit("@", 1)[0] + "@sha256:" + "f" * 64
    monkeypatch.setattr(
        "tuneproof.control.kube.fetch_cluster_objects",
        lambda kcfg: {k: v for k, v in objects.items() if k != "ray_nodes"},
    )
    entry = add_kubernetes_half(cfg, verify_entry(objects["ray_nodes"]))
    assert entry.status == "failed" and entry.failure_class == "infrastructure"
    assert worker["metadata"]["name"] in (entry.cause or "") and "f" * 64 in (entry.cause or "")
    assert isinstance(entry_summary(entry, VerifySummary).cluster.image_digest, dict)  # pods disagree: per-pod map
