"""An append-only JSON-lines log on a storage root: each write costs only the rows it adds.

A job that logs every step (the fine-tune's metrics.jsonl) must not rewrite everything it logged so far
on each flush: that cost grows with the steps already taken. So:

- local disk: one file, `<name>`, appended to; a write cut short by a kill (SIGKILL mid-append) leaves
  an unterminated last line, which readers ignore and the next writer cuts off before it appends.
- S3 (objects cannot be appended to): numbered chunk objects `<name>.d/000000000001.jsonl`, ...,
  each written whole by one flush; readers list them and read them back in order.

Rows are never removed: a step replayed after a restart is a later row; readers that want one row per
step keep the last (tuneproof.core.summaries_training.latest_rows).
"""

from __future__ import annotations

import hashlib
import json
import os
import posixpath
from typing import Any

from tuneproof.core.storage import Storage

CHUNK_DIGITS = 12


def chunk_dir(name: str) -> str:
    """The folder of an S3 log's chunk objects, beside where the local file would be."""
    return f"{name}.d"


def append_rows(storage: Storage, rows: list[dict[str, Any]], *parts: str, chunk: int | None = None) -> int | None:
    """Add `rows` to the log at `parts` (its last part is the log's name); nothing is rewritten.

    On S3 returns the chunk number written: a writer that passes it + 1 back as `chunk` next time skips
    listing the chunks (a listing per flush would grow with the log). None on local disk."""
    if not rows:
        return None if chunk is None else chunk - 1
    data = "".join(json.dumps(r) + "\n" for r in rows).encode()
    if storage.is_s3:
        *folder, name = parts
        number = chunk if chunk is not None else next_chunk(storage, *folder, chunk_dir(name))
        storage.write_bytes(data, *folder, chunk_dir(name), f"{number:0{CHUNK_DIGITS}d}.jsonl")
        return number
    path = storage.path(*parts)
    os.makedirs(posixpath.dirname(path), exist_ok=True)
    with open(path, "ab") as f:
        drop_torn_tail(f)
        f.write(data)
    return None


def next_chunk(storage: Storage, *folder: str) -> int:
    """One past the highest chunk number under `folder` (1 for none)."""
    names = [c.split(".")[0] for c in storage.listdir(*folder)]
    return max((int(n) for n in names if n.isdigit()), default=0) + 1


def drop_torn_tail(f: Any) -> None:
    """Cut an unterminated last line (a write killed halfway) so the next row starts on a line of its own."""
    size = f.seek(0, os.SEEK_END)
    if size == 0:
        return
    with open(f.name, "rb") as r:
        back = min(size, 1 << 16)
        r.seek(size - back)
        tail = r.read()
    if tail.endswith(b"\n"):
        return
    cut = tail.rfind(b"\n")
    keep = size - back + cut + 1 if cut >= 0 else (0 if back == size else size)
    f.truncate(keep)


def read_rows(storage: Storage, *parts: str) -> list[dict[str, Any]]:
    """Every complete row of the log at `parts`, in the order written; [] when there is none."""
    *folder, name = parts
    if storage.is_s3:
        chunks = sorted(c for c in storage.listdir(*folder, chunk_dir(name)) if c.endswith(".jsonl"))
        texts = [storage.read_text(*folder, chunk_dir(name), c) for c in chunks]
    else:
        texts = [storage.read_text(*parts)] if storage.exists(*parts) else []
    return [json.loads(line) for text in texts for line in complete_lines(text)]


def rows_sha256(rows: list[dict[str, Any]]) -> str:
    """sha256 of `rows` (as read_rows returns them) in compact JSON: equal rows, equal hash, whatever the
    storage (file or chunks). One encoder call: at 100,000 rows, a call per row costs seconds."""
    return hashlib.sha256(json.dumps(rows, separators=(",", ":")).encode()).hexdigest()


def remove_log(storage: Storage, *parts: str) -> None:
    """Remove the log at `parts`, file or chunks."""
    *folder, name = parts
    storage.remove(*parts)
    storage.remove(*folder, chunk_dir(name), recursive=True)


def complete_lines(text: str) -> list[str]:
    """Non-blank lines that ended with a newline: a torn last line (the writer was killed) is not a row."""
    lines = text.split("\n")[:-1]  # the piece after the last newline is empty, or torn
    return [line for line in lines if line.strip()]
