"""Controlled comparisons: the same workload under two settings, A and B, run interleaved.

A comparison is a list of runs (ordinary runs, each with its own record) in the order A1 B1 A2 B2 …,
so slow drift on a shared machine (another job, a warming cache) falls on both arms alike. Per
metric it keeps every value, the median and spread of each arm, the ratio B/A of geometric means and
its 95 % Student t interval on the log scale (tuneproof/core/stats.py: valid from 2 repeats an arm,
where a percentile bootstrap of 2-3 values is not an interval at all). The verdict is
  better / worse (higher / lower)  the whole interval is on one side of 1 and the ratio moves by at
                                   least the threshold;
  no detectable difference         the interval fits inside 1 +/- threshold: any difference is smaller
                                   than what was asked to detect;
  insufficient repeats             neither: these repeats cannot tell, and `repeats_needed` says how
                                   many an arm would at the spread seen; always, with one value on
                                   either arm (a ratio of single values is a point, not a verdict);
so that three noisy repeats cannot produce a confident-sounding answer either way.

The statistics are pure functions; `save` and `load` are the only I/O.
"""

from __future__ import annotations

import json
import statistics
from typing import Any, Literal

from pydantic import Field

from tuneproof.core import cas, stats
from tuneproof.core.results import Model
from tuneproof.core.storage import Storage

COMPARISON = "comparison.json"
Direction = Literal["higher", "lower", "none"]
Verdict = Literal[
    "better", "worse", "higher", "lower", "no detectable difference", "insufficient repeats", "not enough data"
]
Arm = Literal["A", "B"]


class Spread(Model):
    values: list[float]
    median: float | None
    min: float | None
    max: float | None


class MetricComparison(Model):
    name: str
    direction: Direction
    """Which way is better: 'higher' (bandwidth, tokens/s, accuracy), 'lower' (time, loss), or 'none'."""
    a: Spread
    b: Spread
    ratio: float | None
    """B / A: the ratio of geometric means when there is an interval, else of medians."""
    ci95: tuple[float, float] | None
    """Student t interval of the ratio (log scale, pooled spread) at `confidence` (95 % but in the canary); None
    below 2 values an arm, whose verdict is then 'insufficient repeats' (or 'not enough data' for an empty arm)."""
    verdict: Verdict
    confidence: float = 0.95
    """The interval's level: 0.95 in `tuneproof compare`; 1 - 0.05/m in the image canary, whose one decision
    rests on m metrics (Bonferroni). Records made before it were at 0.95."""
    method: str | None = None
    """How the interval was made ('t on log ratio'); None for records made before it."""
    repeats_needed: int | None = None
    """With 'insufficient repeats': repeats an arm that would resolve the threshold at the spread seen (None with one
    value on each arm: no spread seen)."""


class ArmIdentity(Model):
    """Everything that set one arm apart, and what it ran on: as diffable as two runs are."""

    label: str
    sets: list[str]
    """The `--set` overrides of this arm (on top of the shared config)."""
    config_hash: str
    config: dict[str, Any]
    runs: list[str] = []
    code: dict[str, Any] | None = None
    cluster: dict[str, Any] | None = None
    data: dict[str, Any] | None = None


class RunOutcome(Model):
    run_id: str
    arm: Arm
    repeat: int
    status: str
    failure_class: str | None = None
    cause: str | None = None
    seconds: float


class Comparison(Model):
    schema_version: int = 1
    comparison_id: str
    created_at: str
    stages: list[str]
    repeats: int
    threshold: float = Field(gt=0.0, lt=1.0)
    status: Literal["running", "succeeded", "failed"]
    cause: str | None = None
    arms: dict[Arm, ArmIdentity]
    order: list[RunOutcome] = []
    """Every run in the order it ran (A1 B1 A2 B2 …)."""
    metrics: list[MetricComparison] = []
    loss_curves: dict[str, list[tuple[int, float | None]]] = {}
    """Fine-tune loss curves by run id, for the overlaid plot."""


def interleaved(repeats: int) -> list[tuple[Arm, int]]:
    """A1 B1 A2 B2 …: each repeat runs both arms back to back."""
    return [(arm, i) for i in range(1, repeats + 1) for arm in ("A", "B")]


def direction(metric: str) -> Direction:
    """Which way is better for a metric named as the stage table names them."""
    name = metric.lower()
    if any(k in name for k in ("loss", "seconds", "time", "perplexity", "diff")):
        return "lower"
    if any(k in name for k in ("busbw", "algbw", "tokens_per_s", "mfu", "exact_match", "accuracy", "f1", "rouge")):
        return "higher"
    return "none"


def spread(values: list[float]) -> Spread:
    if not values:
        return Spread(values=[], median=None, min=None, max=None)
    return Spread(values=values, median=statistics.median(values), min=min(values), max=max(values))


def verdict(dir_: Direction, interval: stats.RatioInterval | None, threshold: float) -> Verdict:
    """'better'/'worse' (or 'higher'/'lower' for a metric with no better side) only when the whole
    interval is on one side of 1 and the ratio moves by at least the threshold; 'no detectable
    difference' when the interval fits inside 1 +/- threshold; otherwise 'insufficient repeats'."""
    if interval is None:
        return "not enough data"
    moved: Literal["higher", "lower"]
    if interval.lo > 1.0 and interval.ratio >= 1.0 + threshold:
        moved = "higher"
    elif interval.hi < 1.0 and interval.ratio <= 1.0 - threshold:
        moved = "lower"
    elif interval.lo >= 1.0 - threshold and interval.hi <= 1.0 + threshold:
        return "no detectable difference"
    else:
        return "insufficient repeats"
    if dir_ == "none":
        return moved
    return "better" if moved == dir_ else "worse"


def compare_metric(
    name: str, a: list[float], b: list[float], threshold: float, confidence: float = 0.95
) -> MetricComparison:
    """B against A with a t interval at `confidence` (higher where one decision rests on several metrics)."""
    sa, sb = spread(a), spread(b)
    medians = sb.median / sa.median if sa.median and sb.median is not None else None
    if min(len(a), len(b)) == 1:
        return one_value_an_arm(name, sa, sb, medians, threshold, confidence)
    interval = stats.log_ratio_interval(a, b, confidence)
    result = verdict(direction(name), interval, threshold)
    return MetricComparison(
        name=name,
        direction=direction(name),
        a=sa,
        b=sb,
        ratio=interval.ratio if interval else medians,
        ci95=(interval.lo, interval.hi) if interval else None,
        verdict=result,
        confidence=confidence,
        method="t on log ratio" if interval else None,
        repeats_needed=stats.repeats_needed(interval.ratio, interval.log_sd, threshold, confidence)
        if interval and result == "insufficient repeats"
        else None,
    )


def one_value_an_arm(
    name: str, a: Spread, b: Spread, ratio: float | None, threshold: float, confidence: float
) -> MetricComparison:
    """One value on either arm: no interval, so never better, worse or no difference, however far apart the
    two values are (one run's value is one draw of its noise). The repeats needed are sized by the other arm's
    spread when it has one; with one value on each arm there is no spread to size them by."""
    spread_seen = stats.log_sd(b.values if len(a.values) == 1 else a.values)
    needed = (
        stats.repeats_needed(ratio, spread_seen, threshold, confidence)
        if ratio is not None and ratio > 0 and spread_seen is not None
        else None
    )
    return MetricComparison(
        name=name,
        direction=direction(name),
        a=a,
        b=b,
        ratio=ratio,
        ci95=None,
        verdict="insufficient repeats",
        confidence=confidence,
        method="one value an arm: no interval",
        repeats_needed=needed,
    )


def compare_all(
    a_runs: list[dict[str, float | None]], b_runs: list[dict[str, float | None]], threshold: float
) -> list[MetricComparison]:
    """One comparison per metric any run reported; a run that lacks a value adds nothing to its arm."""
    names = sorted({n for run in a_runs + b_runs for n in run})
    out = []
    for name in names:
        a = [v for run in a_runs if (v := run.get(name)) is not None]
        b = [v for run in b_runs if (v := run.get(name)) is not None]
        out.append(compare_metric(name, a, b, threshold))
    return out


def summary_rows(result: Comparison) -> list[dict[str, Any]]:
    """The comparison as table rows (terminal, artifact): one per metric."""
    return [
        {
            "metric": m.name,
            "A median": m.a.median,
            "A min..max": f"{m.a.min:.4g}..{m.a.max:.4g}" if m.a.values else "",
            "B median": m.b.median,
            "B min..max": f"{m.b.min:.4g}..{m.b.max:.4g}" if m.b.values else "",
            "B/A": m.ratio,
            "95% CI of B/A": f"{m.ci95[0]:.3f}..{m.ci95[1]:.3f}" if m.ci95 else "",
            "verdict": m.verdict + needed_words(m),
        }
        for m in result.metrics
    ]


def needed_words(m: MetricComparison) -> str:
    """' (7 repeats an arm would tell)', or why no number is given; '' for a resolved verdict."""
    if m.verdict != "insufficient repeats":
        return ""
    if m.repeats_needed:
        return f" ({m.repeats_needed} repeats an arm would tell)"
    if min(len(m.a.values), len(m.b.values)) == 1:
        return " (one value an arm: 2 or more repeats an arm give an interval)"
    return " (more than 1,000 repeats an arm at this spread)"


# ---- storage ------------------------------------------------------------------------------------


def create(storage: Storage, comparison: Comparison) -> bool:
    """Write a new comparison's first file; False when that id is taken (a rerun or a concurrent one).

    Exclusive, so two comparisons can never share an id and overwrite each other's verdicts."""
    data = json.dumps(comparison.to_json(), indent=2).encode()
    return cas.write_if(storage, data, None, "comparisons", comparison.comparison_id, COMPARISON)


def save(storage: Storage, comparison: Comparison) -> str:
    storage.write_json(comparison.to_json(), "comparisons", comparison.comparison_id, COMPARISON)
    return storage.uri("comparisons", comparison.comparison_id, COMPARISON)


def load(storage: Storage, comparison_id: str) -> Comparison:
    if not storage.exists("comparisons", comparison_id, COMPARISON):
        raise FileNotFoundError(f"no comparison {comparison_id!r} under {storage.uri('comparisons')}")
    return Comparison.model_validate(storage.read_json("comparisons", comparison_id, COMPARISON))
