"""packing: training tokens/s with data.overflow pack against drop, on the same data. Target >= 1.0.

    python -m bench.run --only packing

One process, no Ray: the date task through the data stage twice (overflow drop, and pack into rows of
PACK_LEN tokens; nothing is dropped either way), then the same steps of the fine-tune's own batch code
(train_data.StepBatches, step.token_loss_sum, AdamW) on the tiny model under each, interleaved. A
side's figure is real (non-padding) tokens per second over a run's steps; the ratio is pack / drop, so
above 1 packing pays for its block-diagonal mask with the padding it saves. Both sides train on
micro-batches of MICRO_ROWS rows: a packed row holds several examples, so pack also takes fewer steps
per epoch; tokens/s is the figure that compares them.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.common import BenchResult, Target, compare, interleave, say
from tuneproof.core.config import PROJECT_ROOT, PipelineConfig

TARGET = Target(">=", 1.0)
PACK_LEN = 256
MICRO_ROWS = 16


def prepared(root: Path, model_dir: Path, overflow: str) -> str:
    """The dataset path of the date task prepared with `overflow` (the data stage, in this process)."""
    from training.data_prep import prepare_data
    from training.jobkit import JobContext

    cfg = PipelineConfig.model_validate(
        {
            "storage": {"root": str(root)},
            "model": {"source": str(model_dir)},
            "data": {
                "source": str(PROJECT_ROOT / "data" / "dates" / "dates.jsonl"),
                "max_seq_len": PACK_LEN,
                "overflow": overflow,
            },
        }
    )
    path = prepare_data(JobContext(f"bench-{overflow}", "data", cfg)).dataset_path
    if path is None:
        raise RuntimeError(f"the data stage wrote no dataset for overflow {overflow}")
    return path


def tokens_per_s(root: Path, model_dir: Path, dataset: str, steps: int) -> float:
    """Real tokens per second over `steps` training steps of micro-batches of MICRO_ROWS rows."""
    import torch

    from training.modeling import load_model
    from training.step import token_loss_sum
    from training.train_data import BatchLayout, StepBatches, load_examples
    from tuneproof.core.storage import Storage

    model = load_model(str(model_dir), dtype=torch.float32).train()
    batches = StepBatches(load_examples(Storage(str(root)), dataset), BatchLayout(MICRO_ROWS, 1, 1), 0, 0, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    tokens, began = 0, time.perf_counter()
    for step in range(1, steps + 1):
        for batch in batches.micro_batches(step):
            token_loss_sum(model, batch).backward()
            tokens += int(batch["attention_mask"].sum())
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return tokens / (time.perf_counter() - began)


def run(bench, repeats: int, quick: bool) -> BenchResult:
    root = bench.fresh_dir("packing")
    datasets = {side: prepared(root, bench.model_dir, side) for side in ("pack", "drop")}
    steps = 10 if quick else 30

    def side(name: str):
        def measure(i: int) -> float:
            rate = tokens_per_s(root, bench.model_dir, datasets[name], steps)
            say(f"  packing {name} #{i}: {rate:,.0f} tokens/s")
            return rate

        return measure

    measured = interleave({"pack": side("pack"), "drop": side("drop")}, repeats)
    return compare(
        measured["pack"],
        measured["drop"],
        TARGET,
        unit="real tokens/s (ratio = pack / drop)",
        ours_is="pack",
        bare_is="drop",
        steps=steps,
        micro_rows=MICRO_ROWS,
        pack_len=PACK_LEN,
        samples=measured,
    )
