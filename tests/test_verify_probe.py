"""The verify stage: the node probe and storage round trip in-process, then the whole body on a real Ray head."""

from __future__ import annotations

import os

import pytest
import torch

from tests.conftest import ray_driver
from training.jobkit import JobContext
from training.verify import (
    fail_on_errors,
    installed_distributions,
    nccl_version,
    node_facts,
    storage_findings,
    storage_roundtrip,
    verify,
)
from tuneproof.core.checks import environment_digest
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_cluster import StorageConfig
from tuneproof.core.findings import Finding
from tuneproof.core.results import StageFailure
from tuneproof.core.summaries import ClusterFacts, VerifySummary


def test_node_facts_on_this_machine():
    facts = node_facts()
    assert facts["torch_version"].split("+")[0] == torch.__version__.split("+")[0]
    assert facts["ray_version"] == "2.60.0"
    assert facts["python_version"].count(".") == 2
    assert facts["gpus_visible"] == torch.cuda.device_count()
    assert facts["environment_digest"] == environment_digest(installed_distributions())
    assert ("torch", facts["torch_version"]) in installed_distributions()


@pytest.mark.skipif(torch.version.cuda is not None, reason="asserts the CPU build's answer")
def test_cpu_build_has_no_cuda_or_nccl():
    assert node_facts()["cuda_version"] is None
    assert nccl_version() is None


def test_storage_roundtrip_leaves_nothing(tmp_path):
    parts = ["runs", "r1", "stages", "verify", "probe-x"]
    result = storage_roundtrip(StorageConfig(root=str(tmp_path)).model_dump(), parts)
    assert result["ok"] is True and result["seconds"] >= 0
    assert not (tmp_path / "runs" / "r1" / "stages" / "verify" / "probe-x").exists()


def test_storage_roundtrip_error_on_unwritable_root(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    with pytest.raises(OSError):
        storage_roundtrip(StorageConfig(root=str(blocker)).model_dump(), ["probe"])


def test_storage_failure_names_uri_and_error():
    (finding,) = storage_findings(
        {
            "uri": "s3://b/runs/r/stages/verify/probe-1",
            "node_ip": "10.0.0.2",
            "ok": False,
            "error": "PermissionError: Access Denied",
            "seconds": None,
        }
    )
    assert "s3://b/runs/r/stages/verify/probe-1" in finding.line()
    assert "Access Denied" in finding.line()


EMPTY_VERIFY = VerifySummary(nodes=[], findings=[], cluster=ClusterFacts())


def test_failure_cause_is_first_finding_plus_count():
    findings = [
        Finding("node a", "ray_version", "2.58.0", "2.60.0"),
        Finding("node b", "x", 1, 2),
        Finding("node c", "y", 1, 2, severity="warning"),
    ]
    with pytest.raises(StageFailure) as info:
        fail_on_errors(findings, EMPTY_VERIFY)
    assert info.value.failure_class.value == "infrastructure"
    assert info.value.cause == "node a: ray_version is '2.58.0', expected '2.60.0' (+1 more)"
    fail_on_errors(findings[2:], EMPTY_VERIFY)  # warnings alone pass


@pytest.fixture(scope="module")
def ray_connected(ray_head):
    """This process as a Ray driver of the session's head."""
    with ray_driver(ray_head, log_to_driver=False):
        yield ray_head


def _context(tmp_path, ray_version: str) -> JobContext:
    config = PipelineConfig.model_validate(
        {"storage": {"root": str(tmp_path / "storage")}, "cluster": {"expect": {"ray_version": ray_version}}}
    )
    return JobContext("run-verify", "verify", config)


@pytest.mark.integration
def test_verify_body_passes_on_local_head(ray_connected, tmp_path):
    summary = verify(_context(tmp_path, "2.60.0"))
    (head,) = summary.nodes
    assert head.is_head and head.ray_version == "2.60.0" and head.gpus_visible == 0
    assert summary.findings == []
    assert summary.storage_probe is not None
    assert summary.storage_probe.ok is True
    assert summary.storage_probe.uri.startswith(str(tmp_path / "storage" / "runs" / "run-verify"))
    assert summary.cluster.environment_digest == head.environment_digest
    assert os.listdir(tmp_path / "storage" / "runs" / "run-verify" / "stages" / "verify") == []


@pytest.mark.integration
def test_verify_body_fails_on_wrong_ray_version(ray_connected, tmp_path):
    with pytest.raises(StageFailure) as info:
        verify(_context(tmp_path, "2.0.0"))
    failure = info.value
    assert failure.failure_class.value == "infrastructure"
    import ray

    (node,) = ray.nodes()
    assert failure.cause.startswith(f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}): ")
    assert "ray_version is '2.60.0', expected '2.0.0'" in failure.cause
    assert isinstance(failure.summary, VerifySummary)
    assert failure.summary.findings[0].seen == "2.60.0"
