"""The Kubernetes half of verify over saved objects (`tuneproof verify --from-files`).

tests/fixtures/k8s/cluster/ is what `kubectl get -o json` / `ray list nodes --format json` print for
the committed deployments/raycluster.yaml running on two g6.12xlarge nodes; a test keeps the two in
step. Failing cases edit a copy in tmp_path.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tuneproof.app.cli_eks import verify_from_files_command
from tuneproof.control.kube import load_objects_from_dir
from tuneproof.control.kube_checks import as_count, check_cluster, normalize_ray_nodes, operator_version, summarize
from tuneproof.core.config import PROJECT_ROOT, load_config
from tuneproof.core.findings import errors

FIXTURE = Path(__file__).parent / "fixtures" / "k8s" / "cluster"
EKS = PROJECT_ROOT / "configs" / "eks.yaml"
OTHER_DIGEST = "sha256:" + "b" * 64


@pytest.fixture
def saved(tmp_path) -> Path:
    target = tmp_path / "saved"
    shutil.copytree(FIXTURE, target)
    return target


def edit(path: Path, change) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def pod(pods: dict, name: str) -> dict:
    return next(p for p in pods["items"] if p["metadata"]["name"] == name)


def check(directory: Path, *sets: str):
    return check_cluster(load_objects_from_dir(directory), load_config(EKS, list(sets)))


def only(findings, **match):
    found = [f for f in errors(findings) if all(str(v) in str(getattr(f, k)) for k, v in match.items())]
    assert found, f"no error matching {match} in:\n" + "\n".join(f.line() for f in findings)
    return found[0]


@pytest.mark.parametrize("encoding", ["utf-8-sig", "utf-16"])
def test_files_saved_with_a_byte_order_mark_read_as_the_plain_ones(saved, encoding):
    # Windows PowerShell 5's `kubectl ... -o json > pods.json` writes UTF-16 with a mark: read as "not UTF-8 text".
    plain = load_objects_from_dir(FIXTURE)
    for path in saved.iterdir():
        path.write_bytes(path.read_text().encode(encoding))
    assert load_objects_from_dir(saved) == plain and errors(check(saved)) == []


def test_fixture_is_the_committed_manifest():
    manifest = yaml.safe_load((PROJECT_ROOT / "deployments" / "raycluster.yaml").read_text())
    saved = json.loads((FIXTURE / "raycluster.json").read_text())
    assert saved["spec"] == manifest["spec"]
    worker_template = manifest["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    pods = json.loads((FIXTURE / "pods.json").read_text())
    worker_pod = pod(pods, "tuneproof-gpu-worker-4qj8n")["spec"]
    assert {k: v for k, v in worker_pod.items() if k != "nodeName"} == worker_template


def test_healthy_cluster_passes_and_notes_the_operator_version():
    findings = check(FIXTURE)
    assert errors(findings) == []
    note = [f for f in findings if f.severity == "info"]
    assert note[0].subject == "KubeRay operator" and note[0].seen == "v1.6.0"


def test_pod_running_a_different_digest_is_named(saved):
    edit(
        saved / "pods.json",
        lambda pods: pod(pods, "tuneproof-gpu-worker-9tlwz")["status"]["containerStatuses"][0].update(
            {"imageID": f"123456789012.dkr.ecr.us-west-2.amazonaws.com/ray-train@{OTHER_DIGEST}"}
        ),
    )
    finding = only(check(saved), subject="pod tuneproof-gpu-worker-9tlwz")
    assert finding.field == "status.containerStatuses[ray-worker].imageID"
    assert finding.seen.endswith(OTHER_DIGEST) and finding.expected == "sha256:" + "0" * 64
    assert len(errors(check(saved))) == 1


def test_ray_node_advertising_more_gpus_than_its_pod_limit(saved):
    edit(saved / "ray-nodes.json", lambda nodes: nodes[2]["resources_total"].update({"GPU": 8.0}))
    finding = only(check(saved), field="resources_total.GPU")
    assert finding.subject == "Ray node 10.0.2.21 (pod tuneproof-gpu-worker-9tlwz)"
    assert (finding.seen, finding.expected) == (8, 4)


def test_pod_gpu_limit_disagreeing_with_num_gpus(saved):
    def shrink(pods):
        limits = pod(pods, "tuneproof-gpu-worker-4qj8n")["spec"]["containers"][0]["resources"]
        limits["limits"]["nvidia.com/gpu"] = limits["requests"]["nvidia.com/gpu"] = "2"

    edit(saved / "pods.json", shrink)
    findings = check(saved)
    by_spec = only(findings, subject="pod tuneproof-gpu-worker-4qj8n (group gpu)")
    assert (by_spec.seen, by_spec.expected) == (2, "4") and "num-gpus" in by_spec.message
    assert only(findings, subject="pod tuneproof-gpu-worker-4qj8n", message="gpus_per_worker").seen == 2
    ray_node = only(findings, subject="Ray node 10.0.2.20")
    assert (ray_node.seen, ray_node.expected) == (4, 2)


def test_missing_ray_node_for_a_pod(saved):
    edit(saved / "ray-nodes.json", lambda nodes: nodes[2].update({"state": "DEAD"}))
    finding = only(check(saved), field="Ray node on the pod IP")
    assert finding.subject == "pod tuneproof-gpu-worker-9tlwz" and finding.expected == "10.0.2.21"


def efa_slice(node: str) -> dict:
    """The ResourceSlice the dra.net driver publishes for one EFA device on `node`."""
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceSlice",
        "metadata": {"name": f"{node}-dra.net-efa"},
        "spec": {
            "driver": "dra.net",
            "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": [{"name": "rdmap0s26", "attributes": {"dra.net/rdma": {"bool": True}}}],
        },
    }


def test_efa_from_a_dra_resourceslice_is_accepted(saved):
    def no_device_plugin(nodes):
        for node in nodes["items"]:
            node["status"]["allocatable"].pop("vpc.amazonaws.com/efa", None)

    edit(saved / "nodes.json", no_device_plugin)
    finding = only(check(saved), subject="node ip-10-0-2-20.us-west-2.compute.internal")
    assert finding.seen == 0 and "EFA" in finding.message

    slices = [
        efa_slice(n) for n in ("ip-10-0-2-20.us-west-2.compute.internal", "ip-10-0-2-21.us-west-2.compute.internal")
    ]
    edit(saved / "resourceslices.json", lambda data: data.update({"items": slices}))
    assert errors(check(saved)) == []
    assert summarize(load_objects_from_dir(saved))["nodes"][0]["efa_dra_slices"] == 1

    (saved / "resourceslices.json").unlink()
    assert "could not be read" in only(check(saved), subject="node ip-10-0-2-21").message


def test_node_without_allocatable_gpus(saved):
    edit(saved / "nodes.json", lambda nodes: nodes["items"][2]["status"]["allocatable"].pop("nvidia.com/gpu"))
    finding = only(check(saved), field="status.allocatable[nvidia.com/gpu]")
    assert finding.subject == "node ip-10-0-2-21.us-west-2.compute.internal" and finding.seen == 0


def test_cluster_not_ready_or_missing(saved):
    def not_ready(rc):
        rc["status"]["state"] = "suspended"
        rc["status"]["conditions"][1].update({"status": "False", "reason": "RayClusterPodsProvisioning"})

    edit(saved / "raycluster.json", not_ready)
    finding = only(check(saved), field="status.state")
    assert (finding.seen, finding.expected) == (
        "suspended",
        "ready",
    ) and "RayClusterPodsProvisioning" in finding.message
    objects = load_objects_from_dir(FIXTURE) | {"raycluster": None}
    assert (
        only(check_cluster(objects, load_config(EKS)), field="metadata.name").subject
        == "RayCluster tuneproof/tuneproof"
    )


def test_pending_worker_pod(saved):
    edit(
        saved / "pods.json", lambda pods: pod(pods, "tuneproof-gpu-worker-9tlwz")["status"].update({"phase": "Pending"})
    )
    findings = check(saved)
    assert only(findings, subject="pod tuneproof-gpu-worker-9tlwz", field="status.phase").seen == "Pending"
    running = only(findings, field="workerGroupSpecs[gpu] running pods")
    assert (running.seen, running.expected) == (1, 2)


def test_saved_files_as_lists_or_single_objects(saved):
    rc = json.loads((saved / "raycluster.json").read_text())
    (saved / "raycluster.json").write_text(json.dumps({"apiVersion": "v1", "kind": "List", "items": [rc]}))
    pods = json.loads((saved / "pods.json").read_text())["items"]
    (saved / "pods.json").write_text(json.dumps(pods[0]))
    objects = load_objects_from_dir(saved)
    assert objects["raycluster"]["metadata"]["name"] == "tuneproof"
    assert [p["metadata"]["name"] for p in objects["pods"]] == [pods[0]["metadata"]["name"]]
    (saved / "nodes.json").write_text("not json")
    with pytest.raises(ValueError, match="nodes.json: not JSON"):
        load_objects_from_dir(saved)


def test_ray_node_listing_formats():
    cli = json.loads((FIXTURE / "ray-nodes.json").read_text())
    dashboard = {
        "result": True,
        "data": {
            "summary": [
                {
                    "ip": n["node_ip"],
                    "raylet": {
                        "nodeManagerAddress": n["node_ip"],
                        "resourcesTotal": n["resources_total"],
                        "state": n["state"],
                        "nodeId": n["node_id"],
                        "isHeadNode": n["is_head_node"],
                    },
                }
                for n in cli
            ]
        },
    }
    verify_facts = [
        {
            "node_id": n["node_id"],
            "node_ip": n["node_ip"],
            "is_head": n["is_head_node"],
            "alive": True,
            "gpus_advertised": n["resources_total"].get("GPU", 0),
            "cpus_advertised": n["resources_total"]["CPU"],
        }
        for n in cli
    ]
    assert normalize_ray_nodes(cli) == normalize_ray_nodes(dashboard) == normalize_ray_nodes(verify_facts)
    assert [(n["gpus"], n["cpus"]) for n in normalize_ray_nodes(cli)] == [(0, 6.0), (4, 44.0), (4, 44.0)]


def test_operator_version_sources():
    objects = load_objects_from_dir(FIXTURE)
    annotated = {
        **objects["raycluster"],
        "metadata": {**objects["raycluster"]["metadata"], "annotations": {"ray.io/kuberay-version": "v1.6.1"}},
    }
    assert operator_version(annotated, objects["pods"], None)[0] == "v1.6.1"
    assert operator_version(objects["raycluster"], objects["pods"], objects["operator"])[0] == "v1.6.0"
    assert operator_version(objects["raycluster"], objects["pods"], None)[0] == "unknown"


def test_summary_for_the_run_record():
    summary = summarize(load_objects_from_dir(FIXTURE), load_config(EKS))
    assert summary["operator_version"] == "v1.6.0"
    assert set(summary["image_digests"].values()) == {"sha256:" + "0" * 64}
    assert summary["raycluster"]["worker_groups"] == [
        {
            "name": "gpu",
            "pods": 2,
            "ray_gpus": "4",
            "gpu_limit": 4,
            "efa_limit": 1,
            "image": load_config(EKS).cluster.expect.image,
        }
    ]
    assert [n["gpu_allocatable"] for n in summary["nodes"]] == [4, 4]
    json.dumps(summary)


def test_verify_from_files_command(saved, capsys):
    assert verify_from_files_command(str(FIXTURE), str(EKS), [], as_json=True) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["ok"] and out["summary"]["operator_version"] == "v1.6.0"

    edit(saved / "ray-nodes.json", lambda nodes: nodes[1]["resources_total"].update({"GPU": 8.0}))
    assert verify_from_files_command(str(saved), None, [], as_json=False) == 4
    assert (
        "Ray node 10.0.2.20 (pod tuneproof-gpu-worker-4qj8n): resources_total.GPU is 8, expected 4"
        in capsys.readouterr().out
    )

    (saved / "pods.json").unlink()
    assert verify_from_files_command(str(saved), None, [], as_json=False) == 4
    assert "pods.json: missing" in capsys.readouterr().err


def test_verify_from_files_warns_when_the_saved_nodes_cannot_place_the_workers(capsys):
    """As the live verify does (tuneproof.core.checks.check_capacity): 12 GPU workers on two nodes of 4 GPUs
    would wait for resources. A warning, not an error: an autoscaler may add nodes."""
    assert verify_from_files_command(str(FIXTURE), str(EKS), ["train.num_workers=12"], as_json=True) == 0
    found = [f for f in json.loads(capsys.readouterr().out)["findings"] if f["field"] == "train.num_workers"]
    assert [(f["seen"], f["expected"], f["severity"]) for f in found] == [(12, "at most 8", "warning")]
    assert "can place 8 workers of 1 CPU and 1 GPU each; unless an autoscaler adds nodes" in found[0]["message"]
    assert verify_from_files_command(str(FIXTURE), str(EKS), ["train.num_workers=8"], as_json=True) == 0
    assert "train.num_workers" not in capsys.readouterr().out


def crash_loop(status: dict, last_exit: str) -> None:
    status["containerStatuses"][0].update(
        ready=False,
        started=False,
        restartCount=7,
        state={"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 5m0s restarting failed container"}},
        lastState={"terminated": {"exitCode": 1, "reason": last_exit}},
    )


def test_a_crash_looping_ray_container_fails_though_its_pod_is_running(saved):
    # It passed: the pod's phase stays Running while its Ray container restarts, and only the phase was read.
    edit(saved / "pods.json", lambda pods: crash_loop(pod(pods, "tuneproof-gpu-worker-4qj8n")["status"], "Error"))
    (saved / "ray-nodes.json").unlink()
    finding = only(check(saved), subject="pod tuneproof-gpu-worker-4qj8n")
    assert finding.field == "status.containerStatuses[ray-worker].state"
    assert (finding.seen, finding.expected) == ("waiting: CrashLoopBackOff", "running")
    assert "restarts 7, last exit Error" in finding.message


def test_a_ray_container_that_is_not_ready_fails(saved):
    edit(
        saved / "pods.json",
        lambda pods: pod(pods, "tuneproof-gpu-worker-9tlwz")["status"]["containerStatuses"][0].update(ready=False),
    )
    finding = only(check(saved), subject="pod tuneproof-gpu-worker-9tlwz")
    assert (finding.field, finding.seen, finding.expected) == (
        "status.containerStatuses[ray-worker].ready",
        False,
        True,
    )


def test_head_pod_not_ready_fails_though_the_state_is_ready(saved):
    # KubeRay keeps state 'ready' once reached; HeadPodReady falls when the head crash-loops.
    def head_down(rc):
        next(c for c in rc["status"]["conditions"] if c["type"] == "HeadPodReady").update(
            status="False", reason="HeadPodNotReady"
        )

    edit(saved / "raycluster.json", head_down)
    edit(saved / "pods.json", lambda pods: crash_loop(pod(pods, "tuneproof-head-7xk2p")["status"], "OOMKilled"))
    findings = check(saved)
    head_ready = only(findings, field="status.conditions[HeadPodReady]")
    assert (head_ready.subject, head_ready.seen, head_ready.message) == (
        "RayCluster tuneproof/tuneproof",
        "False",
        "HeadPodNotReady",
    )
    assert "last exit OOMKilled" in only(findings, subject="pod tuneproof-head-7xk2p").message


def test_an_autoscaling_cluster_below_max_replicas_is_not_short_of_pods(saved):
    # It failed as infrastructure: under autoscaling, verify wanted maxReplicas pods running.
    def autoscale(rc):
        rc["spec"]["enableInTreeAutoscaling"] = True
        rc["spec"]["workerGroupSpecs"][0].update(minReplicas=0, maxReplicas=4, replicas=2)

    edit(saved / "raycluster.json", autoscale)
    assert errors(check(saved)) == []
    edit(saved / "raycluster.json", lambda rc: rc["spec"]["workerGroupSpecs"][0].update(replicas=3))
    running = only(check(saved), field="workerGroupSpecs[gpu] running pods")
    assert (running.seen, running.expected) == (2, 3)


@pytest.mark.parametrize(
    ("raw", "count"),
    [("4", 4), ("4.0", 4), ("4k", 4000), ("1Ki", 1024), ("2e3", 2000), ("1.5Gi", 1610612736)]
    + [("500m", None), ("four", None), ("4K", None), ("1e400", None), ("nan", None), ("1e999999999", None)],
)
def test_counts_are_read_as_kubernetes_quantities(raw, count):
    # float('4k') failed, so a GPU limit of 4k read as no limit at all (0).
    assert as_count(raw) == count


def test_a_pod_being_deleted_fails_though_it_still_runs_and_is_ready(saved):
    # It passed: a pod being scaled down or evicted keeps phase Running and a ready container until it exits.
    edit(
        saved / "pods.json",
        lambda pods: pod(pods, "tuneproof-gpu-worker-9tlwz")["metadata"].update(
            deletionTimestamp="2026-12-07T15:00:00Z"
        ),
    )
    findings = check(saved)
    going = only(findings, subject="pod tuneproof-gpu-worker-9tlwz")
    assert (going.field, going.seen) == ("metadata.deletionTimestamp", "2026-12-07T15:00:00Z")
    short = only(findings, field="running pods")
    assert (short.seen, short.expected) == (1, 2)


def worker_containers(pods: dict) -> list[dict]:
    return [
        p["spec"]["containers"][0] for p in pods["items"] if p["metadata"]["labels"]["ray.io/node-type"] == "worker"
    ]


def test_worker_pods_given_no_efa_fail_though_their_nodes_have_it(saved):
    # The nodes offered EFA, the pods asked none: verify passed and NCCL could only use sockets.
    def no_efa(pods):
        for container in worker_containers(pods):
            for kind in ("limits", "requests"):
                container["resources"][kind].pop("vpc.amazonaws.com/efa")
                container["resources"][kind].pop("hugepages-2Mi")

    edit(saved / "pods.json", no_efa)
    findings = check(saved)
    finding = only(findings, subject="pod tuneproof-gpu-worker-9tlwz", field="vpc.amazonaws.com/efa")
    assert finding.field == "spec.containers[ray-worker].resources[vpc.amazonaws.com/efa] or .resources.claims"
    assert "no EFA device" in finding.message
    assert len(errors(findings)) == 2  # one per worker pod; the head needs none
    hugepages = [f for f in findings if f.severity == "warning" and "hugepages" in f.field]
    assert {f.subject for f in hugepages} == {"pod tuneproof-gpu-worker-4qj8n", "pod tuneproof-gpu-worker-9tlwz"}
    assert errors(check(saved, "cluster.expect.efa=false")) == []


def test_an_efa_resource_claim_counts_as_efa(saved):
    def claim(pods):
        for p in pods["items"]:
            if p["metadata"]["labels"]["ray.io/node-type"] == "worker":
                container = p["spec"]["containers"][0]
                for kind in ("limits", "requests"):
                    container["resources"][kind].pop("vpc.amazonaws.com/efa")
                container["resources"]["claims"] = [{"name": "efa"}]
                p["spec"]["resourceClaims"] = [{"name": "efa", "resourceClaimTemplateName": "efa"}]

    edit(saved / "pods.json", claim)
    assert errors(check(saved)) == []
    # A claim the pod does not declare gives the container nothing.
    edit(saved / "pods.json", lambda pods: pod(pods, "tuneproof-gpu-worker-4qj8n")["spec"].pop("resourceClaims"))
    assert len(errors(check(saved))) == 1


def test_nccl_and_libfabric_env_pointing_away_from_efa(saved):
    def env(pods):
        for container in worker_containers(pods):
            values = {e["name"]: e for e in container["env"]}
            values["NCCL_NET"]["value"] = "Socket"
            container["env"].remove(values["FI_PROVIDER"])

    edit(saved / "pods.json", env)
    findings = check(saved)
    net = only(findings, subject="pod tuneproof-gpu-worker-4qj8n", field="env[NCCL_NET]")
    assert (net.seen, net.expected) == ("Socket", "Libfabric")
    unset = [f for f in findings if f.field.endswith("env[FI_PROVIDER]")]
    assert len(unset) == 2 and all(f.severity == "warning" and "unset in the pod spec" in f.message for f in unset)
    assert len(errors(findings)) == 2


def test_a_dra_net_device_without_rdma_is_not_efa(saved):
    # DRANET publishes plain ENIs too (dra.net/rdma false): a node without EFA passed on them.
    edit(
        saved / "nodes.json",
        lambda nodes: [n["status"]["allocatable"].pop("vpc.amazonaws.com/efa", None) for n in nodes["items"]],
    )
    slices = [
        efa_slice(n) for n in ("ip-10-0-2-20.us-west-2.compute.internal", "ip-10-0-2-21.us-west-2.compute.internal")
    ]
    for s in slices:
        s["spec"]["devices"] = [{"name": "eth1", "attributes": {"dra.net/rdma": {"bool": False}}}, {"name": "eth2"}]
    edit(saved / "resourceslices.json", lambda data: data.update({"items": slices}))
    finding = only(check(saved), subject="node ip-10-0-2-20.us-west-2.compute.internal")
    assert "dra.net/rdma true" in finding.message
    assert summarize(load_objects_from_dir(saved))["nodes"][0]["efa_dra_slices"] == 0


def test_a_bare_image_id_cannot_confirm_the_digest(saved):
    # 'sha256:<hex>' alone is the local image ID (a preloaded image): it was reported as "a different image".
    edit(
        saved / "pods.json",
        lambda pods: pod(pods, "tuneproof-gpu-worker-9tlwz")["status"]["containerStatuses"][0].update(
            {"imageID": OTHER_DIGEST}
        ),
    )
    finding = only(check(saved), subject="pod tuneproof-gpu-worker-9tlwz")
    assert "cannot be confirmed" in finding.message and "different image" not in finding.message
    assert len(errors(check(saved))) == 1
