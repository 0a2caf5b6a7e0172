"""Resume evidence: did a restarted run pick up where it stopped, and do replayed steps match? Pure.

Two comparisons: the losses of replayed steps, and the data-order ledger (which samples each step trained
on, and a running hash over every step before it) on every step both runs trained. Both judge only the steps
both runs logged, so `check_phase_steps` and `check_first_step` require those to be every step each phase
had to train: a phase whose metrics were lost, or that logged another phase's steps, is no evidence.

The resume test (the resume stage) stops a run after a checkpoint, restarts it under the same name, and
hands these functions what the runs logged: the restored step, and per-step losses of the
reference run and of the replay. On CPU in fp32 with the same world size, replayed losses are
bit-identical (rtol 0); bf16 on GPU needs a small tolerance.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from tuneproof.core.findings import Finding
from tuneproof.core.summaries_training import LedgerPoint


def compare_losses(reference: dict[int, float], replay: dict[int, float], rtol: float) -> dict[str, Any]:
    """Compare losses on the steps both runs logged; ok needs at least one common step and no mismatch.

    A step mismatches when |replay - reference| > rtol * |reference|, or when either loss is not
    finite. Returns {"steps_compared", "max_abs_diff", "max_rel_diff", "ok", "mismatches", "reason"}.
    """
    if rtol < 0:
        raise ValueError(f"rtol must be >= 0, got {rtol}")
    common = sorted(set(reference) & set(replay))
    if not common:
        return _verdict(
            common,
            [],
            [],
            reason=(f"no common steps: reference logged {_span(reference)}, replay logged {_span(replay)}"),
        )
    diffs = [_diff(step, reference[step], replay[step]) for step in common]
    mismatches = [d for d in diffs if not _within(d, rtol)]
    reason = None
    if mismatches:
        first = mismatches[0]
        reason = (
            f"{len(mismatches)} of {len(common)} replayed steps differ; first at step {first['step']}: "
            f"replay {first['replay']!r}, reference {first['reference']!r} (rtol {rtol})"
        )
    return _verdict(common, diffs, mismatches, reason)


Ledger = dict[int, tuple[str, str | None]]
"""{step: (digest of the sample ids trained at that step, the running data-order ledger after it, or None)}."""


def as_ledger(points: list[LedgerPoint]) -> Ledger:
    """{step: (samples digest, running ledger)} of a fine-tune's ledger points (FinetuneSummary.ledger)."""
    return {int(step): (samples, ledger) for step, samples, ledger in points}


def compare_ledgers(reference: Ledger, replay: Ledger) -> dict[str, Any]:
    """Compare two runs' data-order ledgers on every step both ran; ok needs at least one such step and no
    difference. A step differs when its samples differ, or when its running ledger differs where both
    runs know it (then the order before it differed: a sample skipped or repeated earlier, or a restore
    that carried another run's ledger). Returns {"steps_compared", "first_differing_step", "ok", "reason"}.
    """
    common = sorted(set(reference) & set(replay))
    if not common:
        none_common = f"no common steps: reference logged {_span(reference)}, replay logged {_span(replay)}"
        return {"steps_compared": 0, "first_differing_step": None, "ok": False, "reason": none_common}
    differing = [step for step in common if _ledger_differs(reference[step], replay[step])]
    reason = None
    if differing:
        first = differing[0]
        what = "samples" if reference[first][0] != replay[first][0] else "running ledger (the order before it)"
        reason = (
            f"{len(differing)} of {len(common)} steps trained on other samples than the reference; first at step "
            f"{first}: its {what} differ (replay {replay[first][0]}, reference {reference[first][0]})"
        )
    first_step = differing[0] if differing else None
    return {"steps_compared": len(common), "first_differing_step": first_step, "ok": not differing, "reason": reason}


def _ledger_differs(reference: tuple[str, str | None], replay: tuple[str, str | None]) -> bool:
    if reference[0] != replay[0]:
        return True
    return reference[1] is not None and replay[1] is not None and reference[1] != replay[1]


def check_restart(expected_step: int, restored_step: int | None, subject: str = "resumed run") -> Finding | None:
    """A Finding when the restarted run did not restore the checkpoint step it was stopped after."""
    if restored_step == expected_step:
        return None
    message = (
        "it started from scratch instead of a checkpoint"
        if restored_step is None
        else "it restored a different checkpoint than the one saved before the stop"
    )
    return Finding(subject=subject, field="restored_step", seen=restored_step, expected=expected_step, message=message)


def check_phase_steps(
    phase: str, kind: str, expected: range, logged: Iterable[int], reference: Iterable[int]
) -> str | None:
    """A problem line when a phase's `kind` (losses, data order) were not compared with the main run's on exactly
    the `expected` steps: the phase logged other steps, or the main run lacks some. None when they were. Pure."""
    want, seen, main = set(expected), set(logged), set(reference)
    compared = seen & main
    if compared == want and seen == want:
        return None
    gaps = [
        f"{_steps(steps)} {why}"
        for steps, why in (
            (want - seen, "not logged by it"),
            ((want & seen) - main, "not logged by the main run"),
            (seen - want, "logged by it but outside its range"),
        )
        if steps
    ]
    return (
        f"the {phase} phase's {kind} compared with the main run's on {_steps(compared)} instead of "
        f"{_steps(want)}: {'; '.join(gaps)}"
    )


def check_first_step(restored_step: int | None, logged: Iterable[int]) -> str | None:
    """A problem line when the restarted run's first logged step is not the one after the step it restored (step 1
    when it restored none): its curve then did not start where it claims it did. None when it is. Pure."""
    expected = (restored_step or 0) + 1
    first = min(logged, default=None)
    if first == expected:
        return None
    found = "logged no step" if first is None else f"first logged step {first}"
    why = f"the one after its restored step {restored_step}" if restored_step is not None else "it restored no step"
    return f"the restarted run {found}, expected step {expected} first ({why})"


def _steps(steps: Iterable[int]) -> str:
    """'steps 301..304, 309' of a set of steps: consecutive ones as a range; 'no steps' when empty. Pure."""
    runs: list[list[int]] = []
    for step in sorted(set(steps)):
        if runs and step == runs[-1][1] + 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    if not runs:
        return "no steps"
    spans = ", ".join(str(a) if a == b else f"{a}..{b}" for a, b in runs)
    return f"step {spans}" if len(runs) == 1 and runs[0][0] == runs[0][1] else f"steps {spans}"


def _diff(step: int, reference: float, replay: float) -> dict[str, Any]:
    if not (math.isfinite(reference) and math.isfinite(replay)):
        # A non-finite loss never matches; inf (not nan) keeps the maxima well defined.
        return {"step": step, "reference": reference, "replay": replay, "abs_diff": math.inf, "rel_diff": math.inf}
    abs_diff = abs(replay - reference)
    rel_diff = abs_diff / abs(reference) if reference != 0 else (0.0 if abs_diff == 0 else math.inf)
    return {"step": step, "reference": reference, "replay": replay, "abs_diff": abs_diff, "rel_diff": rel_diff}


def _within(diff: dict[str, Any], rtol: float) -> bool:
    return math.isfinite(diff["abs_diff"]) and diff["abs_diff"] <= rtol * abs(diff["reference"])


def _verdict(common: list[int], diffs: list[dict], mismatches: list[dict], reason: str | None) -> dict[str, Any]:
    return {
        "steps_compared": len(common),
        "max_abs_diff": max((d["abs_diff"] for d in diffs), default=None),
        "max_rel_diff": max((d["rel_diff"] for d in diffs), default=None),
        "ok": bool(common) and not mismatches,
        "mismatches": mismatches,
        "reason": reason,
    }


def _span(losses: dict[int, Any]) -> str:
    return f"steps {min(losses)}..{max(losses)}" if losses else "no steps"
