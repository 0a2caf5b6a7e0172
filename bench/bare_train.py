"""The bare alternative to the fine-tune stage: a TorchTrainer FSDP2 loop as a user would write it.

    RAY_ADDRESS=127.0.0.1:<gcs port> python bench/bare_train.py --model DIR --data DIR --workers 2 \
        --steps 40 --batch 32 [--out times.json] [--checkpoint-every 20 --export DIR] \
        [--init-from CHECKPOINT_DIR --then-steps 29]

Run by bench/finetune_step.py as a Ray driver of the benchmark's cluster, and by bench/pipeline.py as
a Ray job (the bare fine-tune and resume stages). Each worker loads the same model in fp32,
fully_shards every decoder layer and then the root (Ray's FSDP example), trains with AdamW on the
prepared dataset's train shards (the same parquet files the fine-tune reads, cut into the very batches
the fine-tune trains on: training.train_data's seeded order, rank slices and right padding, --batch
examples per rank) and times each optimizer step. What the fine-tune stage also does, only when asked:
- `--checkpoint-every N`: stock `dcp.save` of the model and optimizer every N steps and at the last, each
  rank into a temporary directory handed to `ray.train.report` (Ray's FSDP example), which keeps it
  under --storage/--name;
- `--export DIR`: the full state dict gathered and written by rank 0 with `save_pretrained`, beside the
  base's tokenizer;
- `--init-from DIR`: start from that `dcp.save` checkpoint (its step in DIR/step.json) instead of the base;
- `--then-steps M`: a second TorchTrainer.fit under the same name and storage that restores the first's
  latest checkpoint (`ray.train.get_checkpoint`) and trains on to step M: the resume test's two runs.
No metrics files and no progress lines; with --out, rank 0 writes its step times there.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def batches(data_dir: str, batch: int, seed: int, pad_id: int, rank: int, world: int, after: int = 0):
    """Step s's micro-batch for this rank from step `after` + 1, exactly as the fine-tune builds it
    (training.train_data): the same seeded epoch order, rank slice and right padding, so both sides
    train on identical batches."""
    import numpy as np
    import pyarrow.parquet as pq

    from training.train_data import BatchLayout, StepBatches, TrainExample

    table = pq.read_table(sorted(Path(data_dir, "train").glob("*.parquet")))
    ids, labels = table.column("input_ids").to_pylist(), table.column("labels").to_pylist()
    examples = [
        TrainExample(np.asarray(i, dtype=np.int64), np.asarray(lab, dtype=np.int64)) for i, lab in zip(ids, labels)
    ]
    steps = StepBatches(examples, BatchLayout(batch, 1, world), seed, rank, pad_id)
    step = after
    while True:
        step += 1
        yield from steps.micro_batches(step)


def restore(model, optimizer, init_from: str | None) -> int:
    """Load the run's latest Ray Train checkpoint, else `init_from`, into model and optimizer; its step (0: none)."""
    import ray.train

    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as path:
            return load(model, optimizer, path)
    return load(model, optimizer, init_from) if init_from else 0


def load(model, optimizer, path: str) -> int:
    """Stock DCP: the model's and optimizer's sharded state read in place from a `save` checkpoint; its step."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.load({"model": model_state, "optim": optim_state}, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optim_state)
    return int(json.loads(Path(path, "step.json").read_text())["step"])


def save(model, optimizer, step: int, rank: int) -> None:
    """Ray's FSDP example: each rank's DCP files into a temporary directory, reported to Ray Train."""
    import ray.train
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_state, optim_state = get_state_dict(model, optimizer)
    with tempfile.TemporaryDirectory() as tmp:
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp)
        if rank == 0:
            Path(tmp, "step.json").write_text(json.dumps({"step": step}))
        ray.train.report({"step": step}, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def export(model, base: str, out: str, rank: int) -> None:
    """The full state dict gathered on every rank, written by rank 0 as a Hugging Face model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from transformers import AutoTokenizer

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        model.save_pretrained(out, state_dict=full)
        AutoTokenizer.from_pretrained(base).save_pretrained(out)


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
    start = restore(model, optimizer, config["init_from"])
    if config["expect_start"] is not None and start != config["expect_start"]:
        raise RuntimeError(f"the second run restored step {start}, not the first run's last, {config['expect_start']}")
    pad_id = model.config.pad_token_id if model.config.pad_token_id is not None else 0  # the fine-tune's rule
    data = batches(config["data"], config["batch"], config["seed"], pad_id, rank, world, after=start)
    times = []
    for step in range(start + 1, config["steps"] + 1):
        began = time.perf_counter()
        loss = model(**next(data)).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - began)
        if config["checkpoint_every"] and (step % config["checkpoint_every"] == 0 or step == config["steps"]):
            save(model, optimizer, step, rank)
    if config["export"]:
        export(model, config["model"], config["export"], rank)
    if rank == 0 and config["out"]:
        Path(config["out"]).write_text(json.dumps({"step_seconds": times}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument("--data", required=True, help="a prepared dataset directory (datasets/<name>/<hash>)")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40, help="train up to this step")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--seed", type=int, default=0, help="the fine-tune's train.seed: the same batch order")
    parser.add_argument("--out", default=None, help="rank 0's step times (JSON)")
    parser.add_argument("--checkpoint-every", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--export", default=None, help="a directory for the trained model (Hugging Face)")
    parser.add_argument("--init-from", default=None, help="a checkpoint this script saved, to start from")
    parser.add_argument("--then-steps", type=int, default=0, help="a second run: restore and train to this step")
    parser.add_argument("--storage", default="/tmp/tp-bench-bare-train", help="Ray Train storage_path")
    parser.add_argument("--name", default=None, help="Ray Train run name (a second run restores under it)")
    args = parser.parse_args()

    import ray.train
    from ray.train.torch import TorchTrainer

    keys = ("model", "data", "steps", "batch", "lr", "seed", "out", "checkpoint_every", "export", "init_from")
    config = {**{k: getattr(args, k) for k in keys}, "expect_start": None}
    run_config = ray.train.RunConfig(name=args.name, storage_path=args.storage)
    scaling = ray.train.ScalingConfig(num_workers=args.workers)
    TorchTrainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run_config).fit()
    if args.then_steps:
        config.update(steps=args.then_steps, export=None, expect_start=args.steps)
        TorchTrainer(train_loop, train_loop_config=config, scaling_config=scaling, run_config=run_config).fit()


if __name__ == "__main__":
    main()
