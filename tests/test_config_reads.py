"""tuneproof.core.config_reads: what a stage read, observed; what was set and never read, reported."""

from __future__ import annotations

import threading

from tuneproof.core import config_reads
from tuneproof.core.config import PipelineConfig
from tuneproof.core.config_base import reads_recorded


def test_reads_are_dotted_leaves_whole_dumps_and_containers_and_never_timeouts():
    cfg = PipelineConfig()
    with reads_recorded(cfg) as reads:
        cfg.train.num_workers  # noqa: B018 - a read is what is recorded
        cfg.train.lora.rank  # noqa: B018
        cfg.data.fields.model_dump()
        [gate.min for gate in cfg.eval.gates.values()]
        cfg.timeouts.finetune  # noqa: B018 - bounds a stage, changes no result
        cfg.model_dump()  # the whole config travelling (an envelope), not a read
        copy = cfg.model_copy(deep=True)  # Prefect copies a task's parameters: its reads count the same
        reader = threading.Thread(target=lambda: copy.model.name)  # any thread of the process
        reader.start()
        reader.join()
    assert reads == {"train.num_workers", "train.lora.rank", "data.fields", "eval.gates", "model.name"}


def test_nothing_is_recorded_outside_the_block_and_the_hook_is_gone():
    cfg = PipelineConfig()
    with reads_recorded(cfg) as reads:
        pass
    cfg.train.lr  # noqa: B018
    assert reads == set() and "__getattribute__" not in type(cfg).__mro__[1].__dict__


def test_the_inputs_hash_the_values_at_the_outermost_paths():
    config = PipelineConfig().model_dump(mode="json")
    hashes = config_reads.reads_hashes(config, ["data", "data.source", "train.lr"])
    assert list(hashes) == ["data", "train.lr"]  # data read whole covers data.source
    changed = {**config, "train": {**config["train"], "lr": 0.5}}
    assert config_reads.reads_hashes(changed, ["train.lr"]) != config_reads.reads_hashes(config, ["train.lr"])


def test_a_setting_that_reaches_the_jobs_and_is_never_read_is_reported():
    defaults = PipelineConfig().model_dump(mode="json")
    # Planted: a shard group size with full sharding (only hybrid reads it), and a set but unread eval knob.
    config = PipelineConfig.model_validate({"train": {"shard_group_size": 2, "lr": 0.01}}).model_dump(mode="json")
    reads = {"train.lr", "train.sharding", "train.num_workers"}
    assert config_reads.unread_settings(config, defaults, reads) == ["train.shard_group_size"]
    # A whole section read covers it; a section no stage read (left out by --only) says nothing.
    assert config_reads.unread_settings(config, defaults, {"train"}) == []
    assert config_reads.unread_settings(config, defaults, {"data.source"}) == []
