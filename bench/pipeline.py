"""pipeline: each stage as the pipeline runs it, over a bare equivalent of the same work. <= 3 s added a stage.

    python -m bench.run --only pipeline [--pipeline-repeats N]

The workload is short, so that what is measured is the overhead, not the work: configs/local.yaml with
train.max_steps 40 and checkpoint_every 20 (checkpoints at 20 and 40; the resume test starts from 20,
is interrupted at 24 and continues to 29), eval.max_examples 50, and gates any candidate passes (40 steps
teach the tiny model little; the work is the same whatever the verdict). `--quick`: 20 steps, checkpoints
every 10, 20 eval examples.

Each round is a fresh run in fresh storage roots, and takes every stage in pipeline order, ours then bare
(interleave: verify ours, verify bare, connectivity ours, ...), both sides warm in this one process after
an untimed verify and connectivity of each (the working_dir uploads, Prefect's and Ray Train's first use).
- Ours: the Prefect flow for that stage alone, `flows.pipeline(only=[stage])` against a Prefect server of
  its own: flow run, lease, record, working_dir staging, submission, log following, result validation,
  artifacts, the record saved. Wall seconds of the call.
- Bare, a plain job stage (verify, connectivity, data, evaluate): JobSubmissionClient.submit_job of the same
  working_dir, entrypoint, env and job envelope (evaluate: ours' dataset and candidate of the round), its
  status polled every POLL_S seconds as the pipeline polls, to SUCCEEDED. The data job writes into a
  storage root of its own: in ours' the content-addressed dataset would be found, not made.
- Bare, a Ray Train stage: bench/bare_train.py as a Ray job (the staged working_dir plus that file), polled
  the same way. finetune: one TorchTrainer.fit of the same model, ours' dataset, workers, steps, batch and
  seed, a stock DCP checkpoint at the same steps, a Hugging Face export at the end. resume: two fits under
  one name, from the bare fine-tune's checkpoint at the resume test's seed step to its interruption step,
  then restored from that checkpoint to the last replayed step: the interrupt and continue phases.
Promote is not measured: it writes the registry only on evidence this workload does not give, and its bare
equivalent is a file copy.

Per stage the figure is median(ours) - median(bare) in seconds with its bootstrap interval; the row's
figure is the worst stage's, and it is ok when every stage's is. 3 rounds by default, not 5: a round of
six stages on both sides takes about 4 minutes on 2 idle cores (the row 11.4 min), so 5 would be 20.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from bench.common import BenchResult, Target, compare, difference, interleave, say
from bench.harness import Bench, job_client
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig
from tuneproof.core.envelope import ENV_VAR, JobEnvelope

TARGET = Target("<=", 3.0)
POLL_S = 1.0
"""tasks.rayjob.RayJobRunner's default, the interval the pipeline polls at."""
STAGES = ("verify", "connectivity", "data", "finetune", "resume", "evaluate")
JOBS = {
    "verify": "training.verify",
    "connectivity": "training.connectivity",
    "data": "training.data_prep",
    "evaluate": "eval.evaluate_job",
}
"""The plain job stages' modules: the bare side submits the same entrypoint."""
PASSING_GATES = ("eval.gates={exact_match: {min: 0.0}}", "eval.max_truncated_fraction=1.0")
SUITES_PASS = ("eval.suites.add.margin=0.99", "eval.suites.reverse.margin=0.99")
WORKLOAD = ("train.max_steps=40", "train.checkpoint_every=20", "eval.max_examples=50", *PASSING_GATES, *SUITES_PASS)
QUICK = (
    "train.max_steps=20",
    "train.warmup_steps=4",
    "train.checkpoint_every=10",
    "eval.max_examples=20",
    *PASSING_GATES,
    *SUITES_PASS,
)
ROUNDS_WHY = "3 rounds, not 5: a round of six stages on both sides is about 4 min on 2 cores (the row 11.4)"


@dataclass
class Round:
    """One round: ours' run and storage root, the bare side's root, and what ours' stages made."""

    tag: str
    ours: PipelineConfig
    bare: PipelineConfig
    made: dict[str, str] = field(default_factory=dict)
    """dataset_path and export_path, read from ours' record once its stage has run."""


def root(cfg: PipelineConfig) -> Path:
    return Path(cfg.storage.root)


def ours_stage(rnd: Round, stage: str) -> float:
    """The stage alone through the pipeline flow, in the round's run; wall seconds."""
    from flows.pipeline import pipeline
    from tuneproof.control import record as records
    from tuneproof.core.storage import Storage

    run_id = f"bench-ours-{rnd.tag}"
    began = time.perf_counter()
    state = pipeline(config=rnd.ours, run_id=run_id, only=[stage], return_state=True)
    seconds = time.perf_counter() - began
    if not state.is_completed():
        raise RuntimeError(f"the pipeline flow for {stage} ended {state.type.value}: {state.message}")
    summary = records.load(Storage.from_config(rnd.ours.storage), run_id).stages[stage].summary or {}
    rnd.made.update({k: summary[k] for k in ("dataset_path", "export_path") if summary.get(k)})
    return seconds


class BareSide:
    """The bare equivalents: jobs submitted and polled as a user of `ray job submit` would."""

    def __init__(self, bench: Bench, cfg: PipelineConfig) -> None:
        from tuneproof.control.identity import stage_working_dir

        self.bench = bench
        self.client = job_client(cfg, {"Authorization": f"Bearer {bench.head.token()}"})
        self.workdir = str(stage_working_dir()[0])
        # bare_train.py beside the job packages it imports: a working_dir as large as ours, uploaded once.
        self.train_workdir = bench.scratch / "bare-workdir"
        shutil.copytree(self.workdir, self.train_workdir / "pkg")
        shutil.copy2(PROJECT_ROOT / "bench" / "bare_train.py", self.train_workdir / "pkg" / "bare_train.py")

    def stage(self, rnd: Round, stage: str) -> float:
        if stage == "finetune":
            return self.train(rnd.ours, self.finetune_args(rnd))
        if stage == "resume":
            return self.train(rnd.ours, self.resume_args(rnd))
        # evaluate judges ours' candidate, which lives in ours' root; data must make its dataset anew
        cfg, params = (rnd.ours, evaluate_params(rnd)) if stage == "evaluate" else (rnd.bare, {})
        envelope = JobEnvelope(run_id=f"bench-bare-{rnd.tag}", job=stage, config=cfg, params=params)
        env = {**self.env(cfg), ENV_VAR: envelope.encode()}
        return self.submit(f"python -m {JOBS[stage]}", {"working_dir": self.workdir, "env_vars": env})

    def env(self, cfg: PipelineConfig) -> dict[str, str]:
        """The env ours' jobs get besides the envelope (tasks.rayjob.RayJobRunner.runtime_env)."""
        return {"RAY_TRAIN_ENABLE_PRINT_PATCH": "0", **cfg.runtime_env.env_vars}

    def finetune_args(self, rnd: Round) -> list[str]:
        train = rnd.ours.train
        return [
            *self.common_args(rnd),
            *("--steps", str(train.max_steps), "--checkpoint-every", str(train.checkpoint_every)),
            *("--export", str(root(rnd.bare) / "export"), "--name", "finetune"),
        ]

    def resume_args(self, rnd: Round) -> list[str]:
        """The resume test's two runs over the bare fine-tune's checkpoints (tasks/resume.pick_checkpoint's rule)."""
        saved = saved_steps(root(rnd.bare) / "train" / "finetune")
        seed, interrupt_at, last = resume_steps(rnd.ours, saved)
        return [
            *self.common_args(rnd),
            *("--init-from", str(saved[seed]), "--steps", str(interrupt_at), "--then-steps", str(last)),
            *("--checkpoint-every", str(interrupt_at), "--name", "resume"),
        ]

    def common_args(self, rnd: Round) -> list[str]:
        train = rnd.ours.train
        return [
            *("bare_train.py", "--model", str(self.bench.model_dir)),
            *("--data", str(root(rnd.ours) / rnd.made["dataset_path"])),
            *("--workers", str(train.num_workers), "--batch", str(train.micro_batch_size)),
            *("--lr", str(train.lr), "--seed", str(train.seed), "--storage", str(root(rnd.bare) / "train")),
        ]

    def train(self, cfg: PipelineConfig, args: list[str]) -> float:
        runtime_env = {"working_dir": str(self.train_workdir / "pkg"), "env_vars": self.env(cfg)}
        return self.submit(f"python {' '.join(args)}", runtime_env)

    def submit(self, entrypoint: str, runtime_env: dict) -> float:
        """Submit, poll every POLL_S until the job ends; seconds from submission to SUCCEEDED seen."""
        from ray.job_submission import JobStatus

        began = time.perf_counter()
        sid = self.client.submit_job(entrypoint=entrypoint, runtime_env=runtime_env)
        while (status := self.client.get_job_status(sid)) not in (
            JobStatus.SUCCEEDED,
            JobStatus.FAILED,
            JobStatus.STOPPED,
        ):
            time.sleep(POLL_S)
        seconds = time.perf_counter() - began
        if status != JobStatus.SUCCEEDED:
            raise RuntimeError(
                f"bare job {sid} ({entrypoint[:80]}) {status.value}:\n{self.client.get_job_logs(sid)[-3000:]}"
            )
        return seconds


def evaluate_params(rnd: Round) -> dict[str, object]:
    """What ours' evaluate task gives its job (tasks.jobs.evaluate): the round's dataset and candidate, no incumbent."""
    return {"dataset": rnd.made["dataset_path"], "candidate": rnd.made["export_path"], "incumbent": None}


def saved_steps(run_dir: Path) -> dict[int, Path]:
    """The checkpoints bare_train.py left in a Ray Train run directory, by step."""
    import json

    return {json.loads(p.read_text())["step"]: p.parent for p in run_dir.glob("checkpoint_*/step.json")}


def resume_steps(cfg: PipelineConfig, saved: Mapping[int, Path]) -> tuple[int, int, int]:
    """(seed, interruption, last step) of the resume test over these checkpoints: tasks/resume's own pick. Pure."""
    from tasks.resume import pick_checkpoint
    from tuneproof.core.summaries import CheckpointRef

    extra, replay = cfg.resume.extra_steps, cfg.resume.replay_steps
    refs = [CheckpointRef(step, str(path)) for step, path in saved.items()]
    seed = pick_checkpoint(refs, cfg.train.max_steps, extra, replay)
    if seed is None:
        raise ValueError(f"no checkpoint in {sorted(saved)} leaves {extra}+{replay} steps before {cfg.train.max_steps}")
    return seed.step, seed.step + extra, seed.step + extra + replay


def overall(per_stage: Mapping[str, BenchResult], **details: object) -> BenchResult:
    """The row: the worst stage's seconds added and its interval; ok when every stage is, noisy when any is. Pure."""
    worst = max(per_stage, key=lambda name: per_stage[name].ratio or 0.0)
    stages = {
        name: {
            "ours_s": r.details["ours"]["median"],
            "bare_s": r.details["bare"]["median"],
            "added_s": r.ratio,
            "interval": r.interval,
            "noisy": r.noisy,
            "ok": r.ok,
            "samples": r.details["samples"],
        }
        for name, r in per_stage.items()
    }
    return BenchResult(
        ratio=per_stage[worst].ratio,
        target=TARGET.text(),
        ok=all(r.ok for r in per_stage.values()),
        repeats=min(r.repeats for r in per_stage.values()),
        interval=per_stage[worst].interval,
        noisy=any(r.noisy for r in per_stage.values()),
        details={
            "figure": "seconds added by the worst stage (ours - bare medians)",
            "worst": worst,
            "stages": stages,
            **details,
        },
    )


def stage_table(result: BenchResult) -> str:
    """Per stage: ours and bare medians, seconds added with its interval, noisy, ok."""
    lines = [f"  {'stage':<13} {'ours s':>7} {'bare s':>7} {'added s':>8} {'interval':<16} {'noisy':<5} ok"]
    for name, s in result.details["stages"].items():
        low, high = s["interval"]
        lines.append(
            f"  {name:<13} {s['ours_s']:7.2f} {s['bare_s']:7.2f} {s['added_s']:8.2f} [{low:.2f}, {high:.2f}]"
            f"{'':<{16 - len(f'[{low:.2f}, {high:.2f}]')}} {'yes' if s['noisy'] else 'no':<5} {'yes' if s['ok'] else 'NO'}"
        )
    return "\n".join(lines)


def sides(bench: Bench, bare: BareSide, workload: tuple[str, ...]) -> dict[str, Callable[[int], float]]:
    """Ours and bare of every stage, in pipeline order, each taking the round number; a round's runs are
    made by its first call."""
    rounds: dict[int, Round] = {}

    def round_(i: int) -> Round:
        if i not in rounds:
            ours, bare = bench.fresh_dir(f"ours-{i}"), bench.fresh_dir(f"bare-{i}")
            rounds[i] = Round(str(i), bench.config(ours, *workload), bench.config(bare, *workload))
        return rounds[i]

    def timed(stage: str, side: str, run: Callable[[Round, str], float]) -> Callable[[int], float]:
        def measure(i: int) -> float:
            seconds = run(round_(i), stage)
            say(f"  pipeline {stage:<12} {side:<4} #{i}: {seconds:6.2f} s")
            return seconds

        return measure

    return {
        f"{stage} {side}": timed(stage, side, run)
        for stage in STAGES
        for side, run in (("ours", ours_stage), ("bare", bare.stage))
    }


def run(bench: Bench, repeats: int, quick: bool) -> BenchResult:
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, temporary_settings

    from tuneproof.app.servers import prefect_server

    workload = QUICK if quick else WORKLOAD
    home = bench.fresh_dir("prefect-home")
    with prefect_server(home) as url, temporary_settings({PREFECT_API_URL: f"{url}/api", PREFECT_HOME: home}):
        bare = BareSide(bench, bench.config(bench.scratch))
        warm = Round(
            "warm", bench.config(bench.fresh_dir("ours-warm"), *workload), bench.config(bench.scratch, *workload)
        )
        for stage in ("verify", "connectivity"):  # untimed: uploads, imports, Prefect's and Ray Train's first use
            ours_stage(warm, stage)
            bare.stage(warm, stage)
        bare.submit("python -c pass", {"working_dir": str(bare.train_workdir / "pkg")})  # its upload, untimed
        measured = interleave(sides(bench, bare, workload), repeats)
    per_stage = {
        stage: compare(measured[f"{stage} ours"], measured[f"{stage} bare"], TARGET, difference) for stage in STAGES
    }
    result = overall(
        per_stage,
        workload=list(workload),
        poll_s=POLL_S,
        rounds=repeats,
        rounds_why=ROUNDS_WHY,
        ours_is="flows.pipeline(only=[stage]): Prefect flow run, lease, record, RayJobRunner, artifacts",
        bare_is="submit_job + status polls of the same job, or of bench/bare_train.py for finetune and resume",
    )
    say(stage_table(result))
    return result
