"""The LR schedule: linear warmup to the peak, cosine decay to the floor, flat after the end."""

import math

import pytest

from training.schedule import WarmupCosine


def test_warmup_rises_linearly_to_the_peak():
    s = WarmupCosine(peak_lr=1e-3, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert [s.lr_at(k) for k in (1, 2, 4)] == pytest.approx([2.5e-4, 5e-4, 1e-3])


def test_cosine_decays_to_the_floor_and_stays_there():
    s = WarmupCosine(peak_lr=1e-3, warmup_steps=4, total_steps=20, min_lr_ratio=0.1)
    assert s.lr_at(12) == pytest.approx(1e-4 + 0.5 * 9e-4)  # halfway through the decay
    assert s.lr_at(20) == pytest.approx(1e-4)
    assert s.lr_at(500) == pytest.approx(1e-4)
    decay = [s.lr_at(k) for k in range(4, 21)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_no_warmup_starts_at_the_peak():
    s = WarmupCosine(peak_lr=2e-3, warmup_steps=0, total_steps=10, min_lr_ratio=0.0)
    assert s.lr_at(1) == pytest.approx(2e-3 * 0.5 * (1 + math.cos(math.pi / 10)))
    assert s.lr_at(10) == 0.0


def test_warmup_longer_than_the_run_never_divides_by_zero():
    s = WarmupCosine(peak_lr=1e-3, warmup_steps=10, total_steps=5, min_lr_ratio=0.5)
    assert s.lr_at(5) == pytest.approx(5e-4)
    assert s.lr_at(10) == pytest.approx(1e-3)
    assert s.lr_at(11) == pytest.approx(5e-4)


def test_invalid_parameters_and_steps_name_the_value():
    with pytest.raises(ValueError, match="min_lr_ratio must be in \\[0, 1\\], got 1.5"):
        WarmupCosine(peak_lr=1e-3, warmup_steps=0, total_steps=10, min_lr_ratio=1.5)
    with pytest.raises(ValueError, match="step must be >= 1, got 0"):
        WarmupCosine(peak_lr=1e-3, warmup_steps=0, total_steps=10, min_lr_ratio=0.1).lr_at(0)
