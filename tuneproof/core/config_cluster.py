"""Config sections for where a run happens: cluster, storage, base model, runtime env, timeouts, cost.

The sections `cluster`, `storage`, `model`, `runtime_env`, `timeouts` and `cost` of PipelineConfig
(tuneproof/core/config.py), each validated field by field; read by tasks/ (submission, timeouts), the
control plane (Kubernetes, cost) and the jobs (storage, model). A stage's timeout is its field in Timeouts.
Runs on both sides (Prefect and inside Ray jobs): it imports only pydantic and the core, which the published
Ray image has.
"""

from __future__ import annotations

import re
from typing import Annotated, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator, model_validator

from tuneproof.core.config_base import MAX_TIMEOUT_S, Strict
from tuneproof.core.names import (
    check_slug,
    check_storage_root,
    control_character_problem,
    model_source_problem,
    short_repr,
)

DIGEST_REF = re.compile(r"@sha256:[0-9a-f]{64}$")
"""The end of an image pinned by digest: a shorter hex string names no image."""


ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


RESERVED_ENV = {"TUNEPROOF_JOB", "TUNEPROOF_FORWARD_ENV_FILE"}
"""Set by the pipeline for every job (tuneproof.core.envelope, tuneproof.core.forward_env)."""


RAY_RESOURCES = ("CPU", "GPU", "memory", "object_store_memory")
"""Ray's standard resource names, as cost.prices must spell them."""


class ClusterExpect(Strict):
    """What the cluster must be running; None means 'not checked'."""

    ray_version: str | None = "2.60.0"
    """Ray version every node must report (exact)."""
    torch_version: str | None = "2.13.0"
    """torch version without the local build tag (2.13.0 matches 2.13.0+cpu and 2.13.0+cu130)."""
    python_version: str | None = None
    """Python major.minor, e.g. '3.13' on the published image."""
    transformers_version: str | None = None
    cuda_version: str | None = None
    """CUDA version torch was built with, e.g. '13.0'; None skips the check."""
    nccl_version: str | None = None
    image: str | None = None
    """Pinned image reference, repository@sha256:... (eks)."""
    gpus_per_worker: int = Field(0, ge=0, le=64)
    """GPUs each training worker node must advertise to Ray (0 on CPU; at most 64)."""
    efa: bool = False
    """Worker nodes must have the EFA device (eks)."""

    @field_validator("image")
    @classmethod
    def _digest_pinned(cls, v: str | None) -> str | None:
        if v is not None and "@sha256:" not in v:
            raise ValueError(f"image must be pinned by digest (repo@sha256:...), got a tag: {v!r}")
        if v is not None and not DIGEST_REF.search(v):
            raise ValueError(f"image digest must be sha256: and 64 lowercase hex digits, got {v.rpartition('@')[2]!r}")
        return v


def check_path(v: str | None) -> str | None:
    """`v` unless it holds a control character (ValueError saying so; format_errors names the field and value)."""
    if v is not None and (problem := control_character_problem(v)):
        raise ValueError(problem)
    return v


class KubernetesConfig(Strict):
    """Where the RayCluster lives (eks backend)."""

    namespace: str = "tuneproof"
    raycluster: str = "tuneproof"
    kubeconfig: str | None = None
    """Path to a kubeconfig; None means in-cluster config, then ~/.kube/config."""

    @field_validator("kubeconfig")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return check_path(v)


def check_http_url(field: str, whose: str, v: str) -> str:
    """`v` if it is an http(s)://host[:port] URL, else ValueError naming `field` and the value; `whose` names the
    server in the message ("the dashboard's")."""
    if not v.startswith(("http://", "https://")):
        raise ValueError(f"{field} must be {whose} http(s) URL, got {v!r}")
    # Checked here, not found by the first request as requests' InvalidURL or botocore's "Invalid endpoint":
    # "http://" has no host, "http://h:99999" a port past 65535, "http://host name" a space no URL holds.
    url = urlsplit(v)
    if not url.hostname or any(ch.isspace() for ch in v) or control_character_problem(v):
        raise ValueError(
            f"{field} must name {whose} host, with no space or control character (http://host[:port]), got {v!r}"
        )
    try:
        port_ok = url.port is None or url.port > 0
    except ValueError:  # not a number, or past 65535
        port_ok = False
    if not port_ok:
        raise ValueError(f"{field} must give its port as a number 1..65535, or none (http://host[:port]), got {v!r}")
    return v


class ClusterConfig(Strict):
    backend: Literal["local", "eks"] = "local"
    address: str = "http://127.0.0.1:8265"
    """Ray dashboard (job submission) address."""
    auth_token_file: str | None = ".tuneproof/local/ray_auth_token"
    """File holding the Ray auth token sent with job requests; None sends no token."""
    expect: ClusterExpect = ClusterExpect()
    kubernetes: KubernetesConfig = KubernetesConfig()

    @field_validator("address")
    @classmethod
    def _http(cls, v: str) -> str:
        return check_http_url("address", "the dashboard's", v).rstrip("/")

    @field_validator("auth_token_file")
    @classmethod
    def _path(cls, v: str | None) -> str | None:
        return check_path(v)


class StorageConfig(Strict):
    root: str = ".tuneproof/storage"
    """Local directory or s3://bucket/prefix shared by every node."""
    endpoint_url: str | None = None
    """S3-compatible endpoint, http(s)://host[:port] (e.g. a local test server); None for AWS S3."""
    shared: bool = True
    """The root is reachable from every node (S3, FSx); a node-local path is only valid on one node."""

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        return check_storage_root("storage root", v)

    @field_validator("endpoint_url")
    @classmethod
    def _endpoint(cls, v: str | None) -> str | None:
        # "localhost:9000" passed here and failed inside botocore, mid-flow, as an internal error.
        return None if v is None else check_http_url("endpoint_url", "the S3-compatible server's", v)


class ModelConfig(Strict):
    name: str = "dates-qwen2-tiny"
    """Registry name the model is promoted under (models/<name>/)."""
    source: str = ".tuneproof/base-models/tiny-qwen2"
    """Hugging Face hub id, local directory, or s3:// prefix of the base model."""
    revision: str | None = None

    @field_validator("name")
    @classmethod
    def _slug(cls, v: str) -> str:
        return check_slug("model name", v)

    @field_validator("source")
    @classmethod
    def _loadable_form(cls, v: str) -> str:
        if problem := model_source_problem(v):
            raise ValueError(f"{short_repr(v)} {problem}")  # as format_errors shows it, so not printed twice
        return v


MAX_PRICE = 1_000_000.0
"""Per resource-hour: a GPU-hour is a few dollars, and under a million still prices it in any currency people use
(rupiah included); 1e308 was accepted and made the cost 'inf'."""

Price = Annotated[float, Field(ge=0, le=MAX_PRICE)]
"""A price per resource-hour, 0..1,000,000 (finite: Strict refuses inf and NaN)."""


class CostConfig(Strict):
    """What compute costs, for the cost and goodput reports (tuneproof.control.cost)."""

    prices: dict[str, Price] = {}
    """Price per resource-hour by Ray resource name ({"CPU": 0.04, "GPU": 2.5}), each 0..1,000,000; empty: seconds
    only."""

    @field_validator("prices")
    @classmethod
    def _ray_names(cls, v: dict[str, float]) -> dict[str, float]:
        # Ray's names are case-sensitive and the cost looks resources up by them: {"gpu": 4.0} priced GPU-hours at 0.
        misspelt = {key: name for key in v for name in RAY_RESOURCES if key != name and key.lower() == name.lower()}
        if misspelt:
            spelt = ", ".join(f"{key!r} (Ray's {name!r})" for key, name in misspelt.items())
            raise ValueError(f"prices are by Ray resource name, which is case-sensitive: got {spelt}")
        return v


class Timeouts(Strict):
    """Seconds per stage, 1..604,800 (a week)."""

    verify: int = Field(300, ge=1, le=MAX_TIMEOUT_S)
    connectivity: int = Field(600, ge=1, le=MAX_TIMEOUT_S)
    data: int = Field(600, ge=1, le=MAX_TIMEOUT_S)
    finetune: int = Field(3600, ge=1, le=MAX_TIMEOUT_S)
    resume: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    evaluate: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    promote: int = Field(1800, ge=1, le=MAX_TIMEOUT_S)
    """Bounds the copy check's Ray job (the registry copy loaded and scored before the pointer moves)."""


class RuntimeEnvSettings(Strict):
    """What the user adds to every job's runtime_env. What a job was submitted with (these plus the method's
    packages, forwarded variables by name only) is the record's RuntimeEnvAdditions."""

    pip: list[str] = []
    env_vars: dict[str, Annotated[str, Field(min_length=0)]] = {}  # an empty value is a setting (Strict refuses others)
    """Plain settings only: they are recorded, published and logged by Ray. Credentials are refused here."""
    forward_env: list[str] = []
    """Environment variables passed to every job by name: values from the submitting environment (local)
    or a Kubernetes Secret on the Ray pods (EKS), never in the config, the record or Ray's runtime_env."""

    @field_validator("forward_env")
    @classmethod
    def _env_names(cls, v: list[str]) -> list[str]:
        _check_env_names("forward_env takes", v)
        return list(dict.fromkeys(v))

    @field_validator("env_vars")
    @classmethod
    def _env_var_names(cls, v: dict[str, str]) -> dict[str, str]:
        # The same names as forward_env's: a reserved one was overwritten at submission without a word.
        _check_env_names("env_vars keys must be", list(v))
        return v

    @model_validator(mode="after")
    def _not_both(self) -> RuntimeEnvSettings:
        both = sorted(set(self.forward_env) & set(self.env_vars))
        if both:
            raise ValueError(f"forward_env and env_vars both set {both}: a variable is either forwarded or given")
        return self


def _check_env_names(what: str, names: list[str]) -> None:
    """ValueError naming every one of `names` that is no environment variable name or one the pipeline sets."""
    bad = [n for n in names if not ENV_NAME.fullmatch(n) or n in RESERVED_ENV]
    if bad:
        raise ValueError(
            f"{what} environment variable names ([A-Za-z_][A-Za-z0-9_]*, not {sorted(RESERVED_ENV)}), got {bad!r}"
        )
