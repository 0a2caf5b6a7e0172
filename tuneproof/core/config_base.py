"""What every config section is built on: the Strict base model, the upper bounds, the reads hook.

Imported by each section module (tuneproof/core/config_*.py) and by whatever records the settings a stage
reads (`reads_recorded`: training/jobkit.py, flows/pipeline.py); tuneproof.core.config_reads keeps the
reads. Runs on both sides (Prefect and inside Ray jobs): it imports only pydantic and the core, which the published
Ray image has.
"""

from __future__ import annotations

import types
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, ValidationInfo, field_validator

from tuneproof.core import config_reads

# Upper bounds: far above any real run, low enough that a typo (an extra digit, a pasted byte count)
# is refused at submission instead of hanging a cluster or allocating the impossible.
MAX_STEPS = 10_000_000


MAX_SEED = 2**32 - 1
"""numpy's seeds are 0..2**32-1; torch's accept less than Python's ints: a negative seed failed the fine-tune."""


MAX_BATCH = 65_536


MAX_SEQ_LEN = 1_048_576


MAX_WORKERS = 4_096


MAX_EXAMPLES = 10_000_000


MAX_TIMEOUT_S = 7 * 24 * 3600


MAX_ITERS = 100_000
PREEMPTION_WATCHER = "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER"
"""Ray Train's switch for the watcher that raises preemption notices (train.checkpoint_on_preemption)."""


MAX_LORA_RANK = 4_096


MAX_LORA_ALPHA = 65_536


MAX_MODULE_NAMES = 256


class Strict(BaseModel):
    """Base for config sections: unknown keys are errors, assignments re-validate."""

    # allow_inf_nan=False: a NaN or inf threshold, tolerance or rate makes every comparison it enters meaningless.
    # str_min_length=1: an empty path, name or version is never what a user meant, and found late it fails a stage
    # (data.source="" as "cannot tell the format of  from its extension"); None says "not set" where a field may be.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False, str_min_length=1)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_a_number(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads True as 1 and False as 0, and YAML reads on/off and yes/no as booleans:
        # `--set resume.loss_rtol=on` was a tolerance of 100 %. A bool field still takes true/false.
        if problem := _bool_for_a_number(cls.model_fields[info.field_name or ""].annotation, value):
            raise ValueError(problem)
        return value

    # A section dumped whole is read whole (tuneproof.core.config_reads); single reads are noted by
    # _noting_getattribute, installed only while a stage is recorded.
    def model_dump(self, **kwargs: Any) -> dict[str, Any]:
        if config_reads.ACTIVE.recorder is not None:
            config_reads.ACTIVE.recorder.note_whole(self)
        return super().model_dump(**kwargs)

    def model_dump_json(self, **kwargs: Any) -> str:
        if config_reads.ACTIVE.recorder is not None:
            config_reads.ACTIVE.recorder.note_whole(self)
        return super().model_dump_json(**kwargs)


def _members(annotation: Any) -> list[Any]:
    """The types a value of `annotation` may be: a union's members, each without its Annotated metadata (pure)."""
    if get_origin(annotation) is Annotated:
        return _members(get_args(annotation)[0])
    if get_origin(annotation) in (Union, types.UnionType):
        return [member for arg in get_args(annotation) for member in _members(arg)]
    return [annotation]


def _bool_for_a_number(annotation: Any, value: Any, where: str = "") -> str | None:
    """Why `value` cannot be `annotation`: a boolean where a number is expected (the value, or an item of a list
    or mapping), or None (pure). A nested section is a Strict model that checks its own fields."""
    members = _members(annotation)
    if isinstance(value, bool):
        if bool in members or not (int in members or float in members):
            return None
        return (
            f"expected a number{where}, got the boolean {value} (YAML reads true/false, yes/no and on/off as booleans)"
        )
    for member in members:
        args = get_args(member)
        if get_origin(member) is list and isinstance(value, list):
            items, item_type = list(enumerate(value)), args[0]
        elif get_origin(member) is dict and isinstance(value, dict):
            items, item_type = list(value.items()), args[1]
        else:
            continue
        for key, item in items:
            if problem := _bool_for_a_number(item_type, item, f" at [{key!r}]"):
                return problem
    return None


def _noting_getattribute(self: Strict, name: str) -> Any:
    value = object.__getattribute__(self, name)
    recorder = config_reads.ACTIVE.recorder
    if recorder is not None and name[0] != "_":
        recorder.note(self, name, value)
    return value


@contextmanager
def reads_recorded(cfg: BaseModel) -> Iterator[set[str]]:
    """The settings of `cfg` read inside the block (this process, any thread), as dotted paths.

    The attribute hook is installed on the config classes only for the block, so code that runs
    unrecorded (a Prefect process, an encoding actor's hot loop) pays nothing for it.
    """
    installed = "__getattribute__" not in Strict.__dict__
    with config_reads.recording(cfg) as reads:
        if installed:
            setattr(Strict, "__getattribute__", _noting_getattribute)  # noqa: B010 - a slot, set for the block
        try:
            yield reads
        finally:
            if installed:
                delattr(Strict, "__getattribute__")
