"""Content hashes for completion markers and export manifests: what a verdict is bound to.

A checkpoint's completion marker lists every file with its size and sha256; an export carries a
manifest (EXPORT_MANIFEST) with the sha256 of every file and one `content_sha256` over them, and
says which run, invocation and Ray Train run produced it. Evaluate records the content hash of the
model it scored and promote copies only a model with that hash, so a rerun or an edited file can
never be promoted on someone else's evidence; a file beside them that the manifest does not list (a
stray adapter that from_pretrained would attach) fails the check too.

The functions above the line are pure (names, digests and comparisons); `stored_digests` and
`local_digests` at the bottom are the edge that reads files, on local disk or S3 alike. Hashes
detect accidents and stale evidence, not an attacker who can rewrite a file and its marker alike.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict

from tuneproof.core.results import Model
from tuneproof.core.storage import Storage

EXPORT_MANIFEST = "tuneproof-export.json"
"""The export's manifest: every model file with its sha256, and the content hash over them."""
COMPLETION_MARKER = "tuneproof_complete.json"
"""A checkpoint's or export's completion marker, written last (training.checkpointing writes it)."""
NOT_CONTENT = frozenset({EXPORT_MANIFEST, COMPLETION_MARKER, "MODEL_CARD.md", "card.json"})
"""Files that describe a model rather than being part of it: left out of its content hash."""
READ_CHUNK = 8 * 1024 * 1024
"""Bytes a hash reads at a time: a multi-GB shard never sits in memory whole."""


class FileDigest(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    size: int
    sha256: str


Digests = dict[str, FileDigest]
"""Relative path -> size and sha256."""


class ExportManifest(Model):
    """runs/<run>/model*/tuneproof-export.json: the export's content and where it came from."""

    content_sha256: str
    files: Digests
    run_id: str
    invocation: int | None = None
    """The run record's invocation whose fine-tune wrote it (None when the job was not told)."""
    run_name: str
    """The Ray Train run (RunConfig.name) whose weights these are."""
    step: int
    written_at: str


# ---- pure -------------------------------------------------------------------------------------


def content_sha256(files: Digests) -> str:
    """One hash over (path, sha256) of every content file, in path order; markers and cards left out."""
    return hash_of_hashes({name: d.sha256 for name, d in content_files(files).items()})


def hash_of_hashes(hashes: dict[str, str]) -> str:
    """sha256 over 'path NUL sha256 LF' in path order: one name for a set of files (an eval split's shards)."""
    digest = hashlib.sha256()
    for name in sorted(hashes):
        digest.update(f"{name}\0{hashes[name]}\n".encode())
    return digest.hexdigest()


def content_files(files: Digests) -> Digests:
    """The files that are the model (or checkpoint) itself: markers, manifests, cards and caches left out."""
    return {name: d for name, d in files.items() if is_content(name)}


def is_content(name: str) -> bool:
    """Whether a file (by path) is part of the model or checkpoint: not a marker, manifest, card or cache."""
    return Path(name).name not in NOT_CONTENT and "__pycache__" not in Path(name).parts and not name.endswith(".pyc")


def unlisted_problems(listed: Digests, present: Iterable[str]) -> list[str]:
    """Each content file present that the manifest does not list, as 'name (why)'. Such a file is loaded with
    the model (a LoRA adapter beside the weights is attached by from_pretrained) but not hashed with it."""
    return [f"{name} (not listed in the manifest)" for name in sorted(set(present) - set(listed)) if is_content(name)]


def digest_problems(expected: Digests, present: Digests) -> list[str]:
    """Each expected file that is absent, of another size or of other content, as 'name (why)'."""
    problems = []
    for name, want in sorted(expected.items()):
        seen = present.get(name)
        if seen is None:
            problems.append(f"{name} (missing, expected {want.size} bytes)")
        elif seen.size != want.size:
            problems.append(f"{name} (size {seen.size} bytes, expected {want.size})")
        elif seen.sha256 != want.sha256:
            problems.append(f"{name} (sha256 {seen.sha256[:12]}, expected {want.sha256[:12]})")
    return problems


def parse_digests(doc: Any) -> Digests:
    """A marker's {"files": {name: size}, "sha256": {name: hex}} (or a manifest's files) as Digests."""
    sizes, hashes = doc["files"], doc.get("sha256")
    if hashes is None:
        return {str(k): FileDigest.model_validate(v) for k, v in sizes.items()}
    missing = sorted(set(sizes) - set(hashes))
    if missing:
        raise ValueError(f"no sha256 for {', '.join(missing)}")
    return {str(k): FileDigest(size=int(v), sha256=str(hashes[k])) for k, v in sizes.items()}


def marker_fields(files: Digests) -> dict[str, dict[str, Any]]:
    """The "files" (sizes) and "sha256" fields of a completion marker."""
    return {
        "files": {n: d.size for n, d in sorted(files.items())},
        "sha256": {n: d.sha256 for n, d in sorted(files.items())},
    }


# ---- the edge: reading files ------------------------------------------------------------------


def _sha256_file(f: IO[bytes]) -> tuple[int, str]:
    """(size, sha256) of an open binary file, read in chunks so a multi-GB shard never sits in memory."""
    digest, size = hashlib.sha256(), 0
    while chunk := f.read(READ_CHUNK):
        digest.update(chunk)
        size += len(chunk)
    return size, digest.hexdigest()


def local_digests(root: str | Path, names: Iterable[str] | None = None, threads: int = 1) -> Digests:
    """Size and sha256 of files under a local directory (all of them, or those named); `threads` files at
    a time (hashlib lets go of the GIL while it hashes, so the threads hash on as many cores)."""
    base = Path(root)
    paths = [base / n for n in (names if names is not None else local_names(base))]
    paths = [path for path in paths if path.is_file()]

    def digest(path: Path) -> FileDigest:
        with path.open("rb") as f:
            size, sha = _sha256_file(f)
        return FileDigest(size=size, sha256=sha)

    if threads > 1 and len(paths) > 1:
        with ThreadPoolExecutor(min(threads, len(paths))) as pool:
            found = list(pool.map(digest, paths))
    else:
        found = [digest(path) for path in paths]
    return {path.relative_to(base).as_posix(): d for path, d in zip(paths, found)}


def stored_digests(storage: Storage, *parts: str, names: Iterable[str] | None = None) -> Digests:
    """Size and sha256 of files under a storage location (all of them, or those named), read in chunks."""
    base = storage.path(*parts).rstrip("/")
    if names is None:
        names = stored_names(storage, *parts)
    out: Digests = {}
    for name in sorted(names):
        try:
            with storage.fs.open(f"{base}/{name}", "rb") as f:
                size, sha = _sha256_file(f)
        except FileNotFoundError:
            continue
        out[name] = FileDigest(size=size, sha256=sha)
    return out


def stored_names(storage: Storage, *parts: str) -> list[str]:
    """Every file under a storage location, by path relative to it (none when it does not exist)."""
    base = storage.path(*parts).rstrip("/")
    try:
        found = storage.fs.find(base)
    except FileNotFoundError:
        return []
    return [p[len(base) :].lstrip("/") for p in found if p.startswith(base + "/")]


def local_names(root: str | Path) -> list[str]:
    """Every file under a local directory, by path relative to it."""
    base = Path(root)
    return sorted(p.relative_to(base).as_posix() for p in base.rglob("*") if p.is_file())


class ExportUnverified(ValueError):
    """An export whose files do not match its manifest (or that has none): it is not the model that was judged."""


def read_export_manifest(storage: Storage, *parts: str) -> ExportManifest:
    """The export's manifest; ExportUnverified naming the file when it is absent or unreadable."""
    where = storage.uri(*parts, EXPORT_MANIFEST)
    if not storage.exists(*parts, EXPORT_MANIFEST):
        raise ExportUnverified(f"{where} does not exist: the export has no content manifest (re-run finetune)")
    try:
        return ExportManifest.model_validate_json(storage.read_bytes(*parts, EXPORT_MANIFEST))
    except ValueError as e:
        raise ExportUnverified(f"{where} is not an export manifest: {str(e).splitlines()[0]}") from None


def verify_export(storage: Storage, *parts: str, local_dir: str | Path | None = None) -> ExportManifest:
    """The manifest, after checking every file it lists (in `local_dir` when the model was mirrored there)
    has its size and sha256, that content_sha256 is theirs and that no other content file is there (the
    folder loads as a whole: a file the manifest does not list would change the model that was judged);
    ExportUnverified naming what differs."""
    manifest = read_export_manifest(storage, *parts)
    if local_dir is not None:
        present = local_digests(local_dir, manifest.files)
        names = local_names(local_dir)
    else:
        present = stored_digests(storage, *parts, names=manifest.files)
        names = stored_names(storage, *parts)
    problems = digest_problems(manifest.files, present) + unlisted_problems(manifest.files, names)
    if not problems and content_sha256(manifest.files) != manifest.content_sha256:
        problems = [f"content_sha256 {manifest.content_sha256[:12]} is not the hash of the listed files"]
    if problems:
        raise ExportUnverified(f"{storage.uri(*parts)} does not match its manifest: {'; '.join(problems)}")
    return manifest
