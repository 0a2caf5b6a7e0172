"""The bare alternative to the fine-tune stage: a TorchTrainer FSDP2 loop as a user would write it.

    RAY_ADDRESS=127.0.0.1:<gcs port> python bench/bare_train.py --model DIR --data DIR --workers 2 \
        --steps 40 --batch 32 --out times.json

Run by bench/finetune_step.py and bench/scaling.py as a Ray driver of the benchmark's cluster. Each
worker loads the same model in fp32, fully_shards every decoder layer and then the root (Ray's FSDP
example), trains with AdamW on the prepared dataset's train shards (the same parquet files the
fine-tune reads, cut into the very batches the fine-tune trains on: training.train_data's seeded
order, rank slices and right padding, --batch examples per rank) and times each optimizer step.
No checkpoints, no metrics files, no progress lines: rank 0 writes its step times to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def batches(data_dir: str, batch: int, seed: int, pad_id: int, rank: int, world: int):
    """Step s's micro-batch for this rank, exactly as the fine-tune builds it (training.train_data):
    the same seeded epoch order, rank slice and right padding, so both sides train on identical batches."""
    import numpy as np
    import pyarrow.parquet as pq

    from training.train_data import BatchLayout, StepBatches, TrainExample

    table = pq.read_table(sorted(Path(data_dir, "train").glob("*.parquet")))
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    examples = [
        TrainExample(np.asarray(i, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for i, lab in zip(ids, labels)
    ]
    steps = StepBatches(examples, BatchLayout(batch, 1, world), seed, rank, pad_id)
    step = 0
    while True:
        step += 1
        yield from steps.micro_batches(step)


def train_loop(config: dict) -> None:
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    model = AutoModelForCausalLM.from_pretrained(config["model"], dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0  # the fine-tune's rule
    data = batches(config["data"], config["batch"], config["seed"], pad_id, rank, world)
    times = []
    for _ in range(config["steps"]):
        began = time.perf_counter()
        loss = model(**next(data)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
    if rank == 0:
        Path(config["out"]).write_text(json.dumps({"step_seconds": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a prepared dataset directory (datasets/<name>/<hash>)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0, help="the fine-tune's train.seed: the same batch order")
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--storage", default="/tmp/tp-bench-bare-train", help="Ray Train storage_path (nothing is saved)"
    )
    args = parser.parse_args()

    import ray.train
    from ray.train.torch import TorchTrainer

    config = {k: getattr(args, k) for k in ("model", "data", "steps", "batch", "lr", "seed", "out")}
    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(storage_path=args.storage),
    ).fit()


if __name__ == "__main__":
    main()
