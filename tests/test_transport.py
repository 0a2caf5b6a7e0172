"""NCCL log classification over realistic NCCL_DEBUG=INFO (INIT,NET) logs."""

from __future__ import annotations

import pytest

from tuneproof.core.transport import (
    GLOO_EVIDENCE,
    classify,
    classify_sources,
    combine,
    meets,
    verdict_for_files,
)


def classify_text(text: str) -> dict:
    return classify(text.splitlines())


BANNER = """\
ip-10-0-1-5:4121:4121 [0] NCCL INFO Bootstrap : Using eth0:10.0.1.5<0>
ip-10-0-1-5:4121:4121 [0] NCCL INFO cudaDriverVersion 13000
ip-10-0-1-5:4121:4121 [0] NCCL INFO NCCL version 2.29.7+cuda13.0
ip-10-0-1-5:4121:4121 [0] NCCL INFO NCCL_SOCKET_IFNAME set by environment to eth0
"""

EFA_LOG = (
    BANNER
    + """\
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v10)
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.20.0
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Using Libfabric version 2.1
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Using CUDA driver version 13000 with runtime 13000
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 4 nics)
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI GUID for dev[0]: 00000000000000000a0001050000001c
ip-10-0-1-5:4121:4180 [0] NCCL INFO Using network Libfabric
ip-10-0-1-5:4121:4180 [0] NCCL INFO comm 0x55d1 rank 0 nRanks 2 nNodes 2 localRanks 1 localRank 0 MNNVL 0
ip-10-0-1-5:4121:4180 [0] NCCL INFO Channel 00/0 : 1[0] -> 0[0] [receive] via NET/Libfabric/0/GDRDMA
ip-10-0-1-5:4121:4180 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA
ip-10-0-1-5:4121:4180 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 1
"""
)

SOCKET_LOG = (
    BANNER
    + """\
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/Plugin: Loaded net plugin Libfabric (v10)
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.20.0
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI No eligible providers were found
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/Plugin: Failed to initialize net plugin Libfabric (v10), falling back
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/IB : No device found.
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/Socket : Using [0]eth0:10.0.1.5<0>
ip-10-0-1-5:4121:4180 [0] NCCL INFO Using network Socket
ip-10-0-1-5:4121:4180 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Socket/0
"""
)

# A single-node run: every channel is intra-node, no NET transport decides anything.
INTRA_NODE_LOG = (
    BANNER
    + """\
ip-10-0-1-5:4121:4180 [0] NCCL INFO comm 0x55d1 rank 0 nRanks 2 nNodes 1 localRanks 2 localRank 0 MNNVL 0
ip-10-0-1-5:4121:4180 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
ip-10-0-1-5:4121:4180 [0] NCCL INFO Connected all rings, use ring PXN 0 GDR 0
"""
)


def test_efa_selected_provider_and_libfabric_channels():
    verdict = classify_text(EFA_LOG)
    assert verdict["kind"] == "efa"
    assert "via NET/Libfabric" in verdict["evidence"][0]  # the deciding line first
    assert any("Selected provider is efa" in line for line in verdict["evidence"])
    assert any("via NET/Libfabric" in line for line in verdict["evidence"])
    assert not any("Bootstrap" in line for line in verdict["evidence"])


def test_efa_older_plugin_wording():
    assert classify(["x:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[0] [send] via NET/AWS Libfabric/0"])["kind"] == "efa"
    assert classify(["x:1:1 [0] NCCL INFO Channel 00 : 0[0] -> 1[0] [send] via NET/OFI/0"])["kind"] == "efa"


# A single-node run with aws-ofi-nccl loaded: the plugin picks efa, every channel is P2P.
SINGLE_NODE_LOG = (
    BANNER
    + """\
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.20.0
ip-10-0-1-5:4121:4180 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa (found 4 nics)
ip-10-0-1-5:4121:4180 [0] NCCL INFO Using network Libfabric
ip-10-0-1-5:4121:4180 [0] NCCL INFO comm 0x55d1 rank 0 nRanks 4 nNodes 1 localRanks 4 localRank 0 MNNVL 0
ip-10-0-1-5:4121:4180 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
"""
)


def test_the_plugin_choosing_efa_is_not_efa_traffic():
    # It read efa and passed --expect efa: 'Selected provider is efa' is logged on a single node too.
    verdict = classify_text(SINGLE_NODE_LOG)
    assert verdict["kind"] == "inconclusive"
    assert "no channel ran over NET/Libfabric or NET/OFI" in verdict["evidence"][0]
    assert any("Selected provider is efa" in line for line in verdict["evidence"])
    assert classify(["x:1:1 [0] NCCL INFO NET/OFI Selected Provider is efa (found 4 nics)"])["kind"] == "inconclusive"
    assert verdict_for_files({"single-node.log": SINGLE_NODE_LOG}, expect="efa")["ok"] is False


def test_net_channels_within_one_node_are_not_efa_traffic():
    # NCCL_P2P_DISABLE/NCCL_SHM_DISABLE route a single node's channels through the plugin: nothing left the node.
    log = SINGLE_NODE_LOG.replace("via P2P/CUMEM/read", "[send] via NET/Libfabric/0/GDRDMA")
    verdict = classify_text(log)
    assert verdict["kind"] == "inconclusive"
    assert verdict["evidence"][0] == "NET channels, but every communicator has nNodes 1: nothing left the node"
    assert classify_text(EFA_LOG)["kind"] == "efa"  # nNodes 2


def test_socket_fallback_after_ofi_failure():
    verdict = classify_text(SOCKET_LOG)
    assert verdict["kind"] == "socket-fallback"
    assert any("No eligible providers" in line for line in verdict["evidence"])
    assert any("NET/Socket : Using [0]eth0" in line for line in verdict["evidence"])


@pytest.mark.parametrize(
    "line",
    [
        "h:1:1 [0] NCCL INFO NET/OFI aws-ofi-nccl initialization failed",
        "h:1:1 [0] NCCL WARN Failed to initialize any NET plugin",
        "h:1:1 [0] NCCL INFO NET/OFI Selected provider is tcp, fabric is 10.0.0.0/16 (found 1 nics)",
    ],
)
def test_each_fallback_sign_alone(line):
    assert classify([line])["kind"] == "socket-fallback"


def test_socket_line_wins_over_efa_lines():
    verdict = classify_text(EFA_LOG + "ip-10-0-1-6:77:90 [0] NCCL INFO Using network Socket\n")
    assert verdict["kind"] == "socket-fallback"
    assert verdict["evidence"] == ["ip-10-0-1-6:77:90 [0] NCCL INFO Using network Socket"]


def test_bootstrap_interface_is_not_a_fallback():
    verdict = classify_text(BANNER)
    assert verdict["kind"] == "inconclusive"
    assert verdict["evidence"] == ["no NCCL transport line among 4 lines"]


def test_intra_node_only_is_inconclusive():
    assert classify_text(INTRA_NODE_LOG)["kind"] == "inconclusive"


def test_gloo_marker():
    verdict = classify([f"[tuneproof] transport: {GLOO_EVIDENCE}"])
    assert verdict == {"kind": "gloo", "evidence": [f"[tuneproof] transport: {GLOO_EVIDENCE}"]}


def test_meets():
    assert meets("efa", "efa") and meets("socket-fallback", "any") and meets("gloo", "gloo")
    assert not meets("socket-fallback", "efa")
    assert not meets("inconclusive", "efa")
    assert not meets("gloo", "efa")
    with pytest.raises(ValueError, match="'nccl'"):
        meets("efa", "nccl")


def test_combine_worst_wins():
    efa, sock, inc = classify_text(EFA_LOG), classify_text(SOCKET_LOG), classify_text(INTRA_NODE_LOG)
    assert combine({"rank-0": efa, "rank-1": efa})["kind"] == "efa"
    mixed = combine({"rank-0": efa, "rank-1": sock})
    assert mixed["kind"] == "socket-fallback"
    assert mixed["evidence"][0].startswith("rank-1: ")
    assert "rank-0: efa" in mixed["evidence"]
    assert combine({"rank-0": efa, "rank-1": inc})["kind"] == "inconclusive"


def test_verdict_for_files_document():
    doc = verdict_for_files({"nccl.a.1.log": EFA_LOG, "nccl.b.2.log": SOCKET_LOG}, expect="efa")
    assert doc["verdict"] == "socket-fallback"
    assert doc["ok"] is False
    assert doc["expect"] == "efa"
    assert doc["files"] == [
        {"name": "nccl.a.1.log", "kind": "efa"},
        {"name": "nccl.b.2.log", "kind": "socket-fallback"},
    ]
    assert all(line.startswith(("nccl.b.2.log: ", "nccl.a.1.log: efa")) for line in doc["evidence"])
    assert verdict_for_files({"only.log": EFA_LOG}, expect="efa")["ok"] is True


def test_a_gzipped_log_that_expands_past_the_limit_is_refused_not_judged_on_its_first_part(monkeypatch):
    # It was cut at the limit without a word: "no NCCL transport line among 268168 lines" for a 500 MB log.
    import gzip

    from tuneproof.core import transport

    monkeypatch.setattr(transport, "MAX_LOG_BYTES", 1000)
    line = b"NET/OFI Selected provider is efa\n"
    assert "efa" in transport.decode_log(gzip.compress(line * 30))  # 990 bytes: read whole
    with pytest.raises(ValueError, match="expands past 1,000 bytes, more than a log is read to"):
        transport.decode_log(gzip.compress(line * 31))


def test_every_member_of_a_concatenated_gzip_is_read():
    # `cat a.gz b.gz` is one file to zcat: the fallback in the second member was not read, and the log read efa.
    import gzip

    from tuneproof.core.transport import decode_log

    text = decode_log(gzip.compress(EFA_LOG.encode()) + gzip.compress(SOCKET_LOG.encode()))
    assert text == EFA_LOG + SOCKET_LOG
    assert classify_text(text)["kind"] == "socket-fallback"
    assert decode_log(gzip.compress(EFA_LOG.encode()) + b"\x00" * 8) == EFA_LOG  # zero padding after the last


def test_a_truncated_gzip_is_refused_not_judged_on_what_arrived():
    import gzip

    from tuneproof.core.transport import decode_log

    whole = gzip.compress((EFA_LOG + SOCKET_LOG).encode())
    with pytest.raises(ValueError, match="gzip stream ends before its end marker"):
        decode_log(whole[: len(whole) - 12])


def test_the_size_limit_counts_every_member(monkeypatch):
    import gzip

    from tuneproof.core import transport

    monkeypatch.setattr(transport, "MAX_LOG_BYTES", 1000)
    member = gzip.compress(b"x" * 600)
    assert len(transport.decode_log(member)) == 600
    with pytest.raises(ValueError, match="expands past 1,000 bytes"):
        transport.decode_log(member + member)


def ring_rank_log(rank: int, nodes: int = 2, nnodes: int = 2, middle_channel: str = "SHM/direct/direct") -> list[str]:
    """Rank `rank` of a ring over `nodes` g6.12xlarge nodes (4 GPUs, one EFA NIC each): as NCCL logs it, only its
    own connections, so only the ranks at a node's edge have a NET/Libfabric channel."""
    node, local, world = rank // 4, rank % 4, 4 * nodes
    host = f"ip-10-0-2-{20 + node}:{4100 + rank}:{4180 + rank} [{local}] NCCL INFO"
    lines = [
        f"{host} Bootstrap : Using eth0:10.0.2.{20 + node}<0>",
        f"{host} NET/OFI Selected provider is efa, fabric is efa (found 1 nics)",
        f"{host} Using network Libfabric",
        f"{host} comm 0x55d1 rank {rank} nRanks {world} nNodes {nnodes} localRanks 4 localRank {local} MNNVL 0",
    ]
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    if nxt // 4 != node:
        lines.append(f"{host} Channel 00/0 : {rank}[{local}] -> {nxt}[{nxt % 4}] [send] via NET/Libfabric/0")
    else:
        lines.append(f"{host} Channel 00/0 : {rank}[{local}] -> {nxt}[{nxt % 4}] via {middle_channel}")
    if prv // 4 != node:
        lines.append(f"{host} Channel 00/0 : {prv}[{prv % 4}] -> {rank}[{local}] [receive] via NET/Libfabric/0")
    return lines


def test_a_ring_s_middle_ranks_support_the_efa_of_its_edge_ranks():
    # 8 ranks on 2 nodes: ranks 1, 2, 5, 6 log efa selected, nNodes 2 and SHM only; they made the run inconclusive.
    ranks = {f"rank-{r}": ring_rank_log(r) for r in range(8)}
    assert classify(ranks["rank-1"])["kind"] == "inconclusive"  # alone, a middle rank proves nothing
    verdict = classify_sources(ranks)
    assert verdict["kind"] == "efa"
    assert "via NET/Libfabric" in verdict["evidence"][0]
    assert any(line.startswith("rank-5: no NET channel of its own") for line in verdict["evidence"])
    files = {f"nccl.{name}.log": "\n".join(lines) for name, lines in ranks.items()}
    doc = verdict_for_files(files, expect="efa")
    assert doc["verdict"] == "efa" and doc["ok"] is True
    assert {f["kind"] for f in doc["files"]} == {"efa", "inconclusive"}  # each file's own verdict stays


def test_only_middle_ranks_are_not_efa():
    ranks = {f"rank-{r}": ring_rank_log(r) for r in (1, 2, 5, 6)}
    assert classify_sources(ranks)["kind"] == "inconclusive"


@pytest.mark.parametrize(
    ("change", "kind"),
    [
        (lambda lines: [], "inconclusive"),  # a rank with no NCCL line is missing evidence, never a pass
        (lambda lines: [line.replace("nNodes 2", "nNodes 1") for line in lines], "inconclusive"),
        (lambda lines: [line for line in lines if "comm 0x" not in line], "inconclusive"),  # nNodes unknown
        (lambda lines: [*lines, "h:1:1 [1] NCCL INFO Channel 01/0 : 1[1] -> 5[1] [send] via NET/IB/0"], "inconclusive"),
        (
            lambda lines: [line for line in lines if "Selected provider" not in line and "Using network" not in line],
            "inconclusive",
        ),
        (lambda lines: [*lines, "h:1:1 [1] NCCL INFO Using network Socket"], "socket-fallback"),
        (lambda lines: [line.replace("provider is efa", "provider is tcp") for line in lines], "socket-fallback"),
    ],
)
def test_a_middle_rank_supports_efa_only_when_it_chose_efa_across_nodes(change, kind):
    ranks = {f"rank-{r}": ring_rank_log(r) for r in range(8)}
    ranks["rank-1"] = change(ranks["rank-1"])
    verdict = classify_sources(ranks)
    assert verdict["kind"] == kind
    if kind == "inconclusive":  # the rank that blocks it first, not the ring members beside it
        assert verdict["evidence"][0].startswith("rank-1: ")
        assert not any(line.startswith("rank-2: aws-ofi-nccl") for line in verdict["evidence"])


def test_bootstrap_lines_stay_ignored_in_a_job():
    ranks = {f"rank-{r}": ring_rank_log(r) for r in range(8)}
    assert all("Bootstrap" not in line for line in classify_sources(ranks)["evidence"])
