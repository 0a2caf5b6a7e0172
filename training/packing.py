"""Packed rows kept apart: what the model is called with, and the probe that proves it on the first batch.

A collated micro-batch (training/train_data.collate) with packed rows carries position_ids that restart
at every example. `forward_inputs` (training/step.py: the loss uses it) turns them into what the model's attention implementation needs:
- sdpa / eager (what `load_model` gives, on CPU and GPU): a block-diagonal causal mask, so a token attends only
  to earlier tokens of its own example;
- any other implementation (flash, flex) is refused as a modeling failure: transformers honours neither this
  mask nor, for more than one row, the position ids' restarts there (training.step.PACKED_ATTENTION).

`probe_packing` runs on the fine-tune's first batch: each example's loss inside its packed row must equal
its loss alone within PROBE_TOLERANCE (fp32), or the stage fails as infrastructure: a packing that leaks
across examples trains on something other than the data. Runs inside Ray Train workers.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from training.step import forward_inputs  # the probe's forward: a test replaces it here
from training.train_data import TrainExample, collate
from tuneproof.core.hashing import IGNORE_INDEX
from tuneproof.core.results import FailureClass, StageFailure

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel

PROBE_TOLERANCE = 1e-4
"""Largest |packed - alone| per-example mean loss (nats) the probe accepts, in fp32."""


def example_losses(model: PreTrainedModel, batch: dict[str, torch.Tensor], rows: list[TrainExample]) -> list[float]:
    """Mean next-token loss of every example in the batch's rows, in order (fp32 logits)."""
    import torch
    import torch.nn.functional as F

    with torch.no_grad():
        logits = model(**forward_inputs(model, batch)).logits
        per_token = F.cross_entropy(
            logits[:, :-1].float().transpose(1, 2), batch["labels"][:, 1:], ignore_index=IGNORE_INDEX, reduction="none"
        )
    labelled = batch["labels"][:, 1:] != IGNORE_INDEX
    losses = []
    for row, example in enumerate(rows):
        cuts = np.cumsum((0, *(example.segments or (len(example.input_ids),))))
        for start, end in zip(cuts[:-1], cuts[1:]):
            # per_token[j] scores label j + 1: this example's targets are labels start + 1 .. end - 1.
            span = slice(start, end - 1)
            count = int(labelled[row, span].sum())
            losses.append(float(per_token[row, span].sum()) / count if count else 0.0)
    return losses


def probe_packing(
    model: PreTrainedModel,
    rows: list[TrainExample],
    pad_id: int,
    collate_fn: Callable[[list[TrainExample], int], dict[str, torch.Tensor]] = collate,
) -> float:
    """Largest |loss in its packed row - loss alone| over the examples of `rows` (a packed micro-batch);
    raises StageFailure (infrastructure) above PROBE_TOLERANCE. `collate_fn` is what builds the packed
    batch (the test passes a flat one to show what a leak looks like)."""
    device = next(model.parameters()).device
    packed_batch = {k: v.to(device) for k, v in collate_fn(rows, pad_id).items()}
    alone = [example for row in rows for example in row.unpacked()]
    alone_batch = {k: v.to(device) for k, v in collate(alone, pad_id).items()}
    packed = example_losses(model, packed_batch, rows)
    single = example_losses(model, alone_batch, alone)
    worst = max(abs(a - b) for a, b in zip(packed, single))
    if worst > PROBE_TOLERANCE:
        raise StageFailure(
            FailureClass.infrastructure,
            f"packing probe: an example's loss inside its packed row differs from its loss alone by {worst:.3g} "
            f"(expected at most {PROBE_TOLERANCE}, fp32) over the first batch's {len(alone)} examples in "
            f"{len(rows)} rows: packed examples see each other, so training would not be on the data",
        )
    return worst
