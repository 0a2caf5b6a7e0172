"""prefect.yaml: the EKS deployments carry exactly the eks profile; every deployment's parameters validate."""

from __future__ import annotations

import yaml

from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config


def deployments() -> dict[str, dict]:
    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    return {d["name"]: d for d in doc["deployments"]}


def test_eks_deployments_carry_the_eks_profile():
    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml", resolve=False)
    for name in ("eks-manual", "eks-nightly"):
        params = deployments()[name]["parameters"]["config"]
        assert PipelineConfig.model_validate(params) == eks, f"{name} drifted from configs/eks.yaml"


def test_local_deployments_use_the_embedded_default_and_a_portable_pull_step():
    doc = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    assert doc["pull"][0]["prefect.deployments.steps.set_working_directory"]["directory"] == "{{ $PWD }}"
    for name in ("manual", "nightly"):
        assert deployments()[name]["work_pool"]["name"] == "local-process"
        assert deployments()[name]["parameters"] == {}
    assert deployments()["nightly"]["schedules"][0]["cron"]
