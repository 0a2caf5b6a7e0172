"""Refuse credentials in the config: a config is published (record, flow-run parameters, artifacts, the
Ray job's runtime_env), so a secret in it is a secret published. Secrets reach jobs by name through
`runtime_env.forward_env` instead (tuneproof.core.forward_env).

Pure: `credential_problems(raw_config)` walks a config mapping and returns one problem per value that
looks like a credential, naming the dotted key and why, never the value.
"""

from __future__ import annotations

import re
from typing import Any

SECRET_NAME = re.compile(r"SECRET|TOKEN|PASSWORD|PASSWD|CREDENTIAL|ACCESS_KEY|PRIVATE_KEY|API_KEY", re.IGNORECASE)
"""An environment variable name that says it holds a credential."""

VALUE_SHAPES: list[tuple[str, re.Pattern[str]]] = [
    ("an AWS access key id", re.compile(r"\b(AKIA|ASIA)[A-Z0-9]{16}\b")),
    ("a PEM private key", re.compile(r"-----BEGIN [A-Z ]*PRIVATE KEY-----")),
    ("a URL with a password", re.compile(r"://[^/\s:@]+:[^/\s@]+@")),
    # Digits and letters both: a run of one repeated letter ('aaaa…', a too-long name) is no secret.
    ("a long hexadecimal secret", re.compile(r"^(?=[0-9a-fA-F]*[0-9])(?=[0-9a-fA-F]*[a-fA-F])[0-9a-fA-F]{64,}$")),
]
"""Shapes of credential values, wherever they appear. A lone 40-hex git SHA or an image reference
`repo@sha256:<hex>` is no secret and matches none of them."""

TOKEN_CHARS = re.compile(r"^[A-Za-z0-9+/=_\-]{32,}$")

POINTER = (
    "put the value in the submitting environment (or, on EKS, a Kubernetes Secret) and name the variable in "
    "runtime_env.forward_env; the value is not shown here"
)


def looks_like_token(value: str) -> bool:
    """A long unbroken run of base64/URL-safe characters mixing upper case, lower case and digits: an API
    key or a secret access key. Paths (with '.'), words and lower-case hex digests do not qualify."""
    if not TOKEN_CHARS.match(value):
        return False
    return any(c.isupper() for c in value) and any(c.islower() for c in value) and any(c.isdigit() for c in value)


def why_credential(value: str) -> str | None:
    """Which credential shape a value has, or None."""
    for label, pattern in VALUE_SHAPES:
        if pattern.search(value):
            return label
    return "a long random token" if looks_like_token(value.strip()) else None


def credential_problems(data: Any, prefix: str = "", _seen: set[int] | None = None) -> list[str]:
    """One 'dotted.key: ...' problem per credential-looking value (or env var name) in a raw config mapping.

    A mapping or list reached twice (YAML anchors and aliases share them) is looked at once, at the
    first path that reaches it: an alias bomb must not turn a config check into an exponential walk."""
    seen = set() if _seen is None else _seen
    if isinstance(data, dict | list):
        if id(data) in seen:
            return []
        seen.add(id(data))
    problems = []
    if isinstance(data, dict):
        for key, value in data.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if prefix == "runtime_env.env_vars" and SECRET_NAME.search(str(key)):
                problems.append(f"{dotted}: an environment variable named like a credential; {POINTER}")
                continue
            problems += credential_problems(value, dotted, seen)
    elif isinstance(data, list):
        for i, item in enumerate(data):
            problems += credential_problems(item, f"{prefix}[{i}]", seen)
    elif isinstance(data, str):
        why = why_credential(data)
        if why:
            problems.append(f"{prefix}: looks like {why}; {POINTER}")
    return problems
