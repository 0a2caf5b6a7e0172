"""The learning-rate schedule: linear warmup, then cosine decay to a floor. Pure; no torch.

The fine-tune asks `lr_at(step)` before every optimizer step, so the schedule has no state of its
own: a resumed run gets the same rate at the same step from the step number alone, and the
checkpoint stores the schedule's parameters only to say which schedule produced it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class WarmupCosine:
    peak_lr: float
    """Rate reached at the end of warmup."""
    warmup_steps: int
    """Steps of linear warmup; 0 starts at the peak."""
    total_steps: int
    """Step at which the cosine reaches the floor; later steps stay on the floor."""
    min_lr_ratio: float
    """Floor as a fraction of peak_lr."""

    def __post_init__(self) -> None:
        if self.peak_lr <= 0:
            raise ValueError(f"peak_lr must be > 0, got {self.peak_lr}")
        if self.total_steps < 1:
            raise ValueError(f"total_steps must be >= 1, got {self.total_steps}")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            raise ValueError(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")

    def lr_at(self, step: int) -> float:
        """Rate for optimizer step `step` (1-based: the first update is step 1)."""
        if step < 1:
            raise ValueError(f"step must be >= 1, got {step}")
        if step <= self.warmup_steps:
            return self.peak_lr * step / self.warmup_steps
        floor = self.peak_lr * self.min_lr_ratio
        if step >= self.total_steps:
            return floor
        # Here warmup_steps < step < total_steps, so the decay span is positive.
        progress = (step - self.warmup_steps) / (self.total_steps - self.warmup_steps)
        return floor + (self.peak_lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))

    def to_dict(self) -> dict:
        return asdict(self)
