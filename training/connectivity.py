"""The connectivity stage: every rank starts, joins collectives and finishes; bandwidth; transport.

Runs as a Ray job: `python -m training.connectivity` with TUNEPROOF_JOB set. On GPU the
submitting task adds nccl_env(<run>-connectivity) to the job's env, so each NCCL process logs
INIT and NET lines to its own file under /tmp/tuneproof-nccl/<submission id>/ and only this job's
logs are read.

A TorchTrainer (nccl on GPU, gloo on CPU) runs `rank_main` on train.num_workers workers: an
all-reduce sweep over connectivity.sizes_bytes, then a few FSDP2 steps of the configured model
architecture on random tokens. Each rank writes runs/<run>/stages/<job>/rank-<r>.json as it goes
(started, joined, finished), because Ray Train's Result.metrics can be None; the driver reads them,
classifies the transport and fails the stage as infrastructure when a rank did not finish or the
transport does not meet connectivity.expect_transport.
"""

from __future__ import annotations

import glob
import math
import os
import time
from typing import TYPE_CHECKING, Any

from training.jobkit import JobContext, encode_job, load_context, log, run_stage, worker_reads_saved
from tuneproof.core import transport
from tuneproof.core.config import PipelineConfig
from tuneproof.core.envelope import ENV_VAR
from tuneproof.core.results import StageFailure, error_line, now_iso
from tuneproof.core.storage import Storage
from tuneproof.core.summaries import AllreduceRow, ConnectivitySummary, FsdpProbe, RankStatus, TransportVerdict

if TYPE_CHECKING:  # torch is imported inside the functions the ranks run, as before
    import torch

MAX_NCCL_LINES = 2000
"""NCCL lines a rank keeps: the transport is decided during the first communicator's init."""
NODE_NAME_ENV = "NODE_NAME"
"""The Kubernetes node a rank's pod runs on: deployments/raycluster.yaml sets it from spec.nodeName."""
BY_NODE_NAME = "Kubernetes node name"
BY_NODE_IP = "Ray node IP, NODE_NAME unset: two pods on one instance would count as two nodes"
FSDP_BATCH, FSDP_SEQ_LEN = 4, 32


def connectivity(ctx: JobContext) -> ConnectivitySummary:
    cfg = ctx.config
    backend = "nccl" if cfg.train.use_gpu else "gloo"
    clear_rank_reports(ctx)
    log(f"connectivity: {cfg.train.num_workers} workers, backend {backend}")
    fit_error = run_trainer(ctx, backend)
    reports = read_rank_reports(ctx, cfg.train.num_workers)
    summary = summarize(backend, cfg.train.num_workers, reports)
    check_ranks(summary, reports, fit_error)
    check_transport(summary, cfg.connectivity.expect_transport)
    verdict = summary.transport
    # The evidence goes into the job log too, so `tuneproof transport <job log>` finds it there.
    log(
        f"connectivity: transport {verdict.kind} ({verdict.evidence[0]}); "
        f"largest all-reduce busbw {summary.allreduce[-1].busbw_GBps:.3f} GB/s"
    )
    return summary


def clear_rank_reports(ctx: JobContext) -> None:
    """A retried job reuses the stage prefix: never read a previous attempt's rank files."""
    for name in ctx.storage.listdir(*ctx.stage_parts()):
        if name.startswith("rank-") and name.endswith(".json"):
            ctx.storage.remove(*ctx.stage_parts(name))


def run_trainer(ctx: JobContext, backend: str) -> str | None:
    """Run the workers; returns the trainer's error as one line, or None."""
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    cfg = ctx.config
    filesystem, storage_path = ctx.storage.train_storage(*ctx.run_parts("train"))
    run_config = RunConfig(
        name=f"{ctx.run_id}-{ctx.job}",
        storage_path=storage_path,
        **({"storage_filesystem": filesystem} if filesystem is not None else {}),
    )
    trainer = TorchTrainer(
        rank_main,
        train_loop_config={"job": encode_job(ctx.run_id, ctx.job, cfg)},
        torch_config=TorchConfig(backend=backend),
        scaling_config=ScalingConfig(num_workers=cfg.train.num_workers, use_gpu=cfg.train.use_gpu),
        run_config=run_config,
    )
    try:
        trainer.fit()
    except Exception as e:  # noqa: BLE001 - the rank reports say which rank; keep the error as evidence
        log(f"connectivity: trainer failed: {type(e).__name__}: {e}")
        return error_line(e)
    return None


# ---------------------------------------------------------------- per worker (inside Ray Train)


def rank_main(loop_config: dict) -> None:
    """One rank under Ray Train: its story, with the settings it read saved for the job's result."""
    from ray import train

    ctx = load_context({ENV_VAR: loop_config["job"]}, forwarded=False)  # runs no user code: no secrets needed
    context = train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    with worker_reads_saved(ctx, rank):
        rank_story(ctx, rank, world)


def rank_story(ctx: JobContext, rank: int, world: int) -> None:
    """One rank's story: started -> joined (first barrier) -> all-reduce sweep -> FSDP steps -> finished."""
    import ray
    import torch.distributed as dist

    from training.fsdp import worker_device

    cfg = ctx.config
    report = RankReport(ctx.storage, list(ctx.stage_parts()), rank)
    report.update(
        rank=rank,
        world_size=world,
        node_ip=ray.util.get_node_ip_address(),
        node_name=os.environ.get(NODE_NAME_ENV) or None,  # Ray's node IP is the pod's: it cannot tell instances apart
        pid=os.getpid(),
        started=now_iso(),
        joined=None,
        finished=None,
    )
    prepare_nccl_log_dir()  # before the first collective: NCCL opens its debug file then
    device = worker_device(cfg.train.use_gpu)
    dist.barrier()
    report.update(joined=now_iso())
    conn = cfg.connectivity
    try:
        sweep = allreduce_sweep(conn.sizes_bytes, conn.warmup_iters, conn.iters, device, world)
    except AllreduceWrong as e:
        report.update(error=str(e))  # the driver names it: the trainer's error may be another rank's
        raise
    report.update(allreduce=sweep)
    report.update(fsdp_losses=fsdp_losses(cfg, device, conn.fsdp_steps, rank))
    report.update(nccl_lines=own_nccl_lines(), finished=now_iso())


class RankReport:
    """rank-<r>.json under the stage prefix, rewritten whole on every update."""

    def __init__(self, storage: Storage, parts: list[str], rank: int):
        self.storage, self.parts = storage, [*parts, f"rank-{rank}.json"]
        self.doc: dict[str, Any] = {}

    def update(self, **fields: Any) -> None:
        self.doc.update(fields)
        self.storage.write_json(self.doc, *self.parts)


def prepare_nccl_log_dir() -> None:
    """NCCL silently logs to stdout when NCCL_DEBUG_FILE's directory does not exist."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if pattern:
        os.makedirs(os.path.dirname(pattern), exist_ok=True)


def own_nccl_lines() -> list[str]:
    """This process's NCCL debug lines (the file NCCL_DEBUG_FILE names for our pid)."""
    pattern = os.environ.get("NCCL_DEBUG_FILE")
    if not pattern:
        return []
    lines: list[str] = []
    for path in sorted(glob.glob(pattern.replace("%h", "*").replace("%p", str(os.getpid())))):
        with open(path, errors="replace") as f:
            lines += f.read().splitlines()
    return lines[:MAX_NCCL_LINES]


class AllreduceWrong(RuntimeError):
    """An all-reduce of known inputs did not give their sum: its timing measured something else."""


EXACT_FLOAT32 = 2**24
"""Integers up to this are exact in float32: ones summed again and again stay exact while the total is below it."""


def allreduce_sweep(sizes_bytes: list[int], warmup: int, iters: int, device: torch.device, world: int) -> list[dict]:
    """Mean time of one float32 all-reduce per size. Each size's sums are checked: the first call's (ones sum to
    world); the timed calls' (the tensor then holds world**calls, checked while float32 holds that exactly); and,
    after the timing, one more call on fresh ones. A collective that returned early or wrong while it was timed
    raises AllreduceWrong instead of recording its speed."""
    import torch
    import torch.distributed as dist

    rows = []
    for size in sizes_bytes:
        tensor = torch.ones(size // 4, dtype=torch.float32, device=device)
        dist.all_reduce(tensor)
        check_sum(tensor, world, size, world, "the first call")
        for _ in range(warmup):
            dist.all_reduce(tensor)
        _synchronize(device)
        dist.barrier()
        start = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(tensor)
        _synchronize(device)
        time_ms = (time.perf_counter() - start) / iters * 1e3
        calls = 1 + warmup + iters
        if world**calls <= EXACT_FLOAT32:
            check_sum(tensor, world**calls, size, world, f"after the warmup and timed calls ({calls} in all)")
        tensor.fill_(1)
        dist.all_reduce(tensor)
        check_sum(tensor, world, size, world, "a call on fresh ones after the timed calls")
        rows.append({"size_bytes": size, "time_ms": time_ms})
        dist.barrier()
    return rows


def check_sum(tensor: torch.Tensor, expected: int, size: int, world: int, when: str) -> None:
    """AllreduceWrong naming the size, this rank, the first wrong value and the expected one."""
    import torch.distributed as dist

    wrong = tensor != expected
    if bool(wrong.any()):
        seen = float(tensor[wrong][0])
        raise AllreduceWrong(
            f"all-reduce of ones at {size} bytes over {world} ranks gave a wrong sum on rank {dist.get_rank()} "
            f"({when}): {int(wrong.sum())} of {tensor.numel()} elements wrong, e.g. {seen}, expected {expected}"
        )


def fsdp_losses(cfg: PipelineConfig, device: torch.device, steps: int, rank: int) -> list[float]:
    """A few FSDP2 steps of the configured architecture, randomly initialised, on random tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    from training.fsdp import shard_model
    from training.modeling import load_config

    model_config = load_config(cfg.model.source, cfg.model.revision, cfg.storage.endpoint_url)
    torch.manual_seed(0)  # the same initial weights on every rank
    # The same sharding as fine-tuning: a group per decoder layer, tied embeddings in the root group.
    model = AutoModelForCausalLM.from_config(model_config).to(device)
    model = shard_model(
        model,
        device,
        activation_checkpointing=False,
        sharding=cfg.train.sharding,
        shard_group_size=cfg.train.shard_group_size,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens = torch.Generator().manual_seed(rank)
    losses = []
    for _ in range(steps):
        batch = torch.randint(model_config.vocab_size, (FSDP_BATCH, FSDP_SEQ_LEN), generator=tokens).to(device)
        loss = model(input_ids=batch, labels=batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _synchronize(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------- driver: read, summarise, judge


def read_rank_reports(ctx: JobContext, world_size: int) -> dict[int, dict | None]:
    return {
        rank: ctx.storage.read_json(*ctx.stage_parts(f"rank-{rank}.json"))
        if ctx.storage.exists(*ctx.stage_parts(f"rank-{rank}.json"))
        else None
        for rank in range(world_size)
    }


def summarize(backend: str, world_size: int, reports: dict[int, dict | None]) -> ConnectivitySummary:
    finished = [r for r in reports.values() if r and r.get("finished")]
    first = min(finished, key=lambda r: r["rank"]) if finished else {}
    losses = first.get("fsdp_losses", [])
    nodes, counted_by = rank_nodes(finished)
    return ConnectivitySummary(
        backend=backend,
        world_size=world_size,
        ranks=[
            RankStatus(rank=rank, **{k: (r or {}).get(k) for k in ("node_ip", "pid", "started", "joined", "finished")})
            for rank, r in reports.items()
        ],
        # busbw's ring factor is the whole world's: a rank that did not finish leaves no bandwidth to report.
        allreduce=[AllreduceRow(**row) for row in bandwidth([r["allreduce"] for r in finished], world_size)]
        if len(finished) == world_size
        else [],
        fsdp=FsdpProbe(steps=len(losses), losses=losses),
        transport=TransportVerdict.model_validate(
            transport_verdict(
                backend, {f"rank-{r['rank']}": r.get("nccl_lines", []) for r in finished}, nodes, counted_by
            )
        ),
    )


def bandwidth(rows_by_rank: list[list[dict]], world_size: int) -> list[dict]:
    """Per size, the slowest rank's time (a collective ends when its last rank does) and bandwidths.

    algbw = bytes / time; busbw = algbw * 2(n-1)/n, the ring all-reduce's traffic per link
    (nccl-tests' definition), comparable across world sizes.
    """
    if not rows_by_rank or len({tuple(swept_sizes(rows)) for rows in rows_by_rank}) > 1:
        return []  # ranks that swept different sizes have no common table; check_ranks names them
    factor = 2 * (world_size - 1) / world_size
    table = []
    for rows in zip(*rows_by_rank):
        size, time_ms = rows[0]["size_bytes"], max(r["time_ms"] for r in rows)
        algbw = size / (time_ms / 1e3) / 1e9
        table.append(
            {"size_bytes": size, "time_ms": round(time_ms, 4), "algbw_GBps": algbw, "busbw_GBps": algbw * factor}
        )
    return table


def swept_sizes(rows: list[dict]) -> list[int]:
    return [row["size_bytes"] for row in rows]


def rank_nodes(reports: list[dict]) -> tuple[set[str], str]:
    """The nodes the ranks ran on and what names them: Kubernetes node names when every rank's report has one,
    else Ray's node IPs (outside Kubernetes a host's IP; on it a pod's, so two pods on one instance read as two)."""
    names = {r.get("node_name") for r in reports}
    if reports and None not in names and "" not in names:
        return {str(name) for name in names}, BY_NODE_NAME
    return {r.get("node_ip") or "unknown" for r in reports}, BY_NODE_IP


def transport_verdict(
    backend: str, lines_by_rank: dict[str, list[str]], nodes: set[str], counted_by: str = BY_NODE_IP
) -> dict:
    """The job's verdict over its ranks; efa only when the ranks ran on two nodes or more, since on one node no
    traffic crossed the network whatever the NCCL lines say. The evidence says how the nodes were counted."""
    if backend == "gloo":
        return {"kind": "gloo", "evidence": [transport.GLOO_EVIDENCE]}
    verdict = transport.classify_sources(lines_by_rank)
    if verdict["kind"] != "efa":
        return verdict
    where = ", ".join(sorted(nodes)) or "no node"
    if len(nodes) < 2:
        one_node = f"every rank ran on one node ({where}; by {counted_by}): no traffic crossed the network"
        return {"kind": "inconclusive", "evidence": [one_node, *verdict["evidence"]][: transport.MAX_EVIDENCE]}
    spread = f"ranks ran on {len(nodes)} nodes ({where}; by {counted_by})"
    evidence = [verdict["evidence"][0], spread, *verdict["evidence"][1:]]
    return {"kind": "efa", "evidence": evidence[: transport.MAX_EVIDENCE]}


def check_ranks(summary: ConnectivitySummary, reports: dict[int, dict | None], fit_error: str | None) -> None:
    """Every rank finished, the trainer did not fail, and the FSDP losses are finite."""
    trainer = f"; trainer: {fit_error}" if fit_error else ""
    unfinished = [f"rank {rank} ({_how_far(r)})" for rank, r in reports.items() if not (r and r.get("finished"))]
    if unfinished:
        cause = f"{len(unfinished)} of {len(reports)} ranks did not finish: {', '.join(unfinished)}{trainer}"
        raise StageFailure("infrastructure", cause, summary)
    if fit_error:
        raise StageFailure("infrastructure", f"every rank finished but the trainer failed{trainer}", summary)
    sweeps = {rank: swept_sizes(r.get("allreduce", [])) for rank, r in reports.items() if r}
    if len({tuple(sizes) for sizes in sweeps.values()}) > 1:
        # Each rank runs the same sweep: a rank with other sizes (or fewer) ran other collectives than its peers.
        seen = "; ".join(f"rank {rank}: {sizes}" for rank, sizes in sweeps.items())
        raise StageFailure("infrastructure", f"the ranks swept different all-reduce sizes ({seen})", summary)
    losses = summary.fsdp.losses
    if not all(math.isfinite(x) for x in losses):
        # A randomly initialised model's loss is ~ln(vocab): anything else means broken collectives.
        raise StageFailure("infrastructure", f"FSDP losses not finite on a random-init model: {losses}", summary)


def check_transport(summary: ConnectivitySummary, expect: str) -> None:
    verdict = summary.transport
    if not transport.meets(verdict.kind, expect):
        evidence = verdict.evidence[0] if verdict.evidence else "no evidence"
        raise StageFailure("infrastructure", f"transport is {verdict.kind}, expected {expect}: {evidence}", summary)


def _how_far(report: dict | None) -> str:
    if report is None:
        return "no rank report"
    if report.get("error"):
        return str(report["error"])
    return "joined, not finished" if report.get("joined") else "started, never joined the first barrier"


def main() -> None:
    run_stage(connectivity)


if __name__ == "__main__":
    main()
