"""Checks over per-node facts: expected versions, GPU counts, cross-node agreement."""

from __future__ import annotations

from tuneproof.core.checks import check_capacity, check_nodes, environment_digest, summarize_cluster
from tuneproof.core.config_cluster import ClusterExpect

DIGEST = environment_digest([("torch", "2.13.0+cpu"), ("ray", "2.60.0")])


def node(ip: str, node_id: str, is_head: bool = False, **overrides) -> dict:
    facts = {
        "node_id": node_id,
        "node_ip": ip,
        "is_head": is_head,
        "alive": True,
        "ray_version": "2.60.0",
        "python_version": "3.11.9",
        "torch_version": "2.13.0+cpu",
        "transformers_version": "5.24.0",
        "cuda_version": None,
        "nccl_version": None,
        "gpus_visible": 0,
        "gpus_advertised": 0.0,
        "environment_digest": DIGEST,
    }
    return {**facts, **overrides}


HEAD = node("10.0.0.1", "aaaaaaaa11112222", is_head=True)
WORKER = node("10.0.0.2", "bbbbbbbb33334444")


def test_all_good_has_no_findings():
    expect = ClusterExpect(ray_version="2.60.0", torch_version="2.13.0", python_version="3.11")
    assert check_nodes([HEAD, WORKER], expect) == []


def test_version_mismatch_names_node_and_both_values():
    old = node("10.0.0.3", "cccccccc55556666", ray_version="2.58.0")
    (finding,) = check_nodes([HEAD, old], ClusterExpect(ray_version="2.60.0"))
    assert finding.subject == "node 10.0.0.3 (cccccccc)"
    assert (finding.field, finding.seen, finding.expected) == ("ray_version", "2.58.0", "2.60.0")
    assert "node 10.0.0.3 (cccccccc): ray_version is '2.58.0', expected '2.60.0'" in finding.line()


def test_torch_local_tag_and_python_prefix():
    cuda = node("10.0.0.4", "dddddddd", torch_version="2.13.0+cu130", python_version="3.13.1")
    assert check_nodes([cuda], ClusterExpect(torch_version="2.13.0", python_version="3.13")) == []
    (finding,) = check_nodes([cuda], ClusterExpect(torch_version="2.13.1"))
    assert (finding.seen, finding.expected) == ("2.13.0+cu130", "2.13.1")
    (finding,) = check_nodes([cuda], ClusterExpect(torch_version=None, python_version="3.1"))
    assert finding.field == "python_version"


def test_expected_cuda_on_a_cpu_node():
    (finding,) = check_nodes([HEAD], ClusterExpect(cuda_version="13.0"))
    assert (finding.field, finding.seen, finding.expected) == ("cuda_version", None, "13.0")


def test_gpus_visible_differs_from_advertised():
    gpu = node("10.0.0.5", "eeeeeeee", gpus_visible=4, gpus_advertised=8.0)
    (finding,) = check_nodes([gpu], ClusterExpect())
    assert finding.subject == "node 10.0.0.5 (eeeeeeee)"
    assert (finding.field, finding.seen, finding.expected) == ("gpus_visible", 4, 8.0)


def test_worker_gpus_expected():
    good = node("10.0.0.6", "ffffffff", gpus_visible=8, gpus_advertised=8.0)
    short = node("10.0.0.7", "99999999", gpus_visible=4, gpus_advertised=4.0)
    (finding,) = check_nodes([HEAD, good, short], ClusterExpect(gpus_per_worker=8))
    assert (finding.subject, finding.field, finding.seen, finding.expected) == (
        "node 10.0.0.7 (99999999)",
        "gpus_advertised",
        4.0,
        8,
    )
    (finding,) = check_nodes([HEAD], ClusterExpect(gpus_per_worker=1))
    assert (finding.subject, finding.field) == ("cluster", "worker_nodes")


def test_cross_node_disagreement_names_odd_node_and_majority():
    odd = node(
        "10.0.0.9",
        "12345678abcd",
        transformers_version="5.13.0",
        environment_digest=environment_digest([("torch", "2.13.0+cpu")]),
    )
    findings = check_nodes([HEAD, WORKER, odd], ClusterExpect(transformers_version=None))
    assert {(f.subject, f.field) for f in findings} == {
        ("node 10.0.0.9 (12345678)", "transformers_version"),
        ("node 10.0.0.9 (12345678)", "environment_digest"),
    }
    by_field = {f.field: f for f in findings}
    assert by_field["transformers_version"].seen == "5.13.0"
    assert by_field["transformers_version"].expected == "5.24.0"
    assert by_field["environment_digest"].expected == DIGEST


def test_two_nodes_tie_goes_to_head_value():
    worker = node("10.0.0.2", "bbbbbbbb", nccl_version="2.27.3")
    (finding,) = check_nodes(
        [node("10.0.0.1", "aaaaaaaa", is_head=True, nccl_version="2.29.7"), worker], ClusterExpect()
    )
    assert (finding.subject, finding.seen, finding.expected) == ("node 10.0.0.2 (bbbbbbbb)", "2.27.3", "2.29.7")


def test_dead_nodes_are_not_checked():
    dead = node("10.0.0.8", "deadbeef", alive=False, ray_version="1.0.0")
    assert check_nodes([HEAD, dead], ClusterExpect()) == []


def test_environment_digest_is_order_and_spelling_insensitive():
    a = environment_digest([("Foo_Bar", "1.0"), ("ray", "2.60.0")])
    assert a == environment_digest([("ray", "2.60.0"), ("foo-bar", "1.0"), ("foo.bar", "1.0")])
    assert a != environment_digest([("ray", "2.60.0"), ("foo-bar", "1.1")])


def test_summarize_cluster():
    summary = summarize_cluster([HEAD, WORKER])
    assert summary["ray_version"] == "2.60.0"
    assert summary["environment_digest"] == DIGEST
    assert [n["node_ip"] for n in summary["nodes"]] == ["10.0.0.1", "10.0.0.2"]
    split = summarize_cluster([HEAD, node("10.0.0.2", "bbbbbbbb", environment_digest="x")])
    assert split["environment_digest"] == {"node 10.0.0.1 (aaaaaaaa)": DIGEST, "node 10.0.0.2 (bbbbbbbb)": "x"}


def test_workers_the_nodes_cannot_place_are_named_before_a_stage_waits_for_them():
    # The embedded cluster: 4 CPUs on one node. 8 workers of 1 CPU would leave connectivity "waiting for
    # resources" until its 600 s timeout; verify says so at once.
    local = [node("127.0.0.1", "aaaaaaaa", is_head=True, cpus_advertised=4.0)]
    assert check_capacity(local, 4, use_gpu=False, fixed_size=True) == []
    (short,) = check_capacity(local, 8, use_gpu=False, fixed_size=True)
    assert (short.field, short.seen, short.expected, short.severity) == ("train.num_workers", 8, "at most 4", "error")
    assert "can place 4 workers of 1 CPU each" in short.message and "lower train.num_workers" in short.message
    # A GPU worker needs both on one node: a CPU-only head places none, two 1-GPU workers place one each.
    gpu = [
        node("10.0.0.1", "aaaaaaaa", is_head=True, cpus_advertised=8.0),
        *(node(f"10.0.0.{i}", f"{i}" * 8, cpus_advertised=8.0, gpus_advertised=1.0) for i in (2, 3)),
    ]
    assert check_capacity(gpu, 2, use_gpu=True, fixed_size=False) == []
    (warned,) = check_capacity(gpu, 4, use_gpu=True, fixed_size=False)
    assert warned.severity == "warning" and warned.expected == "at most 2" and "unless an autoscaler" in warned.message
    (no_gpu,) = check_capacity(local, 2, use_gpu=True, fixed_size=True)
    assert no_gpu.expected == "at most 0" and "no node advertises a GPU: set train.use_gpu=false" in no_gpu.message
    # Dead nodes place nothing; facts without Ray's CPU count (older records) are not judged.
    assert check_capacity([*local, node("10.0.0.9", "dddddddd", alive=False, cpus_advertised=64.0)], 8, False, True)
    assert check_capacity([HEAD, WORKER], 4096, use_gpu=False, fixed_size=True) == []
