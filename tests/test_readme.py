"""The README's commands, as written: every command line of its ```bash blocks is either run here or listed in
NOT_RUN with the reason, and every `tuneproof` line is at least parsed by the command line itself, so a README
that drifts (a renamed option, a command that no longer exists, a work pool nobody creates) fails the tests.

    .venv/bin/python -m pytest -q tests/test_readme.py                      # parse + the cheap commands: seconds
    .venv/bin/python -m pytest -q tests/test_readme.py -m integration       # + the Prefect and evidence blocks

Placeholders (<run-id>, <64 hex>) are filled with real values; the integration half reuses the session's
Prefect server and finished demo run (tests/conftest.py), so it costs a `prefect deploy` in CI, no more.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer
import yaml

from tests.conftest import tuneproof
from tuneproof.app.cli import app
from tuneproof.core.config import PROJECT_ROOT

README = PROJECT_ROOT / "README.md"
PLACEHOLDERS = {
    "<run-id>": "demo",
    "<run-a>": "demo",
    "<run-b>": "demo",
    "<decision-id>": "d1",
    "<64 hex>": "0" * 64,
    "<repo@sha256:...>": "repo@sha256:" + "0" * 64,
    "<clone URL>": "https://example.invalid/tuneproof.git",
}
PRICED_SHOW = 'tuneproof runs show <run-id> --set \'cost.prices={"CPU": 0.0416, "GPU": 3.0}\''
RUN_HERE = {
    ".venv/bin/tuneproof lint deployments/": "test_cheap_commands_run_as_written",
    ".venv/bin/tuneproof runs list": "test_cheap_commands_run_as_written (and the evidence block)",
    "tuneproof images list": "test_cheap_commands_run_as_written",
    "tuneproof transport nccl-rank0.log --expect efa": "test_cheap_commands_run_as_written",
    ".venv/bin/tuneproof runs show <run-id>": "test_the_evidence_block_runs_on_the_finished_run",
    ".venv/bin/tuneproof models show dates-qwen2-tiny": "test_the_evidence_block_runs_on_the_finished_run",
    PRICED_SHOW: "test_the_evidence_block_runs_on_the_finished_run",
    ".venv/bin/prefect --no-prompt deploy --all": "test_the_prefect_block_runs_against_a_server",
    ".venv/bin/prefect deployment run 'tuneproof-pipeline/manual' --param config='{\"train\": {\"max_steps\": 300}}'": (
        "test_the_prefect_block_runs_against_a_server"
    ),
    ".venv/bin/prefect deployment inspect 'tuneproof-pipeline/nightly'": "test_the_prefect_block_runs_against_a_server",
}
TRAINS = "trains: the pipeline tests (test_full_pipeline, test_continue, test_lora_pipeline) run these"
SEVERAL_PIPELINES = "runs several pipelines: tests/test_compare.py"
CANARY = "runs several pipelines (and EKS for --config configs/eks.yaml): tests/test_canary.py"
PROMOTIONS = "needs promotions: tests/test_history.py promotes, rolls back and reads the history"
NOT_RUN = {
    # Whole lines, compared exactly: a key matched as a substring ("tuneproof run") excused `tuneproof runs ...`.
    "make demo": "installs and runs the whole pipeline: the finished_run fixture runs the same `tuneproof run`",
    "make test": "is the test suite itself",
    "open http://127.0.0.1:4200": "opens a browser (tests/test_browser*.py drive the UI)",
    "tuneproof local up": "binds the profile's fixed ports, which a shared machine's other runs use; fixtures pick free ones",
    ".venv/bin/tuneproof local down": "stops what `local up` started (see local up)",
    "tuneproof run --set cluster.expect.ray_version=2.0.0": TRAINS,
    "tuneproof run --set eval.gates.exact_match.min=0.999": TRAINS,
    "tuneproof run --only evaluate,promote --run-id <run-id>": TRAINS,
    "tuneproof run --run-id <run-id>": TRAINS,
    "tuneproof run --until finetune": TRAINS,
    "tuneproof run --config configs/local-chat.yaml": TRAINS,
    "tuneproof run --config configs/local-alpaca.yaml": TRAINS,
    "tuneproof runs diff <run-a> <run-b>": "needs two finished runs: tests/test_rundiff.py",
    "tuneproof compare --stages connectivity --a connectivity.iters=3 --b connectivity.iters=6 --repeats 3": (
        SEVERAL_PIPELINES
    ),
    "tuneproof compare --stages connectivity --a train.num_workers=2 --b train.num_workers=4 --repeats 3 --json": (
        SEVERAL_PIPELINES
    ),
    "tuneproof compare --stages data,finetune --a train.sharding=full --b train.sharding=hybrid --set "
    "train.num_workers=4 --set train.shard_group_size=2 --set train.max_steps=30 --set train.checkpoint_every=10 "
    "--repeats 3": SEVERAL_PIPELINES,
    "tuneproof canary": CANARY,
    "tuneproof canary --config configs/eks.yaml --candidate-image "
    "public.ecr.aws/deep-learning-containers/ray:train-ml-cuda-v1.2@sha256:<64 hex>": CANARY,
    "tuneproof images show <decision-id> --json": "needs a canary decision: tests/test_canary.py",
    ".venv/bin/prefect deployment run 'tuneproof-image-canary/image-canary' --param candidate_image=<repo@sha256:...>": (
        "runs on the EKS canary pool, which has no worker here"
    ),
    "PREFECT_API_URL=https://<server>/api PREFECT_API_AUTH_STRING='<user:password>' TUNEPROOF_GIT_URL=<clone URL> "
    "deployments/eks-up.sh": "EKS: needs an AWS account; tests/test_eks_up.py runs it with stub aws/eksctl/kubectl",
    "tuneproof models history dates-qwen2-tiny": PROMOTIONS,
    "tuneproof models history dates-qwen2-tiny --at 2026-12-03T14:00:00Z --json": PROMOTIONS,
    'tuneproof rollback dates-qwen2-tiny --reason "v2 answers in the wrong format"': PROMOTIONS,
    'tuneproof rollback dates-qwen2-tiny --to v0001-<run> --reason "..."': PROMOTIONS,
    ".venv/bin/prefect deployment run 'tuneproof-rollback/rollback' -p model=dates-qwen2-tiny -p reason='...' -p by=ana": (
        "needs two promotions: tests/test_history.py deploys and runs it"
    ),
    "tuneproof models show dates-qwen2-tiny": "the evidence block runs the same command (.venv/bin/tuneproof)",
    "echo /.whl/ >> .git/info/exclude": "part of the GPU check's device call (bench/gpu_check.py; tests/test_gpu_check.py)",
    "python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform "
    "manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl pydantic==2.14.4 pydantic_core==2.50.5 "
    "annotated-types==0.8.0 typing-inspection==0.4.5": "fetches the GPU check's wheels (tests/test_gpu_check.py hides them)",
    "python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "
    ".whl/*.whl && export PYTHONPATH=/tmp/site || exit; PYTHONUNBUFFERED=1 timeout 500 python3 bench/gpu_check.py": (
        "needs the lent GPU machine; tests/test_gpu_check.py runs its --dry-run"
    ),
}


def commands() -> list[str]:
    """Every command line of the README's ```bash blocks: continuations joined, comments dropped."""
    lines = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            line = re.sub(r"\s+#.*$", "", line).strip()
            if line and not line.startswith("#"):
                lines.append(" ".join(line.split()))
    return lines


def filled(line: str) -> str:
    for placeholder, value in PLACEHOLDERS.items():
        line = line.replace(placeholder, value)
    return line


def tuneproof_args(line: str) -> list[str] | None:
    """The arguments of a `tuneproof` (or `.venv/bin/tuneproof`) line, or None for another program."""
    words = shlex.split(filled(line))
    return words[1:] if words and Path(words[0]).name == "tuneproof" else None


def test_every_readme_command_is_run_or_says_why_not():
    lines = commands()
    undecided = [line for line in lines if line not in RUN_HERE and line not in NOT_RUN]
    assert undecided == [], f"README commands neither run by a test nor listed in NOT_RUN: {undecided}"
    unused = [line for line in [*NOT_RUN, *RUN_HERE] if line not in lines]
    assert unused == [], f"NOT_RUN or RUN_HERE names commands the README no longer has: {unused}"
    assert set(RUN_HERE).isdisjoint(NOT_RUN)


@pytest.mark.parametrize("line", [c for c in commands() if tuneproof_args(c) is not None])
def test_every_tuneproof_line_parses(line: str):
    """The command and its options exist and take these values (the command is not run)."""
    args = tuneproof_args(line)
    assert args is not None
    command = typer.main.get_command(app)
    ctx = command.make_context("tuneproof", list(args))
    while isinstance(command, click.Group):
        name, sub, rest = command.resolve_command(ctx, [*ctx.protected_args, *ctx.args])
        assert sub is not None, line
        command, ctx = sub, sub.make_context(name or "", rest, parent=ctx)


def test_local_up_creates_every_pool_prefect_yaml_names():
    """`prefect deploy --all` fails on a deployment whose work pool does not exist: `local up` creates them all."""
    from tuneproof.app.localctl import POOLS

    project = yaml.safe_load((PROJECT_ROOT / "prefect.yaml").read_text())
    named = {d["work_pool"]["name"] for d in project["deployments"]}
    assert named <= {name for name, _, _ in POOLS}
    assert all((PROJECT_ROOT / template).is_file() for _, _, template in POOLS if template)


EFA_LOG = (
    "ip-10-0-1-11:1:1 [0] NCCL INFO NET/OFI Selected provider is efa, fabric is efa-direct\n"
    "ip-10-0-1-11:1:1 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[0] [send] via NET/Libfabric/0/GDRDMA\n"
)


def test_cheap_commands_run_as_written(tmp_path, monkeypatch):
    """Read-only commands over the profile's own (possibly empty) storage, and the transport example on a log
    of that name; run from the project root as the README says."""
    monkeypatch.chdir(PROJECT_ROOT)
    lint = tuneproof(*(tuneproof_args(".venv/bin/tuneproof lint deployments/") or []))
    assert lint.exit_code == 0, lint.output
    for line in (".venv/bin/tuneproof runs list", "tuneproof images list"):
        result = tuneproof(*(tuneproof_args(line) or []))
        assert result.exit_code == 0, (line, result.output)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "nccl-rank0.log").write_text(EFA_LOG)
    transport = tuneproof(*(tuneproof_args("tuneproof transport nccl-rank0.log --expect efa") or []))
    assert transport.exit_code == 0 and '"efa"' in transport.output, transport.output


@pytest.mark.integration
def test_the_evidence_block_runs_on_the_finished_run(finished_run, demo_env):
    """`runs show`, `runs list`, `models show` as the README's "look at the evidence" gives them, on the
    session's finished demo run (its storage root appended)."""
    for line in (
        ".venv/bin/tuneproof runs show <run-id>",
        ".venv/bin/tuneproof runs list",
        ".venv/bin/tuneproof models show dates-qwen2-tiny",
        PRICED_SHOW,
    ):
        result = tuneproof(*(tuneproof_args(line) or []), *demo_env.args)
        assert result.exit_code == 0, (line, result.output)
        assert "demo" in result.output or "dates-qwen2-tiny" in result.output


@pytest.mark.integration
@pytest.mark.timeout(600)
def test_the_prefect_block_runs_against_a_server(prefect_server):
    """The README's Prefect block against the session's server, after the pools `local up` creates."""
    from tuneproof.app import localctl

    env = {**os.environ, "PREFECT_API_URL": f"{prefect_server}/api"}
    localctl.ensure_work_pools(env)
    for line in [c for c in commands() if c in RUN_HERE and "prefect" in c.split()[0]]:
        words = shlex.split(line)
        words[0] = str(Path(sys.executable).parent / "prefect")
        done = subprocess.run(words, env=env, cwd=PROJECT_ROOT, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, (line, done.stdout[-2000:], done.stderr[-2000:])
