"""The bare alternative to the fine-tune stage: a TorchTrainer FSDP2 loop as a user would write it.

    RAY_ADDRESS=127.0.0.1:<gcs port> python bench/bare_train.py --model DIR --data DIR --workers 2 \
        --steps 40 --batch 32 --out times.json

Run by bench/finetune_step.py and bench/scaling.py as a Ray driver of the benchmark's cluster. Each
worker loads the same model in fp32, fully_shards every decoder layer and then the root (Ray's FSDP
example), trains with AdamW on the prepared dataset's train shards (the same parquet files the
fine-tune reads: right-padded batches of --batch examples per rank) and times each optimizer step.
No checkpoints, no metrics files, no progress lines: rank 0 writes its step times to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def batches(data_dir: str, batch: int, rank: int, world: int):
    """Endless right-padded batches of this rank's share of the train split, in file order."""
    import pyarrow.parquet as pq
    import torch

    table = pq.read_table(sorted(Path(data_dir, "train").glob("*.parquet")))
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    mine = list(zip(ids, labels))[rank::world]
    while True:
        for start in range(0, len(mine) - batch + 1, batch):
            chunk = mine[start : start + batch]
            width = max(len(i) for i, _ in chunk)
            input_ids = torch.zeros(batch, width, dtype=torch.long)
            target = torch.full((batch, width), -100, dtype=torch.long)
            mask = torch.zeros(batch, width, dtype=torch.long)
            for row, (i, lab) in enumerate(chunk):
                input_ids[row, : len(i)] = torch.tensor(i)
                target[row, : len(lab)] = torch.tensor(lab)
                mask[row, : len(i)] = 1
            yield {"input_ids": input_ids, "labels": target, "attention_mask": mask}


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
    data = batches(config["data"], config["batch"], rank, world)
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
    parser.add_argument("--out", required=True)
    parser.add_argument(
        "--storage", default="/tmp/tp-bench-bare-train", help="Ray Train storage_path (nothing is saved)"
    )
    args = parser.parse_args()

    import ray.train
    from ray.train.torch import TorchTrainer

    config = {k: getattr(args, k) for k in ("model", "data", "steps", "batch", "lr", "out")}
    TorchTrainer(
        train_loop,
        train_loop_config=config,
        scaling_config=ray.train.ScalingConfig(num_workers=args.workers),
        run_config=ray.train.RunConfig(storage_path=args.storage),
    ).fit()


if __name__ == "__main__":
    main()
