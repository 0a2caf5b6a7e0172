"""resume_load: our resume of a real-size checkpoint vs stock `dcp.load` of the same checkpoint. <= 1.3.

    python -m bench.run --only resume_load            # a ~1.3 GB checkpoint (a wider Qwen2 shape on CPU)
    python -m bench.run --only resume_load --quick    # ~50 MB

One process, one gloo rank (bench.checkpoint.one_rank), local storage. The checkpoint is saved once,
as a fine-tune rank saves it (start_saving_shards, finish_saving_shards, write_marker). Ours is what a
fine-tune worker does on resume (training.finetune_worker resolve_start and restore): find the latest
checkpoint whose marker and sizes check out, then load_shards, which hashes every file it loads while
it reads it. Bare is stock DCP: get_state_dict, dcp.load from the directory, set_state_dict. Both into
the same model and optimizer, interleaved. Each side's bytes read are this process's read() bytes
(/proc/self/io rchar) across the load: page-cache hits count, so it is the volume asked for, not the
disk's. At one rank "bytes read per rank" is the whole checkpoint, once on both sides (before
load_shards verified as it read, ours read it twice: hash, then load). Per rank at 4 ranks:
tests/test_sharding.py, each rank its own files whole and only the replicated values of the others.

Not in the ratio: the job's driver checks every file of the checkpoint it picks once per job, before the
trainer starts (training.finetune find_checkpoints), so a changed one is set aside and the run goes on
from the one before. That is one read of the checkpoint per job, whatever the number of ranks; it is
timed here as `driver_check_s`.
"""

from __future__ import annotations

import time
from pathlib import Path

from bench.checkpoint import one_rank, progress, trained_model
from bench.common import BenchResult, Target, compare, interleave, say

TARGET = Target("<=", 1.3)
SIZES = {
    "quick": {"hidden_size": 256, "intermediate_size": 1024, "num_hidden_layers": 4, "vocab_size": 512},
    "full": {"hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 6, "vocab_size": 32768},
}
"""~12 bytes a parameter (fp32 weights, AdamW's two moments): full is ~115 M parameters, ~1.4 GB."""


def bytes_read() -> int:
    """Bytes this process has asked read() for so far (Linux /proc/self/io rchar)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise RuntimeError("/proc/self/io has no rchar line: this benchmark needs Linux")


def resume_ours(model, optimizer, storage) -> int:
    """Our resume path; returns the step restored."""
    from training.checkpoint_listing import latest_complete_checkpoint
    from training.checkpointing import load_shards
    from tuneproof.core.storage import Storage

    ref = latest_complete_checkpoint(storage, "run", contents=False)
    if ref is None:
        raise RuntimeError(f"no complete checkpoint under {storage.uri('run')}")
    return load_shards(model, optimizer, Storage(ref.uri), 0).progress.step


def load_stock(model, optimizer, directory: str) -> None:
    """Stock DCP: the state dicts filled from the directory and set back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)  # fills both dicts in place
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def run(bench, repeats: int, quick: bool) -> BenchResult:
    import torch.distributed as dist

    from training.checkpoint_listing import latest_complete_checkpoint, write_marker
    from training.checkpointing import checkpoint_dir_name, finish_saving_shards, start_saving_shards
    from tuneproof.core.storage import Storage

    size = "quick" if quick else "full"
    storage = Storage(str(bench.fresh_dir("resume-load")))
    read: dict[str, list[int]] = {"ours": [], "bare": []}
    with one_rank():
        model, optimizer = trained_model(SIZES[size])
        name = checkpoint_dir_name(1)
        saving = start_saving_shards(
            model, optimizer, progress(), storage, ("run", name), dist.new_group(backend="gloo")
        )
        files = finish_saving_shards(saving)
        write_marker(storage, 1, files, "run", name)
        checkpoint_bytes = sum(f.size for f in files.values())
        say(f"  resume_load: checkpoint of {checkpoint_bytes / 1e9:.2f} GB in {len(files)} files")

        def timed(side: str, load):
            def one(i: int) -> float:
                before, began = bytes_read(), time.perf_counter()
                load()
                seconds = time.perf_counter() - began
                read[side].append(bytes_read() - before)
                say(f"  resume_load {side} #{i}: {seconds:.2f} s, read {read[side][-1] / 1e9:.2f} GB")
                return seconds

            return one

        began = time.perf_counter()
        if latest_complete_checkpoint(storage, "run") is None:  # the driver's once-per-job check, every byte hashed
            raise RuntimeError("the checkpoint just saved does not check out")
        driver_check_s = round(time.perf_counter() - began, 2)
        measured = interleave(
            {
                "ours": timed("ours", lambda: resume_ours(model, optimizer, storage)),
                "bare": timed("bare", lambda: load_stock(model, optimizer, storage.path("run", name))),
            },
            repeats,
        )
    return compare(
        measured["ours"],
        measured["bare"],
        TARGET,
        unit="s to restore model and optimizer (one rank)",
        size=size,
        shape=SIZES[size],
        checkpoint_bytes=checkpoint_bytes,
        bytes_read_per_rank={side: max(values) for side, values in read.items()},
        driver_check_s=driver_check_s,
        read_over_checkpoint={side: round(max(values) / checkpoint_bytes, 2) for side, values in read.items()},
    )
