"""Code identity: the git commit and dirty flag, and the hash of the Ray working_dir package.

The working_dir shipped to every job is staged from exactly the job side: the core package
(tuneproof/core/, with the empty tuneproof/__init__.py above it), training/ and eval/. Its hash is
what ran, independent of the control plane, the CLI, tests, docs or local outputs in the checkout:
an edit to the CLI does not change the recorded working_dir_hash. The few control-plane modules that decide a
stage's verdict in the flow (the resume test's checks, promotion's refusals) are hashed apart (`code_hash`).
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterable
from pathlib import Path

from tuneproof.core.config import PROJECT_ROOT

JOB_PATHS = ("tuneproof/__init__.py", "tuneproof/core", "training", "eval")
"""What a Ray job needs, relative to the project root: the job side of the layers."""
_SKIP_DIRS = {"__pycache__", ".pytest_cache"}


def git_identity(root: Path = PROJECT_ROOT) -> dict:
    """{'git_sha': str|None, 'dirty': bool|None}; None when the tree is not a git checkout."""

    def git(*args: str) -> str | None:
        try:
            out = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=10)
        except (OSError, subprocess.TimeoutExpired):
            return None
        return out.stdout if out.returncode == 0 else None

    sha = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    return {"git_sha": sha.strip() if sha else None, "dirty": bool(status.strip()) if status is not None else None}


def job_files(root: Path = PROJECT_ROOT) -> list[Path]:
    return files_under(JOB_PATHS, root)


def files_under(paths: Iterable[str], root: Path = PROJECT_ROOT) -> list[Path]:
    """The files `paths` (files or folders, relative to `root`) hold, caches and bytecode left out."""
    files = []
    for entry in paths:
        base = root / entry
        for path in [base] if base.is_file() else sorted(base.rglob("*")):
            if path.is_file() and not (_SKIP_DIRS & set(path.relative_to(root).parts)) and path.suffix != ".pyc":
                files.append(path)
    return files


def tree_hash(files: list[Path], root: Path) -> str:
    """sha256 over (relative path, content) pairs in sorted order."""
    digest = hashlib.sha256()
    for path in sorted(files, key=lambda p: p.relative_to(root).as_posix()):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def staged_hash(target: Path) -> str:
    """tree_hash of a staged working_dir (its files but the .complete marker)."""
    files = [p for p in target.rglob("*") if p.is_file() and p.name != ".complete" and p.suffix != ".pyc"]
    return tree_hash([p for p in files if not (_SKIP_DIRS & set(p.relative_to(target).parts))], target)


def stage_working_dir(root: Path = PROJECT_ROOT) -> tuple[Path, str]:
    """Copy the job packages into a directory named by their hash; returns (dir, hash).

    The same code reuses the same directory, so Ray uploads it once per cluster (Ray names the upload
    by its own hash of the content). A reused directory is re-hashed first: a staged copy edited since
    (it sits in a shared temp dir) is staged again rather than shipped under the hash of other code.
    """
    files = job_files(root)
    digest = tree_hash(files, root)
    target = Path(tempfile.gettempdir()) / "tuneproof-workdir" / digest[:16]
    if not (target / ".complete").exists() or staged_hash(target) != digest:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=".stage-", dir=target.parent))
        for path in files:
            dest = staging / path.relative_to(root)
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, dest)
        (staging / ".complete").write_text(digest)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return target, digest


def working_dir_hash(root: Path = PROJECT_ROOT) -> str:
    """The hash `stage_working_dir` would give the job code now, without staging a copy."""
    return tree_hash(job_files(root), root)


def code_hash(paths: Iterable[str], root: Path = PROJECT_ROOT) -> str:
    """tree_hash of control-plane code outside the working_dir: the modules that decide a stage's verdict in the
    flow (a stage's `verdict_code`), which a fix changes without changing working_dir_hash."""
    return tree_hash(files_under(paths, root), root)
