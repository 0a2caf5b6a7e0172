"""Does LoRA on the pre-trained tiny base still need `modules_to_save: [embed_tokens]`? Measure it.

    python -m bench.lora_base [--steps 1000] [--base DIR]

One process, no Ray: the chat task of configs/local-chat.yaml through the data stage, then its LoRA
fine-tune (its rank, alpha, targets, lr, schedule and 64 examples per step: 2 workers x 32) twice on the
pre-trained base, once with the embedding trained beside the adapters and once without, then greedy exact
match on (up to) the config's eval.max_examples of the eval split. Prints both figures and the base's.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from tuneproof.core.config import PROJECT_ROOT, PipelineConfig, load_config


def chat_config(root: Path, base: Path, *sets: str) -> PipelineConfig:
    return load_config(
        PROJECT_ROOT / "configs" / "local-chat.yaml", [f"storage.root={root}", f"model.source={base}", *sets]
    )


def fine_tune(cfg: PipelineConfig, dataset: str, steps: int):
    """The merged LoRA model after `steps` one-process steps of the config's recipe."""
    import torch

    from training.lora import apply_lora
    from training.modeling import load_model
    from training.schedule import WarmupCosine
    from training.step import token_loss_sum
    from training.train_data import BatchLayout, StepBatches, load_examples
    from tuneproof.core.storage import Storage

    t = cfg.train
    model = load_model(cfg.model.source, dtype=torch.float32)
    peft_model = apply_lora(model, t.lora, t.seed)
    model.train()
    layout = BatchLayout(t.micro_batch_size * t.num_workers, t.grad_accum_steps, 1)
    batches = StepBatches(
        load_examples(Storage(cfg.storage.root), dataset), layout, t.seed, 0, model.config.pad_token_id
    )
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=t.lr, weight_decay=t.weight_decay
    )
    schedule = WarmupCosine(t.lr, t.warmup_steps, t.max_steps, t.min_lr_ratio)
    torch.manual_seed(t.seed)
    for step in range(1, steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = schedule.lr_at(step)
        micro = batches.micro_batches(step)
        targets = sum(int((b["labels"][:, 1:] != -100).sum()) for b in micro)
        for batch in micro:
            (token_loss_sum(model, batch) / targets).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return peft_model.merge_and_unload().eval()


def exact_match(model, cfg: PipelineConfig, dataset: str) -> float:
    from eval.generation import generate
    from training.data_files import read_split
    from training.modeling import load_tokenizer
    from tuneproof.core.storage import Storage

    rows = read_split(Storage(cfg.storage.root), dataset, "eval").to_pylist()[: cfg.eval.max_examples]
    tokenizer = load_tokenizer(cfg.model.source)
    answers = generate(model, tokenizer, [r["prompt"] for r in rows], cfg.eval.max_new_tokens, batch_size=64)
    return sum(a == r["reference"].strip() for a, r in zip(answers, rows)) / len(rows)


def main(argv: list[str] | None = None) -> None:
    import torch

    from training.data_prep import prepare_data
    from training.jobkit import JobContext
    from training.modeling import load_model
    from tuneproof.app.tiny_model import ensure_tiny_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=None, help="train.max_steps (default: the config's)")
    parser.add_argument("--base", default=None, help="a base model directory (default: build the pre-trained one)")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="lora-base-"))
    base = Path(args.base) if args.base else scratch / "tiny-qwen2"
    if not args.base:
        ensure_tiny_model(base)
    torch.set_num_threads(1)  # as the base's build: two threads spin against each other on a shared machine
    steps = [f"train.max_steps={args.steps}"] if args.steps else []  # the schedule spans the shorter run
    cfg = chat_config(scratch / "store", base, *steps)
    dataset = prepare_data(JobContext("lora-base", "data", cfg)).dataset_path
    if dataset is None:
        raise RuntimeError("the data stage wrote no dataset for the chat task")
    results = {"base": exact_match(load_model(str(base), dtype=torch.float32).eval(), cfg, dataset)}
    results["steps"] = cfg.train.max_steps
    for name, modules in (("without_embed", "[]"), ("with_embed", "[embed_tokens]")):
        began = time.perf_counter()
        run_cfg = chat_config(scratch / "store", base, *steps, f"train.lora.modules_to_save={modules}")
        results[name] = exact_match(fine_tune(run_cfg, dataset, run_cfg.train.max_steps), run_cfg, dataset)
        results[f"{name}_seconds"] = round(time.perf_counter() - began, 1)
        print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
