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


def test_eks_deployments_pin_their_flow_run_image_and_the_commit_they_clone():
    for name in ("eks-manual", "eks-nightly", "eks-rollback"):
        deployment = deployments()[name]
        variables = deployment["work_pool"]["job_variables"]
        assert "@sha256:" in variables["image"] and "tuneproof-flow-run" in variables["image"]
        # resolved by `prefect deploy` from the deploying shell, then read by the pull step inside the pod
        assert variables["env"]["TUNEPROOF_GIT_COMMIT"] == "{{ $TUNEPROOF_GIT_COMMIT }}"
        clone = deployment["pull"][0]["prefect.deployments.steps.git_clone"]
        assert clone["commit_sha"] == "{{ $TUNEPROOF_GIT_COMMIT }}" and "branch" not in clone
        install = deployment["pull"][1]["prefect.deployments.steps.run_shell_script"]["script"]
        assert "--no-deps" in install and "--no-build-isolation" in install and install.endswith("-e .")


def test_the_image_canary_deployment_takes_a_typed_candidate_image():
    import jsonschema
    import pytest
    from prefect.exceptions import ParameterTypeError
    from prefect.utilities.callables import parameter_schema

    from flows.canary import image_canary
    from tuneproof.control.images import IMAGE_PATTERN

    eks = load_config(PROJECT_ROOT / "configs" / "eks.yaml", resolve=False)
    deployment = deployments()["image-canary"]
    assert deployment["entrypoint"] == "flows/canary.py:image_canary"
    assert deployment["work_pool"]["name"] == "tuneproof-eks-canary"  # its own pool and account: it creates RayClusters
    assert deployment["work_pool"]["job_variables"]["service_account_name"] == "tuneproof-canary"
    assert PipelineConfig.model_validate(deployment["parameters"]["config"]) == eks
    assert deployments()["image-canary-local"]["work_pool"]["name"] == "local-process"

    # The form: a pattern the UI checks as it is typed ...
    form = parameter_schema(image_canary.fn).model_dump()["properties"]["candidate_image"]
    typed = next(option for option in form["anyOf"] if option.get("type") == "string")
    assert typed["pattern"] == IMAGE_PATTERN
    good = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2@sha256:" + "b" * 64
    jsonschema.validate(good, typed)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate("public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2", typed)
    # ... and the flow run's own validation at start, naming the value.
    assert image_canary.validate_parameters({"candidate_image": good})["candidate_image"] == good
    with pytest.raises(ParameterTypeError, match="not pinned by digest"):
        image_canary.validate_parameters({"candidate_image": "ray:latest"})
