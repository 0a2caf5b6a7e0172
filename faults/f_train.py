"""Issue 11, rows 1, 2, 4 and 7: faults inside the fine-tune and its storage.

    python -m faults --only worker-sigkill,checkpoint-sigkill,s3-down,disk-full

1 worker-sigkill      kill -9 of a Ray Train worker mid-fine-tune: Ray Train (max_failures 1) restarts the
                      group from the latest complete checkpoint; same weights; the record lists the restart
2 checkpoint-sigkill  rank 0 SIGKILLs itself after checkpoint 30's shards are uploaded, before its marker:
                      the partial checkpoint is never used, training resumes from 20; same weights
4 s3-down             the S3-compatible server unreachable for 30 s during data prep and during a checkpoint
                      upload (a TCP proxy in front of moto refuses and resets connections): retried with
                      backoff, the run succeeds with the same weights, or fails as infrastructure
7 disk-full           the storage root (a 20 MB tmpfs) fills up during a checkpoint: an infrastructure
                      failure naming ENOSPC; the previous checkpoint stays complete and a continued run
                      resumes from it (once space is freed) to the reference's weights. Where the disk fills
                      during Ray Train's own rewrite of its checkpoint snapshot, the continuation sets the
                      torn file aside (the notes say which happened)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from faults.f_flow import wait_for
from faults.harness import WORKLOAD, FaultRow, Lab, RunOutcome, RunProcess, scenario
from training.fault_hooks import FAULT_AT, FAULT_PIDS, FIRED
from tuneproof.core.summaries_training import FinetuneSummary, Restart

MAX_STEPS = int(next(s for s in WORKLOAD if s.startswith("train.max_steps=")).split("=")[1])


def forwarded(name: str) -> str:
    """The --set that forwards one variable to the run's jobs: fault runs only, by name."""
    return f"runtime_env.forward_env=[{name}]"


def restarts_of(run: RunOutcome) -> list[Restart]:
    summary = run.finetune
    return summary.restarts if summary else []


def describe(restarts: list[Restart]) -> str:
    return "; ".join(
        f"record: restart {r.attempt} after step {r.at_step}, restored step {r.restored_step}, "
        f"{r.lost_steps} steps lost" + (f" ({r.cause[:120]})" if r.cause else "")
        for r in restarts
    )


def reported(pid_file: Path, step: int) -> dict[str, int] | None:
    """The {pid, step} a worker last wrote to pid_file, once that step is `step` or later (None until then)."""
    try:
        seen = json.loads(pid_file.read_text())
    except (OSError, ValueError):  # not written yet, or caught mid-write
        return None
    return seen if seen["step"] >= step else None


def kill_at_step(run: RunProcess, pid_file: Path, step: int) -> tuple[int, int]:
    """SIGKILL the worker that writes pid_file once it reports `step` (or later); (pid, its step then)."""
    seen = wait_for(f"a worker at step {step} ({pid_file.name})", lambda: reported(pid_file, step), run)
    os.kill(seen["pid"], signal.SIGKILL)
    return seen["pid"], seen["step"]


def survived(run: RunOutcome, compared: dict, restarts_ok: bool) -> str:
    """A restart must reproduce the reference's weights and its data order (no sample skipped or repeated)."""
    same = compared["same_as_reference"] and compared["same_data_order"] is not False
    return "survived" if run.exit_code == 0 and same and restarts_ok else "FAILED"


@scenario(order=1, name="worker-sigkill")
def worker_sigkill(lab: Lab) -> FaultRow:
    lab.reference()
    pids = lab.workdir / "pids" / "worker-sigkill"
    pids.mkdir(parents=True, exist_ok=True)
    target = 23
    run = lab.start("f1-worker-sigkill", sets=[forwarded(FAULT_PIDS)], env={FAULT_PIDS: str(pids)})
    pid, step = kill_at_step(run, pids / "rank1.json", target)
    out = run.wait()
    compared = lab.compare(out)
    restarts = restarts_of(out)
    # The restart must resume from the newest checkpoint at or before the step the worker died at.
    restarts_ok = len(restarts) == 1 and restarts[0].restored_step == (step // 10) * 10
    return FaultRow(
        fault="worker-sigkill",
        injected_at=f"step {step} of {MAX_STEPS}",
        outcome=survived(out, compared, restarts_ok),
        how=f"kill -9 {pid} (Ray Train rank 1, pid from {FAULT_PIDS}); train.max_failures=1",
        notes=describe(restarts) or f"no restart in the record; exit {out.exit_code}: {out.tail(300)}",
        **compared,
    )


@scenario(order=2, name="checkpoint-sigkill")
def checkpoint_sigkill(lab: Lab) -> FaultRow:
    lab.reference()
    at = 30
    out = lab.run("f2-checkpoint-sigkill", sets=[forwarded(FAULT_AT)], env={FAULT_AT: f"checkpoint:{at}"})
    compared = lab.compare(out)
    restarts = restarts_of(out)
    fired = out.storage.exists("runs", out.run_id, "stages", "finetune", FIRED)
    restarts_ok = fired and len(restarts) == 1 and restarts[0].restored_step == at - 10
    summary = out.finetune
    kept = [c.step for c in summary.checkpoints] if isinstance(summary, FinetuneSummary) else []
    return FaultRow(
        fault="checkpoint-sigkill",
        injected_at=f"during checkpoint {at} save (shards uploaded, marker not yet written)",
        outcome=survived(out, compared, restarts_ok),
        how=f"{FAULT_AT}=checkpoint:{at}: rank 0 SIGKILLs itself before the completion marker",
        notes=(describe(restarts) or "no restart in the record")
        + f"; fired: {fired}; complete checkpoints at the end: {kept}",
        **compared,
    )


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


@contextlib.contextmanager
def tmpfs(mountpoint: Path, size_bytes: int) -> Iterator[str]:
    """A tmpfs of size_bytes at mountpoint (needs root); yields how it was made; unmounted after."""
    if os.geteuid() != 0:
        raise RuntimeError(f"mounting a tmpfs needs root (uid {os.geteuid()}): this row cannot be injected here")
    mountpoint.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(mountpoint)], check=True)
    try:
        yield f"tmpfs {size_bytes / 2**20:.0f} MB on {mountpoint}"
    finally:
        subprocess.run(["umount", "-l", str(mountpoint)], check=False)


@scenario(order=7, name="disk-full")
def disk_full(lab: Lab) -> FaultRow:
    """Data on the tmpfs, then ballast leaving room for 1.5 checkpoints: checkpoint 10 fits, 20 does not."""
    ref = lab.reference()
    ref_summary = ref.finetune
    assert ref_summary is not None and ref_summary.checkpoints
    checkpoint_bytes = dir_bytes(Path(ref_summary.checkpoints[0].uri))
    run_id = "f7-disk-full"
    mount = lab.workdir / "tmpfs"
    with tmpfs(mount, max(20 * 2**20, 8 * checkpoint_bytes)) as how:
        root = mount / "storage"
        began = time.monotonic()
        data = lab.run(run_id, only=("data",), storage_root=root)
        if data.exit_code != 0:
            raise RuntimeError(f"the data stage failed on the tmpfs (exit {data.exit_code}):\n{data.tail()}")
        free = os.statvfs(mount).f_bavail * os.statvfs(mount).f_frsize
        ballast = free - int(1.5 * checkpoint_bytes)
        with open(mount / "ballast", "wb") as f:
            f.truncate(0)
            f.write(b"\0" * ballast)  # written, not sparse: tmpfs counts only pages really used
        full = lab.run(run_id, only=("finetune",), storage_root=root)
        rec = full.record
        cause = (rec.cause if rec else None) or ""
        from training.checkpoint_listing import RAY_SNAPSHOT, check_complete, latest_complete_checkpoint
        from training.checkpointing import step_of

        # The fine-tune is the run's second invocation: its Ray Train run is <run>-r2 (the only one).
        train = ("runs", run_id, "train", *full.storage.listdir("runs", run_id, "train")[:1])
        ckpts = [n for n in full.storage.listdir(*train) if step_of(n) is not None]
        first_name = ckpts[0] if ckpts else "checkpoint_000010"
        intact = check_complete(full.storage, *train, first_name) is None
        latest = latest_complete_checkpoint(full.storage, *train)
        # Usable: free the space and continue the same Ray Train run; it must resume from that checkpoint.
        (mount / "ballast").unlink()
        again = lab.run(run_id, only=("finetune",), storage_root=root, sets=["train.continue_previous=true"])
        seconds = time.monotonic() - began
        compared = lab.compare(again)
        summary = again.finetune
        aside = [n for n in again.storage.listdir(*train) if n.startswith(f"{RAY_SNAPSHOT}.unusable-")]
    expected = (
        full.exit_code == 4
        and rec is not None
        and full.failure_class == "infrastructure"
        and "ENOSPC" in cause
        and intact
        and latest is not None
        and latest.step == 10
        and summary is not None
        and summary.start_step == 10
        and compared["same_as_reference"]
    )
    return FaultRow(
        fault="disk-full",
        injected_at=f"during checkpoint 20 save ({free / 2**20:.1f} MB free before training, checkpoint "
        f"{checkpoint_bytes / 2**20:.2f} MB)",
        outcome="failed-as-expected" if expected else "FAILED",
        how=f"{how}, storage.root on it, {ballast / 2**20:.1f} MB ballast after data prep",
        notes=f"cause: {cause[:160]}; checkpoints left: {ckpts}, {first_name} complete: {intact}; continued run "
        f"(space freed, train.continue_previous) started at step {summary.start_step if summary else '?'}; "
        f"Ray Train's snapshot {'torn by the full disk, set aside by the continuation' if aside else 'intact'}",
        **{
            **compared,
            "failure_class": full.failure_class,
            "seconds": round(seconds, 1),
            "time_lost_s": round(seconds - ref.seconds, 1),
        },
    )


S3_BUCKET = "tp-faults"


@scenario(order=4, name="s3-down")
def s3_down(lab: Lab) -> FaultRow:
    """moto behind a FlakyProxy: down 30 s at the first dataset upload, again at checkpoint 20's upload."""
    import boto3

    from faults.proxy import FlakyProxy
    from training.checkpoint_listing import check_complete
    from training.checkpointing import step_of
    from tuneproof.app.servers import FAKE_AWS, environ, moto_server

    lab.reference()
    outage_s = 30
    # This process reads the run's storage too (record, checkpoints): with the server's fake credentials.
    with environ(FAKE_AWS), moto_server() as upstream, FlakyProxy(int(upstream.rsplit(":", 1)[1])) as proxy:
        boto3.client(
            "s3",
            endpoint_url=upstream,
            region_name="us-east-1",
            aws_access_key_id=FAKE_AWS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key="testing",
        ).create_bucket(Bucket=S3_BUCKET)
        proxy.arm(re.compile(rb"^PUT \S*/datasets/"), outage_s)
        proxy.arm(re.compile(rb"^PUT \S*/checkpoint_000020/"), outage_s)
        run_id = "f4-s3-down"
        out = lab.run(run_id, storage_root=f"s3://{S3_BUCKET}/root", endpoint_url=proxy.url)
        compared = lab.compare(out)
        rec, summary = out.record, out.finetune
        # Ray Train keeps its own files beside the checkpoints (.validate_storage_marker, its snapshot): only
        # checkpoint_<step> directories are checkpoints, and each of those must be complete.
        names = [n for n in out.storage.listdir("runs", run_id, "train", run_id) if step_of(n) is not None]
        incomplete = [n for n in names if check_complete(out.storage, "runs", run_id, "train", run_id, n)]
        dataset = rec.data.dataset_path if rec and rec.data else None
        dataset_ok = dataset is not None and out.storage.exists(dataset, "manifest.json")
    outages = [f"{o.trigger.split(' HTTP')[0]} ({(o.ended or time.time()) - o.started:.0f} s)" for o in proxy.outages]
    if out.exit_code == 0:
        ok = compared["same_as_reference"] and len(proxy.outages) == 2 and dataset_ok and not incomplete
        outcome = "survived" if ok else "FAILED"
    else:  # the fault won: it must be an infrastructure failure that names the endpoint
        named = (
            rec is not None
            and out.failure_class == "infrastructure"
            and proxy.url.removeprefix("http://") in (rec.cause or "")
        )
        outcome = "failed-as-expected" if named else "FAILED"
    return FaultRow(
        fault="s3-down",
        injected_at="data prep (first dataset upload) and checkpoint 20 upload",
        outcome=outcome,
        how=f"moto behind a TCP proxy on {proxy.url}: {outage_s} s of refused connections and resets, same port",
        notes=f"outages: {'; '.join(outages) or 'none fired'}; checkpoints {names}, incomplete: {incomplete or 'none'}"
        + ("" if out.exit_code == 0 else f"; cause: {(rec.cause if rec else out.tail(300)) or ''}"[:300])
        + (f"; restarts: {describe(summary.restarts)}" if summary and summary.restarts else ""),
        **compared,
    )
