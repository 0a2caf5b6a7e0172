"""What the benchmarks run against: a local Ray head, an S3-compatible server, the tiny model, configs, jobs.

Everything here is started by a context manager and stopped at its end, bound to 127.0.0.1, with
its files under one temporary directory; nothing is downloaded. "Ours" runs a stage exactly as the
pipeline's task does (tasks.rayjob.RayJobRunner: working_dir staging, submission, log following,
result validation); "bare" runs what a user would type instead (`ray job submit`, a TorchTrainer loop).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.common import say
from tuneproof.app.servers import OFFLINE_ENV
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config

QUIET_ENV = {**OFFLINE_ENV, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}
S3_BUCKET = "tuneproof-bench"


@dataclass
class JobRun:
    """One job as ours ran it: wall seconds from submission to validated result, and what it left."""

    seconds: float
    submitted_at: float
    """Unix time just before submission."""
    summary: dict[str, Any] | None
    status: str
    lines: list[str] = field(default_factory=list)
    startup_s: float | None = None
    """Seconds from submission to the stage body's first line ('[tuneproof] ...'): job and process start-up."""


@dataclass
class Bench:
    """A running local cluster and a scratch directory; `config()` builds pipeline configs against it."""

    head: Any  # tuneproof.app.local.RayHead; None for the benchmarks that need no cluster
    scratch: Path
    model_dir: Path
    used: int = 0

    def config(self, storage_root: str | Path, *sets: str) -> PipelineConfig:
        """configs/local.yaml pointed at this cluster, the tiny model and `storage_root`, plus `sets`."""
        base = [
            f"cluster.address={self.head.address}",
            f"cluster.auth_token_file={self.head.token_file}",
            f"storage.root={storage_root}",
            f"model.source={self.model_dir}",
        ]
        return load_config(PROJECT_ROOT / "configs" / "local.yaml", [*base, *sets])

    def unique(self, prefix: str) -> str:
        """A run id not used before on this cluster (Ray never reuses a submission id)."""
        self.used += 1
        return f"{prefix}-{self.used}"

    def fresh_dir(self, name: str) -> Path:
        path = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=self.scratch))
        return path

    def run_job(
        self, cfg: PipelineConfig, run_id: str, job: str, module: str, params: dict[str, Any] | None = None
    ) -> JobRun:
        """Run one stage job the way the pipeline's task does; raises when it did not succeed."""
        from tasks.rayjob import JobSpec, RayJobRunner
        from tuneproof.core.summaries import Summary
        from tuneproof.core.summaries_data import DataSummary
        from tuneproof.core.summaries_training import FinetuneSummary

        models: dict[str, type[Summary]] = {"training.data_prep": DataSummary, "training.finetune": FinetuneSummary}
        summary = models[module]
        lines: list[str] = []
        first_body_line: list[float] = []

        def on_line(line: str) -> None:
            if not first_body_line and line.startswith(("[tuneproof]", "progress ")):
                first_body_line.append(time.time())
            lines.append(line)

        submitted = time.time()
        began = time.perf_counter()
        for attempt in range(3):
            # A dropped dashboard connection (OSError) on a loaded machine: following again re-attaches to
            # the same submission (its id is the run's and the job's), the time keeps running. RayJobRunner
            # leaves this retry to its caller; in the pipeline it is the task's Prefect retry (tasks.jobs.RETRY).
            try:
                runner = RayJobRunner(cfg, run_id, on_line=on_line, poll_s=0.5)
                entry = runner.run(JobSpec(job, module, 1800, summary, params or {}))
                break
            except OSError:
                if attempt == 2:
                    raise
                time.sleep(5)
        seconds = time.perf_counter() - began
        result = entry.result
        if result.status != "succeeded":
            tail = "\n".join(lines[-30:])
            raise RuntimeError(f"{module} job {entry.submission_id} {result.status}: {result.cause}\n{tail}")
        startup = first_body_line[0] - submitted if first_body_line else None
        return JobRun(seconds, submitted, result.summary, result.status, lines, startup)

    def env(self) -> dict[str, str]:
        """Environment for a process that joins this cluster (a bare driver, `ray job submit`)."""
        from tuneproof.app.local import ray_env

        return {
            **os.environ,
            **QUIET_ENV,
            **ray_env(self.head.token_file),
            "RAY_ADDRESS": self.head.address,
            "PYTHONPATH": str(PROJECT_ROOT),
        }

    def driver_env(self) -> dict[str, str]:
        """Environment for a Ray driver process (ray.init connects to the GCS, not the dashboard)."""
        return {**self.env(), "RAY_ADDRESS": self.head.gcs_address}


def job_client(cfg: PipelineConfig, headers: dict[str, str] | None):
    """A job client that waits (bounded) while the dashboard is unreachable, as the pipeline's does: for
    bench/pipeline.py's bare side (ours connects inside RayJobRunner)."""
    from ray.job_submission import JobSubmissionClient

    from tasks.rayjob import UNREACHABLE_WAIT_S, while_unreachable

    address = cfg.cluster.address
    return while_unreachable(lambda: JobSubmissionClient(address, headers=headers), address, say, UNREACHABLE_WAIT_S)


@contextlib.contextmanager
def bench_cluster(num_cpus: int = 4, ray: bool = True) -> Iterator[Bench]:
    """A scratch directory with the tiny model and, with `ray`, a Ray head, for the length of the block."""
    from tuneproof.app.local import free_port, start_ray_head
    from tuneproof.app.tiny_model import ensure_tiny_model

    os.environ.update(QUIET_ENV)
    scratch = Path(tempfile.mkdtemp(prefix="tp-bench-"))
    head = None
    try:
        model_dir = scratch / "tiny-qwen2"
        ensure_tiny_model(model_dir, PROJECT_ROOT / "data" / "dates" / "dates.jsonl")
        if ray:
            say(f"starting a local Ray head ({num_cpus} CPUs) ...")
            # A head that exits in its own start-up is started again by start_ray_head; one that is only slow
            # on a loaded machine gets the two default waits an earlier second try here gave it.
            head = start_ray_head(scratch / "ray-state", num_cpus=num_cpus, dashboard_port=free_port(), wait_s=240)
            wait_for_job_agent(head)
        yield Bench(head, scratch, model_dir)
    finally:
        if head is not None and not head.alive():
            say(f"the Ray head had exited; its log ends:\n{Path(head.log_file).read_text()[-2000:]}")
        if head is not None:
            head.stop()
        shutil.rmtree(scratch, ignore_errors=True)


def wait_for_job_agent(head, timeout: float = 300) -> None:
    """Run a no-op job to its end: a fresh head answers HTTP before its job agent takes jobs, and on a
    loaded machine its dashboard drops connections for a while (RuntimeError from the SDK, OSError
    from requests); both are retried until `timeout`."""
    from ray.job_submission import JobStatus, JobSubmissionClient

    deadline = time.monotonic() + timeout
    sid = f"bench-warmup-{secrets.token_hex(4)}"
    while True:
        try:
            client = JobSubmissionClient(head.address, headers={"Authorization": f"Bearer {head.token()}"})
            if client_status(client, sid) is None:
                client.submit_job(entrypoint="python -c pass", submission_id=sid)
            if client.get_job_status(sid) in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
                return
        except (RuntimeError, OSError) as e:
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray head at {head.address} ran no job within {timeout:.0f} s: {e}") from e
        time.sleep(2)


def client_status(client, sid: str):
    """The job's status, or None when no job has that id."""
    try:
        return client.get_job_status(sid)
    except RuntimeError as e:
        if "does not exist" in str(e) or "404" in str(e):
            return None
        raise


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """moto's S3 server on 127.0.0.1 with a bucket; fake credentials in this process's environment."""
    from tuneproof.app import servers

    with servers.environ(servers.FAKE_AWS), servers.moto_server() as url:
        import boto3

        boto3.client("s3", endpoint_url=url).create_bucket(Bucket=S3_BUCKET)
        yield url


def write_corpus(path: Path, rows: int) -> Path:
    """A generated date-normalisation corpus of `rows` rows, every prompt distinct.

    The bundled task's generator (another seed) repeats itself past about 200,000 rows (36,500 dates in
    six formats), and the data stage tokenizes each distinct text once where a bare encoder does every
    row: a larger corpus of it would measure the repetition. So each prompt carries its row number
    ("Entry 123456: March 5, 2021"); the answers repeat as dates do, as a real corpus's short answers would.
    Days are drawn with replacement (the bundled file draws each day once, which caps it at 36,524 rows).
    """
    sys.path.insert(0, str(PROJECT_ROOT / "data" / "dates"))
    from make_dates import FORMATS, random_day

    rng = random.Random(7)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(rows):
            day = random_day(rng)
            row = {"input": f"Entry {i}: {FORMATS[i % len(FORMATS)](day)}", "output": day.isoformat()}
            f.write(json.dumps(row) + "\n")
    return path


def run_python(args: list[str], env: dict[str, str], timeout: float = 1800) -> subprocess.CompletedProcess:
    """A child Python (this environment's) in the project root; its output captured, failure raised with it."""
    done = subprocess.run(
        [sys.executable, *args], cwd=PROJECT_ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if done.returncode:
        raise RuntimeError(f"{' '.join(args)} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    return done


def read_metrics(cfg: PipelineConfig, run_id: str, job: str) -> list[dict[str, Any]]:
    """The fine-tune job's metrics log rows (every step rank 0 logged), read as the pipeline reads them: a
    local file or S3 chunks, a torn last line (a killed writer) left out."""
    from tuneproof.core.rowlog import read_rows
    from tuneproof.core.storage import Storage
    from tuneproof.core.summaries_training import METRICS_LOG

    return read_rows(Storage.from_config(cfg.storage), "runs", run_id, "stages", job, METRICS_LOG)


def prepare_dataset(bench: Bench, storage_root: Path, run_id: str | None = None, *sets: str) -> tuple[str, JobRun]:
    """Run the data stage (ours) into `storage_root`; returns the dataset's storage path and the job."""
    run_id = run_id or bench.unique("bench-data")
    job = bench.run_job(bench.config(storage_root, *sets), run_id, "data", "training.data_prep")
    assert job.summary is not None
    return job.summary["dataset_path"], job
