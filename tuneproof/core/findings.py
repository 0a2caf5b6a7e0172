"""A finding: one thing a check saw that differs from what was expected.

Shared by verify (Ray facts), the Kubernetes half of verify, and `tuneproof lint`, so every
check reports the same way: the subject (node, pod, file/object), the field, both values.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Finding:
    subject: str
    """What was checked: 'node 10.0.1.5', 'pod tuneproof-gpu-0', 'deployments/raycluster.yaml: RayCluster/tuneproof'."""
    field: str
    seen: Any
    expected: Any
    message: str = ""
    severity: Severity = "error"

    def line(self) -> str:
        text = f"{self.subject}: {self.field} is {self.seen!r}, expected {self.expected!r}"
        return f"{text} ({self.message})" if self.message else text

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def errors(findings: list[Finding]) -> list[Finding]:
    return [f for f in findings if f.severity == "error"]
