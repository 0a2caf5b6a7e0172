"""`tuneproof lint`: the committed deployments/ pass; each failure mode is a named finding.

Every failing case mutates a copy of the committed manifests in tmp_path, so the tests follow
the manifests as they change.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tuneproof.app.cli_eks import lint_command
from tuneproof.app.lint import lint_paths
from tuneproof.app.lint.eks import PLACEHOLDERS
from tuneproof.app.lint.images import PLACEHOLDER_DIGEST, image_ray_version
from tuneproof.app.lint.raycluster import cluster_gpu_capacity
from tuneproof.app.lint.storage import node_count
from tuneproof.app.lint.worker import PLACEHOLDER_UID
from tuneproof.app.schemas.build import _strict
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.findings import errors

DEPLOYMENTS = PROJECT_ROOT / "deployments"
EKS = PROJECT_ROOT / "configs" / "eks.yaml"
RC = "raycluster.yaml"


@pytest.fixture
def deploy(tmp_path) -> Path:
    target = tmp_path / "deployments"
    shutil.copytree(DEPLOYMENTS, target)
    return target


def eks(*sets: str):
    return load_config(EKS, list(sets))


def edit_yaml(path: Path, change) -> None:
    docs = list(yaml.safe_load_all(path.read_text()))
    for doc in docs:
        change(doc)
    path.write_text(yaml.safe_dump_all(docs, sort_keys=False))


def edit_rc(deploy: Path, change) -> None:
    edit_yaml(deploy / RC, change)


def worker(rc: dict) -> dict:
    return rc["spec"]["workerGroupSpecs"][0]


def worker_container(rc: dict) -> dict:
    return worker(rc)["template"]["spec"]["containers"][0]


def lint_exit(paths: list[Path], capsys, *sets: str) -> tuple[int, str]:
    """`tuneproof lint PATHS` against the eks profile: (exit code, printed findings)."""
    code = lint_command([str(p) for p in paths], str(EKS), list(sets))
    return code, capsys.readouterr().out


def only(findings, **match):
    found = [f for f in errors(findings) if all(str(v) in str(getattr(f, k)) for k, v in match.items())]
    assert found, f"no error matching {match} in:\n" + "\n".join(f.line() for f in findings)
    return found[0]


# ---------------------------------------------------------------- the committed files


def test_committed_deployments_pass_with_and_without_the_eks_profile():
    for cfg in (eks(), None):
        findings = lint_paths([str(DEPLOYMENTS)], cfg)
        assert errors(findings) == [], "\n".join(f.line() for f in errors(findings))
    # The only warnings: the placeholders to replace (image digests, the cluster UID, the example account,
    # subnet and security group that deployments/eks-up.sh replaces on the way to the cluster).
    warnings = [
        f for f in lint_paths([str(DEPLOYMENTS), str(PROJECT_ROOT / "prefect.yaml")], eks()) if f.severity == "warning"
    ]
    examples = {f.seen for f in warnings} - {PLACEHOLDER_DIGEST, PLACEHOLDER_UID}
    assert all(any(p in str(seen) for p in PLACEHOLDERS) for seen in examples), examples


def test_committed_cluster_matches_the_eks_profile():
    rc = yaml.safe_load((DEPLOYMENTS / RC).read_text())
    cfg = eks()
    assert cluster_gpu_capacity(rc) == cfg.train.num_workers == 8
    assert node_count(rc) == 3
    assert rc["spec"]["rayVersion"] == cfg.cluster.expect.ray_version
    assert worker_container(rc)["image"] == cfg.cluster.expect.image
    assert rc["spec"]["headGroupSpec"]["serviceType"] == "ClusterIP"


def test_lint_command_exit_codes(deploy, capsys):
    assert lint_command([str(DEPLOYMENTS)], str(EKS), []) == 0
    assert "0 errors" in capsys.readouterr().out
    edit_rc(deploy, lambda rc: worker(rc)["rayStartParams"].update({"num-gpus": "8"}))
    assert lint_command([str(deploy)], str(EKS), []) == 1
    out = capsys.readouterr().out
    assert "ERROR" in out and "num-gpus" in out
    assert lint_command([str(deploy)], str(EKS), ["train.num_workers=zero"]) == 3


# ---------------------------------------------------------------- image, versions, GPUs


def test_a_tag_instead_of_a_digest_is_an_error(deploy):
    tagged = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1"
    edit_rc(deploy, lambda rc: worker_container(rc).update({"image": tagged}))
    finding = only(
        lint_paths([str(deploy)], None), field="workerGroupSpecs[gpu].template.spec.containers[ray-worker].image"
    )
    assert finding.subject == f"{deploy / RC}: RayCluster/tuneproof"
    assert finding.seen == tagged and finding.expected.endswith("@sha256:<64 hex>")


def test_manifest_digest_must_equal_the_profiles(deploy):
    other = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.1@sha256:" + "a" * 64
    finding = only(lint_paths([str(deploy)], eks(f"cluster.expect.image={other}")), field="containers[ray-head].image")
    assert finding.expected == other and finding.seen.endswith(PLACEHOLDER_DIGEST)


def test_num_gpus_must_equal_the_gpu_limit(deploy):
    edit_rc(deploy, lambda rc: worker(rc)["rayStartParams"].update({"num-gpus": "8"}))
    finding = only(lint_paths([str(deploy)], None), field="spec.workerGroupSpecs[gpu].rayStartParams.num-gpus")
    assert (finding.seen, finding.expected) == ("8", "4")
    assert "nvidia.com/gpu limit is 4" in finding.message


def test_head_advertising_gpus_it_does_not_own_is_an_error(deploy):
    edit_rc(deploy, lambda rc: rc["spec"]["headGroupSpec"]["rayStartParams"].update({"num-gpus": "1"}))
    finding = only(lint_paths([str(deploy)], None), field="spec.headGroupSpec.rayStartParams.num-gpus")
    assert (finding.seen, finding.expected) == ("1", "0")


def test_ray_version_must_match_the_image_tag_and_the_profile(deploy):
    edit_rc(deploy, lambda rc: rc["spec"].update({"rayVersion": "2.57.0"}))
    findings = lint_paths([str(deploy)], eks())
    by_tag = only(findings, field="spec.rayVersion", message="image tag")
    assert (by_tag.seen, by_tag.expected) == ("2.57.0", "2.58.0")
    by_config = only(findings, field="spec.rayVersion", message="cluster.expect.ray_version")
    assert by_config.expected == "2.58.0"


def ray_version_in_image(image: str) -> str | None:
    """The Ray version an image's tag names, or None."""
    return image_ray_version(image)[0]


def test_ray_version_is_read_only_from_ray_images():
    assert ray_version_in_image("r.example/ray-train:2.58.0-gpu-py313-cu130@sha256:" + "0" * 64) == "2.58.0"
    assert ray_version_in_image("rayproject/ray:2.60.0-py311") == "2.60.0"
    assert ray_version_in_image("prefecthq/prefect:3.9.1-python3.13") is None
    assert ray_version_in_image("r.example/ray-train:latest") is None


def test_ray_train_dlc_tags_map_to_their_ray_version_from_the_changelog():
    dlc = "public.ecr.aws/deep-learning-containers/ray:"
    assert ray_version_in_image(dlc + "train-ml-cuda-v1.1@sha256:" + "0" * 64) == "2.58.0"
    assert ray_version_in_image("763104351884.dkr.ecr.us-west-2.amazonaws.com/ray:train-ml-cuda-v1.0.0") == "2.58.0"
    for floating_or_unknown in ("train-ml-cuda", "train-ml-cuda-v1", "train-ml-cuda-v9.9", "serve-ml-cuda-v1.5"):
        assert ray_version_in_image(dlc + floating_or_unknown) is None


def test_a_dlc_tag_that_cannot_be_mapped_is_a_warning_not_a_silent_skip(deploy, capsys):
    floating = "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda@sha256:" + "0" * 64
    edit_rc(deploy, lambda rc: worker_container(rc).update({"image": floating}))
    code, out = lint_exit([deploy], capsys, f"cluster.expect.image={floating}")
    assert code == 0 and "floating DLC tag" in out and "rayVersion 2.58.0 is not checked" in out
    newer = floating.replace("train-ml-cuda@", "train-ml-cuda-v1.7@")
    edit_rc(deploy, lambda rc: worker_container(rc).update({"image": newer}))
    assert "is not in ray-train-dlc.yaml" in lint_exit([deploy], capsys, f"cluster.expect.image={newer}")[1]


def test_ray_version_must_match_the_dlc_tags_ray(deploy, capsys):
    edit_rc(deploy, lambda rc: rc["spec"].update({"rayVersion": "2.60.0"}))
    code, out = lint_exit([deploy], capsys, "cluster.expect.ray_version=2.60.0")
    assert code == 1 and "spec.rayVersion is '2.60.0', expected '2.58.0'" in out and "image tag" in out


def test_scaling_config_larger_than_the_cluster_is_an_error(deploy):
    finding = only(lint_paths([str(deploy)], eks("train.num_workers=12")), field="GPUs over workerGroupSpecs")
    assert (finding.seen, finding.expected) == (8, ">= 12")
    edit_rc(deploy, lambda rc: worker(rc).update({"replicas": 1, "minReplicas": 1, "maxReplicas": 1}))
    finding = only(lint_paths([str(deploy)], eks()), field="GPUs over workerGroupSpecs")
    assert (finding.seen, finding.expected) == (4, ">= 8")


def test_autoscaling_counts_max_replicas(deploy):
    def autoscale(rc):
        rc["spec"]["enableInTreeAutoscaling"] = True
        worker(rc).update({"replicas": 0, "minReplicas": 0, "maxReplicas": 3})

    edit_rc(deploy, autoscale)
    rc = yaml.safe_load((deploy / RC).read_text())
    assert cluster_gpu_capacity(rc) == 12
    assert not [f for f in errors(lint_paths([str(deploy)], eks())) if "GPUs over" in f.field]


def test_efa_and_pinned_nccl_net_are_required_when_expected(deploy):
    def drop(rc):
        container = worker_container(rc)
        for part in ("limits", "requests"):
            container["resources"][part].pop("vpc.amazonaws.com/efa")
        container["env"] = [e for e in container["env"] if e["name"] != "NCCL_NET"]

    edit_rc(deploy, drop)
    findings = lint_paths([str(deploy)], eks())
    assert only(findings, field="[vpc.amazonaws.com/efa]").seen == 0
    assert only(findings, field="env[NCCL_NET]").expected == "Libfabric"
    assert not errors(lint_paths([str(deploy)], eks("cluster.expect.efa=false", "connectivity.expect_transport=any")))


def test_a_gpu_limit_with_a_quantity_suffix_is_read_as_its_value(deploy):
    # It read as limit 0: the suffix made the count unreadable.
    edit_rc(deploy, lambda rc: worker_container(rc)["resources"]["limits"].update({"nvidia.com/gpu": "4k"}))
    finding = only(lint_paths([str(deploy)], None), field="spec.workerGroupSpecs[gpu].rayStartParams.num-gpus")
    assert (finding.seen, finding.expected) == ("4", "4000")


def test_gpus_per_worker_expectation(deploy):
    finding = only(lint_paths([str(deploy)], eks("cluster.expect.gpus_per_worker=8")), field="[nvidia.com/gpu]")
    assert (finding.seen, finding.expected) == (4, 8)


# ---------------------------------------------------------------- storage


def test_node_local_storage_with_several_nodes_is_an_error(deploy):
    no_mount = only(lint_paths([str(deploy)], eks("storage.root=/data/tuneproof")), field="volumeMounts")
    assert no_mount.seen is None and "3 nodes" in no_mount.message
    on_empty_dir = only(lint_paths([str(deploy)], eks("storage.root=/tmp/ray/ckpt")), field="volumes[ray-tmp]")
    assert on_empty_dir.seen == "emptyDir"


def test_hostpath_and_readwriteonce_claims_are_not_shared(deploy):
    def host_path(rc):
        worker(rc)["template"]["spec"]["volumes"][2] = {"name": "fsx", "hostPath": {"path": "/mnt/fsx"}}

    edit_rc(deploy, host_path)
    finding = only(lint_paths([str(deploy)], eks("storage.root=/mnt/fsx/tuneproof")), field="volumes[fsx]")
    assert finding.seen == "hostPath" and "workerGroupSpecs[gpu]" in finding.field

    shutil.copy(DEPLOYMENTS / RC, deploy / RC)
    edit_yaml(
        deploy / "storage.yaml",
        lambda d: (
            d["spec"].update({"accessModes": ["ReadWriteOnce"]}) if d["kind"] == "PersistentVolumeClaim" else None
        ),
    )
    finding = only(lint_paths([str(deploy)], eks("storage.root=/mnt/fsx/tuneproof")), field="volumes[fsx]")
    assert "ReadWriteOnce" in finding.seen


def test_fsx_and_s3_roots_are_shared():
    assert not errors(lint_paths([str(DEPLOYMENTS)], eks("storage.root=/mnt/fsx/tuneproof")))
    assert not errors(lint_paths([str(DEPLOYMENTS)], eks("storage.root=s3://bucket/prefix")))


# ---------------------------------------------------------------- schemas


def test_a_manifest_that_breaks_the_crd_schema_is_an_error(deploy):
    def break_it(rc):
        worker(rc)["rayStartParams"]["num-gpus"] = 4  # the CRD wants strings
        rc["spec"]["workerGroupSpec"] = []  # a typo of workerGroupSpecs

    edit_rc(deploy, break_it)
    findings = lint_paths([str(deploy)], None)
    assert only(findings, field="spec.workerGroupSpecs[0].rayStartParams.num-gpus").seen == 4
    assert "workerGroupSpec" in only(findings, field="spec", message="Additional properties").message


def test_core_objects_are_checked_against_the_kubernetes_schema(deploy):
    def bad(doc):
        if doc["kind"] == "Deployment":
            doc["spec"]["replicas"] = "one"
            doc["spec"]["template"]["spec"]["containers"][0]["resource"] = {}

    edit_yaml(deploy / "prefect-worker.yaml", bad)
    findings = lint_paths([str(deploy / "prefect-worker.yaml")], None)
    assert only(findings, field="spec.replicas").seen == "one"
    assert only(findings, field="spec.template.spec.containers[0]", message="'resource' was unexpected")


def test_unparseable_and_unknown_documents(tmp_path):
    (tmp_path / "broken.yaml").write_text("kind: [unclosed\n")
    (tmp_path / "other.yaml").write_text("apiVersion: example.com/v1\nkind: Widget\nmetadata: {name: w}\n")
    (tmp_path / "notes.md").write_text("# not a manifest\n")
    findings = lint_paths([str(tmp_path)], None)
    assert only(findings, subject="broken.yaml", field="content").seen == "unparseable"
    unknown = [f for f in findings if f.severity == "warning" and "Widget" in f.subject]
    assert unknown and unknown[0].seen == "example.com/v1/Widget"
    with pytest.raises(FileNotFoundError, match="nowhere"):
        lint_paths([str(tmp_path / "nowhere")], None)


def test_strict_crd_conversion():
    crd = {
        "type": "object",
        "properties": {
            "a": {"type": "string", "nullable": True},
            "open": {
                "type": "object",
                "x-kubernetes-preserve-unknown-fields": True,
                "properties": {"x": {"type": "string"}},
            },
            "map": {"type": "object", "additionalProperties": {"type": "string"}},
        },
    }
    strict = _strict(crd)
    assert strict["additionalProperties"] is False
    assert strict["properties"]["a"]["type"] == ["string", "null"]
    assert "additionalProperties" not in strict["properties"]["open"]
    assert strict["properties"]["map"]["additionalProperties"] == {"type": "string"}


def test_strict_crd_conversion_carries_what_the_api_server_adds_to_json_schema():
    defaulted = {"type": "integer", "default": 2147483647}  # the API server defaults it before validating
    crd: dict = {
        "type": "object",
        "required": ["name", "max"],
        "properties": {
            "name": {"type": "string"},
            "max": defaulted,
            "managedBy": {
                "type": "string",
                "x-kubernetes-validations": [
                    {"rule": "self == oldSelf", "message": "immutable"},
                    {"rule": "self in ['ray.io/kuberay-operator', 'kueue.x-k8s.io/multikueue']", "message": "..."},
                ],
            },
        },
    }
    strict = _strict(crd)
    assert strict["required"] == ["name"]
    assert strict["properties"]["managedBy"]["enum"] == ["ray.io/kuberay-operator", "kueue.x-k8s.io/multikueue"]
    assert "required" not in _strict({"type": "object", "required": ["max"], "properties": {"max": defaulted}})


def test_the_committed_crd_schema_is_what_build_makes_of_the_kuberay_crd():
    import json

    from tuneproof.app.schemas.build import build_raycluster

    crd = Path("/work/shared/kuberay/ray.io_rayclusters.yaml")
    if not crd.exists():
        pytest.skip("the KubeRay CRD checkout /work/shared/kuberay is absent")
    committed = json.loads((PROJECT_ROOT / "tuneproof" / "app" / "schemas" / "raycluster-v1.json").read_text())
    assert committed == build_raycluster(crd)


def test_a_managed_by_the_crd_refuses_is_an_error(deploy):
    # It passed: the CRD's CEL rule (self in [...]) was kept as a marker JSON Schema ignores.
    edit_rc(deploy, lambda rc: rc["spec"].update({"managedBy": "example.com/other-controller"}))
    finding = only(lint_paths([str(deploy)], None), field="spec.managedBy")
    assert finding.seen == "example.com/other-controller"
    edit_rc(deploy, lambda rc: rc["spec"].update({"managedBy": "kueue.x-k8s.io/multikueue"}))
    assert not errors(lint_paths([str(deploy)], None))


def test_a_worker_group_may_leave_min_and_max_replicas_to_the_crds_defaults(deploy):
    # It was refused as 'required', though the API server defaults both (0 and 2147483647) before validating.
    edit_rc(deploy, lambda rc: [worker(rc).pop(k) for k in ("minReplicas", "maxReplicas")])
    assert not errors(lint_paths([str(deploy)], eks()))


def test_a_key_repeated_in_a_list_type_map_is_an_error(deploy):
    # It passed: x-kubernetes-list-type map is a marker JSON Schema ignores, and the API server refuses the object.
    def repeat(rc):
        worker_container(rc)["env"].append({"name": "NCCL_SOCKET_IFNAME", "value": "ens5"})
        head = rc["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
        head["ports"].append({"containerPort": head["ports"][0]["containerPort"], "name": "again"})

    edit_rc(deploy, repeat)
    findings = lint_paths([str(deploy)], None)
    env = only(findings, field="spec.workerGroupSpecs[0].template.spec.containers[0].env[")
    assert (env.seen, env.expected) == ({"name": "NCCL_SOCKET_IFNAME"}, "entries with unique name")
    port = only(findings, field="spec.headGroupSpec.template.spec.containers[0].ports[")
    assert port.seen == {"containerPort": 6379, "protocol": "TCP"}  # protocol: the CRD's default
    assert "Duplicate value" in port.message


# ---------------------------------------------------------------- the Prefect template and RBAC


def test_flow_pods_mount_the_clusters_token_secret(deploy):
    path = deploy / "prefect-k8s-base-job-template.json"
    template = json.loads(path.read_text())
    volume = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["volumes"][0]
    volume["secret"]["secretName"] = "some-other-secret"
    path.write_text(json.dumps(template))
    finding = only(lint_paths([str(deploy)], eks()), field="secret.secretName")
    assert (finding.seen, finding.expected) == ("some-other-secret", "tuneproof-ray-auth")

    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["volumeMounts"] = []
    path.write_text(json.dumps(template))
    finding = only(lint_paths([str(deploy)], eks()), field="volumeMounts")
    assert finding.expected == "a mount at /var/run/secrets/tuneproof/ray-auth"


def test_the_pipeline_service_account_only_reads(deploy):
    def add_write(doc):
        if doc["kind"] == "Role" and doc["metadata"]["name"] == "tuneproof-pipeline-read":
            doc["rules"][1]["verbs"].append("delete")

    edit_yaml(deploy / "rbac.yaml", add_write)
    finding = only(lint_paths([str(deploy)], None), subject="Role/tuneproof-pipeline-read")
    assert (finding.field, finding.seen) == ("rules[1].verbs", ["delete"])


def test_job_template_fixed_parts_validate_as_a_job(deploy):
    path = deploy / "prefect-k8s-base-job-template.json"
    template = json.loads(path.read_text())
    template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["restartPolicy"] = 3
    path.write_text(json.dumps(template))
    assert only(lint_paths([str(path)], None), field="spec.template.spec.restartPolicy").seen == 3


def test_a_field_of_the_wrong_type_is_a_schema_finding_not_a_crash(deploy):
    edit_rc(deploy, lambda rc: worker(rc).update({"replicas": "two"}))
    wrong = errors(lint_paths([str(deploy)], eks()))
    assert [f.seen for f in wrong] == ["two"] and "replicas" in wrong[0].field
