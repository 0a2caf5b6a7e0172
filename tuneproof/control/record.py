"""The run record: everything needed to explain an observation, in runs/<run>/record.json.

Identity (image digest, cluster, code SHA + dirty flag, working_dir hash, config + hash,
runtime_env additions, dataset hash) and, per stage: its jobs (entrypoint, submission id,
working_dir hash, runtime_env additions, times), result summary, failure class and cause.
The flow is the only writer; it rewrites the whole document after each stage.
"""

from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from tuneproof.core.config import PipelineConfig
from tuneproof.core.results import now_iso
from tuneproof.core.storage import Storage

RECORD = "record.json"


def make_run_id() -> str:
    """Sortable and unique: UTC time plus random bytes."""
    return f"{datetime.now(timezone.utc):%Y%m%d-%H%M%S}-{secrets.token_hex(3)}"


def new_record(run_id: str, cfg: PipelineConfig, code: dict, flow_run_id: str | None) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "flow_run_id": flow_run_id,
        "created_at": now_iso(),
        "updated_at": now_iso(),
        "status": "running",
        "failure_class": None,
        "cause": None,
        "profile": cfg.profile,
        "code": code,
        "config": cfg.model_dump(mode="json"),
        "config_hash": cfg.config_hash(),
        "runtime_env_additions": cfg.runtime_env.model_dump(),
        "cluster": {},
        "data": {},
        "stages": {},
        "promotion": None,
        "invocations": [],
    }


def stage_entry(stage: str, status: str, failure_class: str | None, cause: str | None, summary: dict,
                jobs: list[dict], started_at: str, ended_at: str) -> dict[str, Any]:
    return {
        "stage": stage, "status": status, "failure_class": failure_class, "cause": cause,
        "started_at": started_at, "ended_at": ended_at, "summary": summary, "jobs": jobs,
    }


def save(storage: Storage, record: dict[str, Any]) -> None:
    record["updated_at"] = now_iso()
    storage.write_json(record, "runs", record["run_id"], RECORD)


def load(storage: Storage, run_id: str) -> dict[str, Any]:
    if not storage.exists("runs", run_id, RECORD):
        raise FileNotFoundError(f"no run record for run {run_id!r} under {storage.uri('runs')}")
    return storage.read_json("runs", run_id, RECORD)


def list_records(storage: Storage) -> list[dict[str, Any]]:
    """Every readable record, newest first."""
    records = []
    for run_id in storage.listdir("runs"):
        if storage.exists("runs", run_id, RECORD):
            records.append(storage.read_json("runs", run_id, RECORD))
    return sorted(records, key=lambda r: r.get("created_at", ""), reverse=True)
