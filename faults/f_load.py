"""Load (issue 11): three whole pipelines started at once on one Ray head and one storage root.

    python -m faults --only load-3-runs

They must all finish, with no collision of Ray job ids, storage paths or leases; runs whose Ray Train workers
cannot be placed wait (the follower says "waiting for resources"). Their promotions serialize through the
production pointer's compare-and-swap: every decision is in its run's record and the registry, and the
pointer is read back and validated all along (never torn). A run refused because production moved after
its evaluation ("re-evaluate") is continued once with `run --run-id`, which re-evaluates it.
Prints its own small table (runs, records, registry history); the row and the table go into faults.json.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from faults.f_flow import FLOW
from faults.harness import FaultRow, Lab, RunOutcome, scenario
from tuneproof.control import registry
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

RUNS = ("load-a", "load-b", "load-c")
MOVED = ("production model changed since evaluation", "lost a concurrent promotion")
"""A promotion refused because another run's promotion came first: serialized, and worth a re-evaluation."""
MODEL = "dates-qwen2-tiny"
"""configs/local.yaml's model.name: the registry entry the three runs promote into."""


class PointerWatch:
    """Reads production.json in a loop while the runs go; every read must be a whole, valid pointer."""

    def __init__(self, storage: Storage, name: str):
        self.storage, self.name = storage, name
        self.reads = 0
        self.torn: list[str] = []
        self.versions: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="pointer-watch")

    def __enter__(self) -> PointerWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()
        self._thread.join(10)

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            try:
                pointer, _ = registry.read_pointer(self.storage, self.name)
            except registry.RegistryUnreadable as e:  # a torn or half-written pointer
                self.torn.append(str(e)[:200])
                continue
            except OSError:  # the models folder does not exist yet
                continue
            self.reads += 1
            version = pointer.version if pointer else None
            if pointer is not None and not pointer.content_sha256:  # every gated promotion names its content
                self.torn.append(f"incomplete pointer: {pointer.model_dump_json()[:200]}")
            if version and (not self.versions or self.versions[-1] != version):
                self.versions.append(version)


def decision(outcome: RunOutcome) -> str:
    rec = outcome.record
    if rec is None or rec.promotion is None:
        return "no decision"
    p = rec.promotion
    return (
        f"promoted {p.version} (previous {p.previous_version or 'none'})"
        if p.promoted
        else "refused: " + "; ".join(p.reasons)
    )


def print_table(outcomes: list[RunOutcome], history: list[dict[str, Any]], watch: PointerWatch) -> None:
    from rich.console import Console
    from rich.table import Table

    runs = Table(title="load: three pipelines at once")
    for column in ("run", "exit", "status", "s", "Ray jobs", "decision"):
        runs.add_column(column, overflow="fold")
    for o in outcomes:
        rec = o.record
        jobs = [j.submission_id for e in (rec.stages.values() if rec else []) for j in e.jobs]
        status = rec.status if rec else "no record"
        runs.add_row(o.run_id, str(o.exit_code), status, f"{o.seconds:.0f}", str(len(jobs)), decision(o))
    reg = Table(title=f"registry history of {MODEL} (pointer read {watch.reads} times, torn {len(watch.torn)})")
    for column in ("version", "run", "production"):
        reg.add_column(column)
    for row in history:
        reg.add_row(row["version"], str(row.get("run_id")), "yes" if row.get("production") else "")
    Console(width=200).print(runs, reg)


def job_ids(outcomes: list[RunOutcome]) -> list[str]:
    return [j.submission_id for o in outcomes if o.record for e in o.record.stages.values() for j in e.jobs]


@scenario(order=90, name="load-3-runs")
def three_at_once(lab: Lab) -> FaultRow:
    ref = lab.reference()
    storage = Storage(str(lab.storage_root))
    began = time.monotonic()
    with PointerWatch(storage, MODEL) as watch:
        procs = [lab.start(run_id, only=None, sets=FLOW) for run_id in RUNS]
        outcomes = [p.wait(1500) for p in procs]
        continued = []
        for o in outcomes:  # production moved after this run evaluated: continue it once, it re-evaluates
            if o.exit_code != 0 and any(why in decision(o) for why in MOVED):
                continued.append(o.run_id)
        outcomes = [lab.run(o.run_id, only=None, sets=FLOW) if o.run_id in continued else o for o in outcomes]
    seconds = time.monotonic() - began
    history = [
        {**row, "run_id": (row.get("card") or {}).get("run_id") or run_of(row["version"])}
        for row in registry.show_model(storage, MODEL)["versions"]
    ]
    print_table(outcomes, history, watch)
    problems = []
    for o in outcomes:
        if o.exit_code != 0:
            problems.append(f"{o.run_id} exited {o.exit_code}: {o.tail(300)}")
    ids = job_ids(outcomes)
    if len(ids) != len(set(ids)):
        problems.append(f"Ray submission ids collided: {sorted(ids)}")
    exports = {o.finetune.export_uri for o in outcomes if o.finetune}
    if len(exports) != len(RUNS):
        problems.append(f"the runs' exports are not {len(RUNS)} distinct paths: {sorted(map(str, exports))}")
    if watch.torn:
        problems.append(f"production.json read torn {len(watch.torn)} time(s): {watch.torn[0]}")
    promoted = [o.run_id for o in outcomes if o.record and o.record.promotion and o.record.promotion.promoted]
    in_registry = {row["run_id"] for row in history}
    if not set(promoted) <= in_registry:
        problems.append(f"promoted runs {promoted} are not all in the registry history {sorted(in_registry)}")
    hashes = {o.finetune.export_sha256 for o in outcomes if o.finetune}
    ref_tuned = ref.finetune
    same = bool(ref_tuned) and hashes == {ref_tuned.export_sha256 if ref_tuned else None}
    waited = [o.run_id for o in outcomes if "waiting for resources" in o.output]
    notes = (
        "; ".join(problems)
        if problems
        else (
            f"3 runs, 3 records, {len(ids)} distinct Ray jobs; decisions: "
            + ", ".join(f"{o.run_id} {decision(o)}" for o in outcomes)
            + f"; continued after a moved pointer: {', '.join(continued) or 'none'}"
            + f"; waited for resources: {', '.join(waited) or 'none'}"
            + f"; pointer versions seen {' -> '.join(watch.versions)} over {watch.reads} reads, none torn"
        )
    )
    tuned: FinetuneSummary | None = outcomes[-1].finetune
    return FaultRow(
        fault="load-3-runs",
        injected_at="3 whole pipelines started together",
        outcome="FAILED" if problems else "survived",
        final_loss=tuned.final_loss if tuned else None,
        weights_sha256=tuned.export_sha256 if tuned else None,
        same_as_reference=same,
        seconds=round(seconds, 1),
        time_lost_s=round(seconds - 3 * ref.seconds, 1),
        how="3 `tuneproof run` subprocesses, distinct run ids, one storage root and Ray head; production.json read every 20 ms",
        notes=notes,
    )


def run_of(version: str) -> str | None:
    """`v0003-load-b` -> `load-b` (registry versions are v<NNNN>-<run_id>)."""
    _, _, run_id = version.partition("-")
    return run_id or None
