"""Secrets reach a job by name: `runtime_env.forward_env: [NAME, ...]`.

Ray logs a job's runtime_env on every node, and the pipeline records and publishes its config, so
neither may carry a value. Locally the submitting side writes the named variables' values to a
private file (mode 0600, in a private directory outside the storage root) and passes the job only
its path (`TUNEPROOF_FORWARD_ENV_FILE`); the job side loads it into os.environ before the stage body
runs (the job's entry and each Ray Train worker, through jobkit.load_context). On EKS no file is
written: the Ray pods get the variables from a Kubernetes Secret (`envFrom: secretRef`), and the job
side only checks that every named variable is there.

The run record keeps the names only (`forwarded_env`).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import MutableMapping
from pathlib import Path

FILE_VAR = "TUNEPROOF_FORWARD_ENV_FILE"


class ForwardEnvMissing(Exception):
    """A variable named in runtime_env.forward_env is not set where it must be."""


def private_dir() -> Path:
    """A directory only this user can read, outside any storage root: <tmp>/tuneproof-env-<uid>."""
    path = Path(tempfile.gettempdir()) / f"tuneproof-env-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    os.chmod(path, 0o700)  # an existing directory keeps no wider mode
    return path


def run_key(run_id: str, storage_root: str) -> str:
    """The value files' name for one run: its id and its storage root, since two runs with one id may write
    to two roots on one machine at once (two checkouts' demos), and one must not remove the other's file."""
    return f"{run_id}-{hashlib.sha256(storage_root.encode()).hexdigest()[:12]}"


def write_values(names: list[str], run_id: str, job: str, environ: MutableMapping[str, str] | None = None) -> Path:
    """Write the named variables' values (from the submitting environment) to a 0600 file; its path.

    Raises ForwardEnvMissing naming every variable the submitting environment lacks."""
    environ = os.environ if environ is None else environ
    missing = [n for n in names if n not in environ]
    if missing:
        raise ForwardEnvMissing(
            f"runtime_env.forward_env names {', '.join(missing)}, not set in the submitting environment: "
            "export it before `tuneproof run` (or drop it from forward_env)"
        )
    path = private_dir() / f"{run_id}-{job}.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({n: environ[n] for n in names}, f)
    return path


def discard(run_id: str, job: str | None = None) -> None:
    """Remove a job's value file (or every file of the run) once nothing will read it again."""
    folder = private_dir()
    pattern = f"{run_id}-{job}.json" if job else f"{run_id}-*.json"
    for path in folder.glob(pattern):
        path.unlink(missing_ok=True)


def load(names: list[str], environ: MutableMapping[str, str] | None = None) -> None:
    """Job side: put the forwarded values into the environment, then check every name is set.

    The file stays where it is (other processes of the job, e.g. Ray Train workers, read it too); the
    submitting side removes it when the job has ended."""
    environ = os.environ if environ is None else environ
    path = environ.get(FILE_VAR)
    if path:
        try:
            values = json.loads(Path(path).read_text())
        except (OSError, ValueError) as e:
            raise ForwardEnvMissing(
                f"cannot read the forwarded environment file {path} ({type(e).__name__}); "
                "the submitting side writes it on this machine: a job on another machine gets forward_env "
                "from a Kubernetes Secret instead"
            ) from None
        for name in names:
            if name in values:
                environ[name] = values[name]
    missing = [n for n in names if n not in environ]
    if missing:
        raise ForwardEnvMissing(
            f"runtime_env.forward_env names {', '.join(missing)}, not set in the job's environment: on EKS add "
            "it to the Secret the Ray pods load with envFrom (deployments/README.md, 'Secrets for jobs')"
        )


def presence(names: list[str], environ: MutableMapping[str, str] | None = None) -> dict[str, bool]:
    """Which forwarded variables a process sees: evidence without the values."""
    environ = os.environ if environ is None else environ
    return {n: bool(environ.get(n)) for n in names}
