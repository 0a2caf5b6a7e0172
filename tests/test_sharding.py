"""train.sharding: full | hybrid | ddp, and checkpoints that resume under another strategy or world size.

    .venv/bin/python -m pytest -q tests/test_sharding.py -m "not integration"   # unit + 4-rank gloo, ~45 s
    .venv/bin/python -m pytest -q tests/test_sharding.py -m integration         # resharded resumes (Ray), ~3 min

- Unit: the mesh shape each choice asks for, and the config check on shard_group_size.
- Four gloo ranks (torch.multiprocessing spawn, in-process FSDP2): a 2 x 2 hybrid mesh shards each
  parameter over 2 ranks and replicates it over 2; one training step under hybrid and under ddp
  gives the weights full sharding gives; a DCP checkpoint saved under full loads under hybrid
  with equal weights and optimizer state.
- Integration, through the real fine-tune under Ray Train on the session Ray head: a run saved by
  2 workers (full) resumes under 4 workers (full), and that run's checkpoint resumes under hybrid
  2 x 2. Both restart at the saved step and their losses match the uninterrupted 2-worker run: the
  global batch is the same (2 x 8 = 4 x 4 sequences a step), so only the summation order differs.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.test_finetune import (
    context,
    make_config,
    ray_cluster,  # noqa: F401 - the fixture: this process as a Ray driver
    write_dataset,
    write_tiny_model,
)
from training.fsdp import mesh_shape
from tuneproof.core.config import ConfigError, validate

WORLD = 4
GROUP = 2
TINY_VOCAB = 64


# ---------------------------------------------------------------- unit: the mesh and the config


def test_mesh_shape_per_sharding_choice():
    assert mesh_shape("full", 8, None, 4) == (8,)
    assert mesh_shape("hybrid", 8, None, 4) == (2, 4)  # default group: the ranks on one node
    assert mesh_shape("hybrid", 4, 2, 4) == (2, 2)  # an explicit group wins (one CPU machine)
    assert mesh_shape("ddp", 8, None, 4) == (8, 1)
    assert mesh_shape("full", 1, None, 1) == (1,)


def test_mesh_shape_errors_name_the_values():
    with pytest.raises(ValueError, match=r"got a group of 3 \(train.shard_group_size\) and world size 4"):
        mesh_shape("hybrid", 4, 3, 4)
    with pytest.raises(ValueError, match=r"got a group of 4 \(the workers on this node\) and world size 6"):
        mesh_shape("hybrid", 6, None, 4)
    with pytest.raises(ValueError, match="sharding must be one of full, hybrid, ddp, got 'zero3'"):
        mesh_shape("zero3", 4, None, 4)


def test_config_checks_that_the_shard_group_divides_the_workers():
    train = validate({"train": {"num_workers": 4, "sharding": "hybrid", "shard_group_size": 2}}).train
    assert (train.sharding, train.shard_group_size) == ("hybrid", 2)
    assert validate({}).train.sharding == "full"
    with pytest.raises(ConfigError, match="got shard_group_size=3 and num_workers=4"):
        validate({"train": {"num_workers": 4, "sharding": "hybrid", "shard_group_size": 3}})
    with pytest.raises(ConfigError, match=r"train.sharding: .*'zero3'"):
        validate({"train": {"sharding": "zero3"}})
    with pytest.raises(ConfigError, match="train.shard_group_size"):
        validate({"train": {"shard_group_size": 0}})
    # Only hybrid uses the group size: full and ddp accept any.
    assert validate({"train": {"num_workers": 4, "shard_group_size": 3}}).train.sharding == "full"


# ---------------------------------------------------------------- four gloo ranks, in-process FSDP2


def tiny_model(sharding: str, seed: int = 0):
    from tests.tiny import tiny_qwen2
    from training.fsdp import shard_model

    # The same seed on every rank: the same initial weights.
    return shard_model(
        tiny_qwen2(TINY_VOCAB, seed),
        torch.device("cpu"),
        activation_checkpointing=False,
        sharding=sharding,
        shard_group_size=GROUP,
    )


def mesh_facts(model) -> dict:
    """How one weight (layer 0's q_proj, 32 x 32) is laid out on this rank."""
    weight = model.model.layers[0].self_attn.q_proj.weight
    return {
        "mesh": tuple(weight.device_mesh.shape),
        "dims": weight.device_mesh.mesh_dim_names,
        "placements": tuple(weight.placements),
        "local": weight.to_local().detach().clone(),
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def one_sgd_step(model, rank: int) -> dict:
    """One step on this rank's own batch; SGD so the update is linear in the (averaged) gradient."""
    from training.fsdp import full_state_dict

    batch = torch.randint(0, TINY_VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    loss = model(input_ids=batch, labels=batch).loss
    loss.backward()
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    return {"loss": loss.item(), "weights": full_state_dict(model)}


def reshard_full_to_hybrid(workdir: Path, rank: int) -> dict:
    """Save model + AdamW state under full sharding, load into a differently seeded hybrid model."""
    from tests.tiny import save_checkpoint
    from training.checkpointing import MARKER, TrainingProgress, capture_rng, load_shards
    from training.fsdp import full_state_dict
    from tuneproof.core.storage import Storage

    saved = tiny_model("full")
    saved_optimizer = torch.optim.AdamW(saved.parameters(), lr=1e-2)
    batch = torch.randint(0, TINY_VOCAB, (2, 8), generator=torch.Generator().manual_seed(rank))
    saved(input_ids=batch, labels=batch).loss.backward()
    saved_optimizer.step()
    progress = TrainingProgress(
        step=1, epoch=0, batch_in_epoch=1, seed=0, rank=rank, world_size=WORLD, schedule={}, rng=capture_rng()
    )
    save_checkpoint(saved, saved_optimizer, progress, workdir / "ckpt")
    loaded = tiny_model("hybrid", seed=1)
    loaded_optimizer = torch.optim.AdamW(loaded.parameters(), lr=1e-2)
    restored = load_shards(loaded, loaded_optimizer, Storage(str(workdir / "ckpt")), rank)
    moments = zip(saved_optimizer.state.values(), loaded_optimizer.state.values())
    same_mesh = tiny_model("full", seed=1)
    return {
        "step": restored.progress.step,
        "read": restored.read,
        "read_same_mesh": load_shards(
            same_mesh, torch.optim.AdamW(same_mesh.parameters(), lr=1e-2), Storage(str(workdir / "ckpt")), rank
        ).read,
        "sizes": Storage(str(workdir / "ckpt")).read_json(MARKER)["files"],
        "mesh": mesh_facts(loaded)["mesh"],
        "before": full_state_dict(saved),
        "after": full_state_dict(loaded),
        "moments_equal": all(
            torch.equal(a[k].full_tensor(), b[k].full_tensor()) for a, b in moments for k in ("exp_avg", "exp_avg_sq")
        ),
    }


def rank_main(rank: int, workdir: Path) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)  # four ranks share two cores
    dist.init_process_group("gloo", init_method=f"file://{workdir / 'pg'}", rank=rank, world_size=WORLD)
    try:
        facts = {}
        for sharding in ("full", "hybrid", "ddp"):
            model = tiny_model(sharding)
            facts[sharding] = {**mesh_facts(model), **one_sgd_step(model, rank)}
        facts["resharded"] = reshard_full_to_hybrid(workdir, rank)
        torch.save(facts, workdir / f"rank-{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def four_ranks(tmp_path_factory) -> list[dict]:
    """What each of 4 gloo ranks saw (rank 0 also holds the gathered weights)."""
    import multiprocessing.forkserver

    import torch.multiprocessing as mp

    workdir = tmp_path_factory.mktemp("four-ranks")
    # The ranks start from a forkserver that has imported torch, transformers' Qwen2 and this module once (a
    # single-threaded process, so its forks are safe), not as four spawned interpreters importing them each
    # on two cores: the fixture took 16 s that way, 7.6 s this way.
    preload = ["tests.test_sharding", "training.fsdp", "transformers.models.qwen2.modeling_qwen2"]
    multiprocessing.get_context("forkserver").set_forkserver_preload(preload)
    try:
        mp.start_processes(rank_main, args=(workdir,), nprocs=WORLD, join=True, start_method="forkserver")
    finally:
        multiprocessing.forkserver._forkserver._stop()  # type: ignore[attr-defined]  # tests stop what they start: no public way
    return [torch.load(workdir / f"rank-{r}.pt", weights_only=False) for r in range(WORLD)]


def test_hybrid_is_a_2x2_mesh_sharded_over_2_and_replicated_over_2(four_ranks):
    from torch.distributed.tensor import Replicate, Shard

    hybrid = [r["hybrid"] for r in four_ranks]
    assert all(h["mesh"] == (2, 2) and h["dims"] == ("replicate", "shard") for h in hybrid)
    assert hybrid[0]["placements"] == (Replicate(), Shard(0))
    assert all(h["local"].shape == (16, 32) for h in hybrid)  # half of the 32 rows on each rank
    # Ranks 0,1 form one shard group and 2,3 the other: each group holds the whole weight once.
    assert torch.equal(hybrid[0]["local"], hybrid[2]["local"]) and torch.equal(hybrid[1]["local"], hybrid[3]["local"])
    assert not torch.equal(hybrid[0]["local"], hybrid[1]["local"])
    full_weight = torch.cat([hybrid[0]["local"], hybrid[1]["local"]])
    assert torch.equal(full_weight, torch.cat([r["full"]["local"] for r in four_ranks]))  # 4 shards of 8 rows
    assert all(h["tied"] for h in hybrid)


def test_full_and_ddp_meshes(four_ranks):
    assert all(r["full"]["mesh"] == (4,) and r["full"]["local"].shape == (8, 32) for r in four_ranks)
    assert all(r["ddp"]["mesh"] == (4, 1) and r["ddp"]["local"].shape == (32, 32) for r in four_ranks)


def test_a_training_step_gives_the_same_weights_under_every_sharding(four_ranks):
    rank0 = four_ranks[0]
    for sharding in ("hybrid", "ddp"):
        assert rank0[sharding]["loss"] == rank0["full"]["loss"]  # the same initial weights and batch
        for name, full in rank0["full"]["weights"].items():

            def message(m: str, where: str = f"{sharding} {name}") -> str:
                return f"{where}: {m}"

            torch.testing.assert_close(
                rank0[sharding]["weights"][name],
                full,
                rtol=1e-5,
                atol=1e-6,
                msg=message,
            )


def test_a_checkpoint_saved_under_full_loads_under_hybrid_exactly(four_ranks):
    for rank in four_ranks:
        assert rank["resharded"]["step"] == 1 and rank["resharded"]["mesh"] == (2, 2)
        assert rank["resharded"]["moments_equal"]
    resharded = four_ranks[0]["resharded"]
    assert resharded["before"].keys() == resharded["after"].keys()
    assert all(torch.equal(resharded["before"][k], resharded["after"][k]) for k in resharded["before"])


# ---------------------------------------------------------------- integration: the fine-tune resumes resharded


@pytest.fixture(scope="module")
def reshard_runs(ray_cluster, tmp_path_factory):
    """Two fine-tunes of the tiny Qwen2 on one storage root, the second continuing the first on another world
    size and mesh at once: saved (2 workers, full, steps 1-6), resharded (4 workers, hybrid 2 x 2, from saved's
    step 2 to step 6). One continuation proves both changes: each alone is a special case of the pair."""
    from tests.test_finetune import train as finetune  # the summary as the record holds it (JSON)
    from tuneproof.core.storage import Storage

    root = tmp_path_factory.mktemp("reshard-storage")
    write_dataset(Storage(str(root)))
    model = write_tiny_model(tmp_path_factory.mktemp("reshard-base") / "tiny-qwen2")
    two = make_config(str(root), model, num_workers=2, micro_batch_size=8, max_steps=6, checkpoint_every=2)
    saved = finetune(context(two, "reshard", run_name="saved", export=False))
    hybrid_config = make_config(
        str(root),
        model,
        num_workers=4,
        micro_batch_size=4,
        max_steps=6,
        checkpoint_every=2,
        sharding="hybrid",
        shard_group_size=2,
    )
    resharded = finetune(
        context(
            hybrid_config, "reshard", job="hybrid", run_name="hybrid", export=False, init_from=checkpoint_uri(saved, 2)
        )
    )
    return saved, resharded


def checkpoint_uri(summary: dict, step: int) -> str:
    return next(c["uri"] for c in summary["checkpoints"] if c["step"] == step)


def assert_losses_match(reference: dict, resumed: dict, steps: list[int]) -> None:
    """Equal to float tolerance: the same batches and weights, summed in another order."""
    expected, got = dict(map(tuple, reference["loss_curve"])), dict(map(tuple, resumed["loss_curve"]))
    assert sorted(got) == steps
    for step in steps:
        assert math.isclose(got[step], expected[step], rel_tol=1e-5), (step, got[step], expected[step])


def test_each_rank_reads_its_own_shard_files_whole_and_of_the_others_only_the_ranges_it_loads(four_ranks):
    """Loading under the mesh it was saved with, each rank reads (and verifies) its own files once and takes from
    the other ranks' files only the replicated values DCP spread over them (each optimizer step count)."""
    for r, rank in enumerate(four_ranks):
        read, sizes = rank["resharded"]["read_same_mesh"], rank["resharded"]["sizes"]
        own = {name for name in sizes if name.startswith(f"__{r}_")}
        others = {name for name in sizes if name.endswith(".distcp")} - own
        assert {name: read[name] for name in own} == {name: sizes[name] for name in own}
        assert sum(read.get(name, 0) for name in others) < sum(sizes[name] for name in others) / 4, read
        assert (
            read[".metadata"] == sizes[".metadata"]
            and read[f"progress-rank{r}.json"] == sizes[f"progress-rank{r}.json"]
        )


@pytest.mark.integration
def test_a_checkpoint_of_2_full_workers_resumes_under_4_in_a_hybrid_mesh(reshard_runs):
    saved, resharded = reshard_runs
    assert resharded["start_step"] == 2 and resharded["restored_from"] == checkpoint_uri(saved, 2)
    assert [c["step"] for c in resharded["checkpoints"]] == [4, 6]
    # The first resumed loss is computed with the restored weights before any update: equal weights give
    # an equal loss. The steps after it also need the restored AdamW moments, resharded, to be right.
    assert_losses_match(saved, resharded, [3, 4, 5, 6])
    assert len(list(Path(checkpoint_uri(resharded, 4)).glob("progress-rank*.json"))) == 4
    # The summary (and so the record) names the mesh each run trained on, not only the configured choice.
    assert (saved["sharding"], saved["mesh"]) == ("full", [2])
    assert (resharded["sharding"], resharded["mesh"]) == ("hybrid", [2, 2])
