"""Fault-injection hooks inside fine-tune workers: inert unless the fault harness (faults/) sets their variable.

    TUNEPROOF_FAULT_AT=checkpoint:<step>   rank 0 SIGKILLs itself once the shards of checkpoint <step> are
                                           uploaded and before its completion marker is written (once per
                                           run: the firing is recorded in the stage's fault-fired.json first)
    TUNEPROOF_FAULT_AT=sampler:<step>      a planted sampler bug: a worker that restores the checkpoint of
                                           <step> loses its epoch seed, and draws every epoch's order from
                                           an unseeded generator (each rank its own) from then on
    TUNEPROOF_FAULT_PIDS=<dir>             every rank writes <dir>/rank<r>.json ({pid, step}) after each step,
                                           so the harness can SIGKILL a worker at a step it chooses
    TUNEPROOF_FAULT_STEP_S=<seconds>       every rank sleeps that long after each step: a slower model's
                                           steps, so a drain deadline of seconds falls mid-run

A fault run forwards them to the job by name (runtime_env.forward_env); no other run has them.
"""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tuneproof.core.storage import Storage

if TYPE_CHECKING:
    from training.train_data import StepBatches

FAULT_AT = "TUNEPROOF_FAULT_AT"
FAULT_PIDS = "TUNEPROOF_FAULT_PIDS"
FAULT_STEP_S = "TUNEPROOF_FAULT_STEP_S"
FIRED = "fault-fired.json"
KINDS = ("checkpoint", "sampler")


class BadFaultSpec(ValueError):
    """A TUNEPROOF_FAULT_AT value the hooks cannot read."""


@dataclass(frozen=True)
class FaultPoint:
    kind: str
    step: int

    def spec(self) -> str:
        return f"{self.kind}:{self.step}"


def parse_fault_at(value: str) -> FaultPoint:
    """'checkpoint:30' -> FaultPoint('checkpoint', 30). Pure; the error names the value and the form expected."""
    kind, _, step = value.strip().partition(":")
    if kind not in KINDS or not step.isdigit() or int(step) < 1:
        raise BadFaultSpec(
            f"{FAULT_AT}={value!r} is not a fault point: expected <kind>:<step> with kind one of "
            f"{', '.join(KINDS)} and step a positive integer, e.g. checkpoint:30"
        )
    return FaultPoint(kind, int(step))


def fault_point(environ: dict[str, str] | None = None) -> FaultPoint | None:
    value = (os.environ if environ is None else environ).get(FAULT_AT)
    return parse_fault_at(value) if value else None


def after_step(rank: int, step: int) -> None:
    """With TUNEPROOF_FAULT_STEP_S set: sleep that long. With TUNEPROOF_FAULT_PIDS set: tell the harness which
    process is at which step."""
    if pause := os.environ.get(FAULT_STEP_S):
        time.sleep(float(pause))
    folder = os.environ.get(FAULT_PIDS)
    if not folder:
        return
    target = Path(folder, f"rank{rank}.json")
    tmp = target.with_suffix(".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "step": step, "time": time.time()}))
    os.replace(tmp, target)  # the harness never reads half a file


def before_marker(storage: Storage, fired_parts: tuple[str, ...], rank: int, step: int) -> None:
    """With TUNEPROOF_FAULT_AT=checkpoint:<step> on rank 0, at that step: record the firing, then SIGKILL
    this process (no handler runs, as when the kernel's OOM killer or a node loss ends it)."""
    point = fault_point()
    if point is None or point.kind != "checkpoint" or point.step != step or rank != 0:
        return
    if storage.exists(*fired_parts, FIRED):  # fired already: a restarted attempt must get past it
        return
    storage.write_json({"fault": point.spec(), "pid": os.getpid(), "time": time.time()}, *fired_parts, FIRED)
    os.kill(os.getpid(), signal.SIGKILL)


def after_restore(batches: StepBatches, step: int) -> None:
    """With TUNEPROOF_FAULT_AT=sampler:<step>, after restoring that step: plant the sampler bug the data-order
    ledger must catch (the resumed run's losses can still look close to the reference's)."""
    point = fault_point()
    if point is None or point.kind != "sampler" or point.step != step:
        return
    import numpy as np

    batches.order = lambda epoch: np.random.default_rng().permutation(len(batches.examples))
