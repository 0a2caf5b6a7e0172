"""bench/common.py and the pure parts of the benchmarks: interleaving, spreads, ratios against targets, slopes, the summary file.

Nothing here is timed: the measurements are made up, so the tests say what is done with them.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.common import (
    BenchResult,
    Spread,
    Target,
    bootstrap_interval,
    compare,
    curve_table,
    difference,
    interleave,
    loglog_slope,
    table,
    write_summary,
)


def test_interleave_alternates_the_sides_round_by_round():
    calls: list[tuple[str, int]] = []

    def side(name: str, value: float):
        def run(round_: int) -> float:
            calls.append((name, round_))
            return value + round_

        return run

    measured = interleave({"ours": side("ours", 10), "bare": side("bare", 1)}, repeats=3)

    assert calls == [("ours", 0), ("bare", 0), ("ours", 1), ("bare", 1), ("ours", 2), ("bare", 2)]
    assert measured == {"ours": [10, 11, 12], "bare": [1, 2, 3]}


def test_interleave_refuses_zero_repeats():
    with pytest.raises(ValueError, match="--repeats must be at least 1, got 0"):
        interleave({"a": lambda r: 1.0}, 0)


def test_spread_is_min_median_max():
    s = Spread.of([3.0, 1.0, 10.0, 2.0])
    assert (s.n, s.min, s.median, s.max) == (4, 1.0, 2.5, 10.0)
    with pytest.raises(ValueError, match="ran 0 times"):
        Spread.of([])


def test_a_cost_target_holds_at_or_below_and_a_speed_target_at_or_above():
    assert Target("<=", 1.05).met(1.05) and not Target("<=", 1.05).met(1.06)
    assert Target(">=", 0.6).met(0.6) and not Target(">=", 0.6).met(0.59)
    assert Target("<=", 2).miss(1.5) is None
    assert Target("<=", 1.2).miss(2.4) == "ratio 2.4 misses <= 1.2 by a factor of 2.00"
    assert Target(">=", 0.6).miss(0.2) == "ratio 0.2 misses >= 0.6 by a factor of 3.00"


def test_compare_is_the_ratio_of_medians_with_its_verdict():
    result = compare([2.0, 2.2, 9.0], [2.0, 1.0, 1.1], Target("<=", 1.05), unit="s")

    assert result.ratio == pytest.approx(2.2 / 1.1)
    assert (result.target, result.ok, result.repeats) == ("<= 1.05", False, 3)
    assert result.details["ours"] == {"n": 3, "min": 2.0, "median": 2.2, "max": 9.0}
    assert result.details["samples"] == {"ours": [2.0, 2.2, 9.0], "bare": [2.0, 1.0, 1.1]}
    assert result.details["unit"] == "s"
    assert "misses <= 1.05" in result.details["miss"]


def test_the_bootstrap_interval_holds_the_figure_and_only_values_the_samples_allow():
    ours, bare = [2.0, 2.1, 2.2, 2.4, 3.0], [1.0, 1.0, 1.1, 1.2, 1.3]
    low, high = bootstrap_interval(ours, bare)
    # every resampled median is one of a side's values, so the ratio stays within these bounds
    assert 2.0 / 1.3 <= low <= 2.2 / 1.1 <= high <= 3.0 / 1.0
    assert bootstrap_interval(ours, bare) == (low, high)  # a fixed seed: recomputable from the summary
    assert bootstrap_interval([2.0] * 5, [1.0] * 5) == (2.0, 2.0)  # no spread, no width


def test_the_interval_of_a_difference_is_in_seconds_added():
    low, high = bootstrap_interval([10.0, 11.0, 12.0, 13.0, 14.0], [9.0] * 5, difference)
    assert 1.0 <= low <= 3.0 <= high <= 5.0


def test_more_repeats_of_the_same_spread_narrow_the_interval():
    few = bootstrap_interval([1.0, 1.5, 2.0, 2.5, 3.0], [1.0] * 5)
    many = bootstrap_interval([1.0, 1.5, 2.0, 2.5, 3.0] * 8, [1.0] * 40)
    assert many[1] - many[0] < few[1] - few[0]


@pytest.mark.parametrize(("ours", "bare", "level"), [([], [1.0], 0.95), ([1.0], [1.0], 1.0)])
def test_the_bootstrap_refuses_what_it_cannot_resample(ours, bare, level):
    with pytest.raises(ValueError, match="both sides|level"):
        bootstrap_interval(ours, bare, level=level)


def test_a_ratio_whose_interval_holds_the_target_is_noisy_whatever_its_verdict():
    target = Target("<=", 1.2)
    steady = compare([1.0, 1.0, 1.01, 1.02, 1.0], [1.0, 1.0, 0.99, 1.0, 1.01], target)
    assert steady.ok is True and steady.noisy is False
    assert steady.interval is not None and steady.interval[1] < 1.2

    shaky = compare([0.8, 1.0, 1.1, 1.4, 1.6], [1.0, 0.9, 1.0, 1.1, 1.0], target)
    assert shaky.ok is True and shaky.noisy is True  # the median meets it, the interval does not promise it
    assert target.crossed_by((1.0, 1.2)) and not target.crossed_by((1.21, 2.0))


def test_compare_takes_a_difference_for_seconds_added():
    result = compare([12.0, 12.5, 13.5, 12.2, 13.2], [10.0, 10.1, 9.9, 10.0, 10.2], Target("<=", 3), difference)
    assert result.ratio == pytest.approx(2.5)
    assert result.ok is True and result.noisy is True  # 2.5 s median, but 3 s lies inside its interval


def test_a_bare_side_of_zero_gives_an_infinite_ratio_that_misses_a_cost_target():
    result = compare([1.0], [0.0], Target("<=", 2))
    assert result.ratio == math.inf and result.ok is False


def test_loglog_slope_recovers_the_power():
    assert loglog_slope([10, 100, 1000], [1, 10, 100]) == pytest.approx(1.0)
    assert loglog_slope([1, 2, 4], [3, 3, 3]) == pytest.approx(0.0)
    assert loglog_slope([1, 2, 4], [1, 4, 16]) == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("xs", "ys", "message"),
    [([1], [1], "at least two"), ([0, 1], [1, 2], "positive"), ([5, 5], [1, 2], "two different sizes")],
)
def test_loglog_slope_refuses_what_has_no_slope(xs, ys, message):
    with pytest.raises(ValueError, match=message):
        loglog_slope(xs, ys)


def test_the_summary_keeps_entries_a_partial_run_did_not_touch(tmp_path):
    path = tmp_path / "out" / "summary.json"
    old = BenchResult(ratio=1.0, target="<= 2", ok=True, repeats=3, details={})
    write_summary(path, {"resume": old, "checkpoint": old})

    new = BenchResult(ratio=3.0, target="<= 2", ok=False, repeats=5, details={"why": "slower"})
    written = write_summary(path, {"resume": new})

    assert json.loads(path.read_text()) == written
    assert list(written) == ["checkpoint", "resume"]
    assert written["resume"] == {
        "ratio": 3.0,
        "target": "<= 2",
        "ok": False,
        "repeats": 5,
        "interval": None,
        "noisy": None,
        "details": {"why": "slower"},
    }
    assert written["checkpoint"]["ratio"] == 1.0


def test_an_unreadable_summary_is_replaced_not_fatal(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"resume": {"rat')
    written = write_summary(path, {"x": BenchResult(ratio=None, target=None, ok=None, repeats=1, details={})})
    assert list(written) == ["x"]


def test_the_table_shows_each_verdict():
    results = {
        "fast": BenchResult(ratio=0.5, target="<= 1", ok=True, repeats=5, interval=(0.4, 0.6), noisy=False, details={}),
        "slow": BenchResult(ratio=4.0, target="<= 1", ok=False, repeats=5, interval=(0.9, 5.0), noisy=True, details={}),
        "curve": BenchResult(ratio=None, target=None, ok=None, repeats=1, details={}),
    }
    lines = table(results).splitlines()
    assert lines[1].split() == ["fast", "0.5", "[0.4,", "0.6]", "<=", "1", "yes", "no", "5"]
    assert lines[2].split()[-3:] == ["NO", "noisy", "5"]
    assert lines[3].split() == ["curve", "-", "-", "-", "-", "-", "1"]


def test_a_curve_table_ends_with_its_slope():
    text = curve_table("runs list", "runs", "seconds", [(10, 0.1), (100, 1.0), (1000, 10.0)])
    assert text.splitlines()[-1].strip() == "log-log slope 1.00"


def test_steps_stalled_per_checkpoint_are_the_extra_time_around_it_in_median_steps():
    from bench.checkpoint import stalled_steps

    # checkpoints after steps 3 and 7, each completed after the next step: steps 3-5 and 7-9 carry them;
    # the others take 1.0 s (the median)
    seconds = [1.0, 1.0, 1.5, 1.2, 1.1, 1.0, 1.0, 2.5, 1.0, 1.0]
    assert stalled_steps(seconds, [(3, 4), (7, 8)]) == pytest.approx([0.8, 1.5])
    # a save that ran on through three steps counts all of them and the one after
    assert stalled_steps([1.0, 1.0, 1.2, 1.3, 1.2, 1.1, 1.0, 1.0], [(2, 4)]) == pytest.approx([0.7])
    assert stalled_steps([2.0, 2.0, 1.9, 2.0], [(2, 2)]) == [0.0]  # a save hidden behind its steps stalls nothing
    assert stalled_steps([1.0, 1.0, 4.0], [(3, 3)]) == [3.0]  # the last step's save has no next step to count


def test_stalled_steps_refuse_what_they_cannot_compare():
    from bench.checkpoint import stalled_steps

    with pytest.raises(ValueError, match=r"checkpoint spans \[\(5, 5\)\] are outside the 3 steps"):
        stalled_steps([1.0, 1.0, 1.0], [(5, 5)])
    with pytest.raises(ValueError, match=r"checkpoint spans \[\(3, 2\)\]"):  # completed before it began
        stalled_steps([1.0, 1.0, 1.0], [(3, 2)])
    with pytest.raises(ValueError, match="no step without a checkpoint"):
        stalled_steps([1.0, 1.0], [(1, 1)])


def test_the_stall_loop_saves_and_completes_every_checkpoint_with_ours_and_with_stock_async_save(tmp_path):
    """Both sides of the stall row go through the same loop: every due checkpoint is started, completed and on disk."""
    from bench.checkpoint import measure_stall, one_rank, our_saver, stock_saver, trained_model
    from training.checkpointing import MARKER, StagingBuffers
    from tuneproof.core.storage import Storage

    plan = {"steps": 7, "every": 2, "batch": 1, "seq": 8}  # checkpoints after steps 2 and 4 (6 + 2 > 7: none)
    shape = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1, "vocab_size": 128}
    with one_rank():
        import torch.distributed as dist

        model, optimizer = trained_model(shape)
        group = dist.new_group(backend="gloo")
        ours_store, stock_store = Storage(str(tmp_path / "ours")), Storage(str(tmp_path / "stock"))
        ours = measure_stall(model, optimizer, our_saver(model, optimizer, group, StagingBuffers(), ours_store), plan)
        stock = measure_stall(model, optimizer, stock_saver(model, optimizer, group, stock_store), plan)
    for side in (ours, stock):
        assert [began for began, _ in side["checkpoint_spans"]] == [2, 4]
        assert all(began <= done <= plan["steps"] for began, done in side["checkpoint_spans"])
        assert len(side["stall_steps"]) == 2 and side["max"] == max(side["stall_steps"]) >= 0
    assert all((tmp_path / "ours" / "stall" / f"step-{s}" / MARKER).is_file() for s in (2, 4))
    assert all((tmp_path / "stock" / "stall" / f"stock-{s}" / ".metadata").is_file() for s in (2, 4))


def test_the_contamination_row_is_ok_while_the_cost_per_row_stays_flat(monkeypatch):
    from bench import contamination

    assert contamination.cpu_seconds(2_000) >= 0  # the real check, small: it finds exactly the planted repeats
    monkeypatch.setattr(contamination, "cpu_seconds", lambda n: 0.2 + n * 4e-5)  # linear, with a fixed start
    flat = contamination.run(None, repeats=3, quick=False)
    assert flat.ok and flat.target == "<= 2" and flat.ratio == pytest.approx(60 / 42, abs=0.001)
    assert flat.details["fit"]["slope_s_per_unit"] == pytest.approx(4e-5) and len(flat.details["samples"]) == 9
    monkeypatch.setattr(contamination, "cpu_seconds", lambda n: n * n * 1e-9)  # pairwise: grows with rows squared
    assert contamination.run(None, repeats=3, quick=False).ok is False


def test_the_pipeline_row_is_its_worst_stage_and_ok_only_when_every_stage_is():
    from bench.pipeline import TARGET, overall, stage_table

    steady = compare([5.0, 5.1, 5.2], [4.0, 4.1, 4.0], TARGET, difference)  # about 1 s added
    slow = compare([12.0, 12.5, 13.0], [8.0, 8.2, 8.1], TARGET, difference)  # about 4.4 s added
    shaky = compare([3.0, 5.5, 6.0], [3.0, 3.1, 3.0], TARGET, difference)  # 2.5 s, but 3 s lies in its interval

    row = overall({"verify": steady, "finetune": slow, "data": shaky}, rounds=3)
    assert (row.ratio, row.interval, row.details["worst"]) == (slow.ratio, slow.interval, "finetune")
    assert row.ok is False and row.noisy is True and row.repeats == 3 and row.target == "<= 3"
    assert row.details["stages"]["verify"] == {
        "ours_s": 5.1,
        "bare_s": 4.0,
        "added_s": steady.ratio,
        "interval": steady.interval,
        "noisy": False,
        "ok": True,
        "samples": {"ours": [5.0, 5.1, 5.2], "bare": [4.0, 4.1, 4.0]},
    }
    assert row.details["rounds"] == 3
    assert overall({"verify": steady}).ok is True and overall({"verify": steady}).noisy is False
    lines = stage_table(row).splitlines()
    assert lines[2].split() == ["finetune", "12.50", "8.10", "4.40", "[3.80,", "5.00]", "no", "NO"]


def test_the_bare_resume_starts_where_the_resume_test_would():
    from bench.pipeline import resume_steps
    from tuneproof.core.config import PipelineConfig

    cfg = PipelineConfig().model_copy(deep=True)
    cfg.train.max_steps, cfg.resume.extra_steps, cfg.resume.replay_steps = 40, 4, 5
    assert resume_steps(cfg, {20: Path("a"), 40: Path("b")}) == (20, 24, 29)  # 40 leaves no room to replay
    assert resume_steps(cfg, {10: Path("a"), 20: Path("b"), 31: Path("c")}) == (31, 35, 40)
    with pytest.raises(ValueError, match=r"no checkpoint in \[40\] leaves 4\+5 steps before 40"):
        resume_steps(cfg, {40: Path("b")})


def test_the_bench_corpus_grows_past_the_days_the_bundled_file_draws_once(tmp_path):
    # The bundled dates file draws each of 36,524 days once; the data_prep and scaling rows need up to 800,000.
    from bench.harness import write_corpus

    rows = write_corpus(tmp_path / "c.jsonl", 40_000).read_text().splitlines()
    assert len(rows) == 40_000 and len(set(rows)) == 40_000  # every prompt distinct by its entry number
    assert json.loads(rows[39_999])["input"].startswith("Entry 39999: ")


def test_the_bench_reads_a_metrics_log_as_the_pipeline_does(tmp_path):
    # A killed writer leaves a torn last row, and on S3 the log is chunk objects: the bench read metrics.jsonl
    # line by line, failing on the one and finding nothing of the other; rowlog's reader handles both.
    from bench.harness import read_metrics
    from tuneproof.core.config import validate
    from tuneproof.core.rowlog import append_rows
    from tuneproof.core.storage import Storage

    parts = ("runs", "bench-ft", "stages", "ft-0", "metrics.jsonl")
    append_rows(Storage(str(tmp_path)), [{"step": 1, "step_seconds": 0.5}, {"step": 2, "step_seconds": 0.4}], *parts)
    with tmp_path.joinpath(*parts).open("a") as f:
        f.write('{"step": 3, "step_sec')
    rows = read_metrics(validate({"storage": {"root": str(tmp_path)}}), "bench-ft", "ft-0")
    assert [r["step"] for r in rows] == [1, 2]
