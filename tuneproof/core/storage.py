"""One storage API for a local directory or s3://bucket/prefix (optionally an S3-compatible endpoint).

Used by every stage on both sides. Files go through fsspec (s3fs for S3); Ray Train gets a
`pyarrow.fs` filesystem plus a path from `train_storage()`. Credentials come only from the
environment / IRSA: nothing here accepts, logs or records a key.
"""

from __future__ import annotations

import json
import os
import posixpath
import shutil
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import fsspec

from tuneproof.core.names import check_storage_root

if TYPE_CHECKING:
    from botocore.config import Config

    from tuneproof.core.config import StorageConfig

S3_MAX_ATTEMPTS = 12
"""Attempts per S3 request (s3fs/botocore, which Ray Train uses too: see train_storage): the
'standard' retry mode waits an exponential, jittered backoff of at most 20 s between them, so an endpoint
that is unreachable for half a minute or so (a restart) is waited out, and a longer outage fails with
the client's error, which names the endpoint (a job's failure is then classed infrastructure)."""
PUT_PART_BYTES = 128 * 2**20
"""put_file's multipart part size on S3; a file under two parts goes in one PUT. Fewer, larger requests:
an S3-compatible server assembles parts by copying them (moto took 2-6 times as long for a 247 MB shard
in 50 MiB parts as for one PUT of it), and at the sizes a real checkpoint shard has (GBs) parts of this
size still upload several at a time."""
PUT_PARTS_IN_FLIGHT = 4
"""Parts of one file uploading at once: bounds the memory one upload holds (4 x 128 MiB)."""
S3_CONNECT_TIMEOUT_S = 5
S3_REQUEST_TIMEOUT_S = 60
BOTO_RETRIES: dict[str, Any] = {
    "retries": {"max_attempts": S3_MAX_ATTEMPTS, "mode": "standard"},
    "connect_timeout": S3_CONNECT_TIMEOUT_S,
    "read_timeout": S3_REQUEST_TIMEOUT_S,
}


def boto_config() -> Config:
    """The same bounded retries for a plain boto3 client (conditional writes: lease, compare-and-swap)."""
    from botocore.config import Config

    return Config(**BOTO_RETRIES)


class Storage:
    """A storage root; every path argument is relative to it, joined with '/'."""

    def __init__(self, root: str, endpoint_url: str | None = None):
        check_storage_root("storage root", root)
        self.endpoint_url = endpoint_url
        self.is_s3 = root.startswith("s3://")
        if self.is_s3:
            self.root = root.rstrip("/")
            self._base = self.root[len("s3://") :]
            kwargs: dict[str, Any] = {"config_kwargs": BOTO_RETRIES}
            if endpoint_url:
                kwargs["client_kwargs"] = {"endpoint_url": endpoint_url}
            # Listings must not be cached: stages poll for markers other processes write.
            self.fs = fsspec.filesystem("s3", use_listings_cache=False, skip_instance_cache=True, **kwargs)
        else:
            local = root.removeprefix("file://")
            self.root = str(Path(local).expanduser().resolve())
            self._base = self.root
            self.fs = fsspec.filesystem("file")

    @classmethod
    def from_config(cls, storage_cfg: StorageConfig) -> Storage:
        return cls(storage_cfg.root, storage_cfg.endpoint_url)

    def path(self, *parts: str) -> str:
        """Filesystem path (bucket/key for S3) of a relative location; refuses parts that would leave the root."""
        for part in parts:
            _check_part(part)
        return posixpath.join(self._base, *parts) if parts else self._base

    def uri(self, *parts: str) -> str:
        for part in parts:
            _check_part(part)
        return posixpath.join(self.root, *parts) if parts else self.root

    def exists(self, *parts: str) -> bool:
        return self.fs.exists(self.path(*parts))

    def read_bytes(self, *parts: str) -> bytes:
        with self.fs.open(self.path(*parts), "rb") as f:
            return f.read()

    def write_bytes(self, data: bytes, *parts: str) -> None:
        """Write a whole object; on local disk via a temp file and rename, so readers never see half."""
        target = self.path(*parts)
        if self.is_s3:
            with self.fs.open(target, "wb") as f:
                f.write(data)
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(target), prefix=".tmp-")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, target)

    def read_json(self, *parts: str) -> Any:
        return json.loads(self.read_bytes(*parts))

    def write_json(self, obj: Any, *parts: str) -> None:
        self.write_bytes(json.dumps(obj, indent=2, sort_keys=True, default=str).encode(), *parts)

    def read_text(self, *parts: str) -> str:
        return self.read_bytes(*parts).decode()

    def listdir(self, *parts: str) -> list[str]:
        """Names directly under a location; [] when it does not exist."""
        target = self.path(*parts)
        try:
            entries = self.fs.ls(target, detail=False)
        except FileNotFoundError:
            return []
        return sorted(posixpath.basename(e.rstrip("/")) for e in entries if e.rstrip("/") != target.rstrip("/"))

    def remove(self, *parts: str, recursive: bool = False) -> None:
        target = self.path(*parts)
        if self.fs.exists(target):
            self.fs.rm(target, recursive=recursive)

    def upload_dir(self, local_dir: str | Path, *parts: str) -> None:
        local_dir = Path(local_dir)
        for file in sorted(p for p in local_dir.rglob("*") if p.is_file()):
            rel = file.relative_to(local_dir).as_posix()
            self.write_bytes(file.read_bytes(), *parts, rel)

    def put_file(self, local: str | Path, *parts: str) -> None:
        """Copy one local file to a location, streamed: a multi-GB checkpoint shard never sits in memory
        (s3fs uploads it in parts, PUT_PART_BYTES each, each retried as S3_MAX_ATTEMPTS says)."""
        target = self.path(*parts)
        if self.is_s3:
            self.fs.put_file(str(local), target, chunksize=PUT_PART_BYTES, max_concurrency=PUT_PARTS_IN_FLIGHT)
            return
        os.makedirs(os.path.dirname(target), exist_ok=True)
        shutil.copyfile(local, target)

    def download_dir(self, local_dir: str | Path, *parts: str) -> Path:
        """Copy every object under a location to local_dir; returns local_dir."""
        local_dir = Path(local_dir)
        base = self.path(*parts).rstrip("/")
        for remote in self.fs.find(base):
            rel = remote[len(base) :].lstrip("/")
            if not rel or remote.endswith("/"):
                continue  # a directory marker object (pyarrow's create_dir writes one): no file to copy
            if ".." in rel.split("/"):
                # An object key is any string; one with '..' would be written outside local_dir.
                raise UnsafePath(f"object {remote!r} under {self.uri(*parts)} has a '..' segment; refusing to copy it")
            dest = local_dir / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            with self.fs.open(remote, "rb") as src:
                dest.write_bytes(src.read())
        return local_dir

    def train_storage(self, *parts: str) -> tuple[Any, str]:
        """(pyarrow filesystem or None, storage_path) for ray.train.RunConfig.

        On S3 the filesystem is this storage's own s3fs seen through pyarrow (PyFileSystem over
        FSSpecHandler, the pattern Ray documents for custom filesystems): it reaches Ray Train's workers
        with its bounded retries (S3_MAX_ATTEMPTS), which pyarrow's S3FileSystem would lose, since its
        pickle drops retry_strategy and timeouts. With a filesystem object Ray wants 'bucket/path'.
        """
        if not self.is_s3:
            return None, self.path(*parts)
        from pyarrow import fs as pafs

        # ignore: pyarrow-stubs declares FSSpecHandler without the handler methods pyarrow implements.
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs)), self.path(*parts)  # type: ignore[abstract]


class UnsafePath(ValueError):
    """A path part or object key that would reach outside the storage root (or a local mirror)."""


def _check_part(part: str) -> None:
    """A relative part may hold '/' (e.g. 'train/shard-0.parquet') but no absolute path and no '..' segment."""
    if not isinstance(part, str):
        raise UnsafePath(f"storage path part must be a string, got {type(part).__name__}: {part!r}")
    if part.startswith("/") or ".." in part.split("/"):
        raise UnsafePath(
            f"storage path part {part!r} is absolute or has a '..' segment: it would leave the storage root"
        )


def split_s3(uri: str) -> tuple[str, str]:
    parsed = urlparse(uri)
    return parsed.netloc, parsed.path.lstrip("/")
