"""The benchmarks' shared pieces: interleaved repeats, min/median/max, ratios against a target, the summary.

Pure except `write_summary` (one JSON file) and `interleave` (which calls what it is given): the
driver (bench/run.py) and each benchmark module use these, and tests/test_bench.py checks them
without timing anything.

A benchmark compares tuneproof ("ours") with what a user would run instead ("bare"), the two
measured alternately in one process run (A B A B ...) so both see the same machine load; the ratio is
median(ours) / median(bare) for costs (seconds: lower is better) or for rates (tokens/s: higher is
better), and the target says which way it must hold.
"""

from __future__ import annotations

import json
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


@dataclass(frozen=True)
class Spread:
    """min / median / max of one side's repeats."""

    n: int
    min: float
    median: float
    max: float

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("no measurements: a benchmark side ran 0 times")
        return cls(len(values), min(values), statistics.median(values), max(values))

    def text(self, unit: str = "s") -> str:
        return f"min {self.min:.4g} / median {self.median:.4g} / max {self.max:.4g} {unit} (n={self.n})"


@dataclass(frozen=True)
class Target:
    """`ratio <= value` (op "<=", a cost) or `ratio >= value` (op ">=", a speed or speed-up)."""

    op: Literal["<=", ">="]
    value: float

    def met(self, ratio: float) -> bool:
        return ratio <= self.value if self.op == "<=" else ratio >= self.value

    def text(self) -> str:
        return f"{self.op} {self.value:g}"

    def crossed_by(self, interval: tuple[float, float]) -> bool:
        """Whether the target's value lies within `interval` (inclusive): the data cannot say which side holds."""
        low, high = interval
        return low <= self.value <= high

    def miss(self, ratio: float) -> str | None:
        """How far a ratio is from the target, in words; None when it is met."""
        if self.met(ratio):
            return None
        return f"ratio {ratio:.3g} misses {self.text()} by a factor of {max(ratio, self.value) / min(ratio, self.value):.2f}"


def interleave(sides: Mapping[str, Callable[[int], float]], repeats: int) -> dict[str, list[float]]:
    """Call each side once per round, in the given order, for `repeats` rounds (A B A B ...).

    Each call gets its round number (0-based) and returns its measurement.
    """
    if repeats < 1:
        raise ValueError(f"--repeats must be at least 1, got {repeats}")
    measured: dict[str, list[float]] = {name: [] for name in sides}
    for round_ in range(repeats):
        for name, side in sides.items():
            measured[name].append(side(round_))
    return measured


def ours_against_bare(
    ours: Callable[[int], float], bare: Callable[[int], float], repeats: int, target: Target, **details: Any
) -> BenchResult:
    """Measure ours then bare, `repeats` rounds (A B A B ...), and compare them against `target`."""
    measured = interleave({"ours": ours, "bare": bare}, repeats)
    return compare(measured["ours"], measured["bare"], target, **details)


def ratio(ours: float, bare: float) -> float:
    """ours / bare; a bare side that took no measurable time makes the ratio infinite, not a crash."""
    return ours / bare if bare else math.inf


def difference(ours: float, bare: float) -> float:
    """ours - bare: the seconds ours adds (the pipeline's per-stage figure)."""
    return ours - bare


MIN_REPEATS = 5
"""Fewer rounds than this give a bootstrap interval too coarse to tell a miss from noise."""


def bootstrap_interval(
    ours: Sequence[float],
    bare: Sequence[float],
    figure: Callable[[float, float], float] = ratio,
    level: float = 0.95,
    draws: int = 2000,
    seed: int = 0,
) -> tuple[float, float]:
    """Percentile bootstrap interval of figure(median(ours), median(bare)).

    Each draw resamples both sides with replacement, independently (each side's repeats are its own
    sample of the machine); the seed is fixed so a summary can be recomputed from its samples exactly.
    """
    if not ours or not bare:
        raise ValueError(f"a bootstrap needs measurements on both sides, got {len(ours)} ours and {len(bare)} bare")
    if not 0 < level < 1:
        raise ValueError(f"confidence level must be in (0, 1), got {level}")
    rng = random.Random(seed)
    figures = sorted(
        figure(statistics.median(rng.choices(ours, k=len(ours))), statistics.median(rng.choices(bare, k=len(bare))))
        for _ in range(draws)
    )
    tail = (1 - level) / 2
    return figures[int(tail * (draws - 1))], figures[math.ceil((1 - tail) * (draws - 1))]


class BenchResult(BaseModel):
    """One entry of bench/out/summary.json."""

    model_config = ConfigDict(extra="forbid")

    ratio: float | None
    """The benchmark's figure against its target; None for a curve (scaling) or a side that could not run."""
    target: str | None
    """'<= 1.05' or '>= 0.6'; None for a curve."""
    ok: bool | None
    """Whether the ratio meets the target; None when there is no target or no ratio."""
    repeats: int
    interval: tuple[float, float] | None = None
    """95 % bootstrap interval of the ratio (bench.common.bootstrap_interval); None for a curve."""
    noisy: bool | None = None
    """The interval contains the target's value: `ok` is a coin the machine's noise could flip."""
    details: dict[str, Any]


def compare(
    ours: Sequence[float],
    bare: Sequence[float],
    target: Target,
    figure: Callable[[float, float], float] = ratio,
    **details: Any,
) -> BenchResult:
    """The result of a side-by-side benchmark: figure (the ratio, by default) of the medians, its
    bootstrap interval, its verdict, whether noise could flip it, and every sample of both sides."""
    a, b = Spread.of(ours), Spread.of(bare)
    r = figure(a.median, b.median)
    low, high = bootstrap_interval(ours, bare, figure)
    return BenchResult(
        ratio=round(r, 4),
        target=target.text(),
        ok=target.met(r),
        repeats=min(a.n, b.n),
        interval=(round(low, 4), round(high, 4)),
        noisy=target.crossed_by((low, high)),
        details={
            "ours": vars(a),
            "bare": vars(b),
            "samples": {"ours": list(ours), "bare": list(bare)},
            "miss": target.miss(r),
            **details,
        },
    )


def loglog_slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of log(y) over log(x): 1 is linear growth, 0 flat, 2 quadratic."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError(f"a slope needs at least two (x, y) points, got {len(xs)} x and {len(ys)} y")
    if min(xs) <= 0 or min(ys) <= 0:
        raise ValueError(f"log-log slope needs positive values, got x={list(xs)} y={list(ys)}")
    lx, ly = [math.log(x) for x in xs], [math.log(y) for y in ys]
    mx, my = statistics.fmean(lx), statistics.fmean(ly)
    spread = sum((x - mx) ** 2 for x in lx)
    if spread == 0:
        raise ValueError(f"a slope needs at least two different sizes, got {list(xs)}")
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / spread


def merged(existing: Mapping[str, Any], new: Mapping[str, BenchResult]) -> dict[str, Any]:
    """The summary after a run: benchmarks that ran replace their old entries, the others are kept
    (so `--only` refreshes part of a full summary instead of erasing the rest)."""
    out = dict(existing)
    out.update({name: result.model_dump(mode="json") for name, result in new.items()})
    return dict(sorted(out.items()))


def write_summary(path: Path, results: Mapping[str, BenchResult]) -> dict[str, Any]:
    """Merge `results` into the JSON file at `path` (created if missing); returns what was written."""
    existing: dict[str, Any] = {}
    if path.exists():
        try:
            existing = json.loads(path.read_text())
        except json.JSONDecodeError:
            existing = {}  # a summary cut short by an interrupted run: start over rather than fail
    summary = merged(existing, results)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def table(results: Mapping[str, BenchResult]) -> str:
    """One line per benchmark: name, figure, its interval, target, verdict, noisy, repeats."""
    lines = [f"{'benchmark':<16} {'ratio':>9} {'interval':<19} {'target':<8} {'ok':<4} {'noisy':<5} repeats"]
    for name, r in results.items():
        shown = "-" if r.ratio is None else f"{r.ratio:.3g}"
        span = "-" if r.interval is None else f"[{r.interval[0]:.3g}, {r.interval[1]:.3g}]"
        verdict = {True: "yes", False: "NO", None: "-"}[r.ok]
        noisy = {True: "noisy", False: "no", None: "-"}[r.noisy]
        lines.append(f"{name:<16} {shown:>9} {span:<19} {r.target or '-':<8} {verdict:<4} {noisy:<5} {r.repeats}")
    return "\n".join(lines)


def curve_table(title: str, unit_x: str, unit_y: str, points: Sequence[tuple[float, float]]) -> str:
    """A scaling curve as text, with its log-log slope when there are enough points."""
    lines = [title, f"  {unit_x:>12} {unit_y:>14}"]
    lines += [f"  {x:>12g} {y:>14.4g}" for x, y in points]
    if len(points) >= 2:
        lines.append(f"  log-log slope {loglog_slope([p[0] for p in points], [p[1] for p in points]):.2f}")
    return "\n".join(lines)


@contextmanager
def stopwatch() -> Iterator[Callable[[], float]]:
    """`with stopwatch() as elapsed: ...; elapsed()` -> seconds since the block began (frozen at its end)."""
    began = time.perf_counter()
    ended: list[float] = []
    yield lambda: (ended[0] if ended else time.perf_counter()) - began
    ended.append(time.perf_counter())


def say(message: str) -> None:
    """Progress on stdout, flushed: a benchmark run is long and its log is read as it goes."""
    print(message, flush=True)
