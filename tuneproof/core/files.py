"""Reading a file someone handed us (a config, a record, saved kubectl output, a log): only a regular file,
and only up to a size.

    read_regular(Path("configs/local.yaml"), 1 << 20)    # the bytes, or FileRefused naming the file
    read_stored(storage, ("runs", run, "record.json"), 64 << 20)
    read_s3_body(client.get_object(...), 64 << 10, uri)     # an S3 response's body, at most that many bytes
    parse_yaml(text)                                      # yaml.safe_load, but a duplicate key or 0042 is an error
    parse_json(text)                                      # json.loads, but a duplicate key is an error
    decode_text(data)                                     # UTF-8, or UTF-16 where a byte-order mark says so
    not_a_file("data/x.jsonl")                            # 'no such file', 'a directory, not a file' or None

A FIFO given as a config blocks open() until a writer comes, and a character device (/dev/zero) reads until
memory runs out: the file is opened non-blocking, its type is checked on the open descriptor (so nothing can
be swapped in between), and at most `limit` + 1 bytes are ever read. YAML and JSON are parsed refusing
duplicate keys, which yaml.safe_load and json.loads would resolve silently to the last one.
"""

from __future__ import annotations

import codecs
import errno
import json
import os
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

if TYPE_CHECKING:
    from mypy_boto3_s3.type_defs import GetObjectOutputTypeDef

    from tuneproof.core.storage import Storage

MAX_MANIFEST_BYTES = 16 << 20
"""Kubernetes refuses objects over about 1.5 MB; a file past this (or a device, a FIFO) is no manifest. Lint and
the image canary read manifests under it."""

KINDS = {
    stat.S_IFIFO: "a FIFO (named pipe)",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
}


def not_a_file(path: str) -> str | None:
    """Why a local path names no file to read ('no such file', 'a directory, not a file', 'not a regular file':
    a FIFO would block the reader), or None."""
    target = Path(path)
    if target.is_file():
        return None
    if target.is_dir():
        return "a directory, not a file"
    return "not a regular file" if target.exists() else "no such file"


class FileRefused(OSError):
    """Not a regular file, or larger than the reader allows; `strerror` says which, `filename` names it."""


UTF16_BOMS = (codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)


def decode_text(data: bytes, errors: str = "strict") -> str:
    """A handed file's text as a shell wrote it: UTF-16 when it starts with its byte-order mark (Windows
    PowerShell 5's `>`), else UTF-8 with or without one (Notepad, Excel)."""
    return data.decode("utf-16" if data.startswith(UTF16_BOMS) else "utf-8-sig", errors=errors)


def read_regular(path: str | Path, limit: int) -> bytes:
    """The whole file at `path`: IsADirectoryError for a directory (as open() would), FileRefused for any
    other file that is not a regular one or that holds more than `limit` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        kind = stat.S_IFMT(os.fstat(fd).st_mode)
        if kind == stat.S_IFDIR:
            raise IsADirectoryError(errno.EISDIR, "Is a directory", str(path))
        if kind != stat.S_IFREG:
            raise FileRefused(
                errno.EINVAL, f"is {KINDS.get(kind, 'not a regular file')}, not a regular file", str(path)
            )
        os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise FileRefused(errno.EFBIG, f"is larger than {limit:,} bytes, more than such a file can be", str(path))
    return data


def read_stored(storage: Storage, parts: tuple[str, ...], limit: int) -> bytes:
    """An object under a storage root, refused (FileRefused) when it is not a regular file or over `limit`."""
    if not storage.is_s3:
        return read_regular(storage.path(*parts), limit)
    size = storage.fs.size(storage.path(*parts))
    if size is not None and size > limit:
        raise FileRefused(errno.EFBIG, f"is larger than {limit:,} bytes", storage.uri(*parts))
    return storage.read_bytes(*parts)


def read_s3_body(response: GetObjectOutputTypeDef, limit: int, where: str) -> bytes:
    """The body of an S3 GetObject response, refused (FileRefused naming `where`) when it holds more than `limit`
    bytes: by its ContentLength before anything is read, and by what arrives, whatever that header claimed."""
    length = response.get("ContentLength")
    data = response["Body"].read(limit + 1) if not (isinstance(length, int) and length > limit) else None
    if data is None or len(data) > limit:
        response["Body"].close()
        raise FileRefused(errno.EFBIG, f"is larger than {limit:,} bytes, more than such a file can be", where)
    return data


class DuplicateKey(yaml.YAMLError):
    """A mapping that names one key twice: YAML keeps the last silently (a gate's threshold could be
    weakened by a second entry further down), kubectl refuses it; so do we."""


class NumberRefused(yaml.YAMLError):
    """An integer whose value depends on who reads it, or that Python cannot read: refused naming it and its line.

    PyYAML follows YAML 1.1, where a leading 0 means octal (`seed: 0042` was 34, `max_steps: 01000` 512); YAML 1.2
    reads both as decimal, kubectl as octal. Read either way, some writer's value changes without a word, so
    neither is chosen. An integer past Python's 4,300-digit limit for text ended in "(please report)"."""


INT_TAG = "tag:yaml.org,2002:int"


def _int_problem(text: str, octal_refused: bool = True) -> str | None:
    """Why the YAML 1.1 integer `text` is refused, or None (pure): a leading 0 where octal and decimal differ (07 is
    7 either way) unless `octal_refused` is off, or more digits than Python reads as text. Base 60 (`1:30`) is not
    refused: it is read as text."""
    digits = text.lstrip("+-").replace("_", "")
    if ":" in digits:
        return None
    leading_zero = octal_refused and len(digits) > 1 and digits[0] == "0" and digits.isdigit()
    if leading_zero and len(digits) > 20:
        return f"{text[:20]}… has a leading 0, octal in YAML 1.1 and decimal in YAML 1.2: write it without one"
    if leading_zero and int(digits, 8) != int(digits):
        return (
            f"{text} has a leading 0: YAML 1.1 reads it as octal ({int(digits, 8)}), YAML 1.2 as decimal "
            f"({int(digits)}); write the number meant without one, or quote it for text"
        )
    try:
        str(int(digits, 10 if digits.isdigit() else 0))  # a long hex value parses, but no message could show it
    except ValueError:
        return f"an integer of over {sys.get_int_max_str_digits():,} digits, more than Python reads as text"
    return None


class UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader refusing duplicate keys (a key a `<<: *anchor` merge brings in may be overridden) and
    integers YAML versions read differently (NumberRefused); base 60 (`1:30`, YAML 1.1's 90) is text, as YAML 1.2
    and kubectl read it."""

    OCTAL_REFUSED = True

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        first: dict = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge" or not isinstance(key_node, yaml.ScalarNode):
                continue
            key = self.construct_scalar(key_node)
            if key in first:
                raise DuplicateKey(
                    f"duplicate key {key!r} at line {key_node.start_mark.line + 1} (first at line {first[key]}): "
                    "remove one of them"
                )
            first[key] = key_node.start_mark.line + 1
            # Checked here to name the key; construct_int names an item of a list by its line alone.
            if value_node.tag == INT_TAG and (problem := _int_problem(value_node.value, self.OCTAL_REFUSED)):
                raise NumberRefused(f"{key!r} at line {value_node.start_mark.line + 1}: {problem}")
        return super().construct_mapping(node, deep=deep)

    def construct_int(self, node: yaml.ScalarNode) -> int | str:
        text = self.construct_scalar(node)
        if problem := _int_problem(text, self.OCTAL_REFUSED):
            raise NumberRefused(f"line {node.start_mark.line + 1}: {problem}")
        return text if ":" in text else self.construct_yaml_int(node)

    def construct_float(self, node: yaml.ScalarNode) -> float | str:
        text = self.construct_scalar(node)
        return text if ":" in text else self.construct_yaml_float(node)


UniqueKeyLoader.add_constructor(INT_TAG, UniqueKeyLoader.construct_int)
UniqueKeyLoader.add_constructor("tag:yaml.org,2002:float", UniqueKeyLoader.construct_float)


class ManifestLoader(UniqueKeyLoader):
    """UniqueKeyLoader for Kubernetes manifests: a leading 0 is octal, as kubectl reads it (`defaultMode: 0400` is
    256, the form the Kubernetes API documents for file modes); the manifest's author wrote it for kubectl."""

    OCTAL_REFUSED = False


def parse_yaml(text: str) -> Any:
    """One YAML document, as yaml.safe_load reads it, but a duplicate key is DuplicateKey naming key and line."""
    return yaml.load(text, Loader=UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass


def parse_yaml_all(text: str) -> list[Any]:
    """Every document of a Kubernetes manifest stream, as kubectl reads them (ManifestLoader), duplicate keys refused."""
    return list(yaml.load_all(text, Loader=ManifestLoader))  # noqa: S506 - a SafeLoader subclass


class DuplicateJSONKey(ValueError):
    """A JSON object naming a key twice: json keeps the last value, so a data row `{"input": "a", "input": "b"}`
    trained on "b" without a word (a CSV naming a column twice is refused for the same reason)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) != len(pairs):
        twice = next(key for i, (key, _) in enumerate(pairs) if key in dict(pairs[:i]))
        raise DuplicateJSONKey(f"names key {json.dumps(twice)} more than once: which value is meant is ambiguous")
    return record


_UNIQUE_KEYS = json.JSONDecoder(object_pairs_hook=_unique_keys)  # built once: json.loads(hook=) builds one a call


def parse_json(text: str) -> Any:
    """One JSON document, as json.loads reads it, but an object naming a key twice is DuplicateJSONKey naming it;
    about json.loads' own cost (a data stage parses every row through it)."""
    return _UNIQUE_KEYS.decode(text)
