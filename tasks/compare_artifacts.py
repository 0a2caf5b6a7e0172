"""Prefect artifacts of a controlled comparison: the metric table and the plots people read it by.

Plots are inline PNGs (a local storage path is not a URL a browser can load): bus bandwidth by
message size for A and B, each arm's tokens/s over its repeats, and the loss curves overlaid.
"""

from __future__ import annotations

import base64
import io
import re
from collections.abc import Callable
from typing import Any

from prefect.artifacts import create_image_artifact, create_table_artifact

from tasks.artifacts import key, safe_cell
from tuneproof.control.comparison import Comparison, summary_rows

COLOURS = {"A": "tab:blue", "B": "tab:orange"}
BUSBW = re.compile(r"^connectivity\.busbw_GBps@(\d+)B$")


def publish(result: Comparison) -> None:
    rows = summary_rows(result)
    if rows:
        create_table_artifact(
            [{k: safe_cell(v) for k, v in r.items()} for r in rows],
            key=key("comparison", result.comparison_id),
            description=f"A: {' '.join(result.arms['A'].sets) or '(shared config)'} / "
            f"B: {' '.join(result.arms['B'].sets) or '(shared config)'}; {result.repeats} interleaved repeats",
        )
    for kind, plot, what in (
        ("comparison-busbw", busbw_plot, "All-reduce bus bandwidth by message size, A vs B (median, min-max)"),
        ("comparison-tokens", tokens_plot, "Fine-tune tokens/s over the repeats, A vs B"),
        ("comparison-loss", loss_plot, "Fine-tune loss curves, A and B overlaid"),
    ):
        png = plot(result)
        if png:
            create_image_artifact(
                "data:image/png;base64," + base64.b64encode(png).decode(),
                key=key(kind, result.comparison_id),
                description=what,
            )


def figure(draw: Callable[[Any], bool]) -> bytes | None:
    """A small PNG, or None when `draw` found nothing to show."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.2), dpi=100)
    try:
        if not draw(ax):
            return None
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        buf = io.BytesIO()
        fig.savefig(buf, format="png")
        return buf.getvalue()
    finally:
        plt.close(fig)


def busbw_plot(result: Comparison) -> bytes | None:
    by_size = sorted((int(match.group(1)), m) for m in result.metrics if (match := BUSBW.match(m.name)) and m.a.values)

    def draw(ax: Any) -> bool:
        if not by_size:
            return False
        sizes = [size for size, _ in by_size]
        for arm in ("A", "B"):
            spreads = [m.a if arm == "A" else m.b for _, m in by_size]
            medians = [s.median or 0.0 for s in spreads]
            low = [med - (s.min or 0.0) for med, s in zip(medians, spreads)]
            high = [(s.max or 0.0) - med for med, s in zip(medians, spreads)]
            ax.errorbar(sizes, medians, yerr=[low, high], marker="o", capsize=3, color=COLOURS[arm], label=arm)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("bus bandwidth (GB/s)")
        return True

    return figure(draw)


def tokens_plot(result: Comparison) -> bytes | None:
    metric = next((m for m in result.metrics if m.name == "finetune.tokens_per_s"), None)

    def draw(ax: Any) -> bool:
        if metric is None:
            return False
        for x, arm in enumerate(("A", "B")):
            values = (metric.a if arm == "A" else metric.b).values
            ax.scatter([x] * len(values), values, color=COLOURS[arm], label=f"{arm} (n={len(values)})")
        ax.set_xticks([0, 1], ["A", "B"])
        ax.set_ylabel("tokens/s")
        return True

    return figure(draw)


def loss_plot(result: Comparison) -> bytes | None:
    arm_of = {o.run_id: o.arm for o in result.order}

    def draw(ax: Any) -> bool:
        labelled: set[str] = set()
        for run_id, curve in result.loss_curves.items():
            points = [(s, loss) for s, loss in curve if loss is not None]
            if not points:
                continue
            arm = arm_of.get(run_id, "A")
            steps, losses = zip(*points)
            ax.plot(steps, losses, color=COLOURS[arm], alpha=0.6, linewidth=1, label=None if arm in labelled else arm)
            labelled.add(arm)
        if not labelled:
            return False
        ax.set_yscale("log")
        ax.set_xlabel("step")
        ax.set_ylabel("training loss")
        return True

    return figure(draw)
