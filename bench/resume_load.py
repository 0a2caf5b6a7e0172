"""resume_load: our resume of a real-size checkpoint vs stock `dcp.load` of the same checkpoint. <= 1.3.

    python -m bench.run --only resume_load            # a ~1.3 GB checkpoint (a wider Qwen2 shape on CPU)
    python -m bench.run --only resume_load --quick    # ~50 MB

One process, one gloo rank (bench.checkpoint.one_rank), local storage. The checkpoint is saved once,
as a fine-tune rank saves it (start_saving_shards, finish_saving_shards, write_marker). Ours is what a
fine-tune worker does on resume (training.finetune): find the latest complete checkpoint (its marker,
sizes and every file's sha256 checked), take a local copy (the directory itself, on local storage) and
load_shards. Bare is stock DCP: get_state_dict, dcp.load from the directory, set_state_dict. Both into
the same model and optimizer, interleaved. Each side's bytes read are this process's read() bytes
(/proc/self/io rchar) across the load: page-cache hits count, so it is the volume asked for, not the
disk's. At one rank "bytes read per rank" is the whole checkpoint; ours reads it about twice today
(hash, then load).
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
    from training.checkpointing import load_shards, local_copy

    ref = latest_complete_checkpoint(storage, "run")
    if ref is None:
        raise RuntimeError(f"no complete checkpoint under {storage.uri('run')}")
    with local_copy(ref.uri, None) as local_dir:
        return load_shards(model, optimizer, local_dir, 0).step


def load_stock(model, optimizer, directory: str) -> None:
    """Stock DCP: the state dicts filled from the directory and set back."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.load({"model": model_sd, "optim": optim_sd}, checkpoint_id=directory)  # fills both dicts in place
    set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)


def run(bench, repeats: int, quick: bool) -> BenchResult:
    import torch.distributed as dist

    from training.checkpoint_listing import write_marker
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
        read_over_checkpoint={side: round(max(values) / checkpoint_bytes, 2) for side, values in read.items()},
    )
