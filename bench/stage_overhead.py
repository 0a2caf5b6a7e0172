"""stage_overhead: the seconds a stage costs as the pipeline runs it, over a bare Ray job of the same body. <= 3 s.

    python -m bench.run --only stage_overhead

The body is the data stage (the bundled 3,000-row corpus, a fresh storage root each time so the
content-addressed cache never hits). Both sides run warm in this one process, after one untimed run
of each (the working_dir upload and first imports are paid there), and both poll the job's status
every POLL_S seconds, the pipeline's own interval. Ours: the Prefect flow (flows.pipeline, `only=
["data"]`) against a Prefect server of its own: flow run, lease, record, working_dir staging, submission,
log following, result validation, the record saved. Bare: JobSubmissionClient.submit_job with the same
working_dir, entrypoint and job envelope, then status polls until it succeeds.

The figure is median(ours) - median(bare) in seconds (the pipeline target: what a user pays per
stage over the bare stack); the ratio of medians, with its own interval, is in the details.
"""

from __future__ import annotations

import time

from bench.common import BenchResult, Target, compare, difference, interleave, say
from bench.harness import Bench
from tuneproof.core.envelope import ENV_VAR, JobEnvelope

TARGET = Target("<=", 3.0)
RATIO_TARGET = Target("<=", 1.2)
POLL_S = 1.0
"""tasks.rayjob.RayJobRunner's default, the interval the pipeline polls at."""


def bare_submit(bench: Bench, client, tag: str) -> float:
    """The data stage as a bare Ray job into a fresh storage root; seconds until it is seen succeeded."""
    from ray.job_submission import JobStatus

    from tuneproof.control.identity import stage_working_dir

    cfg = bench.config(bench.fresh_dir("stage-bare"))
    workdir, _ = stage_working_dir()
    envelope = JobEnvelope(run_id=f"bench-bare-{tag}", job="data", config=cfg, params={}).encode()
    runtime_env = {"working_dir": str(workdir), "env_vars": {ENV_VAR: envelope, "RAY_TRAIN_ENABLE_PRINT_PATCH": "0"}}
    began = time.perf_counter()
    sid = client.submit_job(entrypoint="python -m training.data_prep", runtime_env=runtime_env)
    while (status := client.get_job_status(sid)) not in (JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED):
        time.sleep(POLL_S)
    seconds = time.perf_counter() - began
    if status != JobStatus.SUCCEEDED:
        raise RuntimeError(f"bare data job {sid} {status.value}:\n{client.get_job_logs(sid)[-2000:]}")
    return seconds


def ours_flow(bench: Bench, tag: str) -> float:
    """The data stage alone through the pipeline flow (`only=["data"]`, a fresh run of its own); wall seconds."""
    from flows.pipeline import pipeline

    cfg = bench.config(bench.fresh_dir("stage-ours"))
    began = time.perf_counter()
    state = pipeline(config=cfg, run_id=f"bench-ours-{tag}", only=["data"], return_state=True)
    seconds = time.perf_counter() - began
    if not state.is_completed():
        raise RuntimeError(f"the pipeline flow up to data ended {state.type.value}: {state.message}")
    return seconds


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from bench.harness import job_client
    from bench.pipeline import prefect_server

    home = bench.fresh_dir("prefect-home")
    with prefect_server(home) as env, temporary_settings({PREFECT_API_URL: env["PREFECT_API_URL"], PREFECT_HOME: home}):
        client = job_client(bench.config(bench.scratch), {"Authorization": f"Bearer {bench.head.token()}"})
        ours_flow(bench, "warm")  # untimed, both: the working_dir upload, Prefect's and Ray's first use
        bare_submit(bench, client, "warm")

        def ours(i: int) -> float:
            s = ours_flow(bench, str(i))
            say(f"  stage_overhead ours #{i}: {s:.2f} s")
            return s

        def bare(i: int) -> float:
            s = bare_submit(bench, client, str(i))
            say(f"  stage_overhead bare #{i}: {s:.2f} s")
            return s

        measured = interleave({"ours": ours, "bare": bare}, repeats)
    as_ratio = compare(measured["ours"], measured["bare"], RATIO_TARGET)
    return compare(
        measured["ours"],
        measured["bare"],
        TARGET,
        difference,
        unit="seconds added per stage (ours - bare)",
        stage="data (3,000 rows)",
        poll_s=POLL_S,
        ours_is='flows.pipeline(only=["data"]): Prefect flow run, record, RayJobRunner',
        bare_is="JobSubmissionClient.submit_job + status polls, same working_dir and envelope",
        ratio_of_medians={"ratio": as_ratio.ratio, "interval": as_ratio.interval, "target": as_ratio.target},
    )
