"""The prepared dataset as deterministic training batches, the same on every replay.

The data stage writes datasets/<name>/<hash>/{train,eval}/part-*.parquet (columns input_ids and
labels as list<int32>, -100 on prompt tokens, no padding) and manifest.json last; its `read_split`
reads a split back, checked against the manifest. Under data.overflow: pack a row holds several examples
and its `segments` column their lengths (null for a row of one example). Here:

- every epoch visits the examples in a permutation seeded by (seed, epoch);
- step s takes the next global batch (micro_batch_size x grad_accum_steps x world_size examples);
  rank r takes its contiguous slice and cuts it into grad_accum_steps micro-batches;
- a micro-batch is right-padded to its longest example (labels -100, attention 0 on padding);
- a micro-batch with packed rows also carries position_ids that restart at each example (and at the
  padding), and the label of each example's first token is -100: nothing learns across a boundary.
  training.modeling.forward_inputs turns those position ids into a block-diagonal mask (or the varlen
  path of a flash-attention model), so each example attends to itself only;
- an epoch's tail that cannot fill a global batch is skipped, so every rank runs the same steps.

Which examples a step sees depends only on (seed, step, layout), so a run resumed at step k
trains on exactly the batches the uninterrupted run saw from k + 1 on. The data-order ledger holds
that to account: each step's sample ids (their indices in the train split, every rank's, in rank order)
are folded into a running sha256 (`fold_ledger`) that every checkpoint saves, so a resumed run's ledger
equals the uninterrupted run's step for step only if no sample was skipped, repeated or reordered.
Runs inside Ray Train workers.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from training.data_files import read_split
from tuneproof.core.hashing import IGNORE_INDEX
from tuneproof.core.results import FailureClass, StageFailure
from tuneproof.core.storage import Storage


@dataclass(frozen=True)
class TrainExample:
    """One row: one example, or (segments set) several packed end to end."""

    input_ids: np.ndarray
    labels: np.ndarray
    segments: tuple[int, ...] | None = None
    """Lengths of the examples packed into this row, in order (summing to its length); None: one example."""

    @property
    def packed(self) -> bool:
        return self.segments is not None and len(self.segments) > 1

    def unpacked(self) -> list[TrainExample]:
        """The row's examples, each on its own (as the drop policy would have stored them)."""
        if not self.segments:
            return [self]
        cuts = np.cumsum((0, *self.segments))
        return [TrainExample(self.input_ids[a:b], self.labels[a:b]) for a, b in zip(cuts[:-1], cuts[1:])]


def load_examples(storage: Storage, dataset_path: str, split: str = "train") -> list[TrainExample]:
    """Every example of a split, in the order the data stage wrote them."""
    table = read_split(storage, dataset_path, split)
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    segments = table.column("segments").to_pylist()
    return [
        TrainExample(np.asarray(i, dtype=np.int64), np.asarray(lab, dtype=np.int64), tuple(seg) if seg else None)
        for i, lab, seg in zip(ids, labels, segments)
    ]


@dataclass(frozen=True)
class BatchLayout:
    micro_batch_size: int
    """Examples per rank per micro-step."""
    grad_accum_steps: int
    world_size: int

    @property
    def per_rank(self) -> int:
        return self.micro_batch_size * self.grad_accum_steps

    @property
    def global_batch(self) -> int:
        return self.per_rank * self.world_size


def steps_per_epoch(num_examples: int, layout: BatchLayout) -> int:
    steps = num_examples // layout.global_batch
    if steps < 1:
        raise StageFailure(
            FailureClass.data,
            (
                f"train split has {num_examples} examples, fewer than one global batch of {layout.global_batch} "
                f"(micro_batch_size {layout.micro_batch_size} x grad_accum_steps {layout.grad_accum_steps} "
                f"x {layout.world_size} workers)"
            ),
        )
    return steps


def position(step: int, per_epoch: int) -> tuple[int, int]:
    """(epoch, batch index within the epoch) of 1-based step `step`."""
    return divmod(step - 1, per_epoch)


def epoch_order(num_examples: int, seed: int, epoch: int) -> np.ndarray:
    """The epoch's permutation of example indices; numpy's PCG64 stream is stable across releases."""
    return np.random.default_rng([seed, epoch]).permutation(num_examples)


def rank_slices(order: np.ndarray, batch_in_epoch: int, layout: BatchLayout, rank: int) -> list[np.ndarray]:
    """This rank's micro-batches (index arrays) of one global batch."""
    start = batch_in_epoch * layout.global_batch + rank * layout.per_rank
    mine = order[start : start + layout.per_rank]
    return [mine[i : i + layout.micro_batch_size] for i in range(0, layout.per_rank, layout.micro_batch_size)]


def collate(examples: list[TrainExample], pad_id: int) -> dict:
    """Right-pad to the longest row: input_ids, labels (-100 on padding), attention_mask (1 on real tokens);
    with packed rows also position_ids (restarting per example and at the padding), and -100 on the label
    of every example's first token, which in a packed row the previous example's last token would predict."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE_INDEX, dtype=torch.long)
    attention = torch.zeros((len(examples), width), dtype=torch.long)
    for row, e in enumerate(examples):
        n = len(e.input_ids)
        input_ids[row, :n] = torch.from_numpy(e.input_ids)
        labels[row, :n] = torch.from_numpy(e.labels)
        attention[row, :n] = 1
    batch = {"input_ids": input_ids, "labels": labels, "attention_mask": attention}
    if any(e.packed for e in examples):
        batch["position_ids"] = torch.from_numpy(np.stack([restarting_positions(e, width) for e in examples]))
        for row, e in enumerate(examples):
            labels[row, np.cumsum((0, *(e.segments or ())))[1:-1]] = IGNORE_INDEX
    return batch


def restarting_positions(example: TrainExample, width: int) -> np.ndarray:
    """0, 1, ... within each example of the row, and again over its padding up to `width`. Pure."""
    lengths = [*(example.segments or (len(example.input_ids),)), width - len(example.input_ids)]
    return np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])


class StepBatches:
    """Batches by step number for one rank: `micro_batches(step)` is all that replay needs."""

    def __init__(self, examples: list[TrainExample], layout: BatchLayout, seed: int, rank: int, pad_id: int):
        self.examples, self.layout, self.seed, self.rank, self.pad_id = examples, layout, seed, rank, pad_id
        self.per_epoch = steps_per_epoch(len(examples), layout)
        self.order: Callable[[int], np.ndarray] = lru_cache(maxsize=2)(
            lambda epoch: epoch_order(len(examples), seed, epoch)
        )
        """epoch -> that epoch's permutation of example indices (a fault hook may replace it: a planted bug)."""

    def micro_batches(self, step: int) -> list[dict]:
        return [collate(examples, self.pad_id) for examples in self.micro_examples(step)]

    def micro_examples(self, step: int) -> list[list[TrainExample]]:
        """This rank's micro-batches of step `step`, as the rows they collate."""
        return [[self.examples[i] for i in s] for s in self.slices(step)]

    def sample_ids(self, step: int) -> list[int]:
        """The indices (in the train split) of the examples this rank trains on at `step`, in order."""
        return [int(i) for s in self.slices(step) for i in s]

    def slices(self, step: int) -> list[np.ndarray]:
        epoch, index = position(step, self.per_epoch)
        return rank_slices(self.order(epoch), index, self.layout, self.rank)


def samples_digest(ids: Sequence[int]) -> str:
    """A short digest of one step's sample ids in the order trained (16 hex digits). Pure."""
    return hashlib.sha256(",".join(map(str, ids)).encode()).hexdigest()[:16]


def fold_ledger(ledger: str | None, step: int, ids: Sequence[int]) -> str | None:
    """The data-order ledger after `step`: sha256 of the ledger before it, the step and its sample ids. Pure.

    A fresh run starts from ""; None (a checkpoint written before the ledger existed) stays None: the
    order before it is unknown, so no running hash can vouch for it."""
    if ledger is None:
        return None
    return hashlib.sha256(f"{ledger}|{step}|{','.join(map(str, ids))}".encode()).hexdigest()
