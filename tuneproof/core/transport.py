"""Which transport carried NCCL's inter-node traffic, read from NCCL debug logs (pure, no I/O).

Input: lines written with NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=INIT,NET (one file per process
with NCCL_DEBUG_FILE). Output: one verdict with the lines that decided it:

- efa: channels run over NET/OFI / NET/(AWS) Libfabric, i.e. traffic crossed the network through
  aws-ofi-nccl (the plugin's provider lines are kept beside them as evidence);
- socket-fallback: NCCL used its internal socket transport, or the OFI plugin failed to initialise
  (NCCL then falls back to sockets), or libfabric picked a TCP provider instead of efa;
- inconclusive: no line decides it (e.g. a single-node run whose channels are all P2P/SHM, or IB). The
  plugin selecting efa ("Selected provider is efa", "Using network Libfabric") is not enough: NCCL loads
  and initialises it on a single node too, where no channel uses the network; nor are NET channels
  whose communicators all report nNodes 1;
- gloo: the run used torch's gloo backend (CPU); the connectivity stage writes GLOO_EVIDENCE.

A socket line wins over efa lines: some process fell back, and that is what one must see.
"Bootstrap : Using eth0:..." names the out-of-band bootstrap interface, which NCCL always uses
for rendezvous; it says nothing about the data transport and is ignored.

A job is judged over all its ranks (`classify_sources`), not rank by rank: each NCCL rank logs only
its own connections, and in a ring over nodes with one NIC each only the ranks at a node's edge
have a NET channel; the middle ranks (on g6.12xlarge local ranks 1 and 2) log the plugin choosing
efa, nNodes 2 and P2P/SHM channels only. Such a rank supports an efa verdict that another rank's
NET/Libfabric channels decide; alone it stays inconclusive, and a rank with no NCCL line fails it.

Used by the connectivity stage (per rank) and by `tuneproof transport LOG...` (per file).
"""

from __future__ import annotations

import re
import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from tuneproof.core.files import UTF16_BOMS, decode_text

EXPECTATIONS = ("any", "gloo", "efa")
GLOO_EVIDENCE = "backend gloo (CPU)"
NCCL_LOG_ROOT = "/tmp/tuneproof-nccl"
MAX_EVIDENCE = 20
"""Evidence lines kept per verdict: channel lines repeat for every channel and peer."""
MAX_LOG_BYTES = 256 << 20
"""A log, or what a gzipped one expands to, is read up to this size: a larger one is not read whole."""

_SOCKET = [
    re.compile(r"NET/Socket\s*:\s*Using"),
    re.compile(r"Using network Socket\b"),
    re.compile(r"via NET/Socket"),
    re.compile(r"NET/OFI No eligible providers"),
    re.compile(r"NET/OFI aws-ofi-nccl initialization failed"),
    re.compile(r"Failed to initialize any NET plugin"),
    re.compile(r"NET/OFI Unable to find a protocol that worked"),
    # libfabric over TCP is a socket transport under another name.
    re.compile(r"NET/OFI Selected [Pp]rovider is (tcp|sockets|udp)\b"),
]
_EFA_CHANNEL = [
    re.compile(r"via NET/(AWS )?Libfabric"),
    re.compile(r"via NET/OFI"),
]
"""A channel that runs over aws-ofi-nccl: traffic that crossed the network over it."""
_EFA_SELECTED = [
    re.compile(r"NET/OFI Selected [Pp]rovider is efa\b"),
    re.compile(r"Using network (AWS )?Libfabric\b"),
]
"""The plugin chose efa: logged on a single node too, so evidence only beside an _EFA_CHANNEL line."""
_NET_CHANNEL = re.compile(r"via NET/")
"""Any channel over a network plugin; one not matched above (NET/IB, ...) is not aws-ofi-nccl's."""
_NODES = re.compile(r"\bnNodes (\d+)\b")
"""A communicator's init line: 'comm 0x.. rank 0 nRanks 16 nNodes 2 localRanks 8 ...'."""


def nccl_env(submission_id: str) -> dict[str, str]:
    """Job env vars that make NCCL log its transport choice to one file per host and process."""
    return {
        "NCCL_DEBUG": "INFO",
        "NCCL_DEBUG_SUBSYS": "INIT,NET",
        "NCCL_DEBUG_FILE": f"{NCCL_LOG_ROOT}/{submission_id}/nccl.%h.%p.log",
    }


@dataclass
class LogFacts:
    """The transport lines of one source (a rank's or a file's log), sorted by what they say."""

    socket: list[str] = field(default_factory=list)
    channels: list[str] = field(default_factory=list)
    """Channels over aws-ofi-nccl (_EFA_CHANNEL)."""
    other_net: list[str] = field(default_factory=list)
    """Channels over another network plugin (NET/IB, ...)."""
    selected: list[str] = field(default_factory=list)
    gloo: list[str] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    """nNodes of every communicator this source initialised."""
    seen: int = 0


def read_facts(lines: Iterable[str]) -> LogFacts:
    facts = LogFacts()
    for raw in lines:
        line = raw.strip()
        facts.seen += 1
        if _matches(_SOCKET, line):
            facts.socket.append(line)
        elif _matches(_EFA_CHANNEL, line):
            facts.channels.append(line)
        elif _NET_CHANNEL.search(line):
            facts.other_net.append(line)
        elif _matches(_EFA_SELECTED, line):
            facts.selected.append(line)
        elif GLOO_EVIDENCE in line:
            facts.gloo.append(line)
        if match := _NODES.search(line):
            facts.nodes.append(int(match.group(1)))
    return facts


def classify(lines: Iterable[str]) -> dict:
    """{"kind": efa, socket-fallback, inconclusive or gloo, "evidence": [the lines that decided it]} for one log's lines."""
    return _decide(read_facts(lines))


def _decide(facts: LogFacts) -> dict:
    if facts.socket:
        return _verdict("socket-fallback", facts.socket)
    channels = facts.channels
    # The deciding channel line first, then the plugin's choice: channel lines repeat past the evidence cap.
    efa = [*channels[:1], *facts.selected, *channels[1:]]
    if channels and facts.nodes and max(facts.nodes) == 1:
        return _verdict(
            "inconclusive", ["NET channels, but every communicator has nNodes 1: nothing left the node", *efa]
        )
    if channels:
        return _verdict("efa", efa)
    if facts.selected:
        why = "aws-ofi-nccl selected efa, but no channel ran over NET/Libfabric or NET/OFI (a single node uses P2P/SHM)"
        return _verdict("inconclusive", [why, *facts.selected])
    if facts.gloo:
        return _verdict("gloo", facts.gloo)
    return {"kind": "inconclusive", "evidence": [f"no NCCL transport line among {facts.seen} lines"]}


def _ring_member(facts: LogFacts) -> str | None:
    """Why a rank without a NET channel of its own still supports efa, or None when it does not.

    It does when its plugin chose efa inside a communicator that spans nodes, and it logged no socket line and
    no NET channel at all: its traffic left the node through a neighbour rank's NET/Libfabric channel. A rank
    with a NET channel of another kind (NET/IB) or none of these lines does not."""
    if facts.socket or facts.channels or facts.other_net or not facts.selected or max(facts.nodes, default=0) < 2:
        return None
    return (
        f"no NET channel of its own (P2P/SHM to ranks on its node); aws-ofi-nccl selected efa in a communicator "
        f"of nNodes {max(facts.nodes)}: {facts.selected[0]}"
    )


def decode_log(data: bytes) -> str:
    """A log file's text: gunzipped when gzipped (at most MAX_LOG_BYTES of it), UTF-16 when it starts with
    a byte-order mark or reads as UTF-16 (PowerShell's `>` writes it), else UTF-8; undecodable bytes
    become U+FFFD rather than an error. ValueError for a corrupt or truncated gzip stream, or one that expands
    past MAX_LOG_BYTES."""
    if data[:2] == b"\x1f\x8b":
        data = _gunzip(data)
    head = data[:4096]
    # ASCII text as UTF-16-LE without a byte-order mark: every other byte NUL
    if not data.startswith(UTF16_BOMS) and len(head) >= 4 and head[1::2].count(0) > len(head) // 4:
        return data.decode("utf-16-le", errors="replace")
    return decode_text(data, errors="replace")


def _gunzip(data: bytes) -> bytes:
    """Every member of a gzip file (`cat a.gz b.gz` is one file to zcat, and a fallback can sit in the second),
    at most MAX_LOG_BYTES in all; a stream cut before its end is refused, as zcat refuses it."""
    members: list[bytes] = []
    size, rest = 0, data
    while rest:
        # wbits 16+: the gzip header; max_length bounds what a small file can expand to (a gzip bomb).
        gunzip = zlib.decompressobj(16 + zlib.MAX_WBITS)
        try:
            members.append(gunzip.decompress(rest, MAX_LOG_BYTES - size + 1))
        except zlib.error as e:
            raise ValueError(f"starts like gzip but is not readable gzip ({e})") from None
        size += len(members[-1])
        if size > MAX_LOG_BYTES or gunzip.unconsumed_tail:
            # Refused like an uncompressed log past the size: a verdict on its first part would read as the whole's.
            raise ValueError(
                f"expands past {MAX_LOG_BYTES:,} bytes, more than a log is read to: pass the part with NCCL's "
                "start-up lines (e.g. `zcat LOG | head -c 100M > part.log`)"
            )
        if not gunzip.eof:
            raise ValueError("gzip stream ends before its end marker (truncated: copied or downloaded in part?)")
        # gzip pads some files with zeros after the last member; zcat ignores them too.
        rest = gunzip.unused_data.lstrip(b"\x00")
    return b"".join(members)


def meets(kind: str, expect: str) -> bool:
    """'any' accepts every verdict; 'efa' only efa; 'gloo' only gloo."""
    if expect not in EXPECTATIONS:
        raise ValueError(f"transport expectation must be one of {EXPECTATIONS}, got {expect!r}")
    return expect == "any" or kind == expect


def combine(verdicts: dict[str, dict]) -> dict:
    """One verdict for several sources (ranks, files), worst wins: socket-fallback > inconclusive > efa.

    Sources that disagree without a socket fallback (efa beside inconclusive, gloo beside efa)
    are inconclusive. Evidence lines are prefixed with their source's name. A job's ranks are judged
    with `classify_sources`, which knows that a ring's middle ranks log no NET channel.
    """
    kinds = {v["kind"] for v in verdicts.values()}
    if "socket-fallback" in kinds:
        kind = "socket-fallback"
    elif len(kinds) == 1:
        (kind,) = kinds
    else:
        kind = "inconclusive"
    if not verdicts:
        return classify([])
    deciding, others = [], []
    for name, verdict in verdicts.items():
        if verdict["kind"] == kind:
            deciding += [f"{name}: {line}" for line in verdict["evidence"]]
        else:
            others.append(f"{name}: {verdict['kind']}")
    # The deciding lines first, so the evidence cap never hides them.
    return _verdict(kind, deciding + others)


def classify_sources(lines_by_source: Mapping[str, Iterable[str]]) -> dict:
    """One verdict for a job's sources (one log per rank or per file), as `combine`, except that efa beside
    inconclusive is efa when every inconclusive source is a ring member (`_ring_member`): the ranks at a node's
    edge carry its traffic over NET/Libfabric, the others only reach them over P2P/SHM."""
    return _judge({name: read_facts(lines) for name, lines in lines_by_source.items()})[0]


def _judge(facts_by_source: dict[str, LogFacts]) -> tuple[dict, dict[str, dict]]:
    """(the job's verdict, each source's own verdict)."""
    per_source = {name: _decide(facts) for name, facts in facts_by_source.items()}
    overall = combine(per_source)
    deciding = [name for name, verdict in per_source.items() if verdict["kind"] == "efa"]
    if overall["kind"] != "inconclusive" or not deciding:
        return overall, per_source
    members = {
        name: _ring_member(facts_by_source[name]) for name, verdict in per_source.items() if verdict["kind"] != "efa"
    }
    blocking = [name for name, why in members.items() if why is None]
    if blocking:
        # Inconclusive because of these sources alone: their lines first, the ring members are not the cause.
        lines = [f"{name}: {line}" for name in blocking for line in per_source[name]["evidence"]]
        others = [f"{name}: {per_source[name]['kind']}" for name in per_source if name not in blocking]
        return _verdict("inconclusive", [*lines, *others]), per_source
    # The first deciding channel line, then why each other rank counts, then the rest of the efa lines.
    efa_lines = [f"{name}: {line}" for name in deciding for line in per_source[name]["evidence"]]
    notes = [f"{name}: {why}" for name, why in members.items()]
    return _verdict("efa", [*efa_lines[:1], *notes, *efa_lines[1:]]), per_source


def verdict_for_files(texts: dict[str, str], expect: str = "any") -> dict:
    """The `tuneproof transport` document for log files given as name -> text (one file per rank/process, as
    NCCL_DEBUG_FILE writes them, or one job log): each file's own verdict and the job's (`classify_sources`)."""
    overall, per_file = _judge({name: read_facts(text.splitlines()) for name, text in texts.items()})
    return {
        "verdict": overall["kind"],
        "evidence": overall["evidence"],
        "files": [{"name": name, "kind": v["kind"]} for name, v in per_file.items()],
        "expect": expect,
        "ok": meets(overall["kind"], expect),
    }


def _matches(patterns: list[re.Pattern], line: str) -> bool:
    return any(p.search(line) for p in patterns)


def _verdict(kind: str, lines: list[str]) -> dict:
    unique = list(dict.fromkeys(lines))
    return {"kind": kind, "evidence": unique[:MAX_EVIDENCE]}
