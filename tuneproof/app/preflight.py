"""Checks a command makes before it runs anything, over plain values (pure: no I/O, no Prefect).

environment_problems(os.environ)           # a line per variable a flow-running command would trip on
unknown_stage_lines("--only", ["vеrify"], names)   # escaped, with a "did you mean"
unread_difference(cfg_a, cfg_b, stages, read)      # arms that differ only where no chosen stage reads
"""

from __future__ import annotations

import difflib
import unicodedata
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlparse

from tuneproof.core import config_reads
from tuneproof.core.config import PipelineConfig

LOG_LEVEL_VARIABLES = ("PREFECT_LOGGING_LEVEL", "PREFECT_LOGGING_ROOT_LEVEL", "PREFECT_LOGGING_SERVER_LEVEL")


def environment_problems(environ: Mapping[str, str]) -> list[str]:
    """One line per environment variable a command that runs flows reads and would fail on later (Prefect's
    settings refuse them with a traceback, or a flow run waits on an API that cannot exist). Pure."""
    problems = []
    url = environ.get("PREFECT_API_URL", "")
    parsed = urlparse(url)
    if url and (parsed.scheme not in ("http", "https") or not parsed.hostname or not _port_ok(parsed)):
        problems.append(
            f"PREFECT_API_URL={url!r} is not an http(s) URL of a Prefect API (e.g. http://127.0.0.1:4200/api); "
            "fix it, or unset it to run on a temporary local server"
        )
    levels = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
    for name in LOG_LEVEL_VARIABLES:
        value = environ.get(name, "")
        if value and value.upper() not in levels and not value.isdigit():
            problems.append(f"{name}={value!r} is not a log level: give one of {', '.join(levels)}")
    verbose = environ.get("TUNEPROOF_VERBOSE", "")
    if verbose not in ("", "0", "1"):
        problems.append(f"TUNEPROOF_VERBOSE={verbose!r}: give 1 (Prefect's console log lines) or 0")
    return problems


def _port_ok(parsed: Any) -> bool:
    try:
        parsed.port  # noqa: B018 - raises ValueError for a port that is not a number in 0..65535
    except ValueError:
        return False
    return True


def unknown_stage_lines(option: str, given: list[str], known: list[str]) -> list[str]:
    """A line per name in `given` that is not a stage, escaped to ASCII (a Cyrillic 'е' in 'vеrify' prints like
    the real one) with the stage it looks like."""
    lines = []
    for name in [n for n in given if n not in known]:
        match = difflib.get_close_matches(ascii_skeleton(name), known, n=1, cutoff=0.6)
        hint = f"; did you mean {match[0]!r}?" if match else ""
        lines.append(f"{option}: unknown stage {ascii(name)}{hint} (expected some of {', '.join(known)})")
    return lines


def ascii_skeleton(name: str) -> str:
    """The ASCII letters a name is written with, accents and look-alikes from other scripts dropped: what
    'did you mean' compares."""
    return "".join(ch for ch in unicodedata.normalize("NFKD", name) if ch.isascii())


def unread_difference(a: PipelineConfig, b: PipelineConfig, stages: list[str], read: set[str] | None) -> list[str]:
    """A refusal when arms A and B differ only in settings none of the chosen stages read (`read`: what they read
    when they last ran, observed; None when they never ran here, and then nothing is refused): every run of
    both arms would measure the same thing."""
    doc_a, doc_b = a.model_dump(mode="json"), b.model_dump(mode="json")
    paths = {path for path, _ in config_reads.leaves(doc_a)} | {path for path, _ in config_reads.leaves(doc_b)}
    differing = sorted(p for p in paths if config_reads.value_at(doc_a, p) != config_reads.value_at(doc_b, p))
    if read is None or not differing or any(config_reads.is_read(p, read) for p in differing):
        return []
    return [
        f"arms A and B differ only in {', '.join(differing)}, which the stages {', '.join(stages)} did not read "
        f"when they last ran (they read {', '.join(sorted(config_reads.outermost(read)))}): both arms would run "
        "the same thing"
    ]
