"""The image canary's Prefect artifact: the decision, its reasons and the metric table against the baseline."""

from __future__ import annotations

from prefect.artifacts import create_markdown_artifact

from tasks.artifacts import key
from tuneproof.control.images import Decision


def publish(decision: Decision) -> None:
    create_markdown_artifact(
        render(decision),
        key=key("image-canary", decision.decision_id),
        description=f"{decision.decision} {decision.candidate_image}",
    )


def render(d: Decision) -> str:
    """Markdown for people (pure): what was tried, what it was compared with, and why the decision."""
    versions = ", ".join(f"{k} {v}" for k, v in d.versions.model_dump(exclude_none=True).items()) or "not recorded"
    lines = [
        f"# Image canary {d.decision_id}: **{d.decision}**",
        "",
        f"- candidate: `{d.candidate_image}`" + (f" (release {d.release_tag})" if d.release_tag else ""),
        f"- versions verify saw: {versions}",
        f"- baseline: {f'`{d.baseline_image}` ({d.baseline_decision})' if d.baseline_decision else 'none'}",
        f"- runs: {', '.join(d.runs) or 'none'}",
        "",
        *[f"- {reason}" for reason in d.reasons],
        "",
    ]
    if d.comparison:
        lines += ["| metric | baseline median | candidate median | ratio | verdict |", "|---|---|---|---|---|"]
        lines += [
            f"| {m.name} | {_num(m.a.median)} | {_num(m.b.median)} | {_num(m.ratio)} | {m.verdict} |"
            for m in d.comparison
        ]
    return "\n".join(lines)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4g}"
