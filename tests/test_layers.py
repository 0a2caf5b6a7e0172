"""The layers, enforced: every import in the project points down, and jobs ship exactly the job side.

    jobs (training/, eval/)  -> tuneproof.core
    tuneproof.control        -> tuneproof.core
    tasks/                   -> tuneproof.control, tuneproof.core
    flows/                   -> tasks, tuneproof.control, tuneproof.core
    tuneproof.app            -> flows, tasks, tuneproof.control, tuneproof.core
    faults (the harness)     -> tuneproof.app and everything below it

Imports inside functions count the same as module-level ones: a lazy upward import is still one.
The job side also never imports Prefect or the Ray job client: it runs on the published image.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

from tuneproof.control.identity import job_files, stage_working_dir, tree_hash
from tuneproof.core.config import PROJECT_ROOT

LAYERS = {
    "tuneproof.core": {"tuneproof.core"},
    "training": {"tuneproof.core", "training", "eval"},
    "eval": {"tuneproof.core", "training", "eval"},
    "tuneproof.control": {"tuneproof.core", "tuneproof.control"},
    "tasks": {"tuneproof.core", "tuneproof.control", "tasks"},
    "flows": {"tuneproof.core", "tuneproof.control", "tasks", "flows"},
    "tuneproof.app": {"tuneproof.core", "tuneproof.control", "tasks", "flows", "tuneproof.app"},
    "faults": {"tuneproof.core", "tuneproof.control", "tasks", "flows", "tuneproof.app", "training", "faults"},
}
"""Package -> the project packages its modules may import."""
PROJECT_PACKAGES = ("tuneproof", "training", "eval", "tasks", "flows", "bench", "tests", "faults")
JOB_SIDE = ("tuneproof.core", "training", "eval")
NOT_ON_THE_IMAGE = ("prefect", "ray.job_submission", "kubernetes", "typer", "rich", "jsonschema", "matplotlib")
"""Control-plane libraries a job must not import: the published image lacks them or they are not its business."""


def layer_of(module: str) -> str | None:
    """The most specific LAYERS key a module belongs to."""
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return None


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PROJECT_ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path) -> list[tuple[int, str]]:
    """(line, imported module) for every import statement in the file, at any depth."""
    module = module_name(path)
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:  # relative: resolve against this module's package
                base = module.split(".")[: -node.level] if path.name != "__init__.py" else module.split(".")
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module or ""
            found.append((node.lineno, target))
            found += [(node.lineno, f"{target}.{alias.name}") for alias in node.names]
    return found


def project_files(packages: tuple[str, ...]) -> list[Path]:
    files = []
    for package in packages:
        root = PROJECT_ROOT.joinpath(*package.split("."))
        files += sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)
    return files


def upward_imports(files: list[Path]) -> list[str]:
    """One problem per offending import line: 'file:line (layer) imports module (its layer)'."""
    problems: dict[tuple[Path, int], str] = {}
    for path in files:
        layer = layer_of(module_name(path))
        if layer is None:
            continue
        for line, target in imports_of(path):
            if target.split(".")[0] not in PROJECT_PACKAGES:
                continue
            target_layer = layer_of(target) or target.split(".")[0]
            if target_layer not in LAYERS[layer] and target != "tuneproof":
                line_problem = f"{path.relative_to(PROJECT_ROOT)}:{line} ({layer}) imports {target} ({target_layer})"
                problems.setdefault((path, line), line_problem)
    return sorted(problems.values())


def test_every_import_points_down():
    assert upward_imports(project_files(tuple(LAYERS))) == []


def test_the_job_side_never_imports_control_plane_libraries():
    problems = [
        f"{path.relative_to(PROJECT_ROOT)}:{line} imports {target}"
        for path in project_files(JOB_SIDE)
        for line, target in imports_of(path)
        if any(target == lib or target.startswith(lib + ".") for lib in NOT_ON_THE_IMAGE)
    ]
    assert problems == []


def test_an_upward_import_is_caught(tmp_path, monkeypatch):
    """The check itself: a core module importing the CLI is reported with its file and line."""
    planted = PROJECT_ROOT / "tuneproof" / "core" / "_planted_upward.py"
    planted.write_text("def f():\n    from tuneproof.app import cli\n")
    try:
        problems = upward_imports([planted])
    finally:
        planted.unlink()
    assert problems == ["tuneproof/core/_planted_upward.py:2 (tuneproof.core) imports tuneproof.app (tuneproof.app)"]


def test_the_working_dir_holds_exactly_the_job_side():
    shipped = {p.relative_to(PROJECT_ROOT).parts[0] for p in job_files()}
    assert shipped == {"tuneproof", "training", "eval"}
    tuneproof_parts = {
        p.relative_to(PROJECT_ROOT).parts[:2] for p in job_files() if p.parts[-2:] != ("tuneproof", "__init__.py")
    }
    assert {parts for parts in tuneproof_parts if parts[0] == "tuneproof"} == {("tuneproof", "core")}


@pytest.mark.parametrize("app_file", ["tuneproof/app/cli.py", "tuneproof/control/record.py", "flows/pipeline.py"])
def test_an_edit_outside_the_job_side_leaves_the_working_dir_hash_unchanged(tmp_path, app_file):
    """Copy the project, edit a control-plane file, and hash both: the recorded working_dir_hash is the same."""
    copy = tmp_path / "project"
    for entry in ("tuneproof", "training", "eval", "flows", "tasks"):
        shutil.copytree(PROJECT_ROOT / entry, copy / entry, ignore=shutil.ignore_patterns("__pycache__"))
    before = tree_hash(job_files(copy), copy)
    with open(copy / app_file, "a") as f:
        f.write("\n# an edit that never reaches a job\n")
    assert tree_hash(job_files(copy), copy) == before
    with open(copy / "training" / "finetune.py", "a") as f:
        f.write("\n# an edit that does\n")
    assert tree_hash(job_files(copy), copy) != before


def test_the_staged_working_dir_matches_its_hash():
    workdir, digest = stage_working_dir()
    staged = sorted(p for p in workdir.rglob("*") if p.is_file() and p.name != ".complete")
    assert tree_hash(staged, workdir) == digest


# No fork of a process that may hold threads: a forked child copies every lock as it stood, and a lock a
# thread held at that moment (Ray's, a tokenizer pool's, boto3's, logging's) is never released in the
# child, which then waits on it forever. Workers are spawned (multiprocessing's spawn or forkserver,
# subprocess) or, inside a Ray job, Ray actors. A genuine exception goes in FORK_ALLOWED with its reason.
FORK_ALLOWED: dict[str, str] = {}
"""'path:line' -> why forking there cannot deadlock."""
FORKING_CALLS = {"fork", "forkpty", "Pool", "Process", "ProcessPoolExecutor", "set_start_method", "get_context"}


def fork_uses(path: Path) -> list[str]:
    """'file:line call' for each call that forks: os.fork, a fork context, or a multiprocessing pool,
    process or executor built on the platform default (fork on Linux before Python 3.14)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
        if name not in FORKING_CALLS:
            continue
        literal = [a.value for a in node.args if isinstance(a, ast.Constant)]
        if name in ("fork", "forkpty"):
            forks = owner == "os"
        elif name in ("get_context", "set_start_method"):
            forks = owner.endswith("multiprocessing") and literal[:1] in ([], ["fork"])
        elif name == "ProcessPoolExecutor":
            forks = not any(k.arg == "mp_context" for k in node.keywords)
        else:  # Pool / Process on the multiprocessing module itself, not on a chosen context
            forks = owner in ("multiprocessing", "mp", "multiprocessing.pool")
        if forks:
            found.append(f"{path.relative_to(PROJECT_ROOT)}:{node.lineno} {ast.unparse(func)}")
    return found


def test_nothing_forks_a_process_that_may_hold_threads():
    uses = [use for path in project_files(PROJECT_PACKAGES) for use in fork_uses(path)]
    assert [use for use in uses if use.split(" ")[0] not in FORK_ALLOWED] == []


@pytest.mark.parametrize(
    "source",
    [
        "import os\nos.fork()",
        "import multiprocessing\nmultiprocessing.get_context('fork').Pool(2)",
        "import multiprocessing\nmultiprocessing.get_context().Pool(2)",
        "import multiprocessing\nmultiprocessing.Pool(2)",
        "import multiprocessing as mp\nmp.Process(target=print)",
        "from concurrent.futures import ProcessPoolExecutor\nProcessPoolExecutor(2)",
    ],
)
def test_a_fork_is_caught(tmp_path, monkeypatch, source):
    monkeypatch.setattr(sys.modules[__name__], "PROJECT_ROOT", tmp_path)
    (tmp_path / "forks.py").write_text(source)
    assert len(fork_uses(tmp_path / "forks.py")) == 1
    (tmp_path / "spawns.py").write_text("import multiprocessing\nmultiprocessing.get_context('spawn').Pool(2)")
    assert fork_uses(tmp_path / "spawns.py") == []


def test_a_test_that_needs_a_session_server_is_refused_without_the_integration_marker():
    """The rule conftest applies at collection (a refused session runs nothing), on stand-in test items."""
    from dataclasses import dataclass, field

    from tests.conftest import unmarked_server_tests

    @dataclass
    class Item:
        nodeid: str
        fixturenames: list[str]
        markers: set[str] = field(default_factory=set)

        def get_closest_marker(self, name: str) -> str | None:
            return name if name in self.markers else None

    items = [
        Item("t.py::unit", ["tmp_path"]),
        Item("t.py::through_a_fixture", ["ray_cluster", "ray_head", "s3_endpoint", "tmp_path"]),
        Item("t.py::marked", ["ray_head"], {"integration"}),
        Item("t.py::page", ["prefect_server"], {"browser"}),
        Item("t.py::prefect", ["prefect_harness", "prefect_server"], {"slow"}),
    ]
    assert unmarked_server_tests(items) == [
        "t.py::through_a_fixture (needs ray_head, s3_endpoint)",
        "t.py::prefect (needs prefect_server)",
    ]
