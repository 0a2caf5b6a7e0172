"""One slug pattern for every name that becomes a path segment or a route: run ids, dataset, model and stage names.

    check_slug("run id", "20261130-103832-a31ad3")   # returns the value
    check_slug("data.name", "../../x")                # ValueError naming data.name and the value
    control_character_problem("a\\tb.jsonl")         # why no path or URI can hold it (a tab, a NUL), or None
    short_repr(value)                                 # a value cut to a line for an error message

A name lands in storage paths (runs/<run-id>/, datasets/<name>/, models/<name>/) and in Ray job routes
(/api/jobs/<run>-<stage>), so it must be one path segment that no filesystem, object store or URL
router reads as anything but itself: letters, digits, '.', '_' and '-', starting with a letter or digit
(so never '.', '..', a hidden file or something a command line reads as an option), at most 64 characters.
Pure: no I/O.
"""

from __future__ import annotations

import re
import reprlib
import unicodedata
from typing import Any

from tuneproof.core.results import one_line

SLUG_MAX_LEN = 64
SLUG = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
"""Matched with fullmatch: `$` would let a trailing newline through."""
SLUG_RULE = (
    f"1-{SLUG_MAX_LEN} characters of letters, digits, '.', '_' or '-', starting with a letter or digit "
    "(no '/', '..', spaces)"
)


def slug_problem(value: object) -> str | None:
    """Why `value` is not a slug, or None when it is one."""
    if not isinstance(value, str):
        return f"must be a string, got {type(value).__name__}"
    if not value:
        return "must not be empty"
    if len(value) > SLUG_MAX_LEN:
        return f"is {len(value)} characters long, at most {SLUG_MAX_LEN} allowed"
    if ".." in value:
        return "must not contain '..'"
    if any(not ch.isprintable() for ch in value):
        return f"holds a control character; it must be {SLUG_RULE}"
    if not SLUG.fullmatch(value):
        return f"must be {SLUG_RULE}"
    return None


def check_slug(kind: str, value: object) -> str:
    """`value` when it is a slug; else ValueError naming `kind`, the value and the rule."""
    return _checked(kind, value, slug_problem(value))


def _checked(what: str, value: object, problem: str | None) -> str:
    if problem is not None:
        raise ValueError(f"{what} {short_repr(value)} {problem}")
    assert isinstance(value, str)
    return value


def short_repr(value: Any) -> str:
    """repr cut to a line: a pasted file or an alias-expanded YAML value must not flood the terminal (a
    120,000-character data.name was a 120 KB error line)."""
    # reprlib bounds the work, not only the text: an alias-expanded YAML value's full repr runs to gigabytes.
    r = reprlib.Repr()
    r.maxstring, r.maxother, r.maxlevel = 120, 120, 2
    return one_line(r.repr(value), 200)


def control_character_problem(value: str) -> str | None:
    """Why `value` cannot be a path or URI: it holds a control character, or None (pure).

    A NUL ends a C string, so open() and os.path.realpath refuse it ("embedded null byte", which ended the
    command line in "please report"); a newline or an escape names no file anyone meant and garbles every log
    line that shows it. Other characters a terminal does not print (a no-break space) are left to the file
    system: macOS names screenshots with one."""
    for i, ch in enumerate(value):
        if unicodedata.category(ch) == "Cc":
            return f"holds a control character ({ch!r} at character {i + 1}): no path or URI holds one"
    return None


STORAGE_ROOT_RULE = "a local path or s3://bucket[/prefix]"
S3_BUCKET = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
"""An S3 bucket name: 3-63 of a-z, 0-9, '.', '-', starting and ending with a letter or digit."""


def storage_root_problem(root: object) -> str | None:
    """Why `root` is not a storage root (a local path, file://path or s3://bucket[/prefix]), or None.

    Catches other schemes (gs://, http://) and the typos that would otherwise become a local
    directory named 's3:' (s3:/bucket, s3:bucket) or an S3 root with no bucket.
    """
    if not isinstance(root, str):
        return f"must be a string, got {type(root).__name__}"
    if not root.strip():
        return f"must not be empty; give {STORAGE_ROOT_RULE}"
    if problem := control_character_problem(root):
        return problem
    scheme, sep, rest = root.partition("://")
    if sep and scheme == "s3":
        bucket = rest.split("/", 1)[0]
        if not bucket:
            return f"names no bucket; give {STORAGE_ROOT_RULE}"
        if not S3_BUCKET.fullmatch(bucket):
            return f"bucket {bucket!r} is not a valid S3 bucket name (3-63 of a-z, 0-9, '.', '-')"
        return None
    if sep and scheme == "file" and not rest.strip():
        return f"file:// names no directory (it would be the current one); give {STORAGE_ROOT_RULE}"
    if sep and scheme != "file":
        return f"scheme {scheme + '://'!r} is not supported; give {STORAGE_ROOT_RULE}"
    if re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", root) and not sep:
        # 's3:/bucket', 's3:bucket', 'gs:/x': a mistyped URI, not a directory someone meant to call 's3:'.
        return f"looks like a mistyped URI; give {STORAGE_ROOT_RULE} (e.g. s3://bucket/prefix)"
    return None


def check_storage_root(what: str, root: object) -> str:
    """`root` when it is a storage root; else ValueError naming `what`, the value and the accepted forms."""
    return _checked(what, root, storage_root_problem(root))


MODEL_SOURCE_RULE = "a hub id (org/name), a local model directory or s3://bucket/prefix"


def model_source_problem(source: str) -> str | None:
    """Why `source` cannot name a model by its form alone (pure), or None.

    A URI must be s3://bucket[/prefix] (the jobs load s3:// and nothing else); a form huggingface_hub
    refuses as a repo id is caught by `hub_id_problem` once the config knows it is not a local directory.
    """
    if problem := control_character_problem(source):
        return problem
    if "://" not in source and not re.match(r"^[A-Za-z][A-Za-z0-9+.-]*:", source):
        return None
    if not source.startswith("s3://"):
        return f"is not a form the jobs can load; give {MODEL_SOURCE_RULE}"
    bucket = source[len("s3://") :].split("/", 1)[0]
    if not S3_BUCKET.fullmatch(bucket):
        return f"names no valid S3 bucket ({bucket!r}); give {MODEL_SOURCE_RULE}"
    return None


def hub_id_problem(source: str) -> str | None:
    """Why `source`, taken as a Hugging Face hub id, is not one (huggingface_hub's own rule), or None (pure)."""
    if re.fullmatch(r"[\w.-]{1,96}(/[\w.-]{1,96})?", source) and not re.search(
        r"--|\.\.|^[-.]|[-.]$|/[-.]|[-.]/", source
    ):
        return None
    return (
        f"is neither a directory here nor a hub id (org/name: letters, digits, '-', '_', '.'); give {MODEL_SOURCE_RULE}"
    )
