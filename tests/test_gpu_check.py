"""bench/gpu_check.py --dry-run, in an interpreter whose imports fail as on the lent GPU machine.

That machine (the device tool's nvidia-h100-x1 or nvidia-h200, one image; KINDS.md read 2026-11-17) has Python 3.12 with the packages of
DEVICE_PACKAGES and nothing can be installed there but carried wheels (CARRIED_WHEELS). Every package of
this environment that is neither is made unimportable in the subprocess (tests/device_imports), so an
import that would fail there fails here: Ray, Prefect, s3fs, boto3, datasets, evaluate, kubernetes...
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from bench.gpu_check import CARRIED_WHEELS

ROOT = Path(__file__).resolve().parent.parent
DEVICE_PACKAGES = """
absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build certifi
charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx
huggingface-hub humanize hypothesis idna imageio iniconfig interface-meta jax jaxlib jaxtyping jinja2 joblib
kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml markdown
markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict multipledispatch
mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-ml-py onnx onnx-ir
onnxruntime onnxscript opencv-python-headless optax opt-einsum opt-einsum-fx optimistix orbax-checkpoint
packaging pandas pathspec patsy peft pillow pip pluggy portalocker prometheus-client propcache protobuf psutil
pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks pyre-extensions pytest pytest-benchmark
pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil pytorch-lightning pyyaml regex requests rich
sacrebleu safetensors scikit-build-core scikit-image scikit-learn scipy seaborn sentencepiece
sentence-transformers setuptools shellingham simplejson six sortedcontainers statsmodels sympy tabulate
tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm tokenizers toolz torch
torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope triton typer
typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash yarl zipp
""".split()  # noqa: SIM905 - the list as KINDS.md prints it, easy to compare
"""The Python packages of the lent machine's image (/work/.library/device/KINDS.md, read 2026-11-17)."""


NEVER_THERE = {"ray", "prefect"}
"""Hidden even where a package here lists them: the machine has neither (Ray's wheel alone is over 64 MiB)."""


def normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def absent_there(carried: bool) -> list[str]:
    """Top-level modules of this environment that the lent machine would not have: those of every
    distribution that is neither in its image (nor needed by one of its packages as installed here: the
    machine's own versions bring their own), nor (when `carried`) a carried wheel, nor this project."""
    carried_names = {normalized(w.split("==")[0]) for w in CARRIED_WHEELS}
    there = needed_by({normalized(p) for p in DEVICE_PACKAGES} | (carried_names if carried else set()))
    there = (there | {"tuneproof"}) - NEVER_THERE - (set() if carried else carried_names)
    return sorted(
        module
        for module, dists in metadata.packages_distributions().items()
        if module.isidentifier() and not any(normalized(d) in there for d in dists)
    )


def needed_by(names: set[str]) -> set[str]:
    """names and every distribution installed here that they require, transitively (extras left out)."""
    from packaging.requirements import Requirement

    found, todo = set(names), list(names)
    while todo:
        try:
            requires = metadata.requires(todo.pop()) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            requirement = Requirement(line)
            name = normalized(requirement.name)
            if name not in found and (requirement.marker is None or requirement.marker.evaluate({"extra": ""})):
                found.add(name)
                todo.append(name)
    return found


def device_like(hidden: list[str]) -> dict[str, str]:
    path = os.pathsep.join([str(ROOT / "tests" / "device_imports"), str(ROOT)])
    return {**os.environ, "PYTHONPATH": path, "TUNEPROOF_HIDE": ",".join(hidden), "OUT": ""}


def test_the_blocker_hides_what_the_machine_lacks():
    hidden = absent_there(carried=True)
    assert {"ray", "prefect"} <= set(hidden) and "torch" not in hidden and "pydantic" not in hidden
    probe = "import importlib, sys\nfor m in ('ray', 'prefect'):\n    try: importlib.import_module(m)\n    except ModuleNotFoundError: print(m, 'hidden')"
    shown = subprocess.run([sys.executable, "-c", probe], env=device_like(hidden), capture_output=True, text=True)
    assert shown.stdout.split("\n")[:2] == ["ray hidden", "prefect hidden"], shown.stderr


def test_the_step_and_the_sweep_need_no_pydantic():
    """What the sweep and the job's step import works with pydantic hidden too (only the checkpoint and
    export phases use the carried wheels)."""
    hidden = absent_there(carried=False)
    assert "pydantic" in hidden
    code = "import bench.gpu_check, training.step, training.fsdp, training.flops, training.schedule"
    done = subprocess.run([sys.executable, "-c", code], env=device_like(hidden), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]


@pytest.mark.timeout(600)
def test_dry_run_passes_with_only_what_the_machine_has(tmp_path):
    done = subprocess.run(
        [sys.executable, "bench/gpu_check.py", "--dry-run", "--out", str(tmp_path)],
        cwd=ROOT,
        env=device_like(absent_there(carried=True)),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["name"]: r for r in result["rows"]}
    assert not [r for r in rows.values() if r["error"] or r["skipped"]]
    assert rows["DCP round trip"]["figures"]["tensors_equal"] > 0
    assert rows["Hugging Face export"]["figures"]["weights_equal"] > 0
    assert rows["job step"]["figures"]["last_loss"] < rows["job step"]["figures"]["first_loss"]
    assert {r["settings"]["checkpointing"] for r in rows.values() if "checkpointing" in r["settings"]} == {
        "off",
        "selective",
        "full",
    }
    assert rows["chunked loss + fused AdamW"]["figures"]["estimate_gib"] > 0
    assert (tmp_path / "gpu_check.log").read_text().strip().endswith("gpu_check.json")


def test_repeats_of_a_variant_become_its_median_and_range():
    """`--repeats N` (the device call's 3): the rounds a variant measured, as one row of median and range."""
    from bench.gpu_check import Row, spread

    rows = [
        Row("v", figures={"tokens_per_s": t, "mfu": t / 1e5}, peak_allocated_gib=g)
        for t, g in ((3e4, 50.0), (1e4, 51.0), (2e4, 49.0))
    ]
    summary = spread("v", rows)
    assert summary.name == "v: median of 3" and summary.peak_allocated_gib == 51.0
    assert summary.figures == {
        "repeats": 3,
        "tokens_per_s": 2e4,
        "tokens_per_s_min": 1e4,
        "tokens_per_s_max": 3e4,
        "mfu": 0.2,
        "mfu_min": 0.1,
        "mfu_max": 0.3,
    }


def test_repeats_below_one_is_refused_naming_the_value(capsys):
    from bench.gpu_check import main

    with pytest.raises(SystemExit) as refused:
        main(["--dry-run", "--repeats", "0"])
    assert refused.value.code == 2 and "--repeats must be at least 1 (got 0)" in capsys.readouterr().err
