"""Stage 5, the resume test: prove that a checkpoint restores, instead of assuming it.

1. interrupt: a new training run "<run>-resume" starts from an intermediate checkpoint k of the
   main run, checkpoints at k+extra, and holds; we stop its Ray job (the interruption).
2. continue: the same RunConfig name and storage are resubmitted; Ray Train V2 resumes from the
   latest complete checkpoint. It must restart at k+extra, not at step 0 or k.
3. replay: the losses logged by both jobs for steps k+1 .. k+extra+replay must equal the main
   run's (within resume.loss_rtol; 0 on CPU fp32, where replays are bit for bit).
An unusable checkpoint is an infrastructure failure, and blocks promotion.
"""

from __future__ import annotations

import json
import time
from typing import Any

from prefect import task

from tasks import events
from tasks.rayjob import JobSpec
from tasks.stages import RETRY, entry_from, job_name, runner_for
from tuneproof.core.config import PipelineConfig
from tuneproof.control.record import stage_entry
from tuneproof.control.resume_evidence import check_restart, compare_losses
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage


def pick_checkpoint(checkpoints: list[dict], final_step: int, extra: int, replay: int) -> dict | None:
    """The latest main-run checkpoint that leaves room for extra + replay steps before the end."""
    usable = [c for c in checkpoints if c["step"] + extra + replay <= final_step]
    return max(usable, key=lambda c: c["step"]) if usable else None


@task(name="resume-test", **RETRY)
def resume_test(cfg: PipelineConfig, run_id: str, dataset_path: str, checkpoints: list[dict],
                loss_curve: list[list[float]], invocation: int = 1) -> dict[str, Any]:
    started = now_iso()
    events.publish("stage", stage="resume", status="running")
    extra, replay = cfg.resume.extra_steps, cfg.resume.replay_steps
    final_step = int(max(step for step, _ in loss_curve))
    seed = pick_checkpoint(checkpoints, final_step, extra, replay)
    if seed is None:
        cause = (f"no main-run checkpoint leaves {extra}+{replay} steps before step {final_step} "
                 f"(checkpoints at {[c['step'] for c in checkpoints]}); lower train.checkpoint_every")
        return stage_entry("resume", "failed", "infrastructure", cause, {}, [], started, now_iso())

    hold = seed["step"] + extra
    params = {
        "dataset": dataset_path, "run_name": f"{run_id}-{job_name('resume', invocation)}", "init_from": seed["uri"],
        # max_steps here is where the job stops; the LR schedule still spans train.max_steps,
        # so the resumed trajectory is comparable step for step with the main run.
        "max_steps": hold + replay, "checkpoint_every": extra, "export": False,
    }
    runner = runner_for(cfg, run_id, "resume")
    interrupt_job = job_name("resume-interrupt", invocation)
    marker = f"HOLDING after checkpoint step {hold}"
    interrupt = runner.run(
        JobSpec(interrupt_job, "training.finetune", cfg.timeouts.resume, {**params, "hold_after_checkpoint_step": hold}),
        stop_when=lambda line: marker in line,
    )
    if interrupt.result.ok or interrupt.job_status != "STOPPED":
        # It either failed on its own (an unusable checkpoint) or never reached the hold point.
        return entry_from("resume", [interrupt], started, summary={"seed_checkpoint": seed, "interrupted": False})

    resubmitted_at = time.time()
    resumed = runner.run(JobSpec(job_name("resume-continue", invocation), "training.finetune", cfg.timeouts.resume,
                                 {**params, "first_step_marker": True}))
    if not resumed.result.ok:
        return entry_from("resume", [interrupt, resumed], started)

    evidence = judge(cfg, run_id, interrupt_job, seed, hold, loss_curve, resumed.result.summary, resubmitted_at)
    outcome = entry_from("resume", [interrupt, resumed], started, summary=evidence)
    if evidence["problems"]:
        outcome.update(status="failed", failure_class="infrastructure", cause="; ".join(evidence["problems"]))
    return outcome


def judge(cfg: PipelineConfig, run_id: str, interrupt_job: str, seed: dict, hold: int, main_curve: list, resumed: dict,
          resubmitted_at: float) -> dict[str, Any]:
    """Compare the resumed trajectory with the main run: restored step, and losses step for step."""
    storage = Storage.from_config(cfg.storage)
    replayed = interrupted_losses(storage, run_id, interrupt_job) | {int(s): l for s, l in resumed.get("loss_curve", [])}
    main = {int(s): l for s, l in main_curve}
    comparison = compare_losses(main, replayed, cfg.resume.loss_rtol)
    restart = check_restart(hold, resumed.get("start_step"))
    first_at = resumed.get("first_step_completed_at")
    problems = [restart.line()] if restart else []
    if not comparison["ok"]:
        problems.append(f"replayed losses differ from the main run: max relative difference "
                        f"{comparison['max_rel_diff']:.3g} > tolerance {cfg.resume.loss_rtol}")
    return {
        "seed_checkpoint": seed, "interrupted_at_step": hold, "restored_step": resumed.get("start_step"),
        "restored_from": resumed.get("restored_from"),
        "seconds_to_first_resumed_step": round(first_at - resubmitted_at, 2) if first_at else None,
        "loss_comparison": comparison, "max_loss_diff": comparison["max_abs_diff"],
        "loss_rtol": cfg.resume.loss_rtol, "problems": problems,
    }


def interrupted_losses(storage: Storage, run_id: str, job: str) -> dict[int, float]:
    """Losses the interrupted job logged before it was stopped (its metrics.jsonl survives the stop)."""
    parts = ("runs", run_id, "stages", job, "metrics.jsonl")
    if not storage.exists(*parts):
        return {}
    rows = [json.loads(line) for line in storage.read_text(*parts).splitlines() if line.strip()]
    return {int(r["step"]): float(r["loss"]) for r in rows if "loss" in r}

