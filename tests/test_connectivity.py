"""The connectivity stage's pure parts. The whole stage on a real Ray head (2 CPU workers, gloo, the FSDP step)
is asserted on the session's demo run: tests/test_full_pipeline.py."""

from __future__ import annotations

import os

import pytest

from training.connectivity import (
    AllreduceWrong,
    allreduce_sweep,
    bandwidth,
    check_ranks,
    check_transport,
    own_nccl_lines,
    summarize,
    transport_verdict,
)
from tuneproof.core.results import StageFailure
from tuneproof.core.summaries import ConnectivitySummary, FsdpProbe, TransportVerdict
from tuneproof.core.transport import nccl_env


def test_bandwidth_takes_slowest_rank_and_ring_factor():
    rank0 = [{"size_bytes": 1_000_000, "time_ms": 1.0}, {"size_bytes": 4_000_000, "time_ms": 2.0}]
    rank1 = [{"size_bytes": 1_000_000, "time_ms": 2.0}, {"size_bytes": 4_000_000, "time_ms": 1.0}]
    small, large = bandwidth([rank0, rank1], world_size=4)
    assert small["time_ms"] == 2.0 and small["algbw_GBps"] == pytest.approx(0.5)
    assert small["busbw_GBps"] == pytest.approx(0.5 * 1.5)
    assert large["algbw_GBps"] == pytest.approx(2.0)


class FakeCollective:
    """torch.distributed for one rank of a world of 2 whose peer holds the same tensor: a right all-reduce
    doubles it. `honest_calls` lists the calls (from 1) that reduce; the others return at once, unreduced."""

    def __init__(self, monkeypatch, honest_calls):
        import torch.distributed as dist

        self.calls, self.honest = 0, honest_calls
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)
        monkeypatch.setattr(dist, "barrier", lambda: None)
        monkeypatch.setattr(dist, "get_rank", lambda: 1)

    def all_reduce(self, tensor):
        self.calls += 1
        if self.honest(self.calls):
            tensor.mul_(2)


def test_the_sweep_times_every_size_of_a_collective_that_sums_right(monkeypatch):
    import torch

    FakeCollective(monkeypatch, honest_calls=lambda n: True)
    rows = allreduce_sweep([16, 1024], 2, 5, torch.device("cpu"), world=2)
    assert [r["size_bytes"] for r in rows] == [16, 1024]


@pytest.mark.parametrize(
    ("iters", "when"),
    [
        (5, r"after the warmup and timed calls \(8 in all\)"),  # 2**8 is exact in float32: the timed sums are checked
        (40, "a call on fresh ones after the timed calls"),  # 2**43 is not: the call after them is
    ],
)
def test_a_collective_that_sums_right_once_then_returns_at_once_fails_naming_size_and_rank(monkeypatch, iters, when):
    # The first (checked) call right, the rest unreduced and fast: the sweep recorded 17..112 GB/s.
    import torch

    FakeCollective(monkeypatch, honest_calls=lambda n: n == 1)
    with pytest.raises(AllreduceWrong, match=f"at 1048576 bytes over 2 ranks gave a wrong sum on rank 1 \\({when}"):
        allreduce_sweep([1 << 20], 2, iters, torch.device("cpu"), world=2)


def test_a_wrong_sum_is_the_ranks_cause_in_the_stage_failure():
    wrong = "all-reduce of ones at 1024 bytes over 2 ranks gave a wrong sum on rank 1 (...)"
    reports: dict[int, dict | None] = {0: {"rank": 0, "finished": "t"}, 1: {"rank": 1, "joined": "t", "error": wrong}}
    with pytest.raises(StageFailure) as info:
        check_ranks(with_losses([4.8]), reports, None)
    assert info.value.failure_class == "infrastructure"
    assert info.value.cause == f"1 of 2 ranks did not finish: rank 1 ({wrong})"


def test_no_bandwidth_is_reported_unless_every_rank_finished():
    # busbw's factor is the world's: one rank's times would be reported as the whole world's bandwidth.
    done: dict = {
        "finished": "t",
        "joined": "t",
        "allreduce": [{"size_bytes": 1024, "time_ms": 0.001}],
        "nccl_lines": [],
    }
    reports: dict[int, dict | None] = {0: {"rank": 0, **done, "fsdp_losses": [1.0]}, 1: {"rank": 1, "joined": "t"}}
    assert summarize("gloo", 2, reports).allreduce == []
    reports[1] = {"rank": 1, **done, "fsdp_losses": [1.0]}
    assert [row.size_bytes for row in summarize("gloo", 2, reports).allreduce] == [1024]


def test_ranks_that_swept_different_sizes_fail_naming_them_and_report_no_table():
    # zip() over the ranks' rows kept the shortest sweep and labelled each row with rank 0's size.
    def done(rank: int, sizes: list[int]) -> dict:
        rows = [{"size_bytes": size, "time_ms": 0.001} for size in sizes]
        return {"rank": rank, "finished": "t", "joined": "t", "allreduce": rows, "nccl_lines": [], "fsdp_losses": [1.0]}

    reports: dict[int, dict | None] = {0: done(0, [1024, 4096]), 1: done(1, [4096])}
    summary = summarize("gloo", 2, reports)
    assert summary.allreduce == []
    with pytest.raises(StageFailure) as info:
        check_ranks(summary, reports, None)
    assert info.value.failure_class == "infrastructure"
    assert info.value.cause == "the ranks swept different all-reduce sizes (rank 0: [1024, 4096]; rank 1: [4096])"


def test_nccl_env_is_per_submission_and_per_process():
    env = nccl_env("run-1-connectivity")
    assert env["NCCL_DEBUG"] == "INFO" and env["NCCL_DEBUG_SUBSYS"] == "INIT,NET"
    assert env["NCCL_DEBUG_FILE"] == "/tmp/tuneproof-nccl/run-1-connectivity/nccl.%h.%p.log"


def test_rank_reads_only_its_own_nccl_file(tmp_path, monkeypatch):
    monkeypatch.setenv("NCCL_DEBUG_FILE", str(tmp_path / "nccl.%h.%p.log"))
    (tmp_path / f"nccl.host-a.{os.getpid()}.log").write_text("h:1:1 [0] NCCL INFO Using network Socket\n")
    (tmp_path / f"nccl.host-a.{os.getpid() + 1}.log").write_text("someone else's line\n")
    assert own_nccl_lines() == ["h:1:1 [0] NCCL INFO Using network Socket"]
    monkeypatch.delenv("NCCL_DEBUG_FILE")
    assert own_nccl_lines() == []


def test_transport_verdict_worst_rank_wins_and_fails_efa():
    verdict = transport_verdict(
        "nccl",
        {
            "rank-0": ["h:1:1 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 1 nics)"],
            "rank-1": ["h:2:2 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.0.1<0>"],
        },
        {"10.0.0.1", "10.0.0.2"},
    )
    assert verdict["kind"] == "socket-fallback"
    with pytest.raises(StageFailure, match=r"transport is socket-fallback, expected efa: rank-1: .*NET/Socket"):
        check_transport(with_transport(verdict), "efa")
    check_transport(with_transport(transport_verdict("gloo", {}, set())), "gloo")


def single_node_report(rank: int, channel: str) -> dict:
    """A finished rank of 4 on node 10.0.2.20, aws-ofi-nccl loaded and efa selected, one channel `channel`."""
    host = f"ip-10-0-2-20:41{rank}:41{rank} [{rank}] NCCL INFO"
    lines = [
        f"{host} NET/OFI Selected provider is efa, fabric is efa (found 4 nics)",
        f"{host} Using network Libfabric",
        f"{host} comm 0x55d1 rank {rank} nRanks 4 nNodes 1 localRanks 4 localRank {rank} MNNVL 0",
        f"{host} Channel 00/0 : {rank}[{rank}] -> {(rank + 1) % 4}[{(rank + 1) % 4}] via {channel}",
    ]
    return {
        **{"rank": rank, "node_ip": "10.0.2.20", "pid": 4100 + rank, "started": "t", "joined": "t", "finished": "t"},
        **{"allreduce": [{"size_bytes": 1 << 20, "time_ms": 0.1}], "fsdp_losses": [10.0], "nccl_lines": lines},
    }


@pytest.mark.parametrize("channel", ["P2P/CUMEM/read", "NET/Libfabric/0/GDRDMA"])
def test_a_single_node_run_never_passes_expect_efa(channel):
    # It passed: the plugin's provider choice counted as the transport though all 4 ranks shared one node.
    reports: dict[int, dict | None] = {rank: single_node_report(rank, channel) for rank in range(4)}
    summary = summarize("nccl", 4, reports)
    assert summary.transport.kind == "inconclusive"
    with pytest.raises(StageFailure, match=r"transport is inconclusive, expected efa"):
        check_transport(summary, "efa")


def test_efa_channels_on_two_nodes_pass_expect_efa():
    line = "h:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA"
    verdict = transport_verdict("nccl", {"rank-0": [line], "rank-1": [line]}, {"10.0.2.20", "10.0.2.21"})
    assert verdict["kind"] == "efa"
    check_transport(with_transport(verdict), "efa")
    one_node = transport_verdict("nccl", {"rank-0": [line], "rank-1": [line]}, {"10.0.2.20"})
    assert one_node["kind"] == "inconclusive"
    assert one_node["evidence"][0] == (
        "every rank ran on one node (10.0.2.20; by Ray node IP, NODE_NAME unset: two pods on one instance would "
        "count as two nodes): no traffic crossed the network"
    )
    assert verdict["evidence"][1].startswith("ranks ran on 2 nodes (10.0.2.20, 10.0.2.21; by Ray node IP")


def ring_report(rank: int, node_name: str | None, node_ip: str) -> dict:
    """A finished rank of 8 on two g6.12xlarge nodes (4 GPUs, one EFA NIC each): a ring's middle ranks (local 1, 2)
    log efa selected, nNodes 2 and only SHM channels; the edge ranks a NET/Libfabric channel."""
    node, local = rank // 4, rank % 4
    host = f"ip-10-0-2-{20 + node}:{4100 + rank}:{4180 + rank} [{local}] NCCL INFO"
    nxt, prv = (rank + 1) % 8, (rank - 1) % 8
    lines = [
        f"{host} NET/OFI Selected provider is efa, fabric is efa (found 1 nics)",
        f"{host} comm 0x55d1 rank {rank} nRanks 8 nNodes 2 localRanks 4 localRank {local} MNNVL 0",
        f"{host} Channel 00/0 : {rank}[{local}] -> {nxt}[{nxt % 4}] "
        + ("[send] via NET/Libfabric/0" if nxt // 4 != node else "via SHM/direct/direct"),
    ]
    if prv // 4 != node:
        lines.append(f"{host} Channel 00/0 : {prv}[{prv % 4}] -> {rank}[{local}] [receive] via NET/Libfabric/0")
    return {
        **{"rank": rank, "node_ip": node_ip, "node_name": node_name, "pid": 4100 + rank},
        **{"started": "t", "joined": "t", "finished": "t", "fsdp_losses": [11.9], "nccl_lines": lines},
        "allreduce": [{"size_bytes": 1 << 20, "time_ms": 0.1}],
    }


def test_eight_ranks_on_two_efa_nodes_pass_expect_efa():
    # Ranks 1, 2, 5, 6 have no NET channel of their own: each was inconclusive, and a healthy run failed.
    reports: dict[int, dict | None] = {
        r: ring_report(r, f"ip-10-0-2-{20 + r // 4}.ec2.internal", f"10.0.2.{20 + r // 4}") for r in range(8)
    }
    summary = summarize("nccl", 8, reports)
    assert summary.transport.kind == "efa"
    assert "by Kubernetes node name" in summary.transport.evidence[1]
    check_transport(summary, "efa")


def test_nodes_are_counted_by_kubernetes_node_name_when_every_rank_has_one():
    # Two pods on one instance: two pod IPs, one node name. By IP it read as two nodes and passed expect efa.
    reports: dict[int, dict | None] = {
        r: ring_report(r, "ip-10-0-2-20.ec2.internal", f"10.0.2.{31 + r // 4}") for r in range(8)
    }
    summary = summarize("nccl", 8, reports)
    assert summary.transport.kind == "inconclusive"
    assert summary.transport.evidence[0].startswith(
        "every rank ran on one node (ip-10-0-2-20.ec2.internal; by Kubernetes node name)"
    )
    # One rank without NODE_NAME: the count falls back to IPs, and the evidence says so.
    reports[3] = {**(reports[3] or {}), "node_name": None}
    fallback = summarize("nccl", 8, reports)
    assert fallback.transport.kind == "efa" and "by Ray node IP, NODE_NAME unset" in fallback.transport.evidence[1]


def with_transport(verdict: dict) -> ConnectivitySummary:
    return ConnectivitySummary(
        backend="nccl",
        world_size=2,
        ranks=[],
        allreduce=[],
        fsdp=FsdpProbe(steps=0, losses=[]),
        transport=TransportVerdict.model_validate(verdict),
    )


def with_losses(losses: list[float]) -> ConnectivitySummary:
    return with_transport({"kind": "gloo", "evidence": []}).model_copy(
        update={"fsdp": FsdpProbe(steps=len(losses), losses=losses)}
    )


def test_unfinished_ranks_are_named():
    reports = {0: {"rank": 0, "finished": "t"}, 1: {"rank": 1, "started": "t", "joined": "t"}, 2: None}
    with pytest.raises(StageFailure) as info:
        check_ranks(with_losses([4.8]), reports, "TrainingFailedError: worker died")
    assert info.value.cause == (
        "2 of 3 ranks did not finish: rank 1 (joined, not finished), rank 2 (no rank report); "
        "trainer: TrainingFailedError: worker died"
    )


def test_non_finite_fsdp_loss_fails():
    with pytest.raises(StageFailure, match="not finite"):
        check_ranks(with_losses([4.8, float("nan")]), {0: {"finished": "t"}}, None)
