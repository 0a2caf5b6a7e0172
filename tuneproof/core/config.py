"""The pipeline's one typed configuration.

Loaded from a YAML profile (configs/local.yaml is the default), overridden with
`--set dotted.key=value`, validated once. Every invalid field is reported at once with
its dotted name and the value seen; unknown keys are errors.

PipelineConfig here is the whole; its sections live beside it, one module per concern:
config_cluster.py (cluster, storage, model, runtime_env, timeouts, cost), config_data.py (data),
config_train.py (train with LoRA, connectivity, resume) and config_eval.py (eval, promote), all on
config_base.py's Strict. `load_config` is how every caller gets one.

This module runs on both sides (Prefect and inside Ray jobs), so it imports only
pydantic and yaml, which the published Ray image has.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ConfigDict, ValidationError, field_validator, model_validator

from tuneproof.core.config_base import PREEMPTION_WATCHER, Strict
from tuneproof.core.config_cluster import (
    ClusterConfig,
    CostConfig,
    ModelConfig,
    RuntimeEnvSettings,
    StorageConfig,
    Timeouts,
)
from tuneproof.core.config_data import DataConfig
from tuneproof.core.config_eval import EvalConfig, PromoteConfig
from tuneproof.core.config_train import (
    LORA_JOB_MODULES,
    PEFT_REQUIREMENT,
    ConnectivityConfig,
    ResumeConfig,
    TrainConfig,
)
from tuneproof.core.credentials import credential_problems
from tuneproof.core.files import DuplicateKey, NumberRefused, parse_yaml, read_regular
from tuneproof.core.hashing import sha256_json
from tuneproof.core.names import control_character_problem, hub_id_problem, short_repr

PROJECT_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PROFILE = PROJECT_ROOT / "configs" / "local.yaml"


class PipelineConfig(Strict):
    """Everything one pipeline run needs; the Prefect flow's parameter."""

    # A refused credential must not come back in an error's text (Prefect logs parameter errors).
    model_config = ConfigDict(extra="forbid", validate_assignment=True, hide_input_in_errors=True)

    profile: str = "local"
    cluster: ClusterConfig = ClusterConfig()
    storage: StorageConfig = StorageConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    connectivity: ConnectivityConfig = ConnectivityConfig()
    resume: ResumeConfig = ResumeConfig()
    eval: EvalConfig = EvalConfig()
    promote: PromoteConfig = PromoteConfig()
    timeouts: Timeouts = Timeouts()
    runtime_env: RuntimeEnvSettings = RuntimeEnvSettings()
    cost: CostConfig = CostConfig()

    @model_validator(mode="before")
    @classmethod
    def _no_credentials(cls, data: Any) -> Any:
        # The same check as validate()'s, for configs that arrive another way (a Prefect deployment's parameter).
        problems = credential_problems(data)
        if problems:
            raise ValueError("; ".join(problems))
        return data

    @field_validator("eval")
    @classmethod
    def _suite_sources_are_paths(cls, v: EvalConfig) -> EvalConfig:
        # The path setting no section checks for control characters itself (metric_names.check_suites judges
        # its form, after resolved(), where a NUL ended in "embedded null byte (please report)").
        problems = [
            f"eval.suites.{name}.source: {problem} (got {short_repr(suite.source)})"
            for name, suite in v.suites.items()
            if (problem := control_character_problem(suite.source))
        ]
        if problems:
            raise ValueError("; ".join(problems))
        return v

    @model_validator(mode="after")
    def _cross_field(self) -> PipelineConfig:
        if self.cluster.backend == "eks" and self.cluster.expect.image is None:
            raise ValueError("cluster.expect.image: the eks backend needs the image pinned by digest, got None")
        if self.cluster.backend == "eks" and not self.storage.root.startswith(("s3://", "/")):
            raise ValueError(
                f"storage.root: the eks backend needs s3:// or a shared mount's absolute path, got {self.storage.root!r}"
            )
        if self.cluster.backend == "eks" and self.train.num_workers > 1 and not self.storage.shared:
            raise ValueError(
                "storage.shared: more than one node needs shared storage (S3 or FSx), got a node-local root"
            )
        other_peft = [r for r in self.runtime_env.pip if _requirement_name(r) == "peft" and r != PEFT_REQUIREMENT]
        if self.train.method == "lora" and other_peft:
            raise ValueError(
                f"runtime_env.pip: train.method lora adds {PEFT_REQUIREMENT} (the version the fine-tune is tested "
                f"with), got another peft requirement {other_peft[0]!r}: remove it"
            )
        if self.train.checkpoint_on_preemption and self.runtime_env.env_vars.get(PREEMPTION_WATCHER) == "0":
            raise ValueError(
                f"train.checkpoint_on_preemption: runtime_env.env_vars turns Ray Train's preemption watcher off "
                f'({PREEMPTION_WATCHER}: "0"), so no notice would come: remove that variable, or leave '
                "checkpoint_on_preemption false"
            )
        if (
            self.resume.enabled
            and self.train.checkpoint_every + self.resume.extra_steps + self.resume.replay_steps > self.train.max_steps
        ):
            raise ValueError(
                "resume: the resume test needs a checkpoint followed by resume.extra_steps + resume.replay_steps "
                f"steps of the main run, got checkpoint_every={self.train.checkpoint_every} + "
                f"{self.resume.extra_steps} + {self.resume.replay_steps} > train.max_steps={self.train.max_steps}"
            )
        return self

    def job_pip(self, module: str | None = None) -> list[str]:
        """The pip requirements a job running `module` gets through its runtime_env (and its record entry
        shows): runtime_env.pip, plus peft for a LoRA run's fine-tune jobs. module None: what the run adds
        to any of its jobs (the record's run-level identity)."""
        needs_peft = self.train.method == "lora" and (module is None or module in LORA_JOB_MODULES)
        if needs_peft and PEFT_REQUIREMENT not in self.runtime_env.pip:
            return [*self.runtime_env.pip, PEFT_REQUIREMENT]
        return list(self.runtime_env.pip)

    def config_hash(self) -> str:
        return sha256_json(self.model_dump(mode="json"))

    def resolved(self, base: Path | None = None) -> PipelineConfig:
        """Copy with relative local paths made absolute against `base` (the project root)."""
        base = base or PROJECT_ROOT
        data = self.model_dump(mode="json")
        for dotted in ("storage.root", "model.source", "data.source", "data.eval_source", "cluster.auth_token_file"):
            section, key = dotted.split(".")
            value = data[section][key] = _home_expanded(data[section][key])
            if not value or not _is_relative_local_path(value) or (dotted in HUB_DATASETS and self.data.format == "hf"):
                continue
            if dotted == "model.source" and not _names_a_local_model(value, base):
                # A hub id ("Qwen/Qwen2.5-1.5B"): the jobs load it from the hub, not from base/Qwen/...
                if problem := hub_id_problem(value):
                    raise ConfigError([f"model.source: {short_repr(value)} {problem}"])
                continue
            data[section][key] = str((base / value).resolve())
        for nested in [*data["eval"]["suites"].values(), *([data["data"]["replay"]] if data["data"]["replay"] else [])]:
            nested["source"] = _home_expanded(nested["source"])
            hub = nested is data["data"]["replay"] and self.data.format == "hf"
            if _is_relative_local_path(nested["source"]) and not hub:
                nested["source"] = str((base / nested["source"]).resolve())
        try:
            return PipelineConfig.model_validate(data)
        except ValidationError as e:  # a value valid as given, not once made absolute: named as validate() names it
            raise ConfigError(format_errors(e)) from None


HUB_DATASETS = ("data.source", "data.eval_source")
"""Under data.format: hf these (and data.replay.source) name hub datasets (`imdb`, `org/name:split`), not paths."""


class ConfigError(ValueError):
    """Invalid configuration; `problems` holds one 'dotted.name: message (got value)' per error."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("invalid config:\n  " + "\n  ".join(problems))


def _requirement_name(requirement: str) -> str:
    """'peft==0.21.2' -> 'peft', 'PEFT[extra]>=1' -> 'peft'. Pure."""
    for i, ch in enumerate(requirement):
        if not (ch.isalnum() or ch in "-_."):
            return requirement[:i].strip().lower().replace("_", "-")
    return requirement.strip().lower().replace("_", "-")


def _home_expanded(value: str | None) -> str | None:
    """`value` with a leading ~ read as a shell reads it, the home directory: made absolute against the
    project instead, storage.root=~/tp was <project>/~/tp."""
    return os.path.expanduser(value) if value and value.startswith("~") else value


def _is_relative_local_path(value: str) -> bool:
    # A bare name too: storage.root=store was left to the current directory while x/store was the project's.
    return "://" not in value and not value.startswith("/")


def _names_a_local_model(value: str, base: Path) -> bool:
    """model.source "org/name" is a hub id unless it starts with "." or is a directory under base: the
    rule from_pretrained applies (a directory first, else a repo id), decided here because the jobs
    receive the resolved value and cannot tell a path made absolute from one the user gave."""
    if value.startswith("."):
        return True
    try:
        return (base / value).is_dir()
    except OSError:  # a name no file system holds (too long): not a directory here, so not a local model
        return False


def parse_override(item: str) -> tuple[list[str], Any]:
    """'a.b.c=value' -> (['a','b','c'], value parsed as a YAML scalar/collection); ConfigError for a value that
    nests past MAX_CONFIG_DEPTH with its key."""
    if "=" not in item:
        raise ConfigError([f"--set {item!r}: expected dotted.key=value"])
    key, raw = item.split("=", 1)
    parts = key.strip().split(".")
    if not all(parts):
        raise ConfigError([f"--set {item!r}: empty key segment in {key!r}"])
    deep = f"--set {key.strip()}=...: nested too deeply to be a config (over {MAX_CONFIG_DEPTH} levels)"
    try:
        value = parse_yaml(raw) if raw != "" else ""
    except (DuplicateKey, NumberRefused) as e:  # not read as text: "0042" would become 42 all the same
        raise ConfigError([f"--set {short_repr(item)}: {e}"]) from None
    except yaml.YAMLError:
        value = raw
    except RecursionError:  # the YAML parser's own, past a few hundred levels
        raise ConfigError([deep]) from None
    # As a file's: a value is checked by depth too, not left to a RecursionError wherever it is next walked.
    if _nesting(value, MAX_CONFIG_DEPTH, {}) + len(parts) > MAX_CONFIG_DEPTH:
        raise ConfigError([deep])
    return parts, value


def apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for part in parts[:-1]:
        child = node.get(part)
        if not isinstance(child, dict):
            child = {}
            node[part] = child
        node = child
    node[parts[-1]] = value


def validate(data: dict) -> PipelineConfig:
    """Validate a raw mapping, reporting every problem at once."""
    secrets = credential_problems(data)
    if secrets:
        raise ConfigError(secrets)
    try:
        return PipelineConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(format_errors(e)) from None


def format_errors(e: ValidationError) -> list[str]:
    problems = []
    for err in e.errors():
        parts = [str(p) for p in err["loc"] if not str(p).startswith("function-")]
        # A mapping's key: pydantic's loc is (..., the key, "[key]"), which joined read "eval.gates..[key]".
        loc = ".".join(parts[:-2]) + " (a key)" if parts[-1:] == ["[key]"] else ".".join(parts)
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unknown key"
        value = err.get("input")
        if err["type"] == "string_type" and isinstance(value, (dict, list)):
            # `--set key={a}` or `key=[a]`: YAML read braces or brackets as a collection, not text.
            kind = "mapping" if isinstance(value, dict) else "list"
            msg = f"expected text, got a YAML {kind}; quote it (e.g. --set '{loc}=\"...\"')"
        if err["type"] == "string_too_short":  # Strict's str_min_length=1
            msg = "must not be empty (leave it out, or null where it may be unset)"
        # Cross-field checks name their fields in the message itself: the pipeline's (no loc), and a section's
        # that spells them in full ("train.warmup_steps 50 must ..."), whose input would be the whole section.
        if not loc or msg.startswith(f"{loc}."):
            problems.append(msg)
            continue
        got = short_repr(value)
        # Validators that name the value themselves (slugs, storage roots) need no second copy of it.
        problems.append(f"{loc}: {msg}" if got in msg else f"{loc}: {msg} (got {got})")
    return problems


def load_config(path: str | Path | None = None, overrides: Sequence[str] = (), resolve: bool = True) -> PipelineConfig:
    """Read a YAML profile, apply --set overrides, validate, resolve relative paths."""
    path = Path(path) if path else DEFAULT_PROFILE
    try:
        data = parse_yaml(read_regular(path, MAX_CONFIG_BYTES).decode("utf-8"))
    except FileNotFoundError:
        raise ConfigError([f"--config: file not found (got {str(path)!r})"]) from None
    except IsADirectoryError:
        raise ConfigError([f"--config {path}: is a directory; give a YAML file such as configs/local.yaml"]) from None
    except UnicodeDecodeError as e:
        raise ConfigError([f"--config {path}: not UTF-8 text (byte {e.start}); save it as UTF-8 YAML"]) from None
    except OSError as e:
        raise ConfigError([f"--config {path}: cannot be read: {e.strerror or e}"]) from None
    except NumberRefused as e:
        raise ConfigError([f"--config {path}: {e}"]) from None
    except yaml.YAMLError as e:
        raise ConfigError([f"--config {path}: not valid YAML: {' '.join(str(e).split())}"]) from None
    except RecursionError:
        raise ConfigError([f"--config {path}: nested too deeply to be a config"]) from None
    if _nesting(data, MAX_CONFIG_DEPTH, {}) > MAX_CONFIG_DEPTH:
        # Checked, not left to the parser's RecursionError: that depends on the process's recursion limit.
        raise ConfigError([f"--config {path}: nested too deeply to be a config (over {MAX_CONFIG_DEPTH} levels)"])
    if data is None:
        # Not "all defaults": a profile cut short (an interrupted copy of configs/eks.yaml) ran the local defaults.
        raise ConfigError([f"--config {path}: holds no settings (empty, or only comments); give a profile's mapping"])
    if not isinstance(data, dict):
        raise ConfigError([f"--config {path}: top level must be a mapping (got {type(data).__name__})"])
    for item in overrides:
        parts, value = parse_override(item)
        apply_override(data, parts, value)
    cfg = validate(data)
    return cfg.resolved(_base_dir(path)) if resolve else cfg


MAX_CONFIG_BYTES = 1 << 20
"""A profile is a few kilobytes; a larger file is not one (and a device would never end)."""
MAX_CONFIG_DEPTH = 32
"""A profile is a handful of levels deep (eval.gates.<metric>.min); anything past this is not a config."""


def _nesting(value: Any, budget: int, memo: dict[int, int]) -> int:
    """Levels of mappings and lists in a parsed YAML value, counted only to budget + 1 (pure).

    The budget bounds the recursion; the memo visits a node that YAML aliases share only once, so an
    alias bomb costs its node count, not its expansion.
    """
    if not isinstance(value, (dict, list)):
        return 0
    if id(value) in memo:
        return memo[id(value)]
    if budget <= 0:
        return 1
    children = value.values() if isinstance(value, dict) else value
    height = 1 + max((_nesting(child, budget - 1, memo) for child in children), default=0)
    memo[id(value)] = height
    return height


def _base_dir(profile: Path) -> Path:
    """Relative paths in a profile under configs/ are relative to the project root."""
    profile = profile.resolve()
    return profile.parent.parent if profile.parent.name == "configs" else Path.cwd()
