"""The fault-injection harness: scenarios, the lab they run in, the reference run, the table.

    python -m faults [--only NAME,...]      (make faults; tests/test_faults.py under `pytest -m faults`)

A scenario is a function `(lab) -> FaultRow` registered with `@scenario(order=N, name=...)` in a
module `faults/f_<topic>.py` (found by faults/__main__.py, so a new topic adds a file and touches no
other). It injects one fault into a real run of the small workload (WORKLOAD, stages ONLY) on the
embedded default and says how the run ended compared with the reference: the same workload run once,
uninterrupted, per harness invocation (`lab.reference()`). On CPU fp32 a replay is exact, so "same"
means the same content hash of the exported weights.

The lab is a local Ray head, a Prefect server and a tiny base model under one work directory, started
the way tests/conftest.py starts them (tuneproof.app.local, tuneproof.app.servers). Runs go through
the command line in a subprocess (`python -m tuneproof.app.cli run ...`), as a user's would, so a
scenario can kill it, hold it, or give it an environment of its own.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from tuneproof.app.local import RayHead, free_port, start_ray_head
from tuneproof.app.servers import FAKE_AWS, OFFLINE_ENV, environ, prefect_server
from tuneproof.control import record as records
from tuneproof.control.resume_evidence import as_ledger, compare_ledgers
from tuneproof.core.config import PROJECT_ROOT
from tuneproof.core.storage import Storage
from tuneproof.core.summaries_training import FinetuneSummary

Outcome = Literal["survived", "failed-as-expected", "FAILED"]

WORKLOAD: tuple[str, ...] = (
    "train.max_steps=40",
    "train.checkpoint_every=10",
    "train.log_every=1",  # every step's loss reaches metrics.jsonl: the step a fault hit is exact
    "train.max_failures=1",
)
"""`--set` overrides of every run: small enough that a run takes well under a minute of training."""
ONLY = ("data", "finetune")
"""The stages a fault run needs: the data it trains on and the fine-tune that exports weights."""


class FaultRow(BaseModel):
    """One line of the table: a fault, how it ended, and how that compares with the reference run."""

    model_config = ConfigDict(extra="forbid")

    fault: str
    injected_at: str
    """When, in the run's terms: 'step 23 of 40', 'during checkpoint 30 save'."""
    outcome: Outcome
    """survived: the run finished as the reference did; failed-as-expected: it failed with the right class
    and nothing was lost; FAILED: anything else (the fault won, or the harness could not inject it)."""
    failure_class: str | None = None
    final_loss: float | None = None
    weights_sha256: str | None = None
    """content_sha256 of the export's manifest (tuneproof.core.markers)."""
    same_as_reference: bool | None = None
    same_data_order: bool | None = None
    """The fine-tune's data-order ledger equals the reference's on every step both trained (None: no ledger)."""
    seconds: float
    time_lost_s: float | None = None
    """seconds minus the reference run's seconds: what the fault cost."""
    how: str
    """How the fault was injected, concretely enough to redo by hand."""
    notes: str = ""


@dataclass(frozen=True)
class Scenario:
    order: int
    name: str
    run: Callable[[Lab], FaultRow]


SCENARIOS: dict[str, Scenario] = {}


def scenario(order: int, name: str) -> Callable[[Callable[[Lab], FaultRow]], Callable[[Lab], FaultRow]]:
    """Register a scenario; rows are run and shown by `order`, selected by `name` (--only)."""

    def register(fn: Callable[[Lab], FaultRow]) -> Callable[[Lab], FaultRow]:
        if name in SCENARIOS:
            raise ValueError(f"fault scenario {name!r} is registered twice ({SCENARIOS[name].run.__module__})")
        SCENARIOS[name] = Scenario(order, name, fn)
        return fn

    return register


def ordered(names: list[str] | None = None) -> list[Scenario]:
    """The registered scenarios by order, or only those named; an unknown name is an error naming the known."""
    if names:
        unknown = [n for n in names if n not in SCENARIOS]
        if unknown:
            raise KeyError(f"no fault scenario {', '.join(unknown)}; known: {', '.join(sorted(SCENARIOS))}")
    chosen = [s for s in SCENARIOS.values() if not names or s.name in names]
    return sorted(chosen, key=lambda s: (s.order, s.name))


def failed_row(sc: Scenario, error: BaseException, seconds: float) -> FaultRow:
    """The row of a scenario that raised: the harness itself could not complete it."""
    return FaultRow(
        fault=sc.name,
        injected_at="?",
        outcome="FAILED",
        seconds=round(seconds, 1),
        how="?",
        notes=f"scenario raised {type(error).__name__}: {error}"[:500],
    )


# ---------------------------------------------------------------- runs


@dataclass
class RunOutcome:
    """How one `tuneproof run` ended: exit code, its record as the run left it, its wall time."""

    run_id: str
    exit_code: int
    seconds: float
    output: str
    storage: Storage
    record: records.RunRecord | None = None
    """Read when the run ended: a later run of the same id (a continuation) does not change it."""

    @property
    def failure_class(self) -> str | None:
        rec = self.record
        return rec.failure_class.value if rec and rec.failure_class else None

    @property
    def finetune(self) -> FinetuneSummary | None:
        rec = self.record
        return rec.summary("finetune", FinetuneSummary) if rec else None

    def tail(self, chars: int = 1500) -> str:
        return self.output[-chars:]


@dataclass
class RunProcess:
    """A `tuneproof run` in progress (a subprocess in its own session, output to a log file)."""

    run_id: str
    proc: subprocess.Popen
    log: Path
    storage: Storage
    started: float

    def wait(self, timeout: float = 900) -> RunOutcome:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            code = self.proc.wait()
        output = self.log.read_text(errors="replace")
        seconds = time.monotonic() - self.started
        try:
            record = records.load(self.storage, self.run_id)
        except FileNotFoundError:
            record = None
        return RunOutcome(self.run_id, code, seconds, output, self.storage, record)

    def alive(self) -> bool:
        return self.proc.poll() is None


@dataclass
class Lab:
    """A Ray head, a Prefect server and a tiny base model under `workdir`; runs the workload against them."""

    workdir: Path
    head: RayHead
    prefect_url: str
    model_dir: Path
    _reference: RunOutcome | None = field(default=None, repr=False)

    @property
    def storage_root(self) -> Path:
        """The default storage root: the reference and every local-disk row share it (and its dataset)."""
        return self.workdir / "storage"

    def sets(self, storage_root: str | Path | None = None, extra: tuple[str, ...] | list[str] = ()) -> list[str]:
        root = str(storage_root or self.storage_root)
        return [
            f"cluster.address={self.head.address}",
            f"cluster.auth_token_file={self.head.token_file}",
            f"storage.root={root}",
            f"model.source={self.model_dir}",
            *WORKLOAD,
            *extra,
        ]

    def env(self, extra: dict[str, str] | None = None) -> dict[str, str]:
        return {
            **os.environ,
            **OFFLINE_ENV,
            "PREFECT_API_URL": f"{self.prefect_url}/api",
            "PREFECT_UI_API_URL": f"{self.prefect_url}/api",
            **FAKE_AWS,  # only ever used against the lab's own S3-compatible server
            **(extra or {}),
        }

    def start(
        self,
        run_id: str,
        *,
        only: tuple[str, ...] | None = ONLY,
        until: str | None = None,
        sets: tuple[str, ...] | list[str] = (),
        storage_root: str | Path | None = None,
        endpoint_url: str | None = None,
        env: dict[str, str] | None = None,
    ) -> RunProcess:
        """Start `tuneproof run --run-id run_id` over the workload in a subprocess; returns at once. `only` picks
        the stages of a fresh run; `until` (with only=None) runs the pipeline up to a stage, a continuable run."""
        extra = [*sets, *([f"storage.endpoint_url={endpoint_url}"] if endpoint_url else [])]
        args = [sys.executable, "-m", "tuneproof.app.cli", "run", "--run-id", run_id]
        if only:
            args += ["--only", ",".join(only)]
        if until:
            args += ["--until", until]
        for s in self.sets(storage_root, extra):
            args += ["--set", s]
        log = self.workdir / "logs" / f"{run_id}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "ab") as out:
            proc = subprocess.Popen(
                args,
                cwd=PROJECT_ROOT,
                env=self.env(env),
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        storage = Storage(str(storage_root or self.storage_root), endpoint_url)
        return RunProcess(run_id, proc, log, storage, time.monotonic())

    def run(self, run_id: str, **kwargs: Any) -> RunOutcome:
        """`start` and wait for the run to end."""
        return self.start(run_id, **kwargs).wait()

    def reference(self) -> RunOutcome:
        """The workload run once without a fault (cached for this lab); a failed reference is an error."""
        if self._reference is None:
            ref = self.run("reference")
            summary = ref.finetune
            if ref.exit_code != 0 or summary is None or summary.export_sha256 is None:
                raise RuntimeError(f"the reference run failed (exit {ref.exit_code}):\n{ref.tail()}")
            self._reference = ref
        return self._reference

    def compare(self, run: RunOutcome) -> dict[str, Any]:
        """FaultRow fields comparing a run's fine-tune with the reference's: failure class, loss, hash,
        sameness of the weights and of the data order (every step both trained), time lost."""
        ref, summary = self.reference(), run.finetune
        ref_summary = ref.finetune
        assert ref_summary is not None  # reference() checked it
        sha = summary.export_sha256 if summary else None
        order = compare_ledgers(as_ledger(ref_summary.ledger), as_ledger(summary.ledger)) if summary else None
        return {
            "failure_class": run.failure_class,
            "final_loss": summary.final_loss if summary else None,
            "weights_sha256": sha,
            "same_as_reference": None if sha is None else sha == ref_summary.export_sha256,
            "same_data_order": order["ok"] if order and order["steps_compared"] else None,
            "seconds": round(run.seconds, 1),
            "time_lost_s": round(run.seconds - ref.seconds, 1),
        }


@contextlib.contextmanager
def lab(workdir: Path) -> Iterator[Lab]:
    """Start a Ray head and a Prefect server under workdir, build the tiny base model; stop both after.
    Start-up may take minutes on a busy machine (a fresh Prefect database): both wait up to 10 minutes."""
    from tuneproof.app.tiny_model import ensure_tiny_model

    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = workdir / "base-models" / "tiny-qwen2"
    ensure_tiny_model(str(model_dir), str(PROJECT_ROOT / "data" / "dates" / "dates.jsonl"))
    head = start_head(workdir / "ray-state")
    try:
        with prefect_server(workdir / "prefect-home", wait_s=600) as url:
            yield Lab(workdir, head, url, model_dir)
    finally:
        head.stop()


def start_head(state: Path, dashboard_port: int | None = None, gcs_port: int | None = None) -> RayHead:
    """A Ray head that finished starting, on the given ports (a restart keeps its address); start_ray_head
    starts it again while it exits during start-up."""
    # The head's environment (so every job's) has the fake S3 credentials, as pods get theirs from IRSA.
    with environ(FAKE_AWS):
        port = dashboard_port or free_port()
        return start_ray_head(state, num_cpus=4, dashboard_port=port, gcs_port=gcs_port, wait_s=600)


# ---------------------------------------------------------------- report


def machine_facts() -> dict[str, Any]:
    facts: dict[str, Any] = {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
    }
    with contextlib.suppress(OSError, ValueError, IndexError):
        meminfo = Path("/proc/meminfo").read_text().splitlines()
        facts["memory_gib"] = round(int(meminfo[0].split()[1]) / 2**20, 1)
    for package in ("ray", "torch", "transformers"):
        with contextlib.suppress(Exception):
            from importlib.metadata import version

            facts[package] = version(package)
    return facts


def report(rows: list[FaultRow], total_seconds: float, machine: dict[str, Any]) -> dict[str, Any]:
    """The faults.json document."""
    return {
        "rows": [r.model_dump(mode="json") for r in rows],
        "total_seconds": round(total_seconds, 1),
        "machine": machine,
    }


def write_report(path: Path, rows: list[FaultRow], total_seconds: float, machine: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report(rows, total_seconds, machine), indent=2) + "\n")


TABLE_COLUMNS = (
    "fault", "injected at", "outcome", "class", "final loss", "weights", "same", "order", "s", "lost s", "how",
)  # fmt: skip


def table_cells(row: FaultRow) -> list[str]:
    """One row's cells, in TABLE_COLUMNS order. Pure."""
    same = {True: "yes", False: "NO", None: "-"}[row.same_as_reference]
    order = {True: "same", False: "DIFFERS", None: "-"}[row.same_data_order]
    return [
        row.fault,
        row.injected_at,
        row.outcome,
        row.failure_class or "-",
        "-" if row.final_loss is None else f"{row.final_loss:.4f}",
        (row.weights_sha256 or "-")[:12],
        same,
        order,
        f"{row.seconds:.0f}",
        "-" if row.time_lost_s is None else f"{row.time_lost_s:+.0f}",
        row.how,
    ]


def render_table(rows: list[FaultRow], total_seconds: float):
    """A rich Table of the rows; notes go under it as a caption."""
    from rich.markup import escape
    from rich.table import Table

    table = Table(title=f"fault injection: {len(rows)} rows in {total_seconds:.0f} s", show_lines=True)
    for column in TABLE_COLUMNS:
        table.add_column(column, overflow="fold")
    for row in rows:
        style = "red" if row.outcome == "FAILED" else None
        table.add_row(*map(escape, table_cells(row)), style=style)  # causes quote paths like [/__w/...]
    notes = [escape(f"{row.fault}: {row.notes}") for row in rows if row.notes]
    if notes:
        table.caption = "\n".join(notes)
    return table
